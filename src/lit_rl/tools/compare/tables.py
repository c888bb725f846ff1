"""The markdown of summary.md and summary_vs_<key>.md: the final/best table and its notes, the seed-interval
table, the ``--test`` tables and the tables against a swept value."""

from __future__ import annotations

import math

from .curves import LOWER_IS_BETTER, common_step, curves_for, last_steps, lower_is_better
from .runs import CompareError
from .stats import CONFIDENCE, final_window, missing_steps, seed_finals, t_interval, welch_test


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


def summary_notes(
    rows: list[dict],
    smoothing: float,
    scalars: dict[str, dict] | None = None,
    tags: list[str] = (),
    missing: list[str] = (),
    unfinished: dict[str, str] | None = None,
) -> str:
    """The lines under summary.md's table: the runs without ``finished.json`` ({run: state}, values so far),
    the tags left out, where runs stopped early, the rules of final, best and the plots, and the runs of each
    setting."""
    lines = [
        "",
        *(
            [
                f"- **not finished** (no finished.json; their values are those written so far): {n}: {state}"
                for n, state in sorted(unfinished.items())
            ]
            if unfinished
            else []
        ),
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
