"""Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) as tiny random models (``helpers.families.HYBRIDS``:
3 linear-attention layers and 1 full attention): the embedded engine's cache holds the conv and recurrent states
beside the KV, a group's prompt is prefilled once and its states copied to the G rows, the trainer's log-probs are
the model's own and the engine's equal them, the shared-prefix update continues the prompt's states, and a
2-step run trains."""

import pytest
import torch
from helpers import chat_prompts, fast_config
from helpers.families import HYBRIDS, build_family
from test_families import QUESTIONS, own_logprobs

from lit_rl.kernels import batch_invariant as bi
from lit_rl.kernels import kernel_mode
from lit_rl.logprobs import resolve_shared_prefix, response_logprobs
from lit_rl.models import ModelConfig, load_policy
from lit_rl.rollout.state_cache import StateLayer, hybrid_cache, is_hybrid
from lit_rl.rollout.torch_engine import ReservedLayer, TorchEngine
from lit_rl.rollout.types import SamplingConfig, left_pad
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """family -> the folder of its tiny model, built once per module."""
    built = {}

    def get(family):
        if family not in built:
            built[family] = build_family(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def load(folder):
    return load_policy(ModelConfig(str(folder)))


def grouped_prompts(tok):
    """The four questions (20-40 tokens: mixed lengths, left padding) twice each: groups of two."""
    return [p for p in chat_prompts(tok, QUESTIONS) for _ in range(2)]


def sample_and_score(model, tok, new_tokens=12):
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id])
    prompts = grouped_prompts(tok)
    params = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    r = engine.generate(prompts, params, seeds=list(range(len(prompts))))
    pids, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        trainer = response_logprobs(model, pids, pmask, r.response_ids, r.response_mask).logprobs
    return r, pids, pmask, trainer


@pytest.mark.parametrize("family", [f if f == "qwen3_5" else pytest.param(f, marks=pytest.mark.slow) for f in HYBRIDS])
def test_engine_and_trainer_logprobs_on_each_hybrid(hybrid_dir, family):
    model, tok = load(hybrid_dir(family))
    model.eval()
    assert is_hybrid(model)
    r, pids, pmask, trainer = sample_and_score(model, tok)
    m = r.response_mask
    assert m.sum() > 32
    with torch.no_grad():
        own = own_logprobs(model, pids, pmask, r.response_ids, r.response_mask)
    assert (trainer - own).abs()[m].max().item() < 1e-6
    # chunked prefill + recurrent decode against the trainer's one chunked forward: close, within 1e-5
    assert (trainer - r.rollout_logprobs).abs()[m].max().item() < 1e-5
    # a group's two rows were prefilled once: same prompt state, different seeds, different samples
    assert not torch.equal(r.response_ids[0], r.response_ids[1])


def test_hybrids_fall_back_to_re_prefilling_every_turn(hybrid_dir):
    """Issue 36: a hybrid's conv and recurrent states are not continued across a multi-turn episode's turns: its
    engine keeps no KV in the session, so a later turn re-prefills the whole episode and gives exactly what an
    engine outside any session gives."""
    model, tok = load(hybrid_dir("qwen3_5"))
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id])
    prompts = grouped_prompts(tok)[:4]
    params = SamplingConfig(temperature=1.0, max_new_tokens=4)
    seeds = list(range(4))
    with engine.kv_continuation() as kept:
        assert kept is None and engine.kept is None
        first = engine.generate(prompts, params, seeds)
        later = [p + first.response_ids[i][first.response_mask[i]].tolist() + [11, 12] for i, p in enumerate(prompts)]
        continued = engine.generate(later, params, seeds)
    fresh = engine.generate(later, params, seeds)
    assert torch.equal(continued.response_ids, fresh.response_ids)
    assert torch.equal(continued.rollout_logprobs, fresh.rollout_logprobs)


