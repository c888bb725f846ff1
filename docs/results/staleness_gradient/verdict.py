"""The read-outs of docs/results/staleness_gradient (issue 39, experiment 4; rules in README.md) from probe folders.

    python docs/results/staleness_gradient/verdict.py outputs/stale_probe/*/ [--plot docs/results/staleness_gradient] \
        [--json F]

Each folder is a ``recipes/probe_gradients.py`` run (modes [reward]) whose settings are named ``k=N``: the sampler holds
θ_{s−N}; ``k=0`` is the on-policy sampler (correction none), the coupled batches z. Batches are keyed by their seed
index (``probe.seed_offset`` + b, from each folder's config.yaml) and merged across folders, each counted once: the
reference batches of every folder form y (independent of every cell), and a cell's batch at seed i is paired with z's
batch at seed i (common random numbers: ``lit_rl.tools.staleness_probe``).

Per k and correction: the progress ratio ⟨E ĝ_c, g⟩/‖g‖² and bias/‖g‖ from the coupled differences (and the
uncoupled progress ratio, against y alone, for comparison), with 95% intervals (±1.96 delete-one jackknife SE) and the
minimum detectable effect (2.8 SE: 80% power at a two-sided 5% level); per k the coupled T(a, b) = (‖E ĝ_a − g‖² −
‖E ĝ_b − g‖²)/‖g‖² for (sc, tis), (sc+tis, tis), (sc, none). Q1: per correction, the largest k up to which every k of
the grid has the progress ratio's lower bound ≥ 0.9. Q2: the sign of T(sc, tis) at every k (< 0: SC closer to g than
TIS; an interval holding 0: not settled).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import torch
import yaml

from lit_rl.tools.staleness_probe import coupled_bias2, coupled_gap, coupled_progress, jackknife_groups, progress

CORRECTIONS = ("none", "tis", "sc", "sc+tis")
PAIRS = (("sc", "tis"), ("sc+tis", "tis"), ("sc", "none"))
Z, MDE = 1.96, 2.8


def load(folders: list[Path]):
    """(y [R, D], {k: {correction: {seed: sketch}}}, {k: KL(μ‖π) per token}, {k: TIS clip fraction}); the KL and
    clip fraction are means over a setting's folders weighted by their new batches."""
    ref: dict[int, torch.Tensor] = {}
    batches: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    sums: dict[int, list[float]] = {}
    for folder in folders:
        offset = int(yaml.safe_load((folder / "config.yaml").read_text())["probe"].get("seed_offset") or 0)
        saved = torch.load(folder / "sketches.pt")
        for b, sk in enumerate(saved["reference"]["reward"]):
            ref.setdefault(offset + b, sk)
        rows = json.loads((folder / "probe.json").read_text())["rows"]
        for name, by_corr in saved["settings"].items():
            k = int(re.fullmatch(r"k=(\d+)", name).group(1))
            new = sum(
                offset + b not in batches.get(k, {}).get("none", {}) for b in range(len(by_corr["none"]["reward"]))
            )
            for c, v in by_corr.items():
                seen = batches.setdefault(k, {}).setdefault(c, {})
                for b, sk in enumerate(v["reward"]):
                    seen.setdefault(offset + b, sk)
            row = {r["correction"]: r for r in rows if r["setting"] == name}
            acc = sums.setdefault(k, [0.0, 0.0, 0.0])
            acc[0] += new * row["none"]["kl"]
            acc[1] += new * (row["tis"]["tis_clipfrac"] if "tis" in row else math.nan)
            acc[2] += new
    y = torch.stack([ref[i] for i in sorted(ref)]).double()
    kl = {k: a[0] / a[2] for k, a in sums.items()}
    clip = {k: a[1] / a[2] for k, a in sums.items()}
    return y, dict(sorted(batches.items())), kl, clip


def interval(v: float, se: float) -> dict:
    return {"value": v, "se": se, "low": v - Z * se, "high": v + Z * se, "mde": MDE * se}


