"""The verdict of docs/results/multiturn_calculator_demo: per run and metric, d = mean of the per-step values over
the late window minus the early window, with a Welch 95% interval (Welch-Satterthwaite degrees of freedom,
Student's t), and the mean d over the runs.

    python docs/results/multiturn_calculator_demo/verdict.py RUN [RUN ...] [--early 1-10] [--late 21-30]

Metrics: ``rollout/tool_calls_mean`` and ``rollout/reward_mean`` (TensorBoard), and ``accuracy``: the share of a
step's episodes whose last model turn the task's verifier scores 1 (the final answer alone, without the format
reward), read from the run's samples.jsonl (every episode of every step: ``log.samples_every_n_steps=1``,
``log.num_samples`` = the step's episodes). ``--per-step`` prints each step's values too.
"""

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from lit_rl.tasks import math_reward
from lit_rl.tools.compare.runs import read_scalars

#: Student's t 0.975 quantiles for 1..30 degrees of freedom (beyond: 1.96)
T975 = [
    *(12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228),
    *(2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086),
    *(2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042),
]
TAGS = ("rollout/tool_calls_mean", "rollout/reward_mean")


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean(b) - mean(a), half-width of its Welch 95% interval); 0 half-width when both samples are constant."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    d = statistics.fmean(b) - statistics.fmean(a)
    if va + vb == 0:
        return d, 0.0
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = T975[min(int(df), 30) - 1] if df < 30 else 1.96
    return d, t * math.sqrt(va + vb)


def accuracy_by_step(run: str) -> dict[int, float]:
    """{step: share of the step's logged episodes whose last model turn is the right answer} from samples.jsonl."""
    right = defaultdict(list)
    for line in (Path(run) / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        gold = row["prompt"].split("What is ")[1].split("?")[0]
        answer = str(eval(gold))  # noqa: S307 - the task's own generated arithmetic
        right[row["step"]].append(math_reward(row["completion"], answer))
    return {step: statistics.fmean(v) for step, v in sorted(right.items())}


def window(spec: str) -> tuple[int, int]:
    lo, hi = spec.split("-")
    return int(lo), int(hi)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--early", default="1-10")
    p.add_argument("--late", default="21-30")
    p.add_argument("--per-step", action="store_true")
    args = p.parse_args()
    (e0, e1), (l0, l1) = window(args.early), window(args.late)
    ds = defaultdict(list)
    for run in args.runs:
        scalars = read_scalars(run)
        series = {tag: dict(scalars.get(tag, [])) for tag in TAGS}
        series["accuracy"] = accuracy_by_step(run)
        for name, values in series.items():
            early = [v for s, v in values.items() if e0 <= s <= e1]
            late = [v for s, v in values.items() if l0 <= s <= l1]
            if args.per_step:
                print(f"{run}: {name} per step " + " ".join(f"{s}:{v:.3f}" for s, v in sorted(values.items())))
            if len(early) < 2 or len(late) < 2:
                print(f"{run}: {name}: {len(early)} early and {len(late)} late steps, too few for an interval")
                continue
            d, half = welch(early, late)
            ds[name].append(d)
            sd = statistics.stdev(early)
            print(
                f"{run}: {name} steps {args.early} {statistics.fmean(early):.3f} (per-step SD {sd:.3f}) -> "
                f"{args.late} {statistics.fmean(late):.3f} ({len(early)}, {len(late)} steps); "
                f"d {d:+.3f} [{d - half:+.3f}, {d + half:+.3f}]"
            )
    for name, values in ds.items():
        print(f"mean d over {len(values)} runs, {name}: {statistics.fmean(values):+.3f}")


if __name__ == "__main__":
    main()
