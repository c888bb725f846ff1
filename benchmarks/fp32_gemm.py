"""float32 products through torch's BLAS and through oneDNN (``kernels.fp32_gemm``), side by side in one run.

    python benchmarks/fp32_gemm.py                 # SmolLM2-135M's shapes, then one rollout + update each way
    python benchmarks/fp32_gemm.py --shapes-only   # the products alone (about 1 min)

Part 1: GFLOP/s of each product a linear layer of SmolLM2-135M-Instruct runs -- the forward x @ W.T, the input
gradient g @ W and the weight gradient g.T @ x -- at M rows (1-22: decode steps as rows finish, 64: a full
decode batch, 256-1024: training micro-batches), torch's ``aten::mm`` (MKL in the x86 wheels) against
``lit_rl.kernels.fp32_gemm.mm`` (oneDNN for the first two; the weight gradient stays on aten::mm, shown to say
why). Part 2: the recipe's float32 work, 8 prompts x G=8 x <= 64 new tokens sampled by the embedded engine and
one GRPO update of them (micro-batches of 16, shared prefix on), with ``OneDNNGemm`` off and on, alternating
``--repeats`` times (the same seeds: the same tokens each time); medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import as_rollout_batch, ensure_quiet, grpo_module, machine  # noqa: E402

SHAPES = {"q/o_proj": (576, 576), "k/v_proj": (192, 576), "gate/up_proj": (1536, 576), "down_proj": (576, 1536)}
SHAPES["lm_head"] = (49152, 576)
ROWS = (1, 8, 22, 64, 256, 1024)


def best_seconds(fn, seconds: float = 0.1) -> float:
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def shapes_table() -> None:
    from lit_rl.kernels.fp32_gemm import mm

    print("\n## products: GFLOP/s, torch's aten::mm -> lit_rl fp32_gemm.mm (oneDNN where a is row-major)")
    print("| layer (out x in) | M | forward x @ W.T | input grad g @ W | weight grad g.T @ x (aten both) |")
    print("|---|---|---|---|---|")
    total = {"aten": 0.0, "onednn": 0.0}
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f)
        for m in ROWS:
            x, g = torch.randn(m, in_f), torch.randn(m, out_f)
            flops = 2.0 * m * out_f * in_f
            cells = []
            for a, b in ((x, w.t()), (g, w), (g.t(), x)):
                t_aten, t_ours = best_seconds(lambda: torch.mm(a, b)), best_seconds(lambda: mm(a, b))
                cells.append(f"{flops / t_aten / 1e9:.0f} -> {flops / t_ours / 1e9:.0f}")
                total["aten"] += t_aten
                total["onednn"] += t_ours
            print(f"| {name} ({out_f} x {in_f}) | {m} | " + " | ".join(cells) + " |")
    print(f"\nsum of the best times over the table: aten {total['aten']:.3f} s, lit_rl {total['onednn']:.3f} s")


def recipe_work(repeats: int) -> None:
    from shared_prefix import task_prompts

    from lit_rl.kernels import OneDNNGemm
    from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy

    policy, tok = load_policy(ModelConfig(SMOLLM2_ID))
    module = grpo_module(policy, tok, 64, 8)
    module.shared_prefix = True
    prompts = [p for p in task_prompts(tok, "arithmetic", 8) for _ in range(8)]
    seeds = list(range(len(prompts)))
    opt = torch.optim.AdamW(module.policy.parameters(), lr=0.0)  # lr 0: every repeat samples the same tokens
    times = {False: {"rollout": [], "update": []}, True: {"rollout": [], "update": []}}
    tokens = set()
    for i in range(repeats + 1):
        for on in (False, True):
            mode = OneDNNGemm() if on else None
            if mode:
                mode.enable()
            try:
                t = time.perf_counter()
                r = module.engine.generate(prompts, module.sampling, seeds)
                t_rollout = time.perf_counter() - t
                rb = as_rollout_batch(module, r, 8)
                t = time.perf_counter()
                module.accumulate_gradients(rb)
                opt.step()
                opt.zero_grad(set_to_none=True)
                t_update = time.perf_counter() - t
            finally:
                if mode:
                    mode.disable()
            tokens.add(int(r.response_mask.sum()))
            if i:  # the first round warms up
                times[on]["rollout"].append(t_rollout)
                times[on]["update"].append(t_update)
    med = {on: {k: statistics.median(v) for k, v in parts.items()} for on, parts in times.items()}
    print(
        f"\n## the recipe's float32 work: 8 prompts x G=8 x <= 64 new tokens ({'/'.join(map(str, sorted(tokens)))} "
        f"generated), one GRPO update; median of {repeats}"
    )
    print("| fp32 products | rollout s | update s | both s |")
    print("|---|---|---|---|")
    for on, name in ((False, "torch's aten::mm"), (True, "oneDNN (kernels.fp32_gemm)")):
        m = med[on]
        print(f"| {name} | {m['rollout']:.2f} | {m['update']:.2f} | {m['rollout'] + m['update']:.2f} |")
    a, b = med[False], med[True]
    print(
        f"\noneDNN / aten: rollout {b['rollout'] / a['rollout']:.2f}x, update {b['update'] / a['update']:.2f}x, "
        f"both {(b['rollout'] + b['update']) / (a['rollout'] + a['update']):.2f}x"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes-only", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    ensure_quiet(args.force)
    from lit_rl.kernels.fp32_gemm import available

    if not available():
        sys.exit("this torch build has no oneDNN linear kernel: nothing to compare")
    print(f"# {machine()}")
    shapes_table()
    if not args.shapes_only:
        recipe_work(args.repeats)


if __name__ == "__main__":
    main()
