"""Overhead of score centering (k = 128) on a whole RL step, measured side by side in one run.

    python benchmarks/sc_overhead.py                  # SmolLM2-135M, 4 prompts x G=8 x 64 new tokens
    python benchmarks/sc_overhead.py --tail-samples 4  # and SC with the sampled tail (correction.sc.tail=sampled)

The same GRPO step twice, on identical work (same prompts, same per-row seeds, so the same sampled tokens):

* ``correction=none``: the engine records no top-k; the update scores the sampled tokens only;
* ``correction=sc``: the engine records its top-128 ids and log-probs per generated token, and the update
  gathers the trainer's log-probs at those ids and adds the centring term (``loss.assemble_loss``).

Rollout = ``engine.generate``; update = ``accumulate_gradients`` over the whole batch (forward, backward,
micro-batches of 16) plus an AdamW step, under bf16 autocast as ``trainer.precision=bf16-mixed`` trains.
The weights are restored after each update so every repeat does the same work. The two settings alternate
``--repeats`` times after a warm-up; medians are reported. The documents report <= 1% for SC's overhead.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import as_rollout_batch, ensure_quiet, grpo_module, machine, update  # noqa: E402
from rollout_throughput import prompts_for  # noqa: E402

from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy  # noqa: E402


def build(policy, tok, top_k: int, new_tokens: int, group_size: int, tail_samples: int = 0):
    sc = ["correction=sc", f"correction.sc.top_k={top_k}", "correction.sc.mode=topk"] if top_k > 0 else []
    if tail_samples:  # the sampled tail: m engine draws per token after the head, scored with it
        sc += ["correction.sc.tail=sampled", f"correction.sc.tail_samples={tail_samples}"]
    return grpo_module(policy, tok, new_tokens, group_size, *sc)


def step(module, opt, prompts, seeds, group_size) -> tuple[float, float, int]:
    """(rollout seconds, update seconds, generated tokens) of one RL step."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t0 = time.perf_counter()
        r = module.engine.generate(prompts, module.sampling, seeds)
        t1 = time.perf_counter()
        update(module, opt, as_rollout_batch(module, r, group_size))
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, int(r.response_mask.sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=128)
    ap.add_argument("--tail-samples", type=int, default=0, help="also time correction.sc.tail=sampled with m draws")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    ensure_quiet(args.force)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    policy, tok = load_policy(ModelConfig(args.model))
    initial = copy.deepcopy(policy.state_dict())
    prompts = [p for p in prompts_for(tok, args.prompts) for _ in range(args.group_size)]
    seeds = list(range(len(prompts)))
    settings = {
        "correction=none": build(policy, tok, 0, args.new_tokens, args.group_size),
        f"correction=sc (k={args.top_k})": build(policy, tok, args.top_k, args.new_tokens, args.group_size),
    }
    if args.tail_samples:
        name = f"correction=sc (k={args.top_k}, tail=sampled, m={args.tail_samples})"
        settings[name] = build(policy, tok, args.top_k, args.new_tokens, args.group_size, args.tail_samples)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    times: dict[str, list[tuple[float, float, int]]] = {k: [] for k in settings}
    for r in range(args.repeats + 1):
        for name, module in settings.items():
            measured = step(module, opt, prompts, seeds, args.group_size)
            policy.load_state_dict(initial)
            opt.state.clear()
            if r:
                times[name].append(measured)
    print(f"# {machine()}")
    print(
        f"\n## {args.model}: {args.prompts} prompts x G={args.group_size} x {args.new_tokens} new tokens, "
        f"bf16 autocast, median of {args.repeats}"
    )
    print("| setting | rollout s | update s | step s | tokens |\n|---|---|---|---|---|")
    med = {}
    for name, rows in times.items():
        ro, up = statistics.median(t[0] for t in rows), statistics.median(t[1] for t in rows)
        med[name] = (ro, up, ro + up)
        print(f"| {name} | {ro:.2f} | {up:.2f} | {ro + up:.2f} | {rows[0][2]} |")
    a, b = list(med.values())[:2]
    print(
        f"\nSC / none: rollout {b[0] / a[0]:.3f}x, update {b[1] / a[1]:.3f}x, "
        f"whole step {b[2] / a[2]:.3f}x ({100 * (b[2] / a[2] - 1):+.1f}%)"
    )
    if args.tail_samples:
        c = list(med.values())[2]
        print(
            f"sampled tail / rescaled: rollout {c[0] / b[0]:.3f}x, update {c[1] / b[1]:.3f}x, "
            f"whole step {c[2] / b[2]:.3f}x ({100 * (c[2] / b[2] - 1):+.1f}%)"
        )


if __name__ == "__main__":
    main()
