"""Cost of ``kernels=batch_invariant`` on a whole RL step, measured side by side in one run.

    python benchmarks/batch_invariant_overhead.py                       # SmolLM2-135M, bf16 autocast
    python benchmarks/batch_invariant_overhead.py --precision float32   # trainer.precision=32-true

The same GRPO step with the default kernels and under ``BatchInvariantMode``, on identical work:

* rollout = ``engine.generate`` of the same prompts with the same per-row seeds; stop tokens are off, so
  every completion is exactly ``--new-tokens`` long in both settings (the two kernels round differently, so
  with stop tokens the completions, and the work, would differ);
* update = ``accumulate_gradients`` (forward, backward, micro-batches of 16) plus an AdamW step on one
  fixed rollout batch (sampled once, before timing), the weights restored after each update.

The two settings alternate ``--repeats`` times after a warm-up of each; medians are reported, with the
ratios mode / default. The documents report 2-3x for batch-invariant kernels on GPUs; the target here is
at most 1.3x for a whole step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import as_rollout_batch, ensure_quiet, grpo_module, machine, update  # noqa: E402
from rollout_throughput import prompts_for  # noqa: E402

from lit_rl.kernels import kernel_mode  # noqa: E402
from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy  # noqa: E402
from lit_rl.rollout.torch_engine import TorchEngine  # noqa: E402
from lit_rl.rollout.types import RolloutBatch  # noqa: E402


def build(policy, tok, new_tokens: int, group_size: int):
    module = grpo_module(policy, tok, new_tokens, group_size)
    module.engine = TorchEngine(policy, tok.pad_token_id, stop_token_ids=[])  # fixed-length completions
    return module


def rollout_batch(module, prompts, seeds, group_size) -> RolloutBatch:
    return as_rollout_batch(module, module.engine.generate(prompts, module.sampling, seeds), group_size)


def step(module, opt, prompts, seeds, rb: RolloutBatch, precision: str) -> tuple[float, float, int]:
    """(rollout seconds, update seconds, generated tokens) of one RL step."""
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with amp:
        t0 = time.perf_counter()
        r = module.engine.generate(prompts, module.sampling, seeds)
        t1 = time.perf_counter()
        update(module, opt, rb)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, int(r.response_mask.sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--prompts", type=int, default=8)  # the default step: P x G = 64 decode rows
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--precision",
        choices=["bf16", "float32"],
        default="bf16",
        help="bf16 = trainer.precision=bf16-mixed (the default), float32 = 32-true",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    ensure_quiet(args.force)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    policy, tok = load_policy(ModelConfig(args.model))
    initial = copy.deepcopy(policy.state_dict())
    prompts = [p for p in prompts_for(tok, args.prompts) for _ in range(args.group_size)]
    seeds = list(range(len(prompts)))
    module = build(policy, tok, args.new_tokens, args.group_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        rb = rollout_batch(module, prompts, seeds, args.group_size)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    settings = ("default", "batch_invariant")
    times: dict[str, list[tuple[float, float, int]]] = {k: [] for k in settings}
    for r in range(args.repeats + 1):
        for name in settings:
            with kernel_mode(name, policy):
                measured = step(module, opt, prompts, seeds, rb, args.precision)
            policy.load_state_dict(initial)
            opt.state.clear()
            if r:
                times[name].append(measured)
    print(f"# {machine()}")
    print(
        f"\n## {args.model}: {args.prompts} prompts x G={args.group_size} x {args.new_tokens} new tokens "
        f"(no stop tokens), {'bf16 autocast' if args.precision == 'bf16' else 'float32'}, "
        f"micro-batches of 16, median of {args.repeats}"
    )
    print("| kernels | rollout s | update s | step s | tokens |\n|---|---|---|---|---|")
    med = {}
    for name, rows in times.items():
        ro, up = statistics.median(t[0] for t in rows), statistics.median(t[1] for t in rows)
        med[name] = (ro, up, ro + up)
        print(f"| {name} | {ro:.2f} | {up:.2f} | {ro + up:.2f} | {rows[0][2]} |")
    a, b = med["default"], med["batch_invariant"]
    print(
        f"\nbatch_invariant / default: rollout {b[0] / a[0]:.2f}x, update {b[1] / a[1]:.2f}x, "
        f"whole step {b[2] / a[2]:.2f}x (target <= 1.3x)"
    )


if __name__ == "__main__":
    main()
