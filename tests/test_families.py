"""The architectures people train, as tiny random models loaded through ``model.name_or_path=<folder>``
(``helpers.families``): the trainer's log-probs are the model's own distribution (Gemma-2/3's soft-capping
included), the embedded engine's equal the trainer's, ``kernels=batch_invariant`` is bit for bit or refused at
start-up naming the piece, gradient checkpointing gives the same gradient, and a 2-step GRPO run trains."""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import MOVING, chat_prompts, fast_config
from helpers.families import FAMILIES, SLIDING, build_family

from lit_rl.config import ConfigError
from lit_rl.kernels import batch_invariant as bi
from lit_rl.kernels import kernel_mode
from lit_rl.logprobs import check_head_parity, head_transform, position_ids_from_mask, response_logprobs
from lit_rl.models import ModelConfig, load_policy
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.rollout.types import SamplingConfig, left_pad
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars

QUESTIONS = ["What is 1 + 2?", "What is 7 + 5? Think step by step.", "Hi", "Add 3 and 9, then explain."]
GEMMA_NORMS = ("gemma", "gemma2", "gemma3")
#: transformers has no sdpa path for Gemma-2 (its attention soft-capping): it runs with eager attention
ATTN = {"gemma2": "eager"}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """family (and build overrides) -> the folder of its tiny model, built once per module."""
    built = {}

    def get(family, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = build_family(family, tmp_path_factory.mktemp(family), **overrides)
        return built[key]

    return get


def load(folder, family):
    return load_policy(ModelConfig(str(folder), attn_implementation=ATTN.get(family, "sdpa")))


def own_logprobs(model, pids, pmask, response_ids, response_mask):
    """log_softmax of the model's own ``model(...).logits`` at the response tokens: [N, T] float32."""
    ids = torch.cat([pids, response_ids], 1)
    mask = torch.cat([pmask, response_mask], 1).long()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    p = pids.shape[1]
    return F.log_softmax(logits.float(), -1)[:, p - 1 : -1].gather(-1, response_ids[..., None]).squeeze(-1)


def sample_and_score(model, tok, new_tokens=12):
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id])
    prompts = chat_prompts(tok, QUESTIONS)  # 20-40 tokens: longer than the 8-token sliding windows
    r = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=new_tokens), seeds=[0, 1, 2, 3])
    pids, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        trainer = response_logprobs(model, pids, pmask, r.response_ids, r.response_mask).logprobs
    return r, pids, pmask, trainer


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trainer_logprobs_are_the_model_s_own_and_the_engine_s_equal_them(family_dir, family):
    model, tok = load(family_dir(family), family)
    model.eval()
    r, pids, pmask, trainer = sample_and_score(model, tok)
    m = r.response_mask
    assert m.sum() > 16
    with torch.no_grad():
        own = own_logprobs(model, pids, pmask, r.response_ids, r.response_mask)
    assert (trainer - own).abs()[m].max().item() < 1e-5  # soft-capping and embedding scaling included
    assert (trainer - r.rollout_logprobs).abs()[m].max().item() < 1e-5
    assert check_head_parity(model, len(tok)) < 1e-5


def test_soft_capping_is_scored_and_ignoring_it_is_a_real_gap(family_dir):
    """The bug report's case: Gemma-3's final soft-capping moves the log-probs; the trainer applies it."""
    # a cap of 0.3: the tiny random model's logits are small, a production cap (30) would not bend them
    model, tok = load(family_dir("gemma3", final_logit_softcapping=0.3), "gemma3")
    transform = head_transform(model)
    assert transform.softcap == 0.3 and transform.scale == 1.0
    model.config.final_logit_softcapping = None  # what the trainer computed before: the uncapped head
    r, pids, pmask, uncapped = sample_and_score(model, tok)
    model.config.final_logit_softcapping = 0.3
    with torch.no_grad():
        own = own_logprobs(model, pids, pmask, r.response_ids, r.response_mask)
        capped = response_logprobs(model, pids, pmask, r.response_ids, r.response_mask).logprobs
    m = r.response_mask
    assert (uncapped - own).abs()[m].max().item() > 1e-2
    assert (capped - own).abs()[m].max().item() < 1e-5


