"""How lit_rl's step time and peak memory grow as G, prompts per step and max new tokens double.

    python benchmarks/cost_growth.py      # SmolLM2-135M, float32, from 4 prompts x G=4 x 32 new tokens

One knob doubles at a time from the base (x1, x2, x4), the others stay at the base. Each point is the
recipe's second step of two (``vs_trl.lit_rl_step``) in its own process (peak RSS per process). Time per
generated token stays flat when cost is linear in generated tokens; response lengths vary with sampling,
so the table gives the tokens actually generated.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _common import ensure_quiet, machine  # noqa: E402
from vs_trl import measure  # noqa: E402

BASE = {"prompts": 4, "G": 4, "new_tokens": 32}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    ensure_quiet(args.force)
    points = [dict(BASE)]
    for knob in BASE:
        for factor in (2, 4):
            points.append({**BASE, knob: BASE[knob] * factor})
    print(f"# {machine()}")
    print(
        "\n| prompts | G | max new tokens | generated tokens | rollout s | update s | step s | "
        "ms per token | peak RSS GB |\n|---|---|---|---|---|---|---|---|---|"
    )
    base_rate = None
    for p in points:
        r = measure("lit_rl", p["prompts"], p["G"], p["new_tokens"])
        rate = 1000 * r["step_s"] / r["tokens"]
        base_rate = base_rate or rate
        print(
            f"| {p['prompts']} | {p['G']} | {p['new_tokens']} | {r['tokens']:.0f} | {r['rollout_s']:.1f} | "
            f"{r['update_s']:.1f} | {r['step_s']:.1f} | {rate:.1f} ({rate / base_rate:.2f}x base) | "
            f"{r['peak_rss_gb']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
