"""The full conditional-probe run's table, verdicts and figure, from the probe's run folders (sketches.pt, probe.json).

    PYTHONPATH=src python docs/results/conditional_probe_full/analyse.py outputs/exp2 \
        docs/results/conditional_probe_full
    PYTHONPATH=src python docs/results/conditional_probe_full/analyse.py outputs/exp2b \
        docs/results/conditional_probe_full rest     # the second sitting: table_rest.md, conditional_drift_rest.png

Reads the run folders of ``MAIN`` and ``BORROW`` under <runs> where present (conditional mode; a ``BORROW`` folder
has no `none` of its own: its rollouts are its source's, same seeds, checked against the two logs' per-batch token
counts and rewards) and <runs>/{ref_bf16_default,ref_bf16_bi}/, and writes table.md, table.json and
conditional_drift.png to the output folder (table_<suffix>.md ... with a suffix). Per (setting, correction): the
conditional drift along u (`none`'s leave-one-out direction, in units of its noise-corrected norm ‖E C‖;
``probe.projected_drift``) with its 95% t-interval (B − 1 degrees of freedom) and minimum detectable effect
(t_.975 + t_.80) × SE, the paired norm fraction √(‖E D‖² / ‖E C‖²) with its jackknife SE
(``topk_probe.paired_fraction``) and the pilot's verdict rule. The bf16 references' on-policy gradients are
projected on the float32 run's whole-sample u (one sketch map).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import torch
from scipy.stats import t as student
from torch import Tensor

from lit_rl.tools.probe import Cell, _drift_estimates, jackknife, projected_drift
from lit_rl.tools.topk_probe import paired_fraction

#: runs with a `none` of their own: the first sitting's (δ and σ = 1; σ = 2 and int8), the second's (the same)
MAIN = ("main", "main2", "main3", "main4")
#: runs without a `none` of their own, on another run's rollouts (same seeds): {folder: (TIS cap, source run)}
BORROW = {"cap12": ("1.2", "main"), "mis": ("", "main"), "cap12b": ("1.2", "main4")}
REFS = {
    "main": "float32, default kernels (main's 3 reference batches)",
    "ref_bf16_default": "bf16-mixed, default kernels",
    "ref_bf16_bi": "bf16-mixed, batch_invariant",
}


def mde_factor(n: int) -> float:
    """(t_{0.975, n−1} + t_{0.80, n−1}): 80% power at a two-sided 5% level, in SEs."""
    return float(student.ppf(0.975, n - 1) + student.ppf(0.80, n - 1))


def verdict(lo: float, hi: float) -> str:
    """The pilot's rule: drift left when the interval excludes 0; drift-free to 5% when inside [−0.05, 0.05]."""
    if lo > 0 or hi < 0:
        return "leaves drift" if not (-0.05 <= lo and hi <= 0.05) else "leaves drift (< 5%)"
    return "drift-free to 5%" if -0.05 <= lo and hi <= 0.05 else "not settled"


def cells_of(sketches: dict[str, list]) -> dict[str, Cell]:
    out = {}
    for name, modes in sketches.items():
        cell = Cell()
        cell.sketches = {m: list(v) for m, v in modes.items()}
        out[name] = cell
    return out


def batch_log(path: Path) -> list[str]:
    """The per-batch "setting batch b/B: ..., N tokens, reward r" of a probe's log (the rollouts' fingerprint)."""
    pat = re.compile(r"probe: (\S+) batch (\d+)/\d+: rollout [\d.]+ s, (\d+) tokens, reward ([\d.]+)")
    return [" ".join(m.groups()) for m in map(pat.search, path.read_text().splitlines()) if m]


