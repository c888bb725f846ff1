"""Compare finished (or running) lit_rl runs: one plot per TensorBoard tag and a markdown summary table.

    python recipes/compare.py outputs/multirun/2026-11-29/10-00-00 --tags rollout/reward_mean,eval/accuracy

A *run* is a folder that holds TensorBoard event files, directly or in a ``tensorboard/`` subfolder (what
``recipes/train.py`` writes). A run's name is its path relative to the folder given on the command line
(for a Hydra multirun: the override_dirname, e.g. ``algo=dapo,seed=1``). Runs whose names differ only by a
``seed=N`` item form one *setting* (``algo=dapo``); each tag is shown per setting as the mean over its seeds
with a min–max band across seeds.

Rules (also written under the table in ``summary.md``):

* final — mean over the setting's runs of each run's value of the tag at the last step that every run
  compared logged (each run's last value when they all ended at the same step; otherwise summary.md says
  at which step, and which runs went further).
* best — the maximum over steps of the seed-mean curve, or the minimum for tags that contain ``loss``,
  ``kl``, ``time/`` or ``length`` (case-insensitive), where lower is better. Steps whose mean is not finite
  (a NaN logged by some seed) are skipped.
* The seed-mean at a step is the mean over the runs that logged that step, so the tail of a curve whose
  seeds stopped at different steps averages fewer runs.
* Smoothing is TensorBoard's own: a debiased exponential moving average over the points in order
  (not over step distance), non-finite points passed through, a constant series left as it is.

Against a swept value (``--x rollout.lag``): runs are also split by the numeric value of that override in
their name; each run's value of a tag is the mean of its last ``--final-steps`` logged values (or of the
values at steps ``--window A:B``), averaged over seeds; one PNG per tag (``<tag>_vs_<key>.png``: x = the
value, one line per setting of the other overrides) and ``summary_vs_<key>.md`` (a row per setting, a
column per value). ``--shift-by TAG`` first moves each value from step s to step s - TAG(s): with
``rollout/staleness_mean`` a rollout metric lands on the weight version that generated it, so runs with
different lags compare policies after equally many updates.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass, field

EVENT_FILE_PREFIX = "events.out.tfevents"
TB_SUBDIR = "tensorboard"
FINISHED_MARKER = "finished.json"
LOWER_IS_BETTER = ("loss", "kl", "time/", "length")
DEFAULT_SETTING = "(default)"  # the setting of runs named only by their seed, e.g. ``seed=0``
_SEED_ITEM = re.compile(r"\+{0,2}seed=(-?\d+)")


class CompareError(Exception):
    """A user's mistake (missing folder, no runs, unknown tag): reported as one line, exit code 2."""


# ----------------------------------------------------------------------------------------------- finding
def _has_event_files(folder: str) -> bool:
    try:
        return any(f.startswith(EVENT_FILE_PREFIX) for f in os.listdir(folder))
    except OSError:
        return False


def _event_dirs(run_dir: str) -> list[str]:
    """The folders of one run that hold event files: the run folder itself and its ``tensorboard/``."""
    return [d for d in (run_dir, os.path.join(run_dir, TB_SUBDIR)) if _has_event_files(d)]


def _runs_under(folder: str) -> dict[str, str]:
    """{name relative to ``folder``: run folder} for every run under ``folder`` (walked in sorted order)."""
    runs: dict[str, str] = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        if not any(f.startswith(EVENT_FILE_PREFIX) for f in files):
            continue
        run_dir = os.path.dirname(root) if os.path.basename(os.path.normpath(root)) == TB_SUBDIR else root
        run_dir = os.path.normpath(run_dir)
        name = os.path.relpath(run_dir, folder).replace(os.sep, "/")
        if name == "." or name.startswith(".."):  # the folder given is the run (or its tensorboard/)
            name = os.path.basename(os.path.abspath(run_dir))
        runs.setdefault(name, run_dir)
    return runs


