"""A gradient-bias probe on the real model: what each train–inference correction does to the policy gradient.

At a fixed policy and a fixed prompt set, draw many rollout batches from a (mismatched) sampler and compute
each correction's batch gradient ĝ with the trainer's own parts and update path — the run's data, policy and
kernel mode (``run.train.assemble``), ``build_module`` (from the Hydra config), ``build_batch`` (rewards,
advantages), ``start_update`` and ``accumulate_gradients`` (log-probs, ``policy_loss``, ``correct``,
``finish_loss``, ``reduce_loss``), as ``lit_rl.expectation.batch_gradient`` does on tabular policies. The
reference is the on-policy gradient g = E_π[ĝ] (sampler = trainer, many batches). Per correction × mismatch
setting the probe reports, with standard errors:

* bias ‖E_μ[ĝ] − g‖ (relative to ‖g‖), estimated without its noise floor:
  ‖ḡ_μ − ḡ_π‖² − tr Σ_μ / B − tr Σ_π / R is unbiased for the squared bias (B, R: batches; tr Σ: the
  per-batch variance E‖ĝ − Eĝ‖², estimated with n − 1);
* cosine of E_μ[ĝ] to g, from ḡ_μ·ḡ_π (unbiased for the two samples are independent) over the
  noise-corrected norms;
* variance tr Σ_μ of one batch's gradient and its MSE E‖ĝ − g‖² = bias² + variance (relative to ‖g‖²);
* drift under a constant reward: the same gradient with every advantage forced to 1 (A = 1 on every
  sequence, as ``tests/test_corrections_expectation.py`` does, so a group baseline cannot make it empty),
  ‖E_μ[ĝ_{A=1}]‖ relative to ‖g‖, again without its noise floor. On-policy and for a reduction that does
  not divide by the sampled length (REINFORCE's ``seq_mean_token_sum``, Dr.GRPO's ``constant``) its true
  value is 0; ``sc``, ``sc+tis`` and ``sc+mis`` keep it 0 under any mismatch when the engine's recorded
  head covers the mismatch (a non-proportional tail outside the top-k leaves a residual:
  ``corrections.centering_term``).

Standard errors are delete-one jackknife estimates over the batches of both samples (Efron & Stein 1981).
Memory: a gradient of SmolLM2-135M is 540 MB in float32, so no gradient is kept. Each is compressed at once
by a fixed random linear map S: R^n → R^D (a CountSketch: coordinate i goes to bucket i mod D with a random
sign, D = ``sketch_dim``, Charikar, Chen & Farach-Colton 2002), for which E_S[⟨Sx, Sy⟩] = ⟨x, y⟩ and the
relative error of a squared norm is about √(2/D) (0.4% at D = 2^17); its exact squared norm is kept beside.
Every statistic is then computed from the B sketches of each cell, so the jackknife needs no second pass.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import Tensor

from .probe_plot import plot_rows  # noqa: F401  (the report's figure; importable from here as before)
from .sketch import GradientSketch  # noqa: F401  (importable from here as before)
from .staleness_probe import batch_variance, check_sampler_folder, load_sampler_policy, noise_free_norm2
from .topk_probe import centring_stats, check_top_ks, format_top_k, plot_top_k, top_k_modules, top_k_rows

# ---------------------------------------------------------------------------------------------- statistics


@dataclass
class Sample:
    """The B per-batch gradient sketches of one cell (a correction at a sampler), float64 [B, D]."""

    sketches: Tensor

    @property
    def n(self) -> int:
        return self.sketches.shape[0]

    def moments(self) -> tuple[Tensor, float, int]:
        """(mean [D], Σ_b ‖x_b‖², n)."""
        x = self.sketches
        return x.mean(0), float(x.pow(2).sum()), x.shape[0]


def _estimates(mx: Tensor, s2x: float, nx: int, my: Tensor, s2y: float, ny: int) -> dict[str, float]:
    """Every reported statistic from the sufficient statistics of a cell X (mean, Σ‖x‖², n) and the reference
    Y (on-policy, independent of X). All relative ones divide by ‖g‖, the reference's noise-corrected norm."""
    var_x = max((s2x - nx * float(mx @ mx)) / (nx - 1), 0.0)  # tr Σ_X per batch (unbiased)
    var_y = max((s2y - ny * float(my @ my)) / (ny - 1), 0.0)
    g2 = float(my @ my) - var_y / ny  # ‖g‖², the reference's squared norm without its noise
    mean2 = float(mx @ mx) - var_x / nx  # ‖E ĝ‖²
    diff = mx - my
    bias2 = float(diff @ diff) - var_x / nx - var_y / ny
    out = {"bias2": bias2, "var": var_x, "g2": g2}

    def rel(v: float) -> float:  # relative to |g|^2; no reference signal: no ratio
        return v / g2 if g2 > 0 else math.nan

    out.update(
        {
            "bias2_rel": rel(bias2),
            "bias_rel": math.sqrt(max(rel(bias2), 0.0)) if g2 > 0 else math.nan,
            "cosine": float(mx @ my) / math.sqrt(mean2 * g2) if mean2 > 0 and g2 > 0 else math.nan,
            "var_rel": rel(var_x),
            "mse_rel": rel(max(bias2, 0.0) + var_x),
        }
    )
    return out