def run_rows(folder: Path, cap: str, nones: dict | None = None) -> tuple[list[dict], dict]:
    """The rows of one conditional-mode run folder, and {setting: (u, ‖E C‖)} for projecting other runs. ``nones``:
    {setting: `none`'s sketches} from a run with the same rollouts, for a folder that has no `none`."""
    saved = torch.load(folder / "sketches.pt")
    info = {(r["setting"], r["correction"]): r for r in json.loads((folder / "probe.json").read_text())["rows"]}
    rows, units = [], {}
    for setting, sk in saved["settings"].items():
        cells = cells_of(sk if "none" in sk or not nones else {"none": nones[setting], **sk})
        along = projected_drift(cells, None, "conditional")
        c = torch.stack(cells["none"].sketches["conditional"]).double()
        n = c.shape[0]
        var = max((float(c.pow(2).sum()) - n * float(c.mean(0) @ c.mean(0))) / (n - 1), 0.0)
        units[setting] = (c.sum(0) / c.sum(0).norm(), math.sqrt(float(c.mean(0) @ c.mean(0)) - var / n))
        for name, cell in cells.items():
            d = torch.stack(cell.sketches["conditional"]).double()
            u, se = along[name]
            half = float(student.ppf(0.975, n - 1)) * se
            f, f_se = paired_fraction(d, c)
            if (setting, name) not in info:  # the borrowed `none`: its row is its own run's
                continue
            r = info[(setting, name)]
            rows.append(
                {"setting": setting, "correction": name, "cap": cap if "tis" in name else "", "batches": n,
                 "kl": r["kl"], "tis_clip": r["tis_clipfrac"], "mis_mask": r["mis_maskfrac"],
                 "along_u": u, "se": se, "lo": u - half, "hi": u + half, "mde": mde_factor(n) * se,
                 "norm_frac": f, "norm_frac_se": f_se, "drift2": r["cond_drift2"], "drift2_se": r["cond_drift2_se"],
                 "verdict": verdict(u - half, u + half) if name != "none" else "(the unit)"}
            )  # fmt: skip
    return rows, units


def reference_rows(folder: Path, units: dict, label: str) -> list[dict]:
    """The on-policy batches of a reference run, per mode: ‖E ĝ‖² (noise-corrected, jackknife SE) and the
    projection on each float32 setting's u in units of that setting's ‖E C‖ (mean ± SE over batches)."""
    saved = torch.load(folder / "sketches.pt")
    rows = []
    for mode, sketches in saved["reference"].items():
        if not sketches:
            continue
        y = torch.stack(sketches).double()
        est, se = jackknife(y, y, _drift_estimates(False))
        row = {"run": label, "mode": mode, "batches": y.shape[0], "drift2": est["drift2"], "drift2_se": se["drift2"]}
        for setting, (u, scale) in units.items():
            p = y @ u
            m, s = float(p.mean()) / scale, float(p.std() / math.sqrt(p.numel())) / scale
            half = float(student.ppf(0.975, p.numel() - 1)) * s
            norm = math.sqrt(max(est["drift2"], 0.0)) / scale  # the whole drift's norm, in the setting's unit
            row[setting] = {"along_u": m, "se": s, "lo": m - half, "hi": m + half, "norm": norm}
        rows.append(row)
    return rows


def label(r: dict) -> str:
    """The correction's name with SC's head (the engine's top-128, rescaled tail) and TIS's cap."""
    head = " top-128" if r["correction"].startswith("sc") else ""
    return r["correction"] + head + (f" cap {r['cap']}" if r["cap"] else "")


def fmt(v: float, d: int = 4) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.{d}f}"