def test_a_head_side_transform_lit_rl_does_not_know_is_refused(family_dir):
    from transformers import LlamaForCausalLM

    class DoubledLogits(LlamaForCausalLM):  # a model whose forward scales its logits, config silent about it
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    _, tok = load(family_dir("llama3"), "llama3")
    model = DoubledLogits.from_pretrained(str(family_dir("llama3")))
    with pytest.raises(ValueError, match="DoubledLogits: the trainer's log-probs .* differ from log_softmax"):
        check_head_parity(model, len(tok))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_invariant_kernels_are_bit_for_bit_on_every_family(family_dir, family):
    # sliding windows longer than every sequence: the mask is plain causal, which the kernels serve
    folder = family_dir(family, sliding_window=4096) if family in SLIDING else family_dir(family)
    model, tok = load(folder, family)
    with torch.no_grad():
        _, _, _, reference = sample_and_score(model, tok)
    norms = {cls.__name__: formula for cls, formula in bi.norm_kernels([model]).items()}
    assert norms and set(norms.values()) == {"gemma" if family in GEMMA_NORMS else "llama"}, norms
    with kernel_mode("batch_invariant", model):
        r, pids, pmask, trainer = sample_and_score(model, tok)
        with torch.no_grad():
            alone = response_logprobs(model, pids[1:2], pmask[1:2], r.response_ids[1:2], r.response_mask[1:2])
    m = r.response_mask
    assert torch.equal(trainer[m], r.rollout_logprobs[m])
    assert torch.equal(alone.logprobs[m[1:2]], r.rollout_logprobs[1:2][m[1:2]])
    # the same model up to rounding: Gemma's (1 + w) norm and Gemma-2's attention soft-capping are computed
    assert (trainer - reference).abs()[m].max().item() < 1e-4


def test_final_soft_capping_is_bit_for_bit_under_bf16_autocast(family_dir):
    """A new user's case: Gemma-2 with kernels=batch_invariant at bf16-mixed was 1e-5..2e-4 per token off the
    engine: the model's forward soft-caps its bf16 logits, the trainer capped them after casting to float32."""
    model, tok = load(family_dir("gemma2", sliding_window=4096), "gemma2")
    with kernel_mode("batch_invariant", model), torch.autocast("cpu", dtype=torch.bfloat16):
        r, _, _, trainer = sample_and_score(model, tok)
    m = r.response_mask
    assert torch.equal(trainer[m], r.rollout_logprobs[m])


def test_norm_layers_the_kernels_do_not_cover_are_refused_by_name(tiny):
    model, _ = tiny
    model = torch.nn.ModuleDict({"policy": model, "extra": torch.nn.LayerNorm(64)})
    with pytest.raises(ValueError, match=r"does not cover the norm layer\(s\) \['LayerNorm'\]"):
        bi.BatchInvariantMode(model).enable()
    assert bi.BatchInvariantMode._active is None  # nothing was installed
    assert bi.gemma_rms_norm(torch.ones(1, 4), torch.zeros(4), 0.0).eq(1).all()  # (1 + 0) * x / rms(x)


def test_start_up_refusals_name_the_reason(family_dir, tmp_path):
    # a sliding window shorter than prompt + new tokens, under the batch-invariant kernels
    with pytest.raises(ConfigError, match="does not cover sliding-window attention: the model's sliding_window=8"):
        run(fast_config(f"model.name_or_path={family_dir('mistral')}", "kernels=batch_invariant"), tmp_path / "a")
    # Gemma-2 has no sdpa attention in transformers
    with pytest.raises(
        ConfigError, match="Gemma2ForCausalLM .* has no sdpa attention .*; use model.attn_implementation=eager"
    ):
        run(fast_config(f"model.name_or_path={family_dir('gemma2')}"), tmp_path / "b")
    # flash-attn is CUDA-only
    with pytest.raises(ConfigError, match="model.attn_implementation.*flash-attn runs on CUDA GPUs only"):
        run(fast_config("model.attn_implementation=flash_attention_2"), tmp_path / "c")
    with pytest.raises(ConfigError, match="model.attn_implementation.*choose one of"):
        run(fast_config("model.attn_implementation=flash"), tmp_path / "d")


#: gradient checkpointing in the default suite for three families (Qwen3's q/k norms, Gemma-3, Phi-3's fused
#: projections); the other five with -m slow
DEFAULT_CHECKPOINTING = ("qwen3", "gemma3", "phi3")


