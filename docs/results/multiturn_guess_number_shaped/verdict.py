"""The verdict of docs/results/multiturn_guess_number_shaped: per run, d = mean of a rate tag over steps 21-30
minus steps 1-10, with a 95% Wald interval for a difference of proportions (each step's rate is over
``--episodes`` episodes).

    python docs/results/multiturn_guess_number_shaped/verdict.py RUN [RUN ...] [--tag rollout/solved_rate]
"""

import argparse

from lit_rl.tools.compare.runs import read_scalars
from lit_rl.tools.compare.stats import wald_difference


def window_rate(series: list[tuple[int, float]], first: int, last: int) -> tuple[float, int]:
    """(mean value, steps present) of ``series`` over steps ``first``..``last`` inclusive."""
    values = [v for step, v in series if first <= step <= last]
    return (sum(values) / len(values) if values else float("nan")), len(values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--tag", default="rollout/solved_rate")
    p.add_argument("--episodes", type=int, default=32, help="episodes per step (prompts_per_step x group_size)")
    args = p.parse_args()
    ds = []
    for run in args.runs:
        series = read_scalars(run).get(args.tag, [])
        (p1, k1), (p2, k2) = window_rate(series, 1, 10), window_rate(series, 21, 30)
        n1, n2 = k1 * args.episodes, k2 * args.episodes
        d, half = wald_difference(p1, n1, p2, n2)
        ds.append(d)
        print(
            f"{run}: {args.tag} steps 1-10 {p1:.3f} ({k1} steps) -> 21-30 {p2:.3f} ({k2} steps); "
            f"d {d:+.3f} [{d - half:+.3f}, {d + half:+.3f}]"
        )
    print(f"mean d over the runs {sum(ds) / len(ds):+.3f}")


if __name__ == "__main__":
    main()