def find_runs(folders: list[str]) -> dict[str, str]:
    """Every run under ``folders``: {run name: run folder}.

    A run is a folder holding TensorBoard event files, directly or in a ``tensorboard/`` subfolder; its name
    is its path relative to the folder given (``algo=dapo,seed=1``; the folder's own name when the folder
    given is a single run). When two folders hold runs of the same name, every name is prefixed with its
    folder's name (``10-00-00/algo=dapo,seed=1``), or with the folder's path as given when those clash too.
    Raises CompareError for a folder that does not exist or holds no event files.
    """
    per_folder: list[tuple[str, dict[str, str]]] = []
    seen: set[str] = set()
    for folder in folders:
        if not os.path.isdir(folder):
            raise CompareError(f"no such folder: {folder}")
        real = os.path.realpath(folder)
        if real in seen:  # the same folder named twice
            continue
        seen.add(real)
        runs = _runs_under(folder)
        if not runs:
            raise CompareError(f"no TensorBoard event files under {folder}")
        per_folder.append((folder, runs))

    names = [n for _, runs in per_folder for n in runs]
    if len(names) == len(set(names)):
        return {n: d for _, runs in per_folder for n, d in runs.items()}
    labels = [os.path.basename(os.path.abspath(f)) for f, _ in per_folder]
    if len(labels) != len(set(labels)):
        labels = [os.path.normpath(f).replace(os.sep, "/") for f, _ in per_folder]
    return {f"{label}/{n}": d for label, (_, runs) in zip(labels, per_folder) for n, d in runs.items()}


# ----------------------------------------------------------------------------------------------- reading
def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...] sorted by step} of one run, read with TensorBoard's EventAccumulator.

    Reads the event files in ``run_dir`` and in ``run_dir/tensorboard``: classic scalar summaries
    (``SummaryWriter.add_scalar``, Lightning's TensorBoardLogger) and tensor summaries of the scalars plugin
    (``tensorboard.summary.Writer``). When a step was logged more than once (a resumed run logs again from
    its checkpoint) the last value written wins.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    merged: dict[str, dict[int, float]] = {}
    for folder in _event_dirs(os.fspath(run_dir)):
        acc = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        for tag in tags.get("scalars", []):
            series = merged.setdefault(tag, {})
            for ev in acc.Scalars(tag):
                series[int(ev.step)] = float(ev.value)
        for tag in tags.get("tensors", []):
            if acc.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
                continue
            series = merged.setdefault(tag, {})
            for ev in acc.Tensors(tag):
                arr = tensor_util.make_ndarray(ev.tensor_proto)
                if arr.size == 1:
                    series[int(ev.step)] = float(arr.reshape(()))
    return {tag: sorted(series.items()) for tag, series in merged.items() if series}


# ---------------------------------------------------------------------------------------------- grouping
def setting_of(name: str) -> tuple[str, int | None]:
    """(setting, seed) of a run name: the name without its ``seed=N`` item, and N (None when there is none).

    Only the last path component is searched, its items split on ",": ``algo=dapo,seed=1`` ->
    (``algo=dapo``, 1); ``sweep/seed=3`` -> (``sweep``, 3); ``seed=0`` -> (``(default)``, 0);
    ``algo=grpo`` -> (``algo=grpo``, None). ``+seed=N`` and ``++seed=N`` count as seed items too.
    """
    head, _, last = name.rpartition("/")
    seed: int | None = None
    kept = []
    for item in last.split(","):
        m = _SEED_ITEM.fullmatch(item)
        if m and seed is None:
            seed = int(m.group(1))
        else:
            kept.append(item)
    setting = ",".join(kept)
    if head:
        setting = f"{head}/{setting}" if setting else head
    return (setting or DEFAULT_SETTING), seed


def group_runs(names, group_by_seed: bool = True) -> dict[str, list[str]]:
    """{setting: [run names]}, settings sorted by name; each run its own setting when not grouping by seed."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        groups.setdefault(setting_of(name)[0] if group_by_seed else name, []).append(name)
    return dict(sorted(groups.items()))


@dataclass
class Curve:
    """One setting's curve of one tag: per step the mean, min and max over the runs that logged the step."""

    steps: list[int] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    finals: list[float] = field(default_factory=list)  # each run's last value


def value_at(series: list[tuple[int, float]], step: int) -> float | None:
    """The value a (step, value) series held at ``step``: its last value logged at or before it (None if none)."""
    out = None
    for s, v in series:
        if s > step:
            break
        out = v
    return out


def seed_curve(series: list[list[tuple[int, float]]], final_step: int | None = None) -> Curve:
    """Mean and min–max band across runs per step, over the union of the runs' steps.

    A non-finite value makes that step's mean, min and max NaN (a gap in the plot). ``finals``: each run's
    last value, or its value at ``final_step`` (``value_at``) when given.
    """
    by_step: dict[int, list[float]] = {}
    for s in series:
        for step, value in s:
            by_step.setdefault(step, []).append(value)
    if final_step is None:
        c = Curve(finals=[s[-1][1] for s in series if s])
    else:
        c = Curve(finals=[v for v in (value_at(s, final_step) for s in series if s) if v is not None])
    for step in sorted(by_step):
        vals = by_step[step]
        finite = all(math.isfinite(v) for v in vals)
        c.steps.append(step)
        c.mean.append(sum(vals) / len(vals) if finite else math.nan)
        c.lo.append(min(vals) if finite else math.nan)
        c.hi.append(max(vals) if finite else math.nan)
        c.count.append(len(vals))
    return c


def tb_smooth(values, weight: float = 0.6) -> list[float]:
    """TensorBoard's scalar smoothing: a debiased exponential moving average with ``weight`` in [0, 1).

    ``last = weight * last + (1 - weight) * v`` from ``last = 0``, each point divided by
    ``1 - weight ** n`` (n = finite points so far); non-finite points pass through and do not update the
    average; a constant series is returned unchanged (TensorBoard's classicSmoothing).
    """
    values = [float(v) for v in values]
    if not values or all(v == values[0] for v in values):
        return values
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1.0 - weight) * v
        n += 1
        debias = 1.0 - weight**n if weight != 1 else 1.0
        out.append(last / debias)
    return out