def table(rows: list[dict], refs: list[dict], settings: list[str]) -> str:
    lines = [
        "| setting (KL(μ‖π)/token) | correction | B | cond. drift along u ± SE | 95% interval | MDE | "
        "norm fraction ± SE | tis clip / mis mask | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        name = label(r)
        clip = {"tis": r["tis_clip"], "mis": r["mis_mask"]}.get(r["correction"].split("+")[-1], math.nan)
        lines.append(
            f"| {r['setting']} ({r['kl']:.3f}) | {name} | {r['batches']} | {fmt(r['along_u'])} ± {fmt(r['se'])} | "
            f"[{fmt(r['lo'])}, {fmt(r['hi'])}] | {fmt(r['mde'])} | {fmt(r['norm_frac'], 3)} ± "
            f"{fmt(r['norm_frac_se'], 3)} | {'–' if not math.isfinite(clip) else f'{100 * clip:.1f}%'} | "
            f"{r['verdict']} |"
        )
    if refs:
        head = "| on-policy reference | mode | R | ‖E ĝ‖² ± SE | " + " | ".join(f"/ ‖E C‖ of {s}" for s in settings)
        lines += ["", head + " |", "|---|---|---:|---:|" + "---:|" * len(settings)]
        for r in refs:
            cols = [
                f"{fmt(r[s]['along_u'])} ± {fmt(r[s]['se'])} [{fmt(r[s]['lo'])}, {fmt(r[s]['hi'])}]; norm "
                f"{fmt(r[s]['norm'])}"
                for s in settings
            ]
            lines.append(
                f"| {r['run']} | {r['mode']} | {r['batches']} | {r['drift2']:.4g} ± {r['drift2_se']:.2g} | "
                + " | ".join(cols)
                + " |"
            )
    return "\n".join(lines) + "\n"


def _sq(z: Tensor) -> float:
    """‖E z‖² without its noise floor, from the rows of z [B, D] (float64)."""
    n, m = z.shape[0], z.mean(0)
    return float(m @ m) - max((float(z.pow(2).sum()) - n * float(m @ m)) / (n - 1), 0.0) / n


def paired(c: Tensor, a: Tensor, b: Tensor) -> dict:
    """Cell a against cell b on the same rollouts (rows paired by batch; c: `none`'s, the unit): the difference of
    their drifts along u (leave-one-out u, as ``projected_drift``) and of their norm fractions √(‖E ·‖² / ‖E C‖²)
    (delete-one jackknife over the batches), each with its SE and 95% t-interval."""
    n = c.shape[0]
    total, scale = c.sum(0), math.sqrt(_sq(c))
    diff = torch.stack([(total - c[i]) @ (a[i] - b[i]) / (total - c[i]).norm() for i in range(n)]) / scale
    t975 = float(student.ppf(0.975, n - 1))

    def frac_diff(idx: Tensor) -> float:
        c2 = _sq(c[idx])
        return math.sqrt(max(_sq(a[idx]), 0.0) / c2) - math.sqrt(max(_sq(b[idx]), 0.0) / c2)

    full = frac_diff(torch.arange(n))
    reps = [frac_diff(torch.tensor([j for j in range(n) if j != i])) for i in range(n)]
    mean = sum(reps) / n
    f_se = math.sqrt((n - 1) / n * sum((r - mean) ** 2 for r in reps))
    u, u_se = float(diff.mean()), float(diff.std()) / math.sqrt(n)
    return {"along_u": u, "along_u_se": u_se, "along_u_ci": (u - t975 * u_se, u + t975 * u_se),
            "norm": full, "norm_se": f_se, "norm_ci": (full - t975 * f_se, full + t975 * f_se)}  # fmt: skip


PAIRS = [
    ("tis cap 2", "sc top-128"),
    ("tis cap 1.2", "sc+tis top-128 cap 1.2"),
    ("tis cap 1.2", "tis cap 2"),
    ("mis", "sc top-128"),
    ("mis", "sc+mis top-128"),
    ("tis cap 2", "sc+tis top-128 cap 2"),
]


def comparisons(sketches: dict[str, dict[str, Tensor]]) -> str:
    """The paired table: for each setting and pair of ``PAIRS`` present, a − b along u and in norm fraction."""
    lines = [
        "| setting | a − b | along u: a − b ± SE | 95% interval | norm fraction: a − b ± SE | 95% interval |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for setting, cells in sketches.items():
        for a, b in PAIRS:
            if a in cells and b in cells:
                r = paired(cells["none"], cells[a], cells[b])
                lo, hi = r["along_u_ci"]
                flo, fhi = r["norm_ci"]
                lines.append(
                    f"| {setting} | {a} − {b} | {fmt(r['along_u'])} ± {fmt(r['along_u_se'])} | [{fmt(lo)}, {fmt(hi)}]"
                    f" | {fmt(r['norm'], 3)} ± {fmt(r['norm_se'], 3)} | [{fmt(flo, 3)}, {fmt(fhi, 3)}] |"
                )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Dot-and-interval (95%) of the conditional drift along u, one panel per setting, one line per correction."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig = Figure(figsize=(4.0 * len(settings), 3.6), dpi=110)
    FigureCanvasAgg(fig)
    for j, s in enumerate(settings):
        ax = fig.add_subplot(1, len(settings), j + 1)
        rs = [r for r in rows if r["setting"] == s and r["correction"] != "none"]
        labels = [label(r) for r in rs]
        ys = list(range(len(rs)))[::-1]
        ax.axvspan(-0.05, 0.05, color="0.9", label="±0.05")
        ax.axvline(0, color="0.4", lw=0.8)
        for y, r in zip(ys, rs):
            color = "C3" if r["verdict"].startswith("leaves") else ("C2" if r["verdict"].startswith("drift") else "C0")
            ax.errorbar([r["along_u"]], [y], xerr=[[r["along_u"] - r["lo"]], [r["hi"] - r["along_u"]]], fmt="o",
                        color=color, capsize=3)  # fmt: skip
        ax.set_yticks(ys, labels, fontsize=8)
        ax.set_title(f"{s} (KL {rs[0]['kl']:.3f})" if rs else s, fontsize=9)
        ax.set_xlabel("cond. drift along u / ‖E C‖ (none = 1)", fontsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


def main(runs: Path, out: Path, suffix: str = "") -> None:
    rows, units = [], {}
    for name in MAIN:
        if (runs / name / "probe.json").exists():
            r, u = run_rows(runs / name, "2")
            rows += r
            units.update(u)
    for name, (cap, source) in BORROW.items():
        if not (runs / name / "probe.json").exists():
            continue
        main_log, own_log = batch_log(runs / f"{source}.log"), batch_log(runs / f"{name}.log")
        if main_log[: len(own_log)] != own_log:
            raise SystemExit(f"{name}'s rollouts are not {source}'s: {own_log} against {main_log}")
        nones = {k: v["none"] for k, v in torch.load(runs / source / "sketches.pt")["settings"].items()}
        rows += run_rows(runs / name, cap, nones)[0]
    order = {s: i for i, s in enumerate(["delta=+0.3", "sigma=1", "sigma=2", "int8"])}
    rows.sort(key=lambda r: (order.get(r["setting"], 9), r["correction"] != "none", r["cap"] == "1.2"))
    refs = []
    for name, what in REFS.items():
        if (runs / name / "probe.json").exists():
            refs += reference_rows(runs / name, units, what)
    sketches = {}  # {setting: {label: [B, D]}}, every run's cells on the same rollouts
    for name, cap in [(m, "2") for m in MAIN] + [(k, v[0]) for k, v in BORROW.items()]:
        if (runs / name / "sketches.pt").exists():
            for setting, sk in torch.load(runs / name / "sketches.pt")["settings"].items():
                for corr, modes in sk.items():
                    key = label({"correction": corr, "cap": cap if "tis" in corr else ""})
                    sketches.setdefault(setting, {})[key] = torch.stack(modes["conditional"]).double()
    text = table(rows, refs, list(units)) + "\n" + comparisons(sketches)
    out.mkdir(parents=True, exist_ok=True)
    end = f"_{suffix}" if suffix else ""
    (out / f"table{end}.md").write_text(text)
    (out / f"table{end}.json").write_text(json.dumps({"rows": rows, "references": refs}, indent=1))
    plot(rows, out / f"conditional_drift{end}.png")
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:4])