def jackknife(x: Tensor, y: Tensor, fn: Callable[..., dict[str, float]] = _estimates) -> tuple[dict, dict]:
    """(estimates, standard errors) of ``fn`` over two independent samples x [B, D], y [R, D] (float64):
    the delete-one jackknife, SE² = Σ_samples (m − 1)/m Σ_i (θ_(−i) − θ̄)² over both samples (Efron & Stein
    1981). Needs B, R >= 3."""
    x, y = x.double(), y.double()
    mx, my = x.mean(0), y.mean(0)
    s2x, s2y = float(x.pow(2).sum()), float(y.pow(2).sum())
    nx, ny = x.shape[0], y.shape[0]
    full = fn(mx, s2x, nx, my, s2y, ny)
    var = {k: 0.0 for k in full}
    for sample, m, s2, n, other in ((x, mx, s2x, nx, "x"), (y, my, s2y, ny, "y")):
        reps = []
        for i in range(n):
            mi = (n * m - sample[i]) / (n - 1)
            s2i = s2 - float(sample[i] @ sample[i])
            reps.append(fn(mi, s2i, n - 1, my, s2y, ny) if other == "x" else fn(mx, s2x, nx, mi, s2i, n - 1))
        for k in full:
            vals = [r[k] for r in reps]
            mean = sum(vals) / n
            var[k] += (n - 1) / n * sum((v - mean) ** 2 for v in vals)
    return full, {k: math.sqrt(v) for k, v in var.items()}


def reference_summary(y: Tensor) -> dict[str, float]:
    """The on-policy reference's own precision: ‖g‖ (noise-corrected), the root-mean-square error of its mean
    √(tr Σ / R) relative to ‖g‖, and R."""
    y = y.double()
    n, var, g2 = y.shape[0], batch_variance(y), noise_free_norm2(y)
    if g2 <= 0:  # the reference's mean is noise only (or zero: every advantage 0): no relative scale
        return {"norm": 0.0, "se_rel": math.nan, "var_rel": math.nan, "batches": n, "se": math.sqrt(var / n)}
    return {
        "norm": math.sqrt(g2),
        "se_rel": math.sqrt(var / n / g2),
        "var_rel": var / g2,
        "batches": n,
        "se": math.sqrt(var / n),
    }


# --------------------------------------------------------------------------------------------- the probe


@dataclass
class Cell:
    """The gradients of one correction at one sampler: sketches per mode (``MODES``), the correction's metrics
    (means over batches of the trainer's train/* values) and the seconds spent."""

    sketches: dict[str, list[Tensor]] = field(default_factory=lambda: {m: [] for m in MODES})
    norms2: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})
    metrics: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    token_stats: list[dict] = field(default_factory=list)  # per batch, with probe.sc_top_ks (tools.topk_probe)

    def add_metrics(self, means: dict[str, float]) -> None:
        for k, v in means.items():
            self.metrics.setdefault(k, []).append(float(v))

    def metric(self, name: str) -> float:
        vals = self.metrics.get(name, [])
        return sum(vals) / len(vals) if vals else math.nan


MODES = ("reward", "constant", "conditional")


def own_head(rb, module):
    """``rb`` with the engine's recorded top-k cut to the head ``module`` asked for (its
    ``sampling.logprobs_top_k``), when the probe recorded more (the conditional mode records the whole vocabulary);
    a module that asked for none keeps the record (it does not read it)."""
    k = int(module.sampling.logprobs_top_k)
    if not k or rb.topk_ids is None or rb.topk_ids.shape[-1] <= k:
        return rb
    return replace(rb, topk_ids=rb.topk_ids[..., :k], topk_logprobs=rb.topk_logprobs[..., :k])