def lower_is_better(tag: str) -> bool:
    """Whether ``best`` is the minimum for ``tag``: it contains loss, kl, time/ or length (any case)."""
    t = tag.lower()
    return any(k in t for k in LOWER_IS_BETTER)


def curves_for(
    groups: dict[str, list[str]], scalars: dict[str, dict], tag: str, final_step: int | None = None
) -> dict[str, Curve]:
    """{setting: Curve} of ``tag`` for the settings with at least one run that logged it (finals at
    ``final_step`` when given, see ``seed_curve``)."""
    out = {}
    for setting, names in groups.items():
        series = [scalars[n][tag] for n in names if scalars[n].get(tag)]
        if series:
            out[setting] = seed_curve(series, final_step)
    return out


def last_steps(scalars: dict[str, dict], tag: str) -> dict[str, int]:
    """{run: the last step at which it logged ``tag``} for the runs that logged it."""
    return {name: s[tag][-1][0] for name, s in scalars.items() if s.get(tag)}


def common_step(scalars: dict[str, dict], tag: str) -> int | None:
    """The last step of ``tag`` that every run which logged it reached (the smallest of their last steps);
    ``final`` is compared there, so runs that stopped early are not compared with longer ones' ends."""
    ends = last_steps(scalars, tag)
    return min(ends.values()) if ends else None


