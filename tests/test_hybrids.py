"""Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) as tiny random models (``helpers.families.HYBRIDS``:
3 linear-attention layers and 1 full attention): the embedded engine's cache holds the conv and recurrent states
beside the KV, a group's prompt is prefilled once and its states copied to the G rows, the trainer's log-probs are
the model's own and the engine's equal them, the shared-prefix update is off with its reason, and a 2-step run
trains."""

import pytest
import torch
from helpers import chat_prompts, fast_config
from helpers.families import HYBRIDS, build_family
from test_families import QUESTIONS, own_logprobs

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


@pytest.mark.parametrize("family", list(HYBRIDS))
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
    with pytest.raises(ValueError, match=r"serves linear_attention and full_attention layers, not \['sliding_attention'\]"):
        hybrid_cache_of(["linear_attention", "sliding_attention"])


def test_shared_prefix_is_off_for_hybrids_with_the_reason(hybrid_dir):
    model, _ = load(hybrid_dir("qwen3_5"))
    on, why = resolve_shared_prefix("auto", model, 8)
    assert not on and "linear-attention (Gated DeltaNet) layers" in why and "recurrent states" in why
    with pytest.raises(ValueError, match=r"update.shared_prefix=true: .*Gated DeltaNet"):
        resolve_shared_prefix(True, model, 8)


@pytest.mark.parametrize(
    "family", [f if f == "qwen3_5" else pytest.param(f, marks=pytest.mark.slow) for f in HYBRIDS]
)
def test_two_step_grpo_run_trains_each_hybrid(hybrid_dir, family, tmp_path):
    out = tmp_path / "run"
    run(fast_config(f"model.name_or_path={hybrid_dir(family)}", "trainer.max_steps=2", "algo=grpo"), out)
    scalars = read_scalars(out / "tensorboard")
    assert len(scalars["train/loss"]) == 2
    # the stock gap (chunked trainer, recurrent decode) is small in float32 but not zero
    assert all(0.0 <= v < 1e-5 for _, v in scalars["train/logprob_abs_diff"])
    reloaded, _ = load(out / "policy")
    assert type(reloaded).__name__ == HYBRIDS[family][0].replace("TextConfig", "ForCausalLM").replace(
        "Config", "ForCausalLM"
    )


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
