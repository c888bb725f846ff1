"""CPU time of the engine's KV-cache row drops over one rollout: in place (``kv_cache.keep_rows`` order) against a
copy of every kept row's whole reserved buffer per drop (the engine before issue 34), one run.

    python benchmarks/kv_row_drops.py                  # 64 rows, 96-token prompts, 64 steps, SmolLM2-135M's KV shape
    python benchmarks/kv_row_drops.py --rows 8 --steps 8 --force

Each row stops at a seeded random step (the same for both ways); per decode step every live row writes one
position to each of ``--layers`` layers, and the rows that stopped leave. Printed: the thread CPU seconds spent in
``batch_select_indices`` over the rollout, best of ``--repeats``, each way, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import ensure_quiet  # noqa: E402

from lit_rl.rollout.kv_cache import ReservedLayer, keep_rows  # noqa: E402


def whole_buffer_select(layer: ReservedLayer, keep: torch.Tensor) -> None:
    """The drop before issue 34: index the whole reserved buffer (every kept row, every reserved position)."""
    layer._keys, layer._values = layer._keys[keep], layer._values[keep]
    layer._rows = keep.numel()
    layer._views()


def drop_seconds(in_place: bool, args) -> float:
    finish = torch.randint(1, args.steps, (args.rows,), generator=torch.Generator().manual_seed(0))
    layers = [ReservedLayer(args.prompt + args.steps) for _ in range(args.layers)]
    for layer in layers:
        k = torch.randn(args.rows, args.kv_heads, args.prompt, args.head_dim)
        layer.update(k, k)
    active, spent = torch.arange(args.rows), 0.0
    for step in range(args.steps):
        done = finish[active] <= step
        keep = keep_rows(done) if in_place else (~done).nonzero().squeeze(-1)
        if keep.numel() < active.numel():
            t = time.thread_time()
            for layer in layers:
                layer.batch_select_indices(keep) if in_place else whole_buffer_select(layer, keep)
            spent += time.thread_time() - t
            active = active[keep]
        if active.numel() == 0:
            break
        for layer in layers:
            k = torch.randn(active.numel(), args.kv_heads, 1, args.head_dim)
            layer.update(k, k)
    return spent


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    ensure_quiet(args.force)
    old = min(drop_seconds(False, args) for _ in range(args.repeats))
    new = min(drop_seconds(True, args) for _ in range(args.repeats))
    print(f"\n## KV row drops over one rollout: {args.rows} rows, {args.prompt}-token prompts, {args.steps} steps")
    print("| way | CPU seconds |\n|---|---|")
    print(f"| whole reserved buffer per drop (before) | {old:.3f} |\n| in place, keep_rows order | {new:.3f} |")
    print(f"\nratio before / in place: {old / max(new, 1e-9):.1f}x")


if __name__ == "__main__":
    main()
