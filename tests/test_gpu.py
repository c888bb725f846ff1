"""The GPU path (issue 41), run by ``pytest -m gpu`` inside scripts/gpu_check.sh on a CUDA machine; every test is
skipped, with the reason, where CUDA is absent (tests/test_gpu_check.py checks that). Figures that are reported
rather than bounded (the bf16-mixed gap, peak memory) are printed and added to ``$GPU_CHECK_REPORT/gpu_tests.json``
when the check names a report folder."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import ROOT, chat_prompts, compose_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)"),
]

QUESTIONS = ["What is 1 + 2?", "What is 7 + 5? Think step by step.", "Hi", "Add 3 and 9, then explain."]
#: the GRPO and LoRA runs the device run's dry run composes and validates (scripts/gpu_check.py's CONFIGS)
_spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
_gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpu_check)
RUN, LORA = _gpu_check.RUN, _gpu_check.LORA


def report(key: str, value) -> None:
    """Print a reported figure and add it to $GPU_CHECK_REPORT/gpu_tests.json (when the check set it)."""
    print(f"REPORT {key} = {value}")
    folder = os.environ.get("GPU_CHECK_REPORT")
    if folder:
        path = Path(folder) / "gpu_tests.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[key] = value
        path.write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="module")
def tiny_cuda():
    from lit_rl.models import ModelConfig, load_policy

    model, tok = load_policy(ModelConfig("tiny"))
    return model.cuda(), tok


def generate_and_score(model, tok, autocast: bool, **engine_options):
    """(engine log-probs, trainer log-probs, response mask) of 8 completions of 24 tokens, seeded."""
    from lit_rl.logprobs import response_logprobs
    from lit_rl.rollout.torch_engine import TorchEngine
    from lit_rl.rollout.types import SamplingConfig, left_pad

    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], **engine_options)
    prompts = chat_prompts(tok, QUESTIONS) * 2
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        r = engine.generate(prompts, SamplingConfig(max_new_tokens=24), seeds=list(range(len(prompts))))
        pi, pm = left_pad(r.prompt_ids, tok.pad_token_id)
        with torch.no_grad():
            args = (pi.cuda(), pm.cuda(), r.response_ids.cuda(), r.response_mask.cuda())
            lp = response_logprobs(model, *args).logprobs
    return r.rollout_logprobs.to(lp.device), lp, r.response_mask.to(lp.device)


def test_precision_auto_picks_bf16_mixed_on_a_cuda_device_that_multiplies_bf16():
    from lit_rl.run.hardware import resolve_precision

    precision, why = resolve_precision("auto", "gpu")
    report("precision_auto", f"{precision} ({why})")
    assert torch.cuda.is_bf16_supported(including_emulation=False)  # the check's GPU (H200) is Hopper
    assert precision == "bf16-mixed", why


def test_engine_and_trainer_log_probs_agree_on_cuda_in_float32_and_the_bf16_gap_is_reported(tiny_cuda):
    model, tok = tiny_cuda
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (TF32 would round to 10 mantissa bits)
    engine_lp, trainer_lp, mask = generate_and_score(model, tok, autocast=False)
    assert mask.sum() > 0
    diff = (engine_lp - trainer_lp).abs()[mask]
    report("logprob_abs_diff_float32_max", diff.max().item())
    assert diff.max().item() < 1e-4
    engine_lp, trainer_lp, mask = generate_and_score(model, tok, autocast=True)
    gap = (engine_lp - trainer_lp).abs()[mask]
    report("logprob_abs_diff_bf16_mixed", {"mean": gap.mean().item(), "max": gap.max().item()})
    assert torch.isfinite(gap).all()


def test_an_own_copy_engine_in_bf16_syncs_the_trainer_weights_on_cuda(tiny_cuda):
    from lit_rl.rollout.torch_engine import TorchEngine

    model, tok = tiny_cuda
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], weights_dtype=torch.bfloat16)
    assert engine.own_copy and engine.model is not model
    with torch.no_grad():
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():
            p.add_(0.01)
        engine.sync_weights(1)
        copy = engine.model.state_dict()
        for name, value in model.state_dict().items():
            assert copy[name].device.type == "cuda" and copy[name].dtype == torch.bfloat16, name
            assert torch.equal(copy[name], value.to(torch.bfloat16)), name
        for name, value in before.items():
            model.state_dict()[name].copy_(value)


def test_a_two_step_grpo_run_on_trainer_gpu_logs_every_tag_and_reports_peak_memory(tmp_path):
    from test_train import TAGS  # the tags every run logs (docs/metrics.md's unconditional rows)

    from lit_rl.run.train import run
    from lit_rl.tools.compare import read_scalars

    torch.cuda.reset_peak_memory_stats()
    run(compose_config(*RUN), tmp_path / "run")
    scalars = read_scalars(tmp_path / "run")
    report("grpo_2_steps_peak_gpu_mib", torch.cuda.max_memory_allocated() / 2**20)
    report("grpo_2_steps_perf", {t: scalars[t][-1][1] for t in TAGS if t.startswith(("perf/", "time/"))})
    assert [tag for tag in TAGS if tag not in scalars] == []
    assert len(scalars["train/loss"]) == 2
    assert all(0.0 <= v < 1e-2 for _, v in scalars["train/logprob_abs_diff"])  # bf16-mixed: one autocast


def test_lora_on_cuda_trains_the_adapter(tmp_path):
    from safetensors.torch import load_file

    from lit_rl.run.train import run

    run(compose_config(*RUN, *LORA), tmp_path / "run")
    adapter = load_file(str(tmp_path / "run" / "policy" / "adapter_model.safetensors"))
    moved = [k for k, v in adapter.items() if "lora_B" in k and v.abs().max() > 0]  # B starts at zero
    assert moved, sorted(adapter)


def test_the_shared_prefix_update_on_cuda_equals_the_unshared_one(tiny_cuda):
    from faulty_tasks import UnevenPromptsTask
    from test_shared_prefix import G, cfg_for, run_update

    from lit_rl.rollout.datamodule import RolloutDataModule
    from lit_rl.run.train import build_module

    policy, tok = tiny_cuda
    torch.backends.cuda.matmul.allow_tf32 = False
    module = build_module(cfg_for("grpo"), policy, tok).cuda()  # the module's device: where build_batch puts rows
    dm = RolloutDataModule(UnevenPromptsTask(), tok, 4, G, seed=1, eval_examples=0)
    scored = dm.collect(module.engine, dm.prompts_for(0), module.sampling, step=0)
    scored.rewards = torch.arange(16, dtype=torch.float32) % 3
    loss, grad, _, _ = run_update(module, scored, False, 16)
    s_loss, s_grad, _, _ = run_update(module, scored, True, 3)
    report("shared_prefix_grad_max_abs_diff", (s_grad - grad).abs().max().item())
    assert grad.abs().max() > 0
    torch.testing.assert_close(s_loss, loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(s_grad, grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item())


def test_the_weight_store_cuda_transport_writes_and_loads_a_version(tiny_cuda):
    from lit_rl.rollout.weight_store import WeightStore

    model, _ = tiny_cuda
    store = WeightStore(model.state_dict(), slots=2)
    assert store.transport == "cuda_ipc"
    store.record(3, model)
    got = {}
    assert store.load_into(3, lambda weights: got.update({k: v.clone() for k, v in weights.items()}))
    for name, value in got.items():
        assert value.device.type == "cuda" and torch.equal(value, model.state_dict()[name]), name
    report("weight_store_cuda_bytes_per_version", store.describe()["bytes_per_version"])