def batch_gradients(module, rb, sketch: GradientSketch, modes=MODES):
    """The module's gradient on rollout batch ``rb`` through the real update path (``start_update``, then
    ``accumulate_gradients``), sketched, per mode: "reward" (the batch's own advantages), "constant" (every
    advantage forced to 1) and "conditional" (the same drift's per-prefix conditional expectation from the full
    μ(h) and π(h), ``tools.conditional``). Returns ({mode: (sketch, ‖g‖²)}, the trainer's train/* metric means;
    with the conditional mode alone, their per-prefix expectations, ``conditional.conditional_metrics``)."""
    from .conditional import conditional_backward

    out, means, conditional = {}, {}, {}  # the trainer's metrics, else the conditional mode's expectations of them
    own = own_head(rb, module)
    module.start_update(own)
    for mode in modes:
        module.policy.zero_grad(set_to_none=True)
        if mode == "conditional":
            conditional_backward(module, replace(rb, advantages=torch.ones_like(rb.advantages)), None, conditional)
        else:
            batch = own if mode == "reward" else replace(own, advantages=torch.ones_like(own.advantages))
            stats, _ = module.accumulate_gradients(batch)
            means = means or stats.means()
        out[mode] = sketch()
    module.policy.zero_grad(set_to_none=True)
    return out, means or conditional


def run_cells(
    modules: dict[str, object],
    engine,
    datamodule,
    examples,
    sampling,
    batches: int,
    sketch: GradientSketch,
    step_offset: int = 0,
    modes=MODES,
    log: Callable[[str], None] = print,
    label: str = "",
    top_ks=(),
) -> dict[str, Cell]:
    """Draw ``batches`` rollout batches of ``examples`` (G each) from ``engine`` and record every module's
    gradients on each (the same rollouts for every correction; a module listed twice is computed once), with
    ``top_ks`` the tokens' ``topk_probe.centring_stats`` too. Batch b samples with the seeds of step
    ``step_offset + b``. Returns {correction: Cell}."""
    cells = {name: Cell() for name in modules}
    for b in range(batches):
        t0 = time.perf_counter()
        with torch.no_grad():
            scored = datamodule.collect(engine, examples, sampling, step=step_offset + b)
        t_roll = time.perf_counter() - t0
        stats = centring_stats(next(iter(modules.values())), scored, top_ks) if top_ks else None
        cells[next(iter(cells))].token_stats += [stats] if stats else []
        done = {}
        for name, module in modules.items():
            t1 = time.perf_counter()
            if id(module) not in done:
                done[id(module)] = batch_gradients(module, module.build_batch(scored), sketch, modes)
            grads, means = done[id(module)]
            cell = cells[name]
            for mode, (sk, sq) in grads.items():
                cell.sketches[mode].append(sk)
                cell.norms2[mode].append(sq)
            means["rollout/reward_mean"] = float(scored.rewards.mean())
            means["rollout/tokens"] = float(scored.rollouts.response_mask.sum())
            cell.add_metrics(means)
            cell.seconds += time.perf_counter() - t1
        log(
            f"probe: {label} batch {b + 1}/{batches}: rollout {t_roll:.1f} s, "
            f"{int(scored.rollouts.response_mask.sum())} tokens, reward {float(scored.rewards.mean()):.3f}, "
            f"gradients {time.perf_counter() - t0 - t_roll:.1f} s"
        )
    return cells


