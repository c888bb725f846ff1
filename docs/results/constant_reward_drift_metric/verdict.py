"""The verdict of docs/results/constant_reward_drift_metric (its rules, README.md): per run the change of a drift
measure from step 0 to step 8; within a sampler, corrections paired by seed (a t-interval of the per-seed
differences); a correction under a sampler against the on-policy arm by Welch's interval.

    python docs/results/constant_reward_drift_metric/verdict.py outputs/drift_metric outputs/drift_metric_delta \
        [--tag drift/entropy] [--tag drift/sampler_kl] [--tag train/ref_kl_is] [--plot DIR]

Samplers: "sigma=0" (on-policy), "sigma=1", "sigma=2" from the first folder (engine.logit_noise=S,...), "delta=0.3"
from the second (correction=C,seed=N). ``drift/*`` tags: the value at the last step minus step 0;
``train/ref_kl_is``: the mean of the last two steps (as constant_reward_drift_seeds read it).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from lit_rl.tools.compare.runs import read_scalars
from lit_rl.tools.compare.stats import t_interval, welch_test

CORRECTIONS = ("none", "tis", "sc", "sc+tis")
PAIRS = (("none", "sc"), ("tis", "sc"), ("sc+tis", "sc"), ("sc+tis", "tis"))


def change(series: list[tuple[int, float]], tag: str) -> float:
    values = dict(series)
    last = max(values)
    if tag.startswith("drift/"):
        return values[last] - values[0]
    return (values[last] + values[last - 1]) / 2


def collect(grid: Path, delta: Path | None, tag: str) -> dict[str, dict[str, dict[int, float]]]:
    """{sampler: {correction: {seed: the run's change}}} of every finished run."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    folders = [(grid, None)] + ([(delta, "delta=0.3")] if delta else [])
    for root, sampler in folders:
        for run in sorted(root.iterdir()):
            m = re.fullmatch(r"(?:engine\.logit_noise=(\d+),)?correction=([a-z+]+),seed=(\d+)", run.name)
            if not m or not (run / "finished.json").exists():
                continue
            name = sampler or f"sigma={m.group(1)}"
            series = read_scalars(str(run)).get(tag)
            if series:
                out.setdefault(name, {}).setdefault(m.group(2), {})[int(m.group(3))] = change(series, tag)
    return out


def fmt(mean: float, half: float) -> str:
    return f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"


def report(cells: dict, tag: str) -> None:
    print(f"\n## {tag}: change per run (drift/*: step 8 - step 0; ref_kl_is: steps 7-8)\n")
    print("| sampler | " + " | ".join(CORRECTIONS) + " |")
    print("|---|" + "---|" * len(CORRECTIONS))
    for sampler in sorted(cells):
        row = []
        for c in CORRECTIONS:
            seeds = cells[sampler].get(c, {})
            if len(seeds) >= 2:
                iv = t_interval(list(seeds.values()))
                row.append(f"{fmt(iv.mean, iv.half)} (n={iv.n})")
            else:
                row.append(", ".join(f"{v:+.4f}" for v in seeds.values()) or "-")
        print(f"| {sampler} | " + " | ".join(row) + " |")
    print("\npaired by seed within a sampler (mean of the per-seed differences, 95% t-interval):\n")
    for sampler in sorted(cells):
        for a, b in PAIRS:
            sa, sb = cells[sampler].get(a, {}), cells[sampler].get(b, {})
            common = sorted(set(sa) & set(sb))
            if len(common) >= 2:
                iv = t_interval([sa[s] - sb[s] for s in common])
                print(f"- {sampler}: {a} - {b}: {fmt(iv.mean, iv.half)} over seeds {common}")
    reference = cells.get("sigma=0", {}).get("none", {})
    if len(reference) >= 2:
        print("\nagainst the on-policy arm (sigma=0, none), Welch 95%:\n")
        for sampler in sorted(s for s in cells if s != "sigma=0"):
            for c in CORRECTIONS:
                seeds = cells[sampler].get(c, {})
                if len(seeds) >= 2:
                    w = welch_test(list(seeds.values()), list(reference.values()))
                    print(f"- {sampler}, {c} - on-policy: {fmt(w.diff, w.half)}")


def plot(cells: dict, tag: str, out: Path) -> Path:
    """Dots per seed and the seed mean with its 95% t-interval, per sampler and correction: <out>/<tag>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samplers = sorted(cells)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(CORRECTIONS)
    for j, c in enumerate(CORRECTIONS):
        for i, sampler in enumerate(samplers):
            values = list(cells[sampler].get(c, {}).values())
            if not values:
                continue
            x = i + (j - (len(CORRECTIONS) - 1) / 2) * width
            ax.scatter([x] * len(values), values, s=12, color=f"C{j}", alpha=0.5)
            iv = t_interval(values)
            err = [[iv.half], [iv.half]] if iv.n >= 2 else None
            ax.errorbar([x], [iv.mean], yerr=err, fmt="o", color=f"C{j}", capsize=3, label=c if i == 0 else None)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(samplers)), samplers)
    what = "step 8 - step 0" if tag.startswith("drift/") else "mean of steps 7-8"
    ax.set_ylabel(f"{tag} ({what})")
    ax.set_title(f"{tag}: constant reward, 8 steps, SmolLM2-135M (dots: seeds; bars: 95% t)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / (tag.replace("/", "_") + ".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("grid", type=Path)
    p.add_argument("delta", type=Path, nargs="?")
    p.add_argument("--tag", action="append")
    p.add_argument("--plot", type=Path, help="write <DIR>/<tag>.png per tag")
    args = p.parse_args()
    for tag in args.tag or ["drift/entropy", "drift/sampler_kl", "train/ref_kl_is"]:
        cells = collect(args.grid, args.delta, tag)
        report(cells, tag)
        if args.plot:
            print(f"wrote {plot(cells, tag, args.plot)}")


if __name__ == "__main__":
    main()