# --------------------------------------------------------------------------------------------- summarizing
def summarize(groups: dict[str, list[str]], scalars: dict[str, dict], tags: list[str]) -> list[dict]:
    """One row per setting: ``{"setting", "seeds", "runs", tag: {"final", "best"} or None}``.

    ``seeds`` counts the setting's runs. final = mean over its runs (those that logged the tag) of each
    run's value at the tag's ``common_step`` over all runs compared (its last value when every run ended at
    the same step); best = max over steps of the seed-mean curve, min for tags where
    :func:`lower_is_better`, ignoring non-finite means (NaN when none is finite). None: no run logged it.
    """
    rows = []
    final_steps = {tag: common_step(scalars, tag) for tag in tags}
    for setting, names in groups.items():
        row: dict = {"setting": setting, "seeds": len(names), "runs": list(names)}
        for tag in tags:
            curve = curves_for({setting: names}, scalars, tag, final_steps[tag]).get(setting)
            if curve is None:
                row[tag] = None
                continue
            finite = [m for m in curve.mean if math.isfinite(m)]
            best = (min(finite) if lower_is_better(tag) else max(finite)) if finite else math.nan
            row[tag] = {"final": sum(curve.finals) / len(curve.finals), "best": best}
        rows.append(row)
    return rows


def fmt(value: float | None) -> str:
    """A number with 4 significant digits (``n/a`` for None)."""
    return "n/a" if value is None else f"{value:.4g}"