def projected_drift(
    cells: dict[str, Cell], reference: Cell | None = None, mode: str = "constant"
) -> dict[str, tuple[float, float]]:
    """The constant-reward drift of each correction along the uncorrected drift's direction, with its SE.

    The drift of ``none`` at a batch splits exactly into its centring term C_b = ĝ_none − ĝ_sc (SC's
    Σ_t E_μ[∇log π | prefix], the Rao–Blackwellised drift: no token-sampling noise) and a zero-mean rest. The
    direction u_(−b) = mean of C over the other batches, normalised, is therefore a sharp estimate of where
    the drift points, and independent of batch b; p_b = ⟨u_(−b), ĝ_b⟩ then has mean ⟨u, E ĝ⟩ and the small
    variance of one direction instead of the whole space's. Returns {correction: (mean p / ‖E C‖, SE / ‖E C‖)}
    and, with ``reference``, the on-policy batches projected on the setting's whole-sample u ("on-policy").
    Empty without both ``none`` and ``sc`` (constant mode). ``mode="conditional"``: the same on the conditional
    sketches, where ``none``'s own is C (the full vocabulary's Σ_t E_μ[∇log π | prefix], no top-k)."""
    if not ("none" in cells and cells["none"].sketches[mode] and (mode == "conditional" or "sc" in cells)):
        return {}
    c = torch.stack(cells["none"].sketches[mode]).double()  # [B, D] centring terms
    if mode == "constant":
        c = c - torch.stack(cells["sc"].sketches[mode]).double()
    n = c.shape[0]
    var_c = max((float(c.pow(2).sum()) - n * float(c.mean(0) @ c.mean(0))) / (n - 1), 0.0)
    scale2 = float(c.mean(0) @ c.mean(0)) - var_c / n  # ‖E C‖², noise-corrected
    if not scale2 > 0:  # no drift direction to resolve (e.g. on-policy: C = 0 up to rounding)
        return {}
    scale = math.sqrt(scale2)
    total = c.sum(0)
    units = [(total - c[b]) / (total - c[b]).norm() for b in range(n)]
    out = {}
    for name, cell in cells.items():
        x = torch.stack(cell.sketches[mode]).double()
        p = torch.stack([units[b] @ x[b] for b in range(n)])
        out[name] = (float(p.mean()) / scale, float(p.std() / math.sqrt(n)) / scale)
    if reference is not None and reference.sketches[mode]:
        u = total / total.norm()
        y = torch.stack(reference.sketches[mode]).double() @ u
        out["on-policy"] = (float(y.mean()) / scale, float(y.std() / math.sqrt(y.numel())) / scale)
    return out


def summarize_cells(reference: Cell, settings: dict[str, dict[str, Cell]]) -> list[dict]:
    """One row per (setting, correction): the realised KLs and every statistic with its jackknife SE.
    ``reference`` holds the on-policy batches (correction ``none``)."""
    ref_r = torch.stack(reference.sketches["reward"]).double() if reference.sketches["reward"] else None
    rows = []
    for setting, cells in settings.items():
        projected = {mode: projected_drift(cells, reference, mode) for mode in DRIFT_MODES}
        for name, cell in cells.items():
            row = {
                "setting": setting,
                "correction": name,
                "batches": len(cell.metrics.get("rollout/tokens", [])),
                "kl": cell.metric("train/train_inference_kl"),
                "kl_reverse": cell.metric("train/train_inference_kl_reverse"),
                "tis_clipfrac": cell.metric("train/tis_clipfrac"),
                "mis_maskfrac": cell.metric("train/mis_maskfrac"),
                "tokens_per_batch": cell.metric("rollout/tokens"),
                "seconds": cell.seconds,
            }
            if ref_r is not None and cell.sketches["reward"]:
                est, se = jackknife(torch.stack(cell.sketches["reward"]).double(), ref_r)
                for k in ("bias_rel", "bias2_rel", "cosine", "var_rel", "mse_rel", "bias2", "var", "g2"):
                    row[k], row[k + "_se"] = est[k], se[k]
            for mode, prefix in DRIFT_MODES.items():
                _add_drift(row, cell.sketches[mode], ref_r, projected[mode].get(name), prefix)
            rows.append(row)
        if any("on-policy" in p for p in projected.values()):
            row = {
                "setting": setting,
                "correction": "(on-policy reference)",
                "batches": max(len(reference.sketches[m]) for m in DRIFT_MODES),
                "kl": reference.metric("train/train_inference_kl"),
                "kl_reverse": reference.metric("train/train_inference_kl_reverse"),
                "tis_clipfrac": math.nan,
                "mis_maskfrac": math.nan,
            }
            for mode, prefix in DRIFT_MODES.items():
                if "on-policy" in projected[mode]:
                    row[prefix + "drift_proj"], row[prefix + "drift_proj_se"] = projected[mode]["on-policy"]
            rows.append(row)
    return rows


#: the drift modes (every advantage 1) and the prefix of their statistics' names in a row
DRIFT_MODES = {"constant": "", "conditional": "cond_"}


