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

Seeds and uncertainty (settings with >= 2 seeds): the plots' band is the 95% t-interval of the seed mean
at each step that every seed of the setting logged (mean ± t_{0.975, n−1}·s/√n, s the sample standard
deviation over the n seeds); ``summary.md`` gets a table of each setting's *final* value — per run the mean
of its values over the last ``--final-steps`` k steps that every compared run logged — as mean ± that
interval. ``--test A B`` (repeatable) compares two settings' finals with Welch's t-interval of the
difference mean_A − mean_B (Welch 1947; Satterthwaite's degrees of freedom) and states "A > B", "A < B"
or "indistinguishable at n_A, n_B seeds" from whether the interval excludes 0. A run that lacks a step
other seeds of its setting logged is flagged (stderr and ``summary.md``), never averaged in silently.
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
CONFIDENCE = 0.95  # of the seed intervals and --test
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
        "shaded = 95% t-interval of the seed mean (settings with >= 2 seeds, at steps every seed logged).",
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
    out: dict[str, list[tuple[float, float, int]]] = {}
    for (setting, x), vals in sorted(versus_cells(scalars, key, tag, last, window, shift_by).items()):
        out.setdefault(setting, []).append((x, sum(vals) / len(vals), len(vals)))
    return out


def versus_cells(
    scalars: dict[str, dict],
    key: str,
    tag: str,
    last: int = 1,
    window: tuple[int, int] | None = None,
    shift_by: str | None = None,
) -> dict[tuple[str, float], list[float]]:
    """{(setting, x): [each run's value]} behind ``versus`` (one value per seed), for the seed intervals."""
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
    return cells


def format_versus_intervals(
    key: str, tags: list[str], cells: dict[str, dict], what: str, confidence: float = CONFIDENCE
) -> str:
    """Markdown: per tag a row per setting, a column per value of ``key``: seed mean ± t-interval half-width
    (n seeds in brackets; the half-width n/a with one seed)."""
    out = []
    for tag in tags:
        by = cells[tag]
        xs = sorted({x for _, x in by})
        settings = sorted({s for s, _ in by})
        out.append(f"### {tag} ({what}) vs {key}: seed mean ± {confidence * 100:g}% t-interval [seeds]\n")
        out.append("| setting | " + " | ".join(f"{key}={x:g}" for x in xs) + " |")
        out.append("|---|" + "---:|" * len(xs))
        for setting in settings:
            cell = []
            for x in xs:
                vals = by.get((setting, x))
                if not vals:
                    cell.append("n/a")
                    continue
                iv = t_interval(vals, confidence)
                cell.append(f"{fmt(iv.mean)} ± {'n/a' if iv.n < 2 else fmt(iv.half)} [{iv.n}]")
            out.append(f"| {setting.replace('|', chr(92) + '|')} | " + " | ".join(cell) + " |")
        out.append("")
    return "\n".join(out)


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
    tag: str,
    key: str,
    lines: dict[str, list[tuple[float, float, int]]],
    path: str,
    what: str,
    colors=None,
    errors: dict[tuple[str, float], float] | None = None,
) -> str:
    """A PNG of ``tag`` against ``key``: one marked line per setting (Agg canvas, not pyplot); with ``errors``
    ({(setting, x): t-interval half-width}) each point gets its error bar (points with one seed none)."""
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
        if errors:
            bars = [(x, v, errors.get((setting, x), math.nan)) for x, v, _ in pts]
            bars = [b for b in bars if math.isfinite(b[2])]
            if bars:
                ax.errorbar(
                    [b[0] for b in bars],
                    [b[1] for b in bars],
                    yerr=[b[2] for b in bars],
                    fmt="none",
                    ecolor=colors[setting],
                    capsize=3,
                    alpha=0.7,
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


def plot_tag(
    tag: str,
    curves: dict[str, Curve],
    path: str,
    smoothing: float = 0.6,
    colors=None,
    bands: dict[str, tuple[list[int], list[float], list[float]]] | None = None,
) -> str:
    """Write a PNG of ``tag`` to ``path``: per setting the smoothed seed mean (solid, labelled), the raw mean
    (faint) and a shaded band: ``bands[setting]`` = (steps, lo, hi) when given (``interval_bands``: the 95%
    t-interval over seeds), else the min–max across seeds; x = step. Uses the Agg canvas, not pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = colors or setting_colors(curves)
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for setting, c in curves.items():
        color = colors[setting]
        marker = "o" if len(c.steps) == 1 else None
        if bands is not None:
            if setting in bands:
                ax.fill_between(*bands[setting], color=color, alpha=0.15, linewidth=0)
        elif max(c.count) > 1:
            ax.fill_between(c.steps, c.lo, c.hi, color=color, alpha=0.15, linewidth=0)
        ax.plot(c.steps, c.mean, color=color, alpha=0.3, linewidth=1, marker=marker)
        ax.plot(c.steps, tb_smooth(c.mean, smoothing), color=color, linewidth=2, marker=marker, label=setting)
    ax.set_title(tag)
    ax.set_xlabel("step")
    ax.set_ylabel(tag)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    shaded = "95% t-interval over seeds" if bands is not None else "min–max across seeds"
    fig.text(
        0.01,
        0.01,
        f"solid: seed mean, TensorBoard smoothing {smoothing:g}; faint: raw seed mean; shaded: {shaded}",
        fontsize=7,
        color="0.4",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, format="png")
    return path


def tag_filename(tag: str) -> str:
    """``rollout/reward_mean`` -> ``rollout_reward_mean.png``."""
    return tag.replace("/", "_") + ".png"


# ----------------------------------------------------------------------------------- seeds and uncertainty


def t_quantile(df: float, confidence: float = CONFIDENCE) -> float:
    """The two-sided ``confidence`` quantile of Student's t with ``df`` > 0 degrees of freedom (scipy):
    t_{0.975, 2} = 4.3027 for 95% and df = 2."""
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, df))


@dataclass
class Interval:
    """mean ± half over n values: the t-interval of a mean (``half`` NaN for n < 2); ``sd`` the sample
    standard deviation (n − 1 in the denominator)."""

    mean: float
    half: float
    n: int
    sd: float

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half


def t_interval(values, confidence: float = CONFIDENCE) -> Interval:
    """The t-interval of the mean of ``values`` (n independent seeds): mean ± t_{(1+c)/2, n−1}·s/√n.

    Values 1, 2, 3: mean 2, s = 1, half = 4.3027/√3 = 2.4841. Raises ValueError for no values."""
    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        raise ValueError("t_interval of no values")
    mean = sum(vals) / n
    if n < 2:
        return Interval(mean, math.nan, n, math.nan)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    return Interval(mean, t_quantile(n - 1, confidence) * sd / math.sqrt(n), n, sd)


@dataclass
class WelchResult:
    """Welch's interval of mean_A − mean_B: ``diff`` ± ``half`` with ``df`` degrees of freedom, and the verdict."""

    a: Interval
    b: Interval
    diff: float
    half: float
    df: float
    verdict: str

    @property
    def lo(self) -> float:
        return self.diff - self.half

    @property
    def hi(self) -> float:
        return self.diff + self.half


def welch_test(a, b, names: tuple[str, str] = ("A", "B"), confidence: float = CONFIDENCE) -> WelchResult:
    """Welch's t-interval of the difference of two means, from the two samples ``a`` and ``b`` (seeds).

    diff = mean_a − mean_b, se² = s_a²/n_a + s_b²/n_b, df = se⁴ / ((s_a²/n_a)²/(n_a−1) + (s_b²/n_b)²/(n_b−1))
    (Welch–Satterthwaite), half = t_{(1+c)/2, df}·se. Verdict: "A > B" when the interval lies above 0,
    "A < B" below it, else "indistinguishable at n_a, n_b seeds" (with ``names`` for A and B). Both samples
    constant: the interval has width 0. Raises ValueError unless both have >= 2 values."""
    ia, ib = t_interval(a, confidence), t_interval(b, confidence)
    if ia.n < 2 or ib.n < 2:
        raise ValueError(f"Welch's test needs >= 2 seeds per setting, got {ia.n} and {ib.n}")
    va, vb = ia.sd**2 / ia.n, ib.sd**2 / ib.n
    diff = ia.mean - ib.mean
    se2 = va + vb
    if se2 == 0:
        df, half = math.inf, 0.0
    else:
        df = se2**2 / (va**2 / (ia.n - 1) + vb**2 / (ib.n - 1))
        half = t_quantile(df, confidence) * math.sqrt(se2)
    if diff - half > 0:
        verdict = f"{names[0]} > {names[1]}"
    elif diff + half < 0:
        verdict = f"{names[0]} < {names[1]}"
    else:
        verdict = f"indistinguishable at {ia.n}, {ib.n} seeds"
    return WelchResult(ia, ib, diff, half, df, verdict)


def final_window(scalars: dict[str, dict], tag: str, k: int) -> list[int]:
    """The last ``k`` (>= 1) steps of ``tag`` that every run logging it logged (fewer when fewer are shared):
    the steps a run's *final* value averages over, the same for every run compared."""
    sets = [set(step for step, _ in s[tag]) for s in scalars.values() if s.get(tag)]
    if not sets:
        return []
    return sorted(set.intersection(*sets))[-k:]


def run_final(series: list[tuple[int, float]], window: list[int]) -> float:
    """Mean of a (step, value) series over the steps in ``window`` (NaN when it logged none of them)."""
    steps = set(window)
    vals = [v for step, v in series if step in steps]
    return sum(vals) / len(vals) if vals else math.nan


def missing_steps(groups: dict[str, list[str]], scalars: dict[str, dict], tag: str) -> dict[str, list[int]]:
    """{run: the steps of ``tag`` that another run of its setting logged and it did not}, for the runs that
    lack any (a run that stopped early, or skipped a step); such runs are flagged, not averaged silently."""
    out = {}
    for names in groups.values():
        logged = {n: {step for step, _ in scalars[n].get(tag, [])} for n in names if scalars[n].get(tag)}
        union = set().union(*logged.values()) if logged else set()
        for n, steps in logged.items():
            lacking = sorted(union - steps)
            if lacking:
                out[n] = lacking
    return out


def interval_bands(
    groups: dict[str, list[str]], scalars: dict[str, dict], tag: str, confidence: float = CONFIDENCE
) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """{setting: (steps, lo, hi)} of the seed mean's t-interval per step, for settings with >= 2 runs of
    ``tag``, at the steps every one of those runs logged with a finite value (elsewhere no band: a gap)."""
    out = {}
    for setting, names in groups.items():
        series = [dict(scalars[n][tag]) for n in names if scalars[n].get(tag)]
        if len(series) < 2:
            continue
        steps, lo, hi = [], [], []
        for step in sorted(set.intersection(*(set(s) for s in series))):
            vals = [s[step] for s in series]
            if not all(math.isfinite(v) for v in vals):
                continue
            iv = t_interval(vals, confidence)
            steps.append(step)
            lo.append(iv.lo)
            hi.append(iv.hi)
        out[setting] = (steps, lo, hi)
    return out


def seed_finals(groups: dict[str, list[str]], scalars: dict[str, dict], tag: str, k: int) -> dict[str, list[float]]:
    """{setting: [each run's final value of ``tag``]} (``run_final`` over ``final_window``); runs without the
    tag are left out."""
    window = final_window(scalars, tag, k)
    return {
        setting: [run_final(scalars[n][tag], window) for n in names if scalars[n].get(tag)]
        for setting, names in groups.items()
        if any(scalars[n].get(tag) for n in names)
    }


def format_interval_table(
    groups: dict[str, list[str]], scalars: dict[str, dict], tags: list[str], k: int, confidence: float = CONFIDENCE
) -> str:
    """Markdown: a row per setting, per tag the final value's seed mean and its ± t-interval half-width
    (``n/a`` with one seed), then the window the finals average over and the flagged runs."""
    pct = f"{confidence * 100:g}%"
    header = ["setting", "seeds"]
    for tag in tags:
        header += [f"{tag} final", f"± {pct}"]
    lines = [
        f"## Seeds: final value, mean ± {pct} t-interval over seeds",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    finals = {tag: seed_finals(groups, scalars, tag, k) for tag in tags}
    for setting, names in groups.items():
        cells = [setting.replace("|", "\\|"), str(len(names))]
        for tag in tags:
            vals = finals[tag].get(setting)
            if not vals:
                cells += ["n/a", "n/a"]
                continue
            iv = t_interval(vals, confidence)
            cells += [fmt(iv.mean), "n/a" if iv.n < 2 else fmt(iv.half)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for tag in tags:
        window = final_window(scalars, tag, k)
        where = f"steps {window[0]}–{window[-1]}" if len(window) > 1 else (f"step {window[0]}" if window else "none")
        lines.append(
            f"- {tag}: final = each run's mean over the last {len(window)} step(s) every run logged ({where}); "
            f"± = t_{{{0.5 + confidence / 2:g}, n−1}}·s/√n over the n seeds."
        )
    lines += flag_lines(groups, scalars, tags)
    return "\n".join(lines) + "\n"


def flag_lines(groups: dict[str, list[str]], scalars: dict[str, dict], tags: list[str]) -> list[str]:
    """Markdown bullet lines naming each run that lacks steps its setting's other runs logged, per tag."""
    out = []
    for tag in tags:
        for run, lacking in sorted(missing_steps(groups, scalars, tag).items()):
            shown = ", ".join(map(str, lacking[:8])) + (" …" if len(lacking) > 8 else "")
            out.append(
                f"- **flagged**: {run} lacks {len(lacking)} step(s) of {tag} that other seeds of its "
                f"setting logged ({shown}); the band leaves those steps out and its final uses the shared window"
            )
    return out


def format_tests(
    pairs: list[tuple[str, str]],
    groups: dict[str, list[str]],
    scalars: dict[str, dict],
    tags: list[str],
    k: int,
    confidence: float = CONFIDENCE,
) -> str:
    """Markdown: for each (A, B) pair a table, a row per tag: A's and B's final mean ± interval, the
    difference A − B with Welch's interval and degrees of freedom, and the verdict; a tag with fewer than 2
    seeds' finals in either setting (a tag one of them never logs) gets a "not tested" row. Raises CompareError
    for a setting that is not among ``groups``."""
    pct = f"{confidence * 100:g}%"
    out = []
    for a, b in pairs:
        for name in (a, b):
            if name not in groups:
                raise CompareError(f"--test: no setting {name!r}; settings: {', '.join(groups)}")
        out += [
            f"## --test {a} vs {b} (final = mean of the last {k} shared step(s); Welch {pct} interval)",
            "",
            "| tag | A mean ± | B mean ± | A − B | Welch interval | df | result |",
            "|---|---:|---:|---:|---|---:|---|",
        ]
        flagged = set()
        for tag in tags:
            finals = seed_finals({a: groups[a], b: groups[b]}, scalars, tag, k)
            va, vb = finals.get(a, []), finals.get(b, [])
            if len(va) < 2 or len(vb) < 2:  # e.g. tis_clipfrac of a run without TIS: the other tags still count
                out.append(
                    f"| {tag} | {len(va)} seed(s) | {len(vb)} seed(s) | | | | not tested: needs >= 2 seeds of the "
                    "tag in each setting |"
                )
                continue
            r = welch_test(va, vb, ("A", "B"), confidence)
            out.append(
                f"| {tag} | {fmt(r.a.mean)} ± {fmt(r.a.half)} | {fmt(r.b.mean)} ± {fmt(r.b.half)} | "
                f"{fmt(r.diff)} | [{fmt(r.lo)}, {fmt(r.hi)}] | {fmt(r.df)} | {r.verdict} |"
            )
            flagged |= set(missing_steps({a: groups[a], b: groups[b]}, scalars, tag))
        out += ["", f"A = {a} ({len(groups[a])} runs), B = {b} ({len(groups[b])} runs)."]
        if flagged:
            out.append(f"Flagged (missing steps): {', '.join(sorted(flagged))}.")
        out.append("")
    return "\n".join(out)


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
        help="a run's final value is the mean of its last N logged values (with --x), or of the last N "
        "steps every run logged (the seed-interval table and --test); default 1",
    )
    p.add_argument(
        "--test",
        nargs=2,
        action="append",
        default=[],
        metavar=("A", "B"),
        help="compare two settings' final values (>= 2 seeds each) with Welch's 95%% interval of the "
        "difference A - B: 'A > B', 'A < B' or 'indistinguishable'; repeatable",
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
            tag,
            curves_for(groups, scalars, tag),
            os.path.join(out, tag_filename(tag)),
            args.smoothing,
            colors,
            bands=interval_bands(groups, scalars, tag),
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
        cells = {tag: versus_cells(scalars, args.x, tag, args.final_steps, window, args.shift_by) for tag in tags}
        for tag, lines in tables.items():
            errors = {c: t_interval(v).half for c, v in cells[tag].items()}
            path = plot_versus(
                tag,
                args.x,
                lines,
                os.path.join(out, f"{tag.replace('/', '_')}_vs_{key_file}.png"),
                what,
                line_colors,
                errors=errors,
            )
            print(f"compare: wrote {path}", file=sys.stderr)
        text = format_versus_table(args.x, tags, tables, what)
        if any(len(v) > 1 for c in cells.values() for v in c.values()):
            text += "\n" + format_versus_intervals(args.x, tags, cells, what)
        path = os.path.join(out, f"summary_vs_{key_file}.md")
        with open(path, "w") as f:
            f.write(text)
        sys.stdout.write("\n" + text)
        print(f"compare: wrote {path}", file=sys.stderr)
    write_intervals(args, groups, scalars, tags, summary)
    return 0


def write_intervals(
    args: argparse.Namespace, groups: dict[str, list[str]], scalars: dict[str, dict], tags: list[str], summary: str
) -> None:
    """Append the seed-interval table (when a setting has >= 2 seeds) and each ``--test`` to ``summary`` and
    stdout; warn about flagged runs."""
    if args.final_steps < 1:
        raise CompareError(f"--final-steps must be >= 1, got {args.final_steps}")
    for tag in tags:
        for run, lacking in sorted(missing_steps(groups, scalars, tag).items()):
            print(
                f"compare: warning: {run} lacks {len(lacking)} step(s) of {tag} that other seeds of its setting "
                f"logged (first: {lacking[0]}); flagged in summary.md",
                file=sys.stderr,
            )
    text = ""
    if any(len(runs) > 1 for runs in groups.values()):  # with one seed per setting there is no interval
        text += "\n" + format_interval_table(groups, scalars, tags, args.final_steps)
    if args.test:
        text += "\n" + format_tests([tuple(p) for p in args.test], groups, scalars, tags, args.final_steps)
    if text:
        with open(summary, "a") as f:
            f.write(text)
        sys.stdout.write(text)
