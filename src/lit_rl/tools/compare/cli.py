"""The command line of ``recipes/compare.py``: read the runs, then write the plots, summary.md, the tables
against ``--x`` and the seed intervals and ``--test`` results, one step per function in the order they run."""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import sys

from .curves import curves_for
from .plots import plot_tag, plot_versus, setting_colors, tag_filename
from .runs import FINISHED_MARKER, CompareError, find_runs, read_scalars, run_state
from .settings import group_runs
from .stats import interval_bands, missing_steps, t_interval
from .tables import (
    format_interval_table,
    format_table,
    format_tests,
    format_versus_intervals,
    format_versus_table,
    step_notes,
    summarize,
    summary_notes,
)
from .versus import describe, versus, versus_cells


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
    """The comparison ``main`` runs: each step below in turn; raises CompareError for a user's mistake."""
    tags = requested_tags(args)
    runs = find_runs(args.folders)
    scalars = {name: read_scalars(d) for name, d in runs.items()}
    known = sorted({t for s in scalars.values() for t in s})
    tags, missing = logged_tags(tags, known)
    unfinished = note_unfinished(runs)

    groups = group_runs(runs, group_by_seed=args.group_by_seed)
    check_settings(args, groups, known)  # every option checked before anything is written
    out = args.out or os.path.join(args.folders[0], "compare")
    os.makedirs(out, exist_ok=True)
    write_plots(groups, scalars, tags, out, args.smoothing)
    summary = write_summary(groups, scalars, tags, missing, out, args.smoothing, unfinished)
    if args.x:
        write_versus(args, scalars, tags, known, out)
    write_intervals(args, groups, scalars, tags, summary)
    return 0


def requested_tags(args: argparse.Namespace) -> list[str]:
    """The ``--tags`` asked for, in order without repeats; raises CompareError for none, or for a
    ``--smoothing`` outside [0, 1)."""
    tags = list(dict.fromkeys(t.strip() for t in args.tags.split(",") if t.strip()))
    if not tags:
        raise CompareError("--tags names no tag")
    if not (0.0 <= args.smoothing < 1.0) or math.isnan(args.smoothing):
        raise CompareError(f"--smoothing must be in [0, 1), got {args.smoothing}")
    return tags


def logged_tags(tags: list[str], known: list[str]) -> tuple[list[str], list[str]]:
    """(the tags to compare, the tags asked for that no run logged): the missing ones are left out with a
    warning; raises CompareError when no tag asked for was logged. A tag with ``*`` is a pattern (``fnmatch``) that
    stands for the logged tags it matches, in sorted order: ``eval/*/pass@*`` is every eval set's pass@k."""
    expanded = []
    for t in tags:
        matches = sorted(k for k in known if fnmatch.fnmatchcase(k, t)) if "*" in t else []
        expanded += matches or [t]
    tags = list(dict.fromkeys(expanded))
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
    return tags, missing


def note_unfinished(runs: dict[str, str]) -> dict[str, str]:
    """{run: its state} for each run without ``finished.json`` (``run_state``: still being written, or stopped
    early), each also a note on stderr."""
    unfinished = {}
    for name, d in runs.items():
        state = run_state(d)
        if state != "finished":
            unfinished[name] = state
            print(f"compare: note: {name} has no {FINISHED_MARKER}: {state}", file=sys.stderr)
    return unfinished


def check_settings(args: argparse.Namespace, groups: dict[str, list[str]], known: list[str]) -> None:
    """Raise CompareError for a ``--test`` setting that is not among ``groups`` or a bad ``--final-steps``,
    ``--window`` or ``--shift-by``: run before the first PNG, so a mistyped option writes nothing."""
    if args.final_steps < 1:
        raise CompareError(f"--final-steps must be >= 1, got {args.final_steps}")
    for pair in args.test:
        for name in pair:
            if name not in groups:
                raise CompareError(f"--test: no setting {name!r}; settings: {', '.join(groups)}")
    if args.x:
        versus_window(args, known)


def write_plots(
    groups: dict[str, list[str]], scalars: dict[str, dict], tags: list[str], out: str, smoothing: float
) -> None:
    """One PNG per tag in ``out``: each setting's curve over steps, its band the seed mean's t-interval."""
    colors = setting_colors(groups)
    for tag in tags:
        path = plot_tag(
            tag,
            curves_for(groups, scalars, tag),
            os.path.join(out, tag_filename(tag)),
            smoothing,
            colors,
            bands=interval_bands(groups, scalars, tag),
        )
        print(f"compare: wrote {path}", file=sys.stderr)


def write_summary(
    groups: dict[str, list[str]],
    scalars: dict[str, dict],
    tags: list[str],
    missing: list[str],
    out: str,
    smoothing: float,
    unfinished: dict[str, str] | None = None,
) -> str:
    """Write ``out/summary.md`` (the final/best table and its notes, the runs without ``finished.json`` first),
    print the table to stdout and the step notes to stderr; returns the file's path."""
    rows = summarize(groups, scalars, tags)
    text = format_table(rows, tags)
    summary = os.path.join(out, "summary.md")
    with open(summary, "w") as f:
        f.write(text + summary_notes(rows, smoothing, scalars, tags, missing, unfinished))
    sys.stdout.write(text)
    for line in step_notes(scalars, tags):
        print("compare: note: " + line.removeprefix("- ").replace("**", ""), file=sys.stderr)
    print(f"compare: wrote {summary}", file=sys.stderr)
    return summary


def versus_window(args: argparse.Namespace, known: list[str]) -> tuple[int, int] | None:
    """The ``--window A:B`` of steps (None without one), after checking ``--final-steps`` and ``--shift-by``;
    raises CompareError for a bad value."""
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
    return window


def write_versus(
    args: argparse.Namespace, scalars: dict[str, dict], tags: list[str], known: list[str], out: str
) -> None:
    """``--x KEY``: per tag a PNG against the swept value (error bars: the seed mean's t-interval) and
    ``summary_vs_<key>.md`` (a row per setting, a column per value), also printed to stdout."""
    window = versus_window(args, known)
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