def _add_drift(row: dict, sketches: list[Tensor], ref_r: Tensor | None, projected, prefix: str) -> None:
    """Add one drift mode's statistics to ``row``: drift² (noise floor removed), relative to the real-reward
    reference's ‖g‖ when measured (so drift and bias share a scale), and the projection along u (or nothing)."""
    if not sketches:
        return
    x = torch.stack(sketches).double()
    dest, dse = jackknife(x, ref_r if ref_r is not None else x, _drift_estimates(ref_r is not None))
    for k in ("drift_rel", "drift2_rel", "drift2"):
        row[prefix + k], row[prefix + k + "_se"] = dest[k], dse[k]
    if projected is not None:
        row[prefix + "drift_proj"], row[prefix + "drift_proj_se"] = projected


def _drift_estimates(relative: bool = True) -> Callable[..., dict[str, float]]:
    """The drift statistic for ``jackknife``: ‖E ĝ_{A=1}‖² with the noise floor removed (X: a cell's
    constant-reward sketches), and relative to ‖g‖² of Y (the on-policy real-reward sketches) when
    ``relative``."""

    def fn(mx, s2x, nx, my, s2y, ny):
        var_x = max((s2x - nx * float(mx @ mx)) / (nx - 1), 0.0)
        drift2 = float(mx @ mx) - var_x / nx
        var_y = max((s2y - ny * float(my @ my)) / (ny - 1), 0.0)
        g2 = float(my @ my) - var_y / ny
        if not relative or g2 <= 0:  # no reward signal to compare with: absolute values only
            return {"drift2": drift2, "drift2_rel": math.nan, "drift_rel": math.nan}
        return {"drift2": drift2, "drift2_rel": drift2 / g2, "drift_rel": math.sqrt(max(drift2, 0.0) / g2)}

    return fn


def format_rows(rows: list[dict], reference: dict | None, ref_drift: dict | None = None) -> str:
    """The probe's markdown table (± = one jackknife standard error) and the reference's own precision."""

    def pm(row, k, digits=3):
        v, e = row.get(k, math.nan), row.get(k + "_se", math.nan)
        return "n/a" if not math.isfinite(v) else f"{v:.{digits}f} ± {e:.{digits}f}"

    lines = []
    if reference is not None:
        lines.append(
            f"Reference (on-policy, correction none): ‖g‖ = {reference['norm']:.4g} from "
            f"{reference['batches']} batches; the standard error of that mean is {reference['se_rel']:.3f} ‖g‖ "
            f"(rms), one batch's variance {reference['var_rel']:.2f} ‖g‖²."
        )
    if ref_drift is not None:
        lines.append(
            f"On-policy drift under A = 1 (expected 0): ‖E ĝ‖² = {ref_drift['drift2']:.4g} ± "
            f"{ref_drift['drift2_se']:.4g} (noise floor removed)."
        )
    lines += [
        "",
        "| setting | KL(μ‖π) | KL(π‖μ) | correction | drift along u / ‖E C‖ | drift² (A=1) | cond. drift along "
        "u / ‖E C‖ | cond. drift² | bias / ‖g‖ | cosine | var / ‖g‖² | MSE / ‖g‖² | tis clip | mis mask |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['kl']:.4f} | {r['kl_reverse']:.4f} | {r['correction']} | {pm(r, 'drift_proj')} | "
            f"{pm(r, 'drift2', 1)} | {pm(r, 'cond_drift_proj', 4)} | {pm(r, 'cond_drift2', 2)} | "
            f"{pm(r, 'bias_rel')} | {pm(r, 'cosine')} | {pm(r, 'var_rel', 2)} | "
            f"{pm(r, 'mse_rel', 2)} | {_pct(r['tis_clipfrac'])} | {_pct(r['mis_maskfrac'])} |"
        )
    lines += [
        "",
        "- drift along u: the constant-reward (A = 1) gradient projected on the uncorrected drift's direction u "
        "(from the other batches' centring terms C = ĝ_none − ĝ_sc), in units of ‖E C‖: `none` should read ~1, "
        "a drift-free correction 0 (± one SE over batches); the on-policy reference projected on the same u.",
        "- drift² (A = 1): ‖E ĝ‖² over the whole parameter space, its noise floor removed (0 when drift-free).",
        "- cond.: the same two from the conditional mode (each prefix's E_μ[ĝ | prefix] from the full μ and π, no "
        "token noise); u and C from `none`'s own conditional gradients (the full vocabulary, no top-k).",
        "- bias, cosine, var, MSE: the real-reward gradient against the on-policy reference g (n/a when not measured).",
    ]
    return "\n".join(lines) + "\n"