def test_state_layer_copies_and_drops_rows():
    cache = hybrid_cache_of(["linear_attention", "full_attention"])
    linear, attention = cache.layers
    assert isinstance(linear, StateLayer) and isinstance(attention, ReservedLayer)
    conv = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    state = torch.arange(2 * 2 * 2 * 2, dtype=torch.float32).view(2, 2, 2, 2)
    cache.update_conv_state(conv, 0, conv_kernel_size=4)
    cache.update_recurrent_state(state, 0)
    cache.update(torch.ones(2, 1, 5, 8), torch.ones(2, 1, 5, 8), 1)
    cache.batch_select_indices(torch.tensor([1, 1, 0]))  # prompt 1 to two rows, prompt 0 to one
    assert torch.equal(cache.get_conv_state(0), conv[[1, 1, 0]])
    assert torch.equal(cache.get_recurrent_state(0), state[[1, 1, 0]])
    assert attention.keys.shape == (3, 1, 5, 8)
    cache.batch_select_indices(torch.tensor([2]))  # rows 0 and 1 finished
    assert torch.equal(cache.get_recurrent_state(0), state[[0]])


def hybrid_cache_of(types):
    class Config:
        layer_types = types

    class Model(torch.nn.Module):
        config = Config()

    return hybrid_cache(Model(), lambda: ReservedLayer(16))


def test_hybrid_cache_refuses_other_layer_types_by_name():
    assert hybrid_cache_of(["full_attention"]) is None  # no linear layer: the engine keeps its own cache
    with pytest.raises(ValueError, match=r"and full_attention layers, not \['sliding_attention'\]"):
        hybrid_cache_of(["linear_attention", "sliding_attention"])


def shared_and_unshared(model, tok, kernels="default", linear_attention="chunked"):
    """((log-probs, gradient) of the one-forward path, the same of the shared-prefix path) on the four questions
    twice each (groups of two, prompts of 20-40 tokens: mixed left padding) with uneven 6-token completions."""
    ids, mask = left_pad(chat_prompts(tok, QUESTIONS), tok.pad_token_id)
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    g = torch.Generator().manual_seed(0)
    response = torch.randint(0, len(tok), (ids.shape[0], 6), generator=g)
    response_mask = torch.ones_like(response, dtype=torch.bool)
    response_mask[1::3, 3:] = False
    out = []
    with kernel_mode(kernels, model, linear_attention=linear_attention):
        for shared in (False, True):
            model.zero_grad()
            lp = response_logprobs(model, ids, mask, response, response_mask, shared_prefix=shared).logprobs
            lp.sum().backward()
            grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            out.append((lp.detach(), grad))
    return out


@pytest.mark.parametrize("family", [f if f == "qwen3_5" else pytest.param(f, marks=pytest.mark.slow) for f in HYBRIDS])
def test_shared_prefix_continues_the_prompt_s_conv_and_recurrent_states(hybrid_dir, family):
    """``update.shared_prefix`` on a hybrid: each prompt runs once and its completions continue its keys and
    values and its conv and recurrent states; the log-probs and the gradient equal the one-forward path's, with
    either algorithm."""
    model, tok = load(hybrid_dir(family))
    assert resolve_shared_prefix("auto", model, 8) == (True, "")
    for mode in ("chunked", "recurrent"):
        (lp, grad), (s_lp, s_grad) = shared_and_unshared(model, tok, linear_attention=mode)
        torch.testing.assert_close(s_lp, lp, rtol=1e-5, atol=1e-6, msg=mode)
        torch.testing.assert_close(s_grad, grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(), msg=mode)


def test_shared_prefix_is_bit_for_bit_under_batch_invariant_kernels(hybrid_dir):
    """Under ``kernels=batch_invariant`` (the recurrent algorithm) a completion continuing its prompt's states
    computes the very float operations of the one-forward path: equal log-probs."""
    model, tok = load(hybrid_dir("qwen3_5"))
    (lp, grad), (s_lp, s_grad) = shared_and_unshared(model, tok, "batch_invariant", "recurrent")
    assert torch.equal(s_lp, lp)
    torch.testing.assert_close(s_grad, grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item())


