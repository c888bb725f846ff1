"""The gradient-bias probe's figure (``lit_rl.tools.probe``): each correction's drift and bias against the realised
mismatch, one panel per measured quantity."""

from __future__ import annotations

import math


def plot_rows(rows: list[dict], path: str) -> str:
    """A PNG: drift (A = 1) and bias relative to ‖g‖ per correction against the realised KL(μ‖π), with ±1 SE
    error bars (Agg canvas); panels of quantities the run did not measure are left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in rows if not r["correction"].startswith("(")]
    corrections = list(dict.fromkeys(r["correction"] for r in rows))
    panels = [
        ("drift_proj", "drift under A = 1 along u / ‖E C‖"),
        ("drift2", "drift² ‖E ĝ‖² under A = 1"),
        ("cond_drift_proj", "conditional drift along u / ‖E C‖"),
        ("bias_rel", "bias ‖E ĝ − g‖ / ‖g‖ (real reward)"),
    ]
    # a panel whose quantity was not measured (a mode not in probe.modes) is left out
    panels = [p for p in panels if any(math.isfinite(r.get(p[0], math.nan)) for r in rows)] or panels[:1]
    fig = Figure(figsize=(4.4 * len(panels), 4.2), dpi=110)
    FigureCanvasAgg(fig)
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    for j, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), j + 1)
        for i, c in enumerate(corrections):
            pts = sorted(
                (r["kl"], r.get(key, math.nan), r.get(key + "_se", math.nan)) for r in rows if r["correction"] == c
            )
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[p[2] for p in pts],
                marker="o",
                capsize=3,
                color=cmap(i % 10),
                label=c,
            )
        kls = [r["kl"] for r in rows if math.isfinite(r["kl"])]
        if kls and min(kls) > 0 and max(kls) > 10 * min(kls):  # log axis only where the KLs span a decade
            ax.set_xscale("log")
        ax.set_xlabel("realised KL(μ ‖ π) per token")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        if j == 0:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