def read_outs(y, batches) -> dict:
    z_all = batches[0]["none"]
    out = {"reference_batches": y.shape[0], "coupled_batches": len(z_all), "cells": {}, "pairs": {}}
    for k, by_corr in batches.items():
        if k == 0:
            continue
        seeds = sorted(set.intersection(set(z_all), *(set(v) for v in by_corr.values())))
        z = torch.stack([z_all[i] for i in seeds]).double()
        x = {c: torch.stack([v[i] for i in seeds]).double() for c, v in by_corr.items()}
        out["cells"][k] = {}
        for c, xc in x.items():
            b2, b2_se = jackknife_groups(coupled_bias2, xc, z, y, paired=2)
            out["cells"][k][c] = {
                "batches": len(seeds),
                "progress": interval(*jackknife_groups(coupled_progress, xc, z, y, paired=2)),
                "progress_uncoupled": interval(*jackknife_groups(progress, xc, y)),
                "bias2_rel": interval(b2, b2_se),
                "bias_rel": math.sqrt(max(b2, 0.0)),
            }
        out["pairs"][k] = {
            f"T({a}, {b})": interval(*jackknife_groups(coupled_gap, x[a], x[b], z, y, paired=3))
            for a, b in PAIRS
            if a in x and b in x
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
    lines = [
        f"Reference y: {res['reference_batches']} on-policy batches; coupled on-policy z: {res['coupled_batches']}.",
        "",
        "| k | KL(μ‖π)/token | TIS clip | correction | B | progress ratio (coupled) | uncoupled "
        "| bias² / ‖g‖² | bias / ‖g‖ |",
        "|---:|---:|---:|---|---:|---|---|---|---:|",
    ]
    for k, by_corr in res["cells"].items():
        for c in CORRECTIONS:
            if c in by_corr:
                cell = by_corr[c]
                clip_k = f"{100 * clip[k]:.2f}%" if math.isfinite(clip.get(k, math.nan)) else "–"
                lines.append(
                    f"| {k} | {kl[k]:.2e} | {clip_k} | {c} | {cell['batches']} | {fmt(cell['progress'])} | "
                    f"{fmt(cell['progress_uncoupled'])} | {fmt(cell['bias2_rel'], 4)} | {cell['bias_rel']:.3f} |"
                )
    lines += ["", "| k | " + " | ".join(f"T({a}, {b})" for a, b in PAIRS) + " |", "|---:|" + "---|" * len(PAIRS)]
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
        x = [k * (1 + 0.05 * (i - 1.5)) for k, _ in pts]
        ax1.errorbar(
            x, [p["value"] for _, p in pts], yerr=[Z * p["se"] for _, p in pts], marker="o", capsize=3, label=c
        )
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.axhline(0.9, color="grey", lw=0.8, ls="--")
    ax1.set(xscale="log", xlabel="lag k (sampler θ₁₆₋ₖ, trainer θ₁₆)", ylabel="progress ratio ⟨E ĝ, g⟩ / ‖g‖²")
    ax1.set_xticks(ks, [str(k) for k in ks])
    ax1.legend(title="correction (95% CI)")
    for i, (a, b) in enumerate(PAIRS):
        name = f"T({a}, {b})"
        pts = [(k, res["pairs"][k][name]) for k in ks if name in res["pairs"][k]]
        x = [k * (1 + 0.05 * (i - 1)) for k, _ in pts]
        ax2.errorbar(
            x, [p["value"] for _, p in pts], yerr=[Z * p["se"] for _, p in pts], marker="s", capsize=3, label=name
        )
    ax2.axhline(0.0, color="grey", lw=0.8)
    ax2.set(xscale="log", xlabel="lag k", ylabel="T(a, b) / ‖g‖²  (< 0: a closer to g)")
    ax2.set_xticks(ks, [str(k) for k in ks])
    ax2.legend()
    title = ", ".join(f"k={k}: {kl[k]:.1e}" for k in ks)
    fig.suptitle(
        f"Staleness as gradient bias, SmolLM2-135M after 16 GRPO steps (KL(μ‖π) per token: {title})", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(folder / "staleness_gradient.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path, help="write staleness_gradient.png there")
    ap.add_argument("--json", type=Path, help="write every number there")
    args = ap.parse_args()
    y, batches, kl, clip = load(args.folders)
    if 0 not in batches:
        raise SystemExit("no k=0 setting (the coupled on-policy batches) among the folders")
    res = read_outs(y, batches)
    v = verdicts(res)
    print(report(res, kl, clip, v))
    if args.json:
        args.json.write_text(json.dumps({"kl": kl, "tis_clipfrac": clip, **res, **v}, indent=2))
    if args.plot:
        plot(res, kl, args.plot)


if __name__ == "__main__":
    main()