def _pct(v: float) -> str:
    return "–" if not math.isfinite(v) else f"{100 * v:.2f}%"


# ------------------------------------------------------------------------------------------- the recipe

ENGINE_KNOBS = ("logit_noise", "temperature_offset", "dtype", "int8_roundtrip")
REFERENCE_STEP = 1_000_000  # the reference's batches sample with seeds of steps >= this: apart from the settings'


def correction_config(base: dict, name: str) -> dict:
    """The ``correction`` group of correction ``name`` (``none``, ``tis``, ``sc+mis`` ...) with the fields
    (cap, band, levels, top_k) of ``base``: the parts ``corrections.CORRECTIONS[name]`` lists are switched on,
    the rest off. Raises UnknownChoice (a ValueError) for a name that is not a correction."""
    from ..corrections import CORRECTIONS

    parts = CORRECTIONS[name]
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    out["name"] = name
    for comp in ("tis", "mis", "sc"):
        out[comp] = dict(out.get(comp) or {}, enabled=comp in parts)
    return out


def check_probe(cfg) -> None:
    """ConfigError for a bad ``probe`` value, before any model loads. The keys and types are the schema's
    (``schema.ProbeConfig``: an unknown key fails at compose time, naming it); this checks the ranges, the
    names and that each setting's engine fields pass ``config.validate`` merged into the run."""
    from ..config import _check, _check_int
    from ..corrections import CORRECTIONS

    p = cfg.probe
    _check(
        len(p.corrections) >= 1 and all(c in CORRECTIONS for c in p.corrections),
        "probe.corrections",
        list(p.corrections),
        f"a non-empty list from {list(CORRECTIONS)}",
    )
    for key, low in (("batches", 3), ("reference_batches", 3)):
        _check_int(p[key], f"probe.{key}", low, " (the jackknife leaves one batch out)")
    _check_int(p.sketch_dim, "probe.sketch_dim", 1)
    _check_int(p.seed_offset, "probe.seed_offset", 0)
    _check(len(p.settings) >= 1, "probe.settings", p.settings, "a non-empty list of {name, engine: {...}}")
    names = []
    for i, s in enumerate(p.settings):
        _check(not OmegaConf.is_missing(s, "name"), f"probe.settings[{i}]", s, "needs a name")
        names.append(s.name)
        if s.sampler is not None:  # a stale sampler's weights: checked before any model loads
            check_sampler_folder(s.sampler, cfg.model, f"probe.settings[{i}].sampler")
    _check(len(set(names)) == len(names), "probe.settings", names, "names must be distinct")
    modes = list(p.modes)
    _check(
        len(modes) >= 1 and set(modes) <= set(MODES) and len(set(modes)) == len(modes),
        "probe.modes",
        modes,
        f"a non-empty list from {list(MODES)}",
    )
    if "conditional" in modes:  # a per-prefix form: per-token weights, the rescaled tail (tools.conditional)
        from .conditional import check_conditional

        check_conditional(cfg.correction, list(p.corrections))
    check_top_ks(cfg)
    if set(modes) & set(DRIFT_MODES) and cfg.loss.reduction not in ("seq_mean_token_sum", "constant"):
        print(
            f"lit_rl: note: loss.reduction={cfg.loss.reduction} divides by the sampled length, so even the "
            f"on-policy drift under A = 1 is not 0 in expectation; compare each drift with the on-policy row",
            flush=True,
        )


def setting_config(cfg, setting) -> DictConfig:
    """A copy of the run's config with the mismatch ``setting``'s engine fields (those not null) set."""
    c = copy.deepcopy(cfg)
    with open_dict(c):
        for k, v in setting.engine.items():
            if v is not None:
                c.engine[k] = v
    return c


