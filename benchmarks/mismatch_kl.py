"""The train–inference gap each mismatch knob gives, on the real model: KL per token, both directions.

    python benchmarks/mismatch_kl.py                       # SmolLM2-135M-Instruct, the README table (~5 min)
    python benchmarks/mismatch_kl.py --model tiny --prompts 2 --group-size 4

Not a timing benchmark. For each knob setting the engine the config builds (``engine.*`` overrides, or the
bf16-autocast default) samples the same rollouts' prompts (arithmetic, P prompts x G completions, temperature
1, <= --new-tokens tokens) with the same seeds, and the float32 trainer scores the sampled tokens, as a
training step does. Printed per setting, as the trainer logs them (means over the sampled tokens):
``train/train_inference_kl`` (k3 estimate of KL(μ ‖ π)), ``train/train_inference_kl_reverse`` (KL(π ‖ μ) =
E_μ[w log w]), ``train/logprob_abs_diff`` (mean |log μ − log π|), and each with its standard error over the
sequences (a sequence's tokens are not independent; its mean is).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import machine  # noqa: E402

from lit_rl.corrections import mismatch_decomposition  # noqa: E402
from lit_rl.logprobs import response_logprobs  # noqa: E402
from lit_rl.models import ModelConfig, load_policy  # noqa: E402
from lit_rl.rollout.datamodule import RolloutDataModule  # noqa: E402
from lit_rl.rollout.engines import build_engine  # noqa: E402
from lit_rl.rollout.types import SamplingConfig, left_pad  # noqa: E402
from lit_rl.tasks import ArithmeticTask  # noqa: E402

# label -> (engine config, trainer autocast): the embedded engine's knobs, float32 trainer unless noted
SETTINGS = {
    "on-policy (float32)": ({}, False),
    "bf16 autocast, sampler and trainer (trainer.precision=bf16-mixed)": ({}, True),
    "engine.dtype=bfloat16": ({"dtype": "bfloat16"}, False),
    "engine.int8_roundtrip=true": ({"int8_roundtrip": True}, False),
    "engine.logit_noise=0.25": ({"logit_noise": 0.25}, False),
    "engine.logit_noise=0.5": ({"logit_noise": 0.5}, False),
    "engine.logit_noise=1": ({"logit_noise": 1.0}, False),
    "engine.logit_noise=2": ({"logit_noise": 2.0}, False),
    "engine.temperature_offset=0.1": ({"temperature_offset": 0.1}, False),
    "engine.temperature_offset=0.3": ({"temperature_offset": 0.3}, False),
    "engine.temperature_offset=-0.3": ({"temperature_offset": -0.3}, False),
}


def per_sequence(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(token-weighted mean, its standard error from the per-sequence means) of [N, T] values."""
    m = mask.float()
    mean = float((values * m).sum() / m.sum())
    seq = (values * m).sum(-1) / m.sum(-1).clamp(min=1)
    keep = mask.any(-1)
    seq = seq[keep]
    se = float(seq.std() / math.sqrt(seq.numel())) if seq.numel() > 1 else math.nan
    return mean, se


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    policy, tok = load_policy(ModelConfig(args.model))
    policy.eval()
    dm = RolloutDataModule(ArithmeticTask(seed=0), tok, args.prompts, args.group_size, seed=0, eval_examples=0)
    examples = dm.prompts_for(0)
    params = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens)
    stops = [tok.eos_token_id] + (
        [policy.generation_config.eos_token_id]
        if isinstance(getattr(policy.generation_config, "eos_token_id", None), int)
        else []
    )
    print(
        f"{args.model}: {args.prompts} prompts x G={args.group_size}, <= {args.new_tokens} new tokens, "
        f"temperature 1; {machine()}\n"
    )
    print("| knob | KL(μ‖π) per token | KL(π‖μ) per token | mean \\|log μ − log π\\| | tokens |")
    print("|---|---:|---:|---:|---:|")
    for label, (engine_cfg, autocast) in SETTINGS.items():
        t0 = time.perf_counter()
        engine = build_engine({"name": "torch", **engine_cfg}, policy, tok.pad_token_id, stops)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
        with torch.no_grad(), ctx:
            scored = dm.collect(engine, examples, params, step=0)
            r = scored.rollouts
            pids, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
            lp = response_logprobs(
                policy, pids, pmask, r.response_ids, r.response_mask, with_entropy=False, chunk_tokens=256
            ).logprobs.float()
        m = r.response_mask
        d = (lp - r.rollout_logprobs).masked_fill(~m, 0.0)
        fwd = torch.expm1(d) - d
        rev = d.exp() * d - torch.expm1(d)
        check = mismatch_decomposition(r.rollout_logprobs, lp, lp, m)  # the trainer's own metric function
        (kf, sf), (kr, sr), (ad, sa) = per_sequence(fwd, m), per_sequence(rev, m), per_sequence(d.abs(), m)
        assert abs(kf - float(check["train_inference_kl"])) < 1e-5 + 1e-3 * kf
        print(
            f"| {label} | {kf:.4g} ± {sf:.2g} | {kr:.4g} ± {sr:.2g} | {ad:.4g} ± {sa:.2g} | {int(m.sum())} |",
            flush=True,
        )
        engine.close()
        del engine
        print(f"  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
