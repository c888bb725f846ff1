"""The PNGs: a tag over steps per setting (seed mean, smoothed, with its band) and a tag against a swept
value; matplotlib's Agg canvas, imported when a plot is drawn."""

from __future__ import annotations

import math

from .curves import Curve, tb_smooth


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
