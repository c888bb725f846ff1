"""The read-outs of docs/results/staleness_gradient (issue 39, experiment 4; rules in README.md) from probe folders.

    python docs/results/staleness_gradient/verdict.py --reference outputs/stale_probe/a \
        outputs/stale_probe/a outputs/stale_probe/b [--plot docs/results/staleness_gradient] [--json F]

Each folder is a ``recipes/probe_gradients.py`` run (modes [reward]) whose settings are named ``k=N`` (the sampler
holds θ_{s−N}); the on-policy reference g is the one in ``--reference`` (one reference for every cell, so the cells'
statistics share it). Per k and correction: the progress ratio ⟨E ĝ_c, g⟩/‖g‖² and bias/‖g‖ with 95% intervals
(±1.96 jackknife SE) and the minimum detectable effect (2.8 SE: 80% power at a two-sided 5% level); per k the paired
T(a, b) = (‖E ĝ_a − g‖² − ‖E ĝ_b − g‖²)/‖g‖² for (sc, tis), (sc+tis, tis), (sc, none). Q1: per correction, the largest
k up to which every k of the grid has the progress ratio's lower bound ≥ 0.9. Q2: the sign of T(sc, tis) at every k
(< 0: SC closer to g than TIS; an interval holding 0: not settled).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from lit_rl.tools.probe import jackknife
from lit_rl.tools.staleness_probe import jackknife_groups, paired_gap, progress

CORRECTIONS = ("none", "tis", "sc", "sc+tis")
PAIRS = (("sc", "tis"), ("sc+tis", "tis"), ("sc", "none"))
Z, MDE = 1.96, 2.8


def load(folders: list[Path], reference: Path):
    """(reference sketches [R, D], {k: {correction: [B, D]}}, {k: KL(μ‖π) per token}, {k: tis clip fraction})."""
    y = torch.stack(torch.load(reference / "sketches.pt")["reference"]["reward"]).double()
    cells, kl, clip = {}, {}, {}
    for folder in folders:
        saved = torch.load(folder / "sketches.pt")["settings"]
        rows = json.loads((folder / "probe.json").read_text())["rows"]
        for name, by_corr in saved.items():
            k = int(re.fullmatch(r"k=(\d+)", name).group(1))
            cells[k] = {c: torch.stack(v["reward"]).double() for c, v in by_corr.items() if v["reward"]}
            kl[k] = next(r["kl"] for r in rows if r["setting"] == name and r["correction"] == "none")
            clip[k] = next((r["tis_clipfrac"] for r in rows if r["setting"] == name and r["correction"] == "tis"), None)
    return y, dict(sorted(cells.items())), kl, clip


def interval(v: float, se: float) -> dict:
    return {"value": v, "se": se, "low": v - Z * se, "high": v + Z * se, "mde": MDE * se}


def read_outs(y, cells) -> dict:
    out = {"g_batches": y.shape[0], "cells": {}, "pairs": {}}
    for k, by_corr in cells.items():
        out["cells"][k] = {}
        for c, x in by_corr.items():
            est, se = jackknife(x, y)
            out["cells"][k][c] = {
                "batches": x.shape[0],
                "progress": interval(*jackknife_groups(progress, x, y)),
                "bias_rel": interval(est["bias_rel"], se["bias_rel"]),
                "cosine": interval(est["cosine"], se["cosine"]),
                "var_rel": est["var_rel"],
            }
        out["pairs"][k] = {
            f"T({a}, {b})": interval(*jackknife_groups(paired_gap, by_corr[a], by_corr[b], y, paired=2))
            for a, b in PAIRS
            if a in by_corr and b in by_corr
        }
    return out


def verdicts(res: dict) -> dict:
    ks = sorted(res["cells"])
    q1 = {}
    for c in CORRECTIONS:
        tolerated = 0
        for k in ks:
            cell = res["cells"][k].get(c)
            if cell is None or not cell["progress"]["low"] >= 0.9:
                break
            tolerated = k
        q1[c] = tolerated
    q2 = {}
    for k in ks:
        t = res["pairs"][k].get("T(sc, tis)")
        if t is not None:
            q2[k] = "sc closer" if t["high"] < 0 else "tis closer" if t["low"] > 0 else "not settled"
    return {"Q1_tolerated_k": q1, "Q2_sign_T_sc_tis": q2}


def fmt(i: dict, digits: int = 3) -> str:
    return f"{i['value']:+.{digits}f} [{i['low']:+.{digits}f}, {i['high']:+.{digits}f}] (MDE {i['mde']:.{digits}f})"


def report(res: dict, kl: dict, clip: dict, v: dict) -> str:
    lines = [f"Reference: {res['g_batches']} on-policy batches at θ_s.", ""]
    lines += ["| k | KL(μ‖π)/token | TIS clip | correction | B | progress ratio | bias / ‖g‖ | cosine |"]
    lines += ["|---:|---:|---:|---|---:|---|---|---|"]
    for k, by_corr in res["cells"].items():
        for c in CORRECTIONS:
            if c in by_corr:
                cell = by_corr[c]
                clip_k = f"{100 * clip[k]:.2f}%" if clip.get(k) is not None else "–"
                lines.append(
                    f"| {k} | {kl[k]:.2e} | {clip_k} | {c} | {cell['batches']} | {fmt(cell['progress'])} | "
                    f"{fmt(cell['bias_rel'])} | {fmt(cell['cosine'])} |"
                )
    lines += ["", "| k | " + " | ".join(f"T{p}".replace("T(", "T(") for p in (f"({a}, {b})" for a, b in PAIRS)) + " |"]
    lines += ["|---:|" + "---|" * len(PAIRS)]
    for k, pairs in res["pairs"].items():
        lines.append(f"| {k} | " + " | ".join(fmt(pairs[f"T({a}, {b})"], 4) for a, b in PAIRS) + " |")
    lines += ["", f"Q1 (largest k with the progress ratio's lower bound >= 0.9 up to it): {v['Q1_tolerated_k']}"]
    lines += [f"Q2 (sign of T(sc, tis) per k): {v['Q2_sign_T_sc_tis']}"]
    return "\n".join(lines) + "\n"


def plot(res: dict, kl: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(res["cells"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, c in enumerate(CORRECTIONS):
        pts = [(k, res["cells"][k][c]["progress"]) for k in ks if c in res["cells"][k]]
        x = [k * (1 + 0.04 * (i - 1.5)) for k, _ in pts]
        ax1.errorbar(
            x, [p["value"] for _, p in pts], yerr=[Z * p["se"] for _, p in pts], marker="o", capsize=3, label=c
        )
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.axhline(0.9, color="grey", lw=0.8, ls="--")
    ax1.set(xscale="log", xlabel="lag k (sampler θ_{16−k}, trainer θ_16)", ylabel="progress ratio ⟨E ĝ, g⟩ / ‖g‖²")
    ax1.set_xticks(ks, [str(k) for k in ks])
    ax1.legend(title="correction (95% CI)")
    for i, (a, b) in enumerate(PAIRS):
        name = f"T({a}, {b})"
        pts = [(k, res["pairs"][k][name]) for k in ks if name in res["pairs"][k]]
        x = [k * (1 + 0.04 * (i - 1)) for k, _ in pts]
        ax2.errorbar(
            x, [p["value"] for _, p in pts], yerr=[Z * p["se"] for _, p in pts], marker="s", capsize=3, label=name
        )
    ax2.axhline(0.0, color="grey", lw=0.8)
    ax2.set(xscale="log", xlabel="lag k", ylabel="T(a, b) / ‖g‖²  (< 0: a closer to g)")
    ax2.set_xticks(ks, [str(k) for k in ks])
    ax2.legend()
    fig.suptitle(
        "Staleness as gradient bias, SmolLM2-135M after 16 GRPO steps (KL per token: "
        + ", ".join(f"k={k}: {kl[k]:.1e}" for k in ks)
        + ")",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(folder / "staleness_gradient.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--reference", type=Path, required=True, help="the probe folder whose on-policy reference to use")
    ap.add_argument("--plot", type=Path, help="write staleness_gradient.png there")
    ap.add_argument("--json", type=Path, help="write every number there")
    args = ap.parse_args()
    y, cells, kl, clip = load(args.folders, args.reference)
    res = read_outs(y, cells)
    v = verdicts(res)
    print(report(res, kl, clip, v))
    if args.json:
        args.json.write_text(json.dumps({"kl": kl, "tis_clipfrac": clip, **res, **v}, indent=2))
    if args.plot:
        plot(res, kl, args.plot)


if __name__ == "__main__":
    main()