def format_table(rows: list[dict], tags: list[str]) -> str:
    """The markdown table of :func:`summarize`'s rows: setting, seeds, then final and best per tag."""
    header = ["setting", "seeds"]
    for tag in tags:
        header += [f"{tag} final", f"{tag} best ({'min' if lower_is_better(tag) else 'max'})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for row in rows:
        cells = [row["setting"].replace("|", "\\|"), str(row["seeds"])]
        for tag in tags:
            stats = row[tag]
            cells += [fmt(stats and stats["final"]), fmt(stats and stats["best"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def step_notes(scalars: dict[str, dict], tags: list[str]) -> list[str]:
    """Lines for summary.md, one per tag whose runs stopped at different steps: where ``final`` was taken and
    which runs went further (their later values are in the plots, not in ``final``)."""
    lines = []
    for tag in tags:
        ends = last_steps(scalars, tag)
        if len(set(ends.values())) > 1:
            at = min(ends.values())
            later = ", ".join(f"{n} (step {e})" for n, e in sorted(ends.items()) if e > at)
            lines.append(
                f"- **{tag}: the runs stopped at different steps**; final is each run's value at step {at}, "
                f"the last step all of them logged; later steps of {later} are left out of final."
            )
    return lines


def _notes(
    rows: list[dict],
    smoothing: float,
    scalars: dict[str, dict] | None = None,
    tags: list[str] = (),
    missing: list[str] = (),
) -> str:
    lines = [
        "",
        *([f"- **not logged by any run, left out:** {', '.join(missing)}"] if missing else []),
        *(step_notes(scalars, list(tags)) if scalars else []),
        "- final: mean over the setting's runs of each run's value at the last step that every run logged "
        "(its last logged value when all runs ended at the same step).",
        "- best: max over steps of the seed-mean curve; min for tags containing "
        + ", ".join(f"`{k}`" for k in LOWER_IS_BETTER)
        + " (lower is better).",
        f"- plots: solid = seed mean smoothed as TensorBoard does (weight {smoothing:g}), faint = raw seed mean, "
        "shaded = min–max across seeds.",
        "",
        "Runs per setting:",
        "",
    ]
    lines += [f"- {r['setting']}: " + ", ".join(r["runs"]) for r in rows]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------- against a swept value
def split_key(name: str, key: str) -> tuple[str, float | None]:
    """(setting without the ``key=value`` item, the value as a float) of a run name; the seed item is left in
    (``setting_of`` takes it out). ``correction=tis,rollout.lag=4`` with key ``rollout.lag`` ->
    (``correction=tis``, 4.0); None when the name has no such item. Raises CompareError for a value that is
    not a number."""
    head, _, last = name.rpartition("/")
    value, kept = None, []
    for item in last.split(","):
        k, eq, v = item.partition("=")
        if eq and k.lstrip("+~") == key and value is None:
            try:
                value = float(v)
            except ValueError as err:
                raise CompareError(f"--x {key}: run {name!r} has {item!r}, not a number") from err
        else:
            kept.append(item)
    setting = ",".join(kept)
    if head:
        setting = f"{head}/{setting}" if setting else head
    return (setting or DEFAULT_SETTING), value


def final_mean(series: list[tuple[int, float]], last: int) -> float:
    """Mean of the last ``last`` (>= 1) values of a (step, value) series."""
    tail = [v for _, v in series[-last:]]
    return sum(tail) / len(tail)


def shifted(series: list[tuple[int, float]], shift: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``series`` with each step s moved to s - shift(s) (rounded), for the steps ``shift`` logged, in step order."""
    by_step = dict(shift)
    return sorted((step - round(by_step[step]), v) for step, v in series if step in by_step)


def versus(
    scalars: dict[str, dict],
    key: str,
    tag: str,
    last: int = 1,
    window: tuple[int, int] | None = None,
    shift_by: str | None = None,
) -> dict[str, list[tuple[float, float, int]]]:
    """{setting: [(x, value, runs), ...] sorted by x} of ``tag``: per run the mean of its last ``last``
    values, or of its values at steps in ``window`` (inclusive) when given, after ``shifted`` by the tag
    ``shift_by`` when given; averaged over the runs (seeds) that share the setting and x. Runs without
    ``key`` in their name, without the tag, or without values in the window are left out."""
    cells: dict[tuple[str, float], list[float]] = {}
    for name, runs_scalars in scalars.items():
        setting, x = split_key(setting_of(name)[0], key)
        series = runs_scalars.get(tag)
        if shift_by is not None and series:
            series = shifted(series, runs_scalars.get(shift_by, []))
        if window is not None and series:
            series = [(step, v) for step, v in series if window[0] <= step <= window[1]]
            last = max(len(series), 1)
        if x is None or not series:
            continue
        cells.setdefault((setting, x), []).append(final_mean(series, last))
    out: dict[str, list[tuple[float, float, int]]] = {}
    for (setting, x), vals in sorted(cells.items()):
        out.setdefault(setting, []).append((x, sum(vals) / len(vals), len(vals)))
    return out


def describe(last: int, window: tuple[int, int] | None, shift_by: str | None) -> str:
    """How a run's value was taken, for titles: ``mean of the last 4 values``, ``mean over steps 4-7 ...``."""
    what = (
        ("last value" if last == 1 else f"mean of the last {last} values")
        if window is None
        else f"mean over steps {window[0]}-{window[1]}"
    )
    return what + (f", steps shifted by -{shift_by}" if shift_by else "")


def format_versus_table(key: str, tags: list[str], tables: dict[str, dict], what: str) -> str:
    """Markdown: per tag a table with a row per setting and a column per value of ``key``."""
    out = []
    for tag in tags:
        lines_by = tables[tag]
        xs = sorted({x for pts in lines_by.values() for x, _, _ in pts})
        label = lambda x: f"{x:g}"  # noqa: E731
        out.append(f"### {tag} ({what}) vs {key}\n")
        out.append("| setting | " + " | ".join(f"{key}={label(x)}" for x in xs) + " |")
        out.append("|---|" + "---:|" * len(xs))
        for setting, pts in lines_by.items():
            by_x = {x: v for x, v, _ in pts}
            out.append(f"| {setting.replace('|', chr(92) + '|')} | " + " | ".join(fmt(by_x.get(x)) for x in xs) + " |")
        out.append("")
    return "\n".join(out)


def plot_versus(
    tag: str, key: str, lines: dict[str, list[tuple[float, float, int]]], path: str, what: str, colors=None
) -> str:
    """A PNG of ``tag`` against ``key``: one marked line per setting (Agg canvas, not pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = colors or setting_colors(lines)
    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for setting, pts in lines.items():
        ax.plot(
            [x for x, _, _ in pts],
            [v for _, v, _ in pts],
            marker="o",
            linewidth=2,
            color=colors[setting],
            label=setting,
        )
    ax.set_title(f"{tag} vs {key}\n({what})", fontsize=10)
    ax.set_xlabel(key)
    ax.set_ylabel(tag)
    xs = sorted({x for pts in lines.values() for x, _, _ in pts})
    ax.set_xticks(xs)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


# ------------------------------------------------------------------------------------------------ plotting
def setting_colors(settings) -> dict[str, tuple]:
    """A fixed colour per setting (tab10, tab20 past 10 settings), the same in every plot."""
    from matplotlib import colormaps

    settings = list(settings)
    cmap = colormaps["tab10" if len(settings) <= 10 else "tab20"]
    return {s: cmap(i % cmap.N) for i, s in enumerate(settings)}


def plot_tag(tag: str, curves: dict[str, Curve], path: str, smoothing: float = 0.6, colors=None) -> str:
    """Write a PNG of ``tag`` to ``path``: per setting the smoothed seed mean (solid, labelled), the raw mean
    (faint) and the min–max band across seeds (shaded); x = step. Uses the Agg canvas, not pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = colors or setting_colors(curves)
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for setting, c in curves.items():
        color = colors[setting]
        marker = "o" if len(c.steps) == 1 else None
        if max(c.count) > 1:
            ax.fill_between(c.steps, c.lo, c.hi, color=color, alpha=0.15, linewidth=0)
        ax.plot(c.steps, c.mean, color=color, alpha=0.3, linewidth=1, marker=marker)
        ax.plot(c.steps, tb_smooth(c.mean, smoothing), color=color, linewidth=2, marker=marker, label=setting)
    ax.set_title(tag)
    ax.set_xlabel("step")
    ax.set_ylabel(tag)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.text(
        0.01,
        0.01,
        f"solid: seed mean, TensorBoard smoothing {smoothing:g}; faint: raw seed mean; shaded: min–max across seeds",
        fontsize=7,
        color="0.4",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, format="png")
    return path


def tag_filename(tag: str) -> str:
    """``rollout/reward_mean`` -> ``rollout_reward_mean.png``."""
    return tag.replace("/", "_") + ".png"


# ---------------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
    """The command line of ``recipes/compare.py``."""
    p = argparse.ArgumentParser(
        prog="compare.py",
        description="Plot and tabulate TensorBoard scalars of lit_rl runs, seeds of one setting grouped.",
    )
    p.add_argument("folders", nargs="+", help="run folders, or folders with runs under them (a multirun sweep)")
    p.add_argument("--tags", required=True, help="comma-separated scalar tags, e.g. rollout/reward_mean,eval/accuracy")
    p.add_argument("--out", default=None, help="output folder (default: <first folder>/compare)")
    p.add_argument(
        "--smoothing",
        type=float,
        default=0.6,
        help="TensorBoard smoothing weight in [0, 1) for the solid lines (default 0.6)",
    )
    p.add_argument(
        "--group-by-seed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="group runs that differ only by seed=N into one setting (default: yes)",
    )
    p.add_argument(
        "--x",
        default=None,
        metavar="KEY",
        help="also plot each tag against this swept override's value (e.g. rollout.lag), "
        "one line per setting of the other overrides",
    )
    p.add_argument(
        "--final-steps",
        type=int,
        default=1,
        help="with --x: a run's value is the mean of its last N logged values (default 1)",
    )
    p.add_argument(
        "--window",
        default=None,
        metavar="A:B",
        help="with --x: a run's value is the mean of its values at steps A..B (inclusive) instead",
    )
    p.add_argument(
        "--shift-by",
        default=None,
        metavar="TAG",
        help="with --x: move each value from step s to s - TAG(s) first (rollout/staleness_mean: "
        "to the weight version that generated the rollouts)",
    )
    p.add_argument("--suffix", default="", help="with --x: appended to the output file names")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the comparison; returns the exit code (0, or 2 after a one-line error on stderr)."""
    args = parse_args(argv)
    try:
        return _main(args)
    except CompareError as err:
        print(f"compare: error: {err}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    tags = list(dict.fromkeys(t.strip() for t in args.tags.split(",") if t.strip()))
    if not tags:
        raise CompareError("--tags names no tag")
    if not (0.0 <= args.smoothing < 1.0) or math.isnan(args.smoothing):
        raise CompareError(f"--smoothing must be in [0, 1), got {args.smoothing}")

    runs = find_runs(args.folders)
    scalars = {name: read_scalars(d) for name, d in runs.items()}
    known = sorted({t for s in scalars.values() for t in s})
    missing = [t for t in tags if t not in known]
    if len(missing) == len(tags):
        raise CompareError(
            f"tag{'s' if len(missing) > 1 else ''} {', '.join(repr(t) for t in missing)} not logged by any run; "
            f"tags that exist: {', '.join(known) if known else '(none)'}"
        )
    if missing:  # e.g. eval/accuracy of runs too short to have evaluated: compare the tags that exist
        print(
            f"compare: warning: tag{'s' if len(missing) > 1 else ''} {', '.join(repr(t) for t in missing)} "
            f"not logged by any run, left out (tags that exist: {', '.join(known)})",
            file=sys.stderr,
        )
        tags = [t for t in tags if t not in missing]
    for name, d in runs.items():
        if not os.path.exists(os.path.join(d, FINISHED_MARKER)):
            print(f"compare: note: {name} has no {FINISHED_MARKER} (still running, or stopped early)", file=sys.stderr)

    groups = group_runs(runs, group_by_seed=args.group_by_seed)
    out = args.out or os.path.join(args.folders[0], "compare")
    os.makedirs(out, exist_ok=True)
    colors = setting_colors(groups)
    for tag in tags:
        path = plot_tag(
            tag, curves_for(groups, scalars, tag), os.path.join(out, tag_filename(tag)), args.smoothing, colors
        )
        print(f"compare: wrote {path}", file=sys.stderr)

    rows = summarize(groups, scalars, tags)
    text = format_table(rows, tags)
    summary = os.path.join(out, "summary.md")
    with open(summary, "w") as f:
        f.write(text + _notes(rows, args.smoothing, scalars, tags, missing))
    sys.stdout.write(text)
    for line in step_notes(scalars, tags):
        print("compare: note: " + line.removeprefix("- ").replace("**", ""), file=sys.stderr)
    print(f"compare: wrote {summary}", file=sys.stderr)
    if args.x:
        if args.final_steps < 1:
            raise CompareError(f"--final-steps must be >= 1, got {args.final_steps}")
        window = None
        if args.window:
            try:
                a, b = (int(v) for v in args.window.split(":"))
            except ValueError as err:
                raise CompareError(f"--window must be A:B with integer steps, got {args.window!r}") from err
            window = (a, b)
        if args.shift_by and args.shift_by not in known:
            raise CompareError(f"--shift-by {args.shift_by!r} is not logged by any run")
        tables = {tag: versus(scalars, args.x, tag, args.final_steps, window, args.shift_by) for tag in tags}
        if not any(tables.values()):
            raise CompareError(f"--x {args.x}: no run name has a numeric {args.x}=... item")
        key_file = args.x.replace("/", "_") + args.suffix
        what = describe(args.final_steps, window, args.shift_by)
        line_colors = setting_colors(sorted({s for t in tables.values() for s in t}))
        for tag, lines in tables.items():
            path = plot_versus(
                tag, args.x, lines, os.path.join(out, f"{tag.replace('/', '_')}_vs_{key_file}.png"), what, line_colors
            )
            print(f"compare: wrote {path}", file=sys.stderr)
        text = format_versus_table(args.x, tags, tables, what)
        path = os.path.join(out, f"summary_vs_{key_file}.md")
        with open(path, "w") as f:
            f.write(text)
        sys.stdout.write("\n" + text)
        print(f"compare: wrote {path}", file=sys.stderr)
    return 0