@pytest.mark.parametrize("family", [f if f == "qwen3_5" else pytest.param(f, marks=pytest.mark.slow) for f in HYBRIDS])
def test_two_step_grpo_run_trains_each_hybrid(hybrid_dir, family, tmp_path):
    out = tmp_path / "run"
    run(fast_config(f"model.name_or_path={hybrid_dir(family)}", "trainer.max_steps=2", "algo=grpo"), out)
    scalars = read_scalars(out)
    assert len(scalars["train/loss"]) == 2
    # the stock gap (chunked trainer, recurrent decode) is small in float32 but not zero
    assert all(0.0 < v < 1e-5 for _, v in scalars["train/logprob_abs_diff"])
    reloaded, _ = load(out / "policy")
    expected = HYBRIDS[family][0].replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")
    assert type(reloaded).__name__ == expected


@pytest.mark.slow
@pytest.mark.parametrize("linear_attention", ["auto", "chunked"])
def test_two_step_run_under_batch_invariant_kernels(hybrid_dir, linear_attention, tmp_path):
    """kernels=batch_invariant trains Qwen3.5 with no gap (auto: the recurrent algorithm on both sides); with
    linear_attention=chunked, the stock split, the gap is back, small and nonzero."""
    out = tmp_path / "run"
    overrides = ["trainer.max_steps=2", "kernels=batch_invariant", f"kernels.linear_attention={linear_attention}"]
    run(fast_config(f"model.name_or_path={hybrid_dir('qwen3_5')}", *overrides, "algo=grpo"), out)
    gaps = [v for _, v in read_scalars(out)["train/logprob_abs_diff"]]
    assert len(gaps) == 2
    assert all(v == 0.0 for v in gaps) if linear_attention == "auto" else all(0 < v < 1e-5 for v in gaps)


def test_vllm_is_refused_at_start_up_by_name_on_this_cpu(hybrid_dir, capsys):
    """The installed CPU build of vLLM cannot load the family (its model module imports torchvision): engine=vllm
    stops before any weight loads, naming the architecture; engine=auto takes the embedded engine and says why."""
    from helpers import compose_config

    from lit_rl.config import ConfigError
    from lit_rl.run.resolve import resolve_engine

    if torch.cuda.is_available():
        pytest.skip("the refusal is the CPU build's")
    cfg = compose_config(f"model.name_or_path={hybrid_dir('qwen3_5')}", "engine=vllm")
    with pytest.raises(ConfigError, match=r"engine=vllm: vLLM's CPU build does not serve Qwen3_5ForCausalLM"):
        resolve_engine(cfg)
    cfg = compose_config(f"model.name_or_path={hybrid_dir('qwen3_5')}", "engine=auto")
    resolve_engine(cfg)
    assert cfg.engine.name == "torch" and "Gated DeltaNet" in capsys.readouterr().out


def engine_and_trainer(model, tok, prompts, seeds, new_tokens=12):
    """The engine's rollouts of ``prompts`` and the trainer's log-probs of them ([N, T] float32)."""
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id])
    r = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=new_tokens), seeds=seeds)
    pids, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        trainer = response_logprobs(model, pids, pmask, r.response_ids, r.response_mask).logprobs
    return r, trainer


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_stock_gap_and_one_algorithm_bit_for_bit(hybrid_dir, autocast, capsys):
    """Under kernels=batch_invariant the stock split (chunked trainer, recurrent decode) leaves a gap; with
    linear_attention=recurrent (auto) the engine equals the trainer bit for bit, and a decode batch of 1 equals
    the same row decoded among 8 (prompts of mixed lengths, groups of two)."""
    model, tok = load(hybrid_dir("qwen3_5"))
    model.eval()
    prompts, seeds = grouped_prompts(tok), list(range(8))
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with kernel_mode("batch_invariant", model, linear_attention="chunked"), cast:
        r, trainer = engine_and_trainer(model, tok, prompts, seeds)
    gap = (trainer - r.rollout_logprobs).abs()[r.response_mask].max().item()
    with kernel_mode("batch_invariant", model), cast:  # auto -> recurrent
        r, trainer = engine_and_trainer(model, tok, prompts, seeds)
        alone, _ = engine_and_trainer(model, tok, prompts[2:3], seeds[2:3])
    m = r.response_mask
    with capsys.disabled():
        print(f"\nstock gap (chunked trainer, recurrent decode), {'bf16' if autocast else 'float32'}: max {gap:.3g}")
    assert gap > 0
    assert torch.equal(trainer[m], r.rollout_logprobs[m])
    n = int(alone.response_mask.sum())
    assert torch.equal(alone.response_ids[0, :n], r.response_ids[2, :n])
    assert torch.equal(alone.rollout_logprobs[0, :n], r.rollout_logprobs[2, :n])


