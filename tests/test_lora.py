"""LoRA adapters (``model.lora``, PEFT): only the adapter trains and is checkpointed, the reference policy is the
shared frozen base with the adapter disabled, the merged weights are W0 + (alpha / r) B A, a resumed run logs
what a straight one does, the export is the adapter or the merged model, and bad settings are refused."""

import pytest
import torch
from helpers import MOVING, compose_config, fast_config
from safetensors.torch import load_file

import lit_rl.run.train
from lit_rl.config import ConfigError, validate
from lit_rl.models import ModelConfig, adapter_disabled, load_policy, merged_weights
from lit_rl.rollout.types import RolloutBatch, left_pad
from lit_rl.run.train import build_module, run
from lit_rl.tools.compare import read_scalars

LORA = ["model.lora.r=4", "model.lora.alpha=8"]


def lora_policy(seed=0):
    """The tiny model with a rank-4 adapter whose B is random (PEFT starts B at zero: the adapted model would
    equal the base, and every comparison below would pass trivially)."""
    policy, tok = load_policy(ModelConfig("tiny", lora={"r": 4, "alpha": 8}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return policy, tok


def test_merged_weights_are_the_base_plus_the_scaled_low_rank_product_peft_merges():
    policy, _ = lora_policy()
    merged = merged_weights(policy)
    base, _ = load_policy(ModelConfig("tiny"))
    assert set(merged) == set(base.state_dict())  # the base model's names: what vLLM and save_pretrained expect
    sd = policy.state_dict()
    q = "model.layers.0.self_attn.q_proj"
    a, b = sd[f"{q}.lora_A.default.weight"], sd[f"{q}.lora_B.default.weight"]
    want = sd[f"{q}.base_layer.weight"] + b @ a * (8 / 4)  # W0 + (alpha / r) B A
    torch.testing.assert_close(merged[f"{q}.weight"], want, rtol=0, atol=1e-6)
    embed = "model.embed_tokens.weight"
    assert merged[embed].data_ptr() == sd[embed].data_ptr()  # untouched: the same storage (ties stay visible)
    # PEFT's own merge (merge_and_unload) gives the same model
    from lit_rl.models import peft_model

    peft_merged = peft_model(policy).merge_and_unload().state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(v, peft_merged[k], rtol=0, atol=1e-6)


def test_the_reference_is_the_shared_base_scored_with_the_adapter_disabled():
    policy, tok = lora_policy()
    module = build_module(fast_config(*LORA, "kl.beta=0.1"), policy, tok)
    assert module.ref_policy is None and module.has_reference
    # no second copy of the weights: every parameter storage of the module is the policy's own
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    assert storages == {p.untyped_storage().data_ptr() for p in policy.parameters()}
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in policy.parameters())
    # the optimizer holds the adapter's parameters only
    (group,) = module.configure_optimizers().param_groups
    names = {id(p): n for n, p in policy.named_parameters()}
    assert group["params"] and all("lora_" in names[id(p)] for p in group["params"])
    assert sum(p.numel() for p in group["params"]) == 2 * 4 * (  # 2 layers x r (in + out) per projection
        (64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + (64 + 128) + (64 + 128) + (128 + 64)
    )
    # reference log-probs = the base model's, bit for bit; the adapted policy's differ
    prompts = [tok("What is 2 + 3?").input_ids, tok("Hi").input_ids]
    pi, pm = left_pad(prompts, tok.pad_token_id)
    ri = torch.tensor([[100, 200, 300], [400, 500, tok.pad_token_id]])
    rm = torch.tensor([[True, True, True], [True, True, False]])
    n, t = ri.shape
    zeros = torch.zeros(n, t)
    mb = RolloutBatch(pi, pm, ri, rm, zeros, torch.zeros(n), torch.zeros(n), torch.arange(n), torch.zeros(n).long())
    ref = module.reference_logprobs(mb)
    base, _ = load_policy(ModelConfig("tiny"))
    module_base = build_module(fast_config("kl.beta=0.1"), base, tok)
    with torch.no_grad():
        want = module_base.logprobs_of(base, mb, with_entropy=False).logprobs
        adapted = module.logprobs_of(policy, mb, with_entropy=False).logprobs
    assert torch.equal(ref, want)
    assert (adapted - want).abs()[mb.response_mask].max() > 1e-3
    with adapter_disabled(policy), torch.no_grad():  # and the context restores the adapter after
        pass
    with torch.no_grad():
        assert torch.equal(module.logprobs_of(policy, mb, with_entropy=False).logprobs, adapted)


def test_lora_run_checkpoints_the_adapter_only_resumes_exactly_and_exports(tmp_path):
    """3 steps straight = 2 steps + resume to 3, every logged value identical; the checkpoint holds the adapter
    (+ its Adam state) only; policy/ is the adapter, or with merge_on_export the merged model."""
    common = ["eval.num_examples=0", "checkpoint.every_n_steps=1", "kl.beta=0.05", *MOVING, *LORA]
    run(fast_config("trainer.max_steps=3", "model.lora.merge_on_export=true", *common), tmp_path / "straight")
    run(fast_config("trainer.max_steps=2", *common), tmp_path / "resumed")
    run(fast_config("trainer.max_steps=3", "ckpt_path=last", *common), tmp_path / "resumed")
    a = read_scalars(tmp_path / "straight")
    b = read_scalars(tmp_path / "resumed")
    tags = [t for t in a if not t.startswith(("time/", "perf/"))]
    assert "train/ref_kl" in tags and "train/loss" in tags
    for tag in tags:
        assert b[tag] == a[tag], tag
    assert len({v for _, v in a["train/grad_norm"]}) == 3 and a["train/ref_kl"][-1][1] > 0  # the adapter moved

    ckpt = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    keys = list(ckpt["state_dict"])
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:5]
    (state,) = ckpt["optimizer_states"]
    assert len(state["state"]) == len(keys)  # Adam moments for the adapter's tensors only
    base, _ = load_policy(ModelConfig("tiny"))
    full_weights = sum(p.numel() * p.element_size() for p in base.parameters())
    size = (tmp_path / "resumed" / "checkpoints" / "last.ckpt").stat().st_size
    assert size < 0.05 * full_weights, (size, full_weights)  # a full checkpoint holds >= the weights themselves

    # policy/: the adapter (PEFT format) or the merged model; both are the same trained weights
    from peft import PeftModel

    adapter = tmp_path / "resumed" / "policy"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert not (adapter / "model.safetensors").exists()
    merged = load_file(tmp_path / "straight" / "policy" / "model.safetensors")
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    reloaded = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(v, reloaded[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.lora.r=-1", "model.lora.r"),
        ("model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.dropout=1.0", "model.lora.dropout"),
        ("model.lora.target_modules=[]", "model.lora.target_modules"),
        ("trainer=fsdp", "LoRA is not wired for trainer=fsdp"),
    ],
)
def test_bad_lora_settings_are_refused_at_start_up(override, named):
    cfg = compose_config("model=tiny", "model.lora.r=4", override)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate(cfg)


def test_lora_with_batch_invariant_kernels_at_float32_is_refused(tmp_path):
    cfg = fast_config(*LORA, "kernels=batch_invariant", "trainer.precision=32-true")
    with pytest.raises(ConfigError, match=r"kernels='batch_invariant'.*only under trainer\.precision=bf16-mixed"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_target_modules_the_model_lacks_are_refused_before_the_weights_load(tmp_path, monkeypatch):
    # a new user's finding: refused only after the weights had loaded; now from the config on the meta device
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the targets were checked")

    monkeypatch.setattr(lit_rl.run.train, "load_policy", no_load)
    with pytest.raises(
        ConfigError,
        match=r"model\.lora\.target_modules=\['no_such_proj'\]: no module of .* "
        r"its linear layers are named \[.*'q_proj'",
    ):
        run(fast_config("model.lora.r=4", "model.lora.target_modules=[no_such_proj]"), tmp_path / "run")


@pytest.mark.parametrize(
    "engine, bound",
    [
        (["kernels=batch_invariant", "trainer.precision=bf16-mixed"], 0.0),  # batch-invariant: bit for bit
        (["engine.dtype=float32"], 1e-4),  # the embedded engine's own copy of the adapted model
    ],
    ids=["batch_invariant", "own_copy"],
)
def test_the_embedded_engine_samples_through_the_adapter(tmp_path, engine, bound):
    """Two moving steps: the engine's log-probs equal the trainer's (the adapted model's) after the update."""
    run(fast_config("trainer.max_steps=2", "eval.num_examples=0", *MOVING, *LORA, *engine), tmp_path / "run")
    s = read_scalars(tmp_path / "run")
    gaps = [v for _, v in s["train/logprob_abs_diff"]]
    assert len(gaps) == 2 and all(v <= bound for v in gaps), gaps
    assert s["train/grad_norm"][0][1] > 0


@pytest.mark.slow
def test_a_three_step_lora_run_on_smollm2(tmp_path):
    """SmolLM2-135M with a rank-16 adapter and a KL term: 3 moving steps, the engine's log-probs within 1e-4 of
    the trainer's, a checkpoint of adapter tensors only, the adapter exported."""
    out = tmp_path / "run"
    cfg = compose_config(
        "model=smollm2-135m",
        "model.lora.r=16",
        "model.lora.alpha=32",
        "trainer.precision=32-true",
        "trainer.enable_progress_bar=false",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "sampling.max_new_tokens=16",
        "eval.num_examples=0",
        "checkpoint.every_n_steps=3",
        "trainer.max_steps=3",
        "kl.beta=0.05",
        *MOVING,
    )
    run(cfg, out)
    s = read_scalars(out)
    assert all(v < 1e-4 for _, v in s["train/logprob_abs_diff"])
    assert s["train/ref_kl"][-1][1] > 0  # the adapter moved away from the shared base
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert all(".lora_A." in k or ".lora_B." in k for k in ckpt["state_dict"])
    # adapter 4.9 M parameters + 2 Adam moments: ~59 MB; the full model's weights alone are 540 MB
    assert (out / "checkpoints" / "last.ckpt").stat().st_size < 100e6
    assert (out / "policy" / "adapter_model.safetensors").is_file()


def test_an_engine_with_its_own_copy_holds_the_merged_weights():
    from helpers import chat_prompts

    from lit_rl.logprobs import response_logprobs
    from lit_rl.rollout.torch_engine import TorchEngine
    from lit_rl.rollout.types import SamplingConfig

    policy, tok = lora_policy()
    engine = TorchEngine(policy, tok.pad_token_id, [tok.eos_token_id], own_copy=True)
    assert not any("lora" in n or "base_layer" in n for n, _ in engine.model.named_parameters())
    with torch.no_grad():
        for name, value in merged_weights(policy).items():
            assert torch.equal(engine.model.state_dict()[name], value), name
    r = engine.generate(chat_prompts(tok, ["What is 2 + 3?", "Hi"]), SamplingConfig(max_new_tokens=8), seeds=[0, 1])
    pi, pm = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        lp = response_logprobs(policy, pi, pm, r.response_ids, r.response_mask, with_entropy=False).logprobs
    assert (lp - r.rollout_logprobs).abs()[r.response_mask].max() < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3", "gemma", "gemma2", "gemma3", "mistral", "phi3"])
def test_the_default_targets_adapt_every_projection_of_each_family(family):
    """model.lora.target_modules' default puts an adapter on every attention and MLP projection (Phi-3's fused
    qkv_proj / gate_up_proj too), none on the output layer; the merged weights carry the base model's names."""
    from helpers.families import family_config
    from transformers import AutoModelForCausalLM

    from lit_rl.models import LoraConfig, add_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, 256))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    names = set(model.state_dict())
    adapted = add_lora(model, LoraConfig(r=2))
    from peft.tuners.lora import LoraLayer

    assert {n for n, m in adapted.named_modules() if isinstance(m, LoraLayer)} == linears
    assert set(merged_weights(adapted)) == names
    assert all(("lora_" in n) == p.requires_grad for n, p in adapted.named_parameters())