def prepare_probe(cfg, out_dir) -> tuple[dict[str, DictConfig], Path]:
    """Check the config and the output folder before any model loads, then fill the auto settings as a run does.

    ``config.validate``, the probe's fields (``check_probe``), the embedded engine, each mismatch setting merged
    into the config and validated; the folder must not hold a probe. Writes config.yaml, fills the auto settings
    (``run.resolve.resolve_settings``: trainer.precision, threads, the engine) and sets the seed. Returns
    ({setting name: its config}, the output folder). Raises ConfigError."""
    import lightning as L

    from ..config import ConfigError, validate
    from ..run.resolve import resolve_settings

    validate(cfg)
    check_probe(cfg)
    with open_dict(cfg):
        cfg.engine.name = "torch" if cfg.engine.name == "auto" else cfg.engine.name
    if cfg.engine.name != "torch":
        raise ConfigError(f"engine={cfg.engine.name}: the probe samples with the embedded engine (engine=torch)")
    setting_cfgs = {s.name: setting_config(cfg, s) for s in cfg.probe.settings}
    for c in setting_cfgs.values():
        validate(c)
    out = Path(out_dir)
    if (out / "probe.md").exists():
        raise ConfigError(f"output folder {out} already holds a probe (probe.md); choose another (hydra.run.dir=...)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    resolve_settings(cfg)  # trainer.precision, threads and the engine: auto resolved as a training run does
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    return setting_cfgs, out


def with_correction(cfg, name: str) -> DictConfig:
    """A copy of ``cfg`` whose ``correction`` is correction ``name`` with ``cfg``'s fields (``correction_config``)."""
    from ..schema import CorrectionConfig, config_of

    c = copy.deepcopy(cfg)
    c.correction = config_of(
        CorrectionConfig, correction_config(OmegaConf.to_container(cfg.correction, resolve=True), name)
    )
    return c


def reference_config(cfg) -> DictConfig:
    """The on-policy sampler's config: ``cfg`` with every mismatch knob of the engine off and correction none."""
    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.engine.update(logit_noise=0.0, temperature_offset=0.0, dtype=None, int8_roundtrip=False)
    return with_correction(ref_cfg, "none")


def measure(cfg, parts, setting_cfgs: dict[str, DictConfig], examples) -> tuple[Cell, dict, GradientSketch]:
    """The probe's gradients around the run's parts (``run.train.assemble`` of ``reference_config``: its module
    samples on-policy) on the fixed prompts ``examples``: the reference's cells, then every setting's, each
    correction's module built by the run's ``build_module`` around the same policy. Returns (the reference's
    cell, {setting: {correction: Cell}}, the sketch)."""
    from ..run.train import build_module

    policy, tok, dm = parts.policy, parts.tokenizer, parts.datamodule
    modules = {name: build_module(with_correction(cfg, name), policy, tok) for name in cfg.probe.corrections}
    modules.update(top_k_modules(cfg, modules, build_module, policy, tok))  # probe.sc_top_ks: sc@k=K rows
    top_ks = tuple(cfg.probe.sc_top_ks or ())
    sampling = max((m.sampling for m in modules.values()), key=lambda s: s.logprobs_top_k)
    sketch = GradientSketch(list(policy.parameters()), cfg.probe.sketch_dim, cfg.probe.sketch_seed)
    modes = tuple(cfg.probe.modes)
    if "conditional" in modes:  # the engine records its whole distribution μ(h); each module cuts its own head
        sampling = replace(sampling, logprobs_top_k=policy.get_output_embeddings().weight.shape[0])

    def log(msg: str) -> None:
        print(msg, flush=True)

    n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    log(
        f"probe: {len(cfg.probe.settings)} settings x {len(modules)} corrections x {cfg.probe.batches} batches of "
        f"{n_seq} sequences, modes {list(modes)}; reference {cfg.probe.reference_batches} on-policy batches; "
        f"{sketch.numel / 1e6:.1f}M parameters sketched to {sketch.dim}"
    )
    # the trainer's precision: bf16-mixed runs sampling and gradients under bf16 autocast, as Lightning would
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=str(cfg.trainer.precision).startswith("bf16"))
    with autocast:
        reference = run_cells(
            {"none": parts.module},
            parts.module.engine,
            dm,
            examples,
            sampling,
            cfg.probe.reference_batches,
            sketch,
            REFERENCE_STEP + cfg.probe.seed_offset,
            modes,
            log,
            "reference",
            top_ks=top_ks,
        )["none"]
        results = {}
        for i, s in enumerate(cfg.probe.settings):  # a setting's own sampler weights: staleness_probe
            sampler = (
                policy
                if s.sampler is None
                else load_sampler_policy(parts.spec, s.sampler, policy, tok, f"probe.settings[{i}].sampler")
            )
            engine = build_module(with_correction(setting_cfgs[s.name], "none"), sampler, tok).engine
            results[s.name] = run_cells(
                modules,
                engine,
                dm,
                examples,
                sampling,
                cfg.probe.batches,
                sketch,
                cfg.probe.seed_offset,
                modes,
                log,
                s.name,
                top_ks=top_ks,
            )
            engine.close()
    return reference, results, sketch