@pytest.mark.parametrize(
    "family", [f if f in DEFAULT_CHECKPOINTING else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_gradient_checkpointing_gives_the_same_gradient(family_dir, family):
    grads = []
    for checkpointing in (False, True):
        spec = ModelConfig(str(family_dir(family)), attn_implementation=ATTN.get(family, "sdpa"))
        spec.gradient_checkpointing = checkpointing
        model, tok = load_policy(spec)
        assert model.is_gradient_checkpointing == checkpointing
        ids, mask = left_pad(chat_prompts(tok, QUESTIONS), tok.pad_token_id)
        response = ids[:, -6:].clone()  # any tokens: the gradient of their log-probs is what is compared
        scores = response_logprobs(model, ids, mask, response, torch.ones_like(response, dtype=torch.bool))
        scores.logprobs.sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], rtol=1e-5, atol=1e-6), name


#: one family in the default suite (Gemma-3: scaled embeddings, (1 + w) norms, soft-capping, sliding window),
#: the others with -m slow
DEFAULT_RUNS = ("gemma3",)


@pytest.mark.parametrize(
    "family", [f if f in DEFAULT_RUNS else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_two_step_grpo_run(family_dir, family, tmp_path):
    overrides = [f"model.name_or_path={family_dir(family)}", "trainer.max_steps=2", *MOVING]
    if family in ATTN:
        overrides.append(f"model.attn_implementation={ATTN[family]}")
    out = tmp_path / "run"
    run(fast_config(*overrides), out)
    scalars = read_scalars(out)
    assert len(scalars["train/loss"]) == 2
    assert all(0.0 <= v < 1e-4 for _, v in scalars["train/logprob_abs_diff"])
    assert (out / "policy" / "model.safetensors").is_file()
    reloaded, _ = load(out / "policy", family)
    assert type(reloaded).__name__ == FAMILIES[family][0].replace("Config", "ForCausalLM").replace("Text", "")


# -- vLLM per family (the CPU build needs head_dim >= 32: every tiny family has head_dim 32) ----------------
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("LIT_RL_VLLM") != "1", reason="vLLM not installed"
)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_logprobs_equal_the_trainer_s_after_a_sync(family_dir, family):
    from lit_rl.rollout.vllm_engine import VLLMEngine

    model, tok = load(family_dir(family), family)
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    engine = VLLMEngine(model, tok.pad_token_id, stops, dtype="float32", kv_cache_gb=0.25, max_model_len=512)
    try:
        engine.sync_weights(0)
        params = SamplingConfig(temperature=1.0, max_new_tokens=16)
        prompts = chat_prompts(tok, QUESTIONS)
        for version in (0, 1):
            r = engine.generate(prompts, params, seeds=[0, 1, 2, 3])
            pids, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
            with torch.no_grad():
                lp = response_logprobs(model, pids, pmask, r.response_ids, r.response_mask).logprobs
            assert (lp - r.rollout_logprobs).abs()[r.response_mask].max().item() < 1e-4, version
            with torch.no_grad():  # an "update": every weight moves, and the sync must carry it
                for p in model.parameters():
                    p.add_(0.02 * torch.randn_like(p))
            engine.sync_weights(1)
    finally:
        engine.close()


#: the sliding-window families (the window shorter than the prompts) and Gemma-2's attention soft-capping in the
#: default suite; the others with -m slow
DEFAULT_SHARED_PREFIX = ("gemma2", "mistral")


@pytest.mark.parametrize(
    "family", [f if f in DEFAULT_SHARED_PREFIX else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_shared_prefix_forward_equals_the_one_forward_path(family_dir, family):
    """``update.shared_prefix``: each prompt encoded once, its KV cache reused by its two completions; the
    log-probs and the gradient equal the one-forward path's (prompts of 20-40 tokens, windows of 8)."""
    from lit_rl.logprobs import resolve_shared_prefix

    model, tok = load(family_dir(family), family)
    assert resolve_shared_prefix(True, model, 2) == (True, "")
    ids, mask = left_pad(chat_prompts(tok, QUESTIONS), tok.pad_token_id)
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)  # groups of two
    g = torch.Generator().manual_seed(0)
    response = torch.randint(0, len(tok), (ids.shape[0], 6), generator=g)
    response_mask = torch.ones_like(response, dtype=torch.bool)
    response_mask[1::3, 3:] = False  # uneven completion lengths
    out = []
    for shared in (False, True):
        model.zero_grad()
        lp = response_logprobs(model, ids, mask, response, response_mask, shared_prefix=shared).logprobs
        lp.sum().backward()
        out.append((lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (lp, grad), (s_lp, s_grad) = out
    torch.testing.assert_close(s_lp, lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_grad, grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item())
