"""The verdict of docs/results/multiturn_calculator: per run and tag, d = mean of the per-step values over steps
21-30 minus steps 1-10, with a Welch 95% interval (Welch-Satterthwaite degrees of freedom, Student's t).

    python docs/results/multiturn_calculator/verdict.py RUN [RUN ...] [--tags TAG,TAG]
"""

import argparse
import math
import statistics

from lit_rl.tools.compare.runs import read_scalars

#: Student's t 0.975 quantiles for 1..30 degrees of freedom (beyond: 1.96)
T975 = [
    *(12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228),
    *(2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086),
    *(2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042),
]


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean(b) - mean(a), half-width of its Welch 95% interval); 0 half-width when both samples are constant."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    d = statistics.fmean(b) - statistics.fmean(a)
    if va + vb == 0:
        return d, 0.0
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = T975[min(int(df), 30) - 1] if df < 30 else 1.96
    return d, t * math.sqrt(va + vb)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--tags", default="rollout/tool_calls_mean,rollout/reward_mean")
    args = p.parse_args()
    for run in args.runs:
        scalars = read_scalars(run)
        for tag in args.tags.split(","):
            series = scalars.get(tag, [])
            early = [v for s, v in series if 1 <= s <= 10]
            late = [v for s, v in series if 21 <= s <= 30]
            d, half = welch(early, late)
            print(
                f"{run}: {tag} steps 1-10 {statistics.fmean(early):.3f} -> 21-30 {statistics.fmean(late):.3f} "
                f"({len(early)}, {len(late)} steps); d {d:+.3f} [{d - half:+.3f}, {d + half:+.3f}]"
            )


if __name__ == "__main__":
    main()