def write_report(cfg, out: Path, reference: Cell, results: dict, sketch, n_prompts: int, t_start: float) -> list[dict]:
    """Write sketches.pt, probe.md, probe.json and probe.png under ``out`` and print the table (``n_prompts``
    fixed prompts; the wall time since ``t_start``); returns the rows."""
    import json
    import os

    from ..run.hardware import describe_machine

    torch.save(
        {
            "reference": reference.sketches,
            "settings": {k: {c: v.sketches for c, v in cells.items()} for k, cells in results.items()},
        },
        out / "sketches.pt",
    )
    rows = summarize_cells(reference, results)
    ref = ref_drift = None
    if reference.sketches["reward"]:
        ref = reference_summary(torch.stack(reference.sketches["reward"]).double())
    if reference.sketches["constant"]:
        yc = torch.stack(reference.sketches["constant"]).double()
        est, se = jackknife(yc, yc, _drift_estimates(False))
        ref_drift = {"drift2": est["drift2"], "drift2_se": se["drift2"]}
    wall = time.perf_counter() - t_start
    n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    samplers = {s.name: str(s.sampler) for s in cfg.probe.settings if s.sampler is not None}  # stale samplers
    notes = [f"batches from seed offset {cfg.probe.seed_offset}"] if cfg.probe.seed_offset else []
    runs_on = "".join(
        f"; {n}" for n in notes + [f"setting {k} samples with the weights of {v}" for k, v in samplers.items()]
    )
    header = (
        f"# Gradient-bias probe: {cfg.model.name_or_path}, algo={cfg.algo.name}, task={cfg.task.name}\n\n"
        f"{n_prompts} fixed prompts x G={cfg.rollout.group_size} = {n_seq} sequences per batch, "
        f"<= {cfg.sampling.max_new_tokens} new tokens, temperature {cfg.sampling.temperature}; "
        f"{cfg.probe.batches} batches per setting ({cfg.probe.batches * n_seq} sequences), reference "
        f"{cfg.probe.reference_batches} on-policy batches ({cfg.probe.reference_batches * n_seq} sequences); "
        f"gradients sketched to D = {sketch.dim} of {sketch.numel} parameters; ± = one jackknife standard "
        f"error; drift = the gradient with every advantage forced to 1; trainer precision "
        f"{cfg.trainer.precision}{runs_on}. Wall time {wall / 60:.1f} min "
        f"({describe_machine()}).\n\n"
    )
    top_k = top_k_rows(cfg, reference, results)  # probe.sc_top_ks (tools.topk_probe); [] without
    text = header + format_rows(rows, ref, ref_drift) + format_top_k(top_k)
    (out / "probe.md").write_text(text)
    report = {"reference": ref, "reference_drift": ref_drift, "rows": rows, "top_k": top_k, "wall_s": wall,
              "seed_offset": int(cfg.probe.seed_offset), "samplers": samplers}  # fmt: skip
    (out / "probe.json").write_text(json.dumps(report, indent=2))
    plot_rows(rows, os.fspath(out / "probe.png"))
    plot_top_k(top_k, os.fspath(out / "topk.png"))
    print(text, flush=True)
    return rows


def run_probe(cfg, out_dir) -> list[dict]:
    """Run the probe the config describes and write probe.md, probe.json and probe.png under ``out_dir``.

    The policy, its data and its kernels are the run's own (``run.train.assemble``, as ``build`` makes them for
    training: the same checks, before the weights load). Raises ConfigError for a bad config (the train fields
    via ``config.validate``, each mismatch setting merged into it, and ``probe``) or an ``out_dir`` that already
    holds a probe's results."""
    from ..run.train import assemble

    setting_cfgs, out = prepare_probe(cfg, out_dir)
    t_start = time.perf_counter()
    parts = assemble(reference_config(cfg))  # the data, the policy (checked), the kernel mode, the on-policy module
    try:
        parts.policy.eval()  # no dropout: the same policy for every batch (SmolLM2 has none; a checkpoint might)
        examples = parts.datamodule.prompts_for(0)
        reference, results, sketch = measure(cfg, parts, setting_cfgs, examples)
    finally:
        parts.kernels.__exit__(None, None, None)
    return write_report(cfg, out, reference, results, sketch, len(examples), t_start)