@pytest.mark.parametrize("family", ["qwen3_5_moe", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_batch_invariant_refuses_mixture_of_experts_by_name(hybrid_dir, family):
    """No routing replay: the experts' token sets depend on the batch, so the mode refuses the model (a run turns
    the ValueError into a ConfigError naming model.name_or_path, ``run.train.enter_kernel_mode``)."""
    model, _ = load(hybrid_dir(family))
    with pytest.raises(ValueError, match=r"does not cover Qwen3\w*ForCausalLM's mixture-of-experts layers"):
        kernel_mode("batch_invariant", model).__enter__()
    assert bi.BatchInvariantMode._active is None  # nothing was installed


def test_recurrent_parity_refuses_value_heads_off_the_vector_width(tmp_path):
    folder = build_family("qwen3_5", tmp_path / "m", linear_num_value_heads=4)
    model, _ = load(folder)
    with pytest.raises(ValueError, match="needs linear_num_value_heads to be a multiple of 16 .* has 4"):
        kernel_mode("batch_invariant", model)
    kernel_mode("batch_invariant", model, linear_attention="chunked")  # nothing to refuse: the stock split


def test_gradient_through_the_recurrent_forward_is_the_chunked_one_with_and_without_checkpointing(hybrid_dir):
    grads = {}
    for mode, checkpointing in (("chunked", False), ("recurrent", False), ("recurrent", True)):
        spec = ModelConfig(str(hybrid_dir("qwen3_5")))
        spec.gradient_checkpointing = checkpointing
        model, tok = load_policy(spec)
        ids, mask = left_pad(grouped_prompts(tok)[::2], tok.pad_token_id)
        response = ids[:, -6:].clone()
        with kernel_mode("default", model, linear_attention=mode):
            scores = response_logprobs(model, ids, mask, response, torch.ones_like(response, dtype=torch.bool))
            scores.logprobs.sum().backward()
        grads[mode, checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters()}
    chunked = grads["chunked", False]
    for key in (("recurrent", False), ("recurrent", True)):
        for name, grad in grads[key].items():
            torch.testing.assert_close(grad, chunked[name], rtol=1e-4, atol=1e-6, msg=f"{key} {name}")
    A_log = "model.layers.0.linear_attn.A_log"
    assert chunked[A_log].abs().max() > 0  # the decay parameters are trained through the chunked backward


def test_keep_float32_keeps_the_decay_parameters_out_of_the_engine_copy_s_rounding(hybrid_dir, capsys):
    """The A_log trap: a bf16 engine copy that rounds A_log and dt_bias samples from another model than the
    trainer, which uses them in float32. Here the trainer's weights are bf16 except those two (float32), so an
    engine copy in bf16 that keeps them (the default) is the same model, bit for bit under batch-invariant
    kernels; emptying ``keep_float32`` rounds them and the gap appears: everything else equal."""
    model, tok = load(hybrid_dir("qwen3_5"))
    model.eval().to(torch.bfloat16)
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            p.data = p.data.float() + 1e-3  # off the bf16 grid: rounding them would change them
    prompts, seeds = grouped_prompts(tok), list(range(8))
    gaps = {}
    with kernel_mode("batch_invariant", model):
        for keep in (("A_log", "dt_bias"), ()):
            engine = TorchEngine(
                model, tok.pad_token_id, [tok.eos_token_id], weights_dtype=torch.bfloat16, keep_float32=keep
            )
            assert engine.model.model.layers[0].linear_attn.A_log.dtype == (torch.float32 if keep else torch.bfloat16)
            r = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=12), seeds=seeds)
            pids, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
            with torch.no_grad():
                trainer = response_logprobs(model, pids, pmask, r.response_ids, r.response_mask).logprobs
            gaps[keep] = (trainer - r.rollout_logprobs).abs()[r.response_mask].mean().item()
    with capsys.disabled():
        kept, rounded = gaps[("A_log", "dt_bias")], gaps[()]
        print(f"\nbf16 engine copy, mean |rollout - trainer| log-prob: keep {kept:.3g}, not {rounded:.3g}")
    assert gaps[("A_log", "dt_bias")] == 0.0
    assert gaps[()] > 1e-4


