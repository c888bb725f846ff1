"""The variance score centering's sampled tail adds (``correction.sc.tail=sampled``), against full SC's own.

    python benchmarks/sampled_tail_noise.py                          # SmolLM2-135M, delta = +0.3, B = 3
    python benchmarks/sampled_tail_noise.py --model tiny --batches 4 --new-tokens 8

A sampler with a temperature offset (``engine.temperature_offset``, default +0.3: the top-k study's delta) records
its whole distribution; the trainer is SmolLM2 in float32 with full score centering (``correction.sc.mode=exact``)
and REINFORCE under a constant advantage (the probe's A = 1, so full SC's gradient has mean 0). Per rollout batch
b: ‖g_sc,b‖², full SC's gradient, and for every head k and draws m one draw of the sampled tail's noise ξ_b
(``lit_rl.tools.tail_noise``: the sampled tail's centring term minus the exact tail's, 0 in expectation), ‖ξ_b‖².
Reported per (k, m): R = Σ_b ‖ξ_b‖² / Σ_b ‖g_sc,b‖², the variance the sampled tail adds in units of full SC's
(the sampled tail's gradient variance is (1 + R) times full SC's), with a delete-one jackknife 95% t-interval
(B − 1 degrees of freedom), and the mean tail mass 1 − M_H per generated token. Timings are not the point here
(the step-time cost is ``benchmarks/sc_overhead.py --tail-samples 4``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import as_rollout_batch, machine, run_config  # noqa: E402
from rollout_throughput import prompts_for  # noqa: E402

from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy  # noqa: E402
from lit_rl.tools.tail_noise import noise_ratio, tail_noise_backward  # noqa: E402
from lit_rl.tools.topk_probe import t_interval  # noqa: E402


def grad_sq(policy) -> float:
    return float(sum(p.grad.double().pow(2).sum() for p in policy.parameters() if p.grad is not None))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--temperature-offset", type=float, default=0.3)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ks", default="32,128")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ks, ms = [int(k) for k in args.ks.split(",")], [int(m) for m in args.ms.split(",")]
    print(f"# {machine()}", flush=True)
    policy, tok = load_policy(ModelConfig(args.model))
    cfg = run_config(
        "model=tiny" if args.model == "tiny" else f"model.name_or_path={args.model}",
        "algo=reinforce",
        "algo.baseline=none",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={args.new_tokens}",
        f"rollout.group_size={args.group_size}",
        "rollout.micro_batch_size=4",
        f"engine.temperature_offset={args.temperature_offset}",
        "correction=sc",
        "correction.sc.mode=exact",
    )
    from lit_rl.run.train import build_module

    module = build_module(cfg, policy, tok)
    prompts = [p for p in prompts_for(tok, args.prompts) for _ in range(args.group_size)]
    n = len(prompts)
    sc_sq, noise_sq, tail_mass = [], {(k, m): [] for k in ks for m in ms}, {k: [] for k in ks}
    gen = torch.Generator().manual_seed(args.seed)
    for b in range(args.batches):
        t0 = time.perf_counter()
        with torch.no_grad():
            r = module.engine.generate(prompts, module.sampling, list(range(b * n, (b + 1) * n)))
        rb = as_rollout_batch(module, r, args.group_size)
        rb = replace(rb, advantages=torch.ones_like(rb.advantages))
        module.start_update(rb)
        policy.zero_grad(set_to_none=True)
        module.accumulate_gradients(rb)
        sc_sq.append(grad_sq(policy))
        mask = rb.response_mask
        for k in ks:
            tail_mass[k].append(float((1 - rb.topk_logprobs[..., :k].double().exp().sum(-1))[mask].mean()))
            for m in ms:
                policy.zero_grad(set_to_none=True)
                tail_noise_backward(module, rb, k, m, gen)
                noise_sq[(k, m)].append(grad_sq(policy))
        print(
            f"batch {b + 1}/{args.batches}: {int(mask.sum())} tokens, |g_sc|^2 {sc_sq[-1]:.4g}, "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    print(
        f"\n## {args.model}, temperature offset {args.temperature_offset:+}, float32, REINFORCE A = 1, "
        f"{args.batches} batches of {n} sequences x <= {args.new_tokens} tokens\n"
    )
    print("| k | mean tail mass 1 − M_H | m | R = E‖ξ‖² / Var(g_sc) [95% CI] | variance factor 1 + R |")
    print("|---:|---:|---:|---:|---:|")
    for k in ks:
        mass = sum(tail_mass[k]) / len(tail_mass[k])
        for m in ms:
            ratio, se = noise_ratio(noise_sq[(k, m)], sc_sq)
            lo, hi = t_interval(ratio, se, args.batches)
            print(f"| {k} | {mass:.3f} | {m} | {ratio:.4f} [{lo:.4f}, {hi:.4f}] | {1 + ratio:.4f} |")


if __name__ == "__main__":
    main()