def test_keep_float32_refuses_names_that_match_no_parameter_at_load(hybrid_dir, tmp_path):
    """A misspelt name would leave its parameter to be rounded silently: the engine refuses it when built, naming
    it and the model's close candidates; null (None) is the family's defaults, none for an attention model."""
    model, tok = load(hybrid_dir("qwen3_5"))
    assert TorchEngine(model, tok.pad_token_id, [tok.eos_token_id]).keep_float32 == ("A_log", "dt_bias")
    with pytest.raises(ValueError, match=r"engine.keep_float32: \['dtbias'\] match no parameter of Qwen3_5.*'dt_bias'"):
        TorchEngine(
            model, tok.pad_token_id, [tok.eos_token_id], weights_dtype=torch.bfloat16, keep_float32=["A_log", "dtbias"]
        )
    with pytest.raises(ValueError, match=r"\['A_lg', 'gate'\] match no parameter.*'A_lg': close to \['A_log'\]"):
        TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], keep_float32=["A_lg", "gate", "dt_bias"])
    attention, _ = load(build_family("qwen3", tmp_path / "qwen3"))
    assert TorchEngine(attention, tok.pad_token_id, [tok.eos_token_id]).keep_float32 == ()
    with pytest.raises(ValueError, match=r"\['A_log'\] match no parameter of Qwen3ForCausalLM"):
        TorchEngine(attention, tok.pad_token_id, [tok.eos_token_id], keep_float32=["A_log"])


def test_flops_count_the_linear_attention_layers(hybrid_dir):
    """perf/mfu's FLOP model: per linear-attention layer its projections and conv (not q/k/v/o), the S² term on the
    full-attention layer only, and 8 FLOPs per state entry and token for the state (3 linear layers x 16 heads
    x 32 x 32)."""
    from lit_rl.run.flops import FlopModel

    model, tok = load(hybrid_dir("qwen3_5"))
    flops = FlopModel.from_config(model.config)
    layers = model.model.layers
    matrices = sum(m.weight.numel() for m in layers.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d)))
    assert flops.dense_params == matrices + 2 * len(tok) * 64  # every product a token runs, embedding and head
    assert (flops.layers, flops.linear_unit) == (1, 3 * 16 * 32 * 32)
    assert flops.update_flops([10]) == 6 * flops.dense_params * 10 + 12 * 64 * 100 + 24 * 3 * 16 * 32 * 32 * 10
    assert flops.rollout_flops([5], [2]) == (2 * flops.dense_params + 8 * 3 * 16 * 32 * 32) * 2 + 4 * 64 * 13


def test_lora_default_targets_cover_the_gated_deltanet_projections(hybrid_dir):
    spec = ModelConfig(str(hybrid_dir("qwen3_5")))
    spec.lora.r = 4
    model, _ = load_policy(spec)
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "gate_proj"} <= adapted
