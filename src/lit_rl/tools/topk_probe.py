"""The probe's top-k rows: score centering with several heads k on the same rollouts, against the full drift.

``probe.sc_top_ks: [8, 32, 128, 512]`` adds, per k, a row ``sc@k=K``: the ``sc`` correction built as a run with
``correction.sc.top_k=K`` builds it (``run.train.build_module``), measured on the same rollouts as every other
correction. With the full head SC's conditional drift is 0 (``tools.conditional``), so in the conditional mode the
row's gradient D_k is the residual the truncated head leaves, and ``none``'s is the full drift C. Per sampler the
report gives, with delete-one jackknife intervals (95% t, B − 1 degrees of freedom), paired over the batches:

* the norm fraction √(‖E D_k‖² / ‖E C‖²), each squared norm with its noise floor removed (‖mean‖² − tr Σ / B);
* the fraction along u (``probe.projected_drift``: the projection on ``none``'s conditional drift direction from
  the other batches, in units of ‖E C‖).

And per generated token, from the sampler's full distribution μ(h) and the trainer's π(h) (``centring_errors``):
the head's μ-mass Σ_{v∈H} μ_v and the relative error, in logit space, of the top-k estimate of the centring vector.
The full centring term's gradient with respect to the logits is μ − π; the top-k one (head μ, tail the trainer's
rescaled by ρ = (1 − Σ_H μ) / (1 − Σ_H π), ``corrections.centering_term``) is μ̂ − π with μ̂ = μ on H and ρ π off
it, so the relative error is ‖μ̂ − μ‖ / ‖μ − π‖ (Euclidean over the vocabulary). The reference (on-policy)
batches give the floor: there μ = π up to rounding, and the absolute norms are reported beside.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
from torch import Tensor

from ..corrections import TAIL_EPS

#: percentiles reported per token: the error's bad side is high, the head mass's low
ERROR_QUANTILES = (0.5, 0.9, 0.99)
MASS_QUANTILES = (0.5, 0.1, 0.01)


def row_name(k: int) -> str:
    """The probe's row label for score centering with head size k: ``sc@k=K``."""
    return f"sc@k={int(k)}"


def check_top_ks(cfg) -> None:
    """ConfigError for a bad ``probe.sc_top_ks`` (null: no top-k rows): a non-empty list of distinct integers
    >= 1, with ``none`` among ``probe.corrections`` (its conditional drift is the denominator), ``conditional``
    among ``probe.modes`` (the residual is read without token noise there) and ``correction.sc.mode=topk``; and
    ``correction.sc.tail=rescaled`` whatever the rows (the probe's shared rollouts record no tail draws)."""
    from ..config import _check, is_int

    tail = cfg.correction.sc.get("tail", "rescaled")
    _check(
        tail == "rescaled",
        "correction.sc.tail",
        tail,
        "rescaled in the probe: its rollouts are shared by every correction and record no tail draws; the sampled "
        "tail's noise is measured by benchmarks/sampled_tail_noise.py",
    )
    ks = cfg.probe.get("sc_top_ks")
    if ks is None:
        return
    ks = list(ks)
    _check(
        len(ks) >= 1 and all(is_int(k) and k >= 1 for k in ks) and len(set(ks)) == len(ks),
        "probe.sc_top_ks",
        ks,
        "a non-empty list of distinct integers >= 1 (or null)",
    )
    _check(
        "none" in cfg.probe.corrections and "conditional" in cfg.probe.modes,
        "probe.sc_top_ks",
        ks,
        "needs `none` in probe.corrections and `conditional` in probe.modes (the residual is a fraction of "
        "none's conditional drift)",
    )
    _check(cfg.correction.sc.mode == "topk", "probe.sc_top_ks", ks, "needs correction.sc.mode=topk")


def top_k_modules(cfg, modules: dict, build: Callable, policy, tokenizer) -> dict:
    """{``sc@k=K``: module} for each k of ``probe.sc_top_ks`` (none when null): each the ``sc`` module a run with
    ``correction.sc.top_k=K`` builds around ``policy``, by ``build(cfg, policy, tokenizer)``; where ``modules``
    already holds ``sc`` with that head, that very module (the probe computes a module's gradients once)."""
    from .probe import with_correction

    out = {}
    for k in cfg.probe.get("sc_top_ks") or ():
        if "sc" in modules and int(cfg.correction.sc.top_k) == int(k):
            out[row_name(k)] = modules["sc"]
            continue
        c = copy.deepcopy(cfg)
        c.correction.sc.top_k = int(k)
        out[row_name(k)] = build(with_correction(c, "sc"), policy, tokenizer)
    return out


# ---------------------------------------------------------------------------------------- per-token statistics


def centring_errors(logpi: Tensor, logmu: Tensor, ks) -> dict[str, Tensor]:
    """Per token, the head's μ-mass and the top-k centring vector's error, for each head size k.

    Args:
        logpi: float [n, V], the trainer's log π(·|h) per token, in the engine's order (largest μ first);
            −inf (outside the trainer's support) counts as π_v = 0.
        logmu: float [n, V], the sampler's log μ(·|h) of the same ids (NaN or −inf: μ_v = 0).
        ks: head sizes (k >= V: the whole vocabulary, error 0 and mass Σ μ).

    Returns:
        float64 tensors [n]: ``gap`` ‖μ − π‖ (the full centring vector's norm in logit space), ``kl`` the
        realised KL(μ‖π) in nats (Σ over μ's support; +inf where π_v = 0 < μ_v), and per k
        ``mass@k`` Σ_{v<k} μ_v, ``abs_err@k`` ‖μ̂ − μ‖ and ``rel_err@k`` ‖μ̂ − μ‖ / ‖μ − π‖ (NaN where μ = π
        exactly), μ̂ = μ on the head and ρ π on the tail, ρ = max(1 − Σ_H μ, 0) / (1 − Σ_H π), and μ̂ = μ on the
        head with an empty tail when 1 − Σ_H π <= ``corrections.TAIL_EPS`` (as ``centering_term``).

    Raises:
        ValueError: the shapes differ or are not [n, V].
    """
    if logpi.shape != logmu.shape or logpi.dim() != 2:
        raise ValueError(f"logpi and logmu must both be [n, V], got {tuple(logpi.shape)}, {tuple(logmu.shape)}")
    pi = logpi.double().exp().nan_to_num(0.0)
    mu = logmu.double().nan_to_num(float("-inf")).exp()
    gap = (mu - pi).norm(dim=-1)
    log_ratio = logmu.double().nan_to_num(float("-inf")) - logpi.double()
    out = {"gap": gap, "kl": torch.where(mu > 0, mu * log_ratio, 0.0).sum(-1)}
    for k in ks:
        k = min(int(k), pi.shape[-1])
        mass = mu[:, :k].sum(-1)
        tail_pi = 1.0 - pi[:, :k].sum(-1, keepdim=True)
        has_tail = tail_pi > TAIL_EPS
        rho = torch.where(has_tail, (1.0 - mass[:, None]).clamp(min=0.0) / tail_pi.where(has_tail, 1.0), 0.0)
        err = (rho * pi[:, k:] - mu[:, k:]).norm(dim=-1)
        out[f"mass@{k}"], out[f"abs_err@{k}"] = mass, err
        out[f"rel_err@{k}"] = torch.where(gap > 0, err / gap.where(gap > 0, 1.0), math.nan)
    return out


def centring_stats(module, scored, ks) -> dict[str, Tensor] | None:
    """``centring_errors`` of every generated token of one rollout batch (``scored``), the trainer's π from
    ``module``'s policy (no gradient) at the sampler's temperature and support, μ from the engine's record.
    None when the engine did not record the whole vocabulary (the probe records it in the conditional mode)."""

    rb = module.build_batch(scored)
    vocab = module.policy.get_output_embeddings().weight.shape[0]
    if rb.topk_ids is None or rb.topk_ids.shape[-1] < vocab:
        return None
    with torch.no_grad():
        scores = module._score(module.policy, rb, rb.topk_ids, {"with_entropy": False, "shared_prefix": False})
    mask = rb.response_mask.bool()
    return centring_errors(scores.head_logprobs[mask], rb.topk_logprobs[mask], ks)


def _quantiles(x: Tensor, qs) -> list[float]:
    x = x[torch.isfinite(x)]
    return [float(torch.quantile(x, q)) if x.numel() else math.nan for q in qs]


def token_summary(batches: list[dict[str, Tensor]], ks) -> dict:
    """The pooled tokens' percentiles: {"tokens", "kl": the mean KL(μ‖π), "gap": [p50, p90, p99], per k
    {"mass": [p50, p10, p1], "rel_err": [p50, p90, p99], "abs_err": [p50, p90, p99]}} (``ERROR_QUANTILES``,
    ``MASS_QUANTILES``)."""
    pooled = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    out = {"tokens": int(pooled["gap"].numel()), "gap": _quantiles(pooled["gap"], ERROR_QUANTILES)}
    out["kl"] = float(pooled["kl"].mean())
    vocab_cut = {int(key.split("@")[1]) for key in pooled if key.startswith("mass@")}
    for k in ks:
        kk = min(int(k), max(vocab_cut))
        out[str(k)] = {
            "mass": _quantiles(pooled[f"mass@{kk}"], MASS_QUANTILES),
            "rel_err": _quantiles(pooled[f"rel_err@{kk}"], ERROR_QUANTILES),
            "abs_err": _quantiles(pooled[f"abs_err@{kk}"], ERROR_QUANTILES),
        }
    return out


# ------------------------------------------------------------------------------------------ gradient fractions


def paired_fraction(d: Tensor, c: Tensor) -> tuple[float, float]:
    """(f, jackknife SE) of f = √(max(‖E D‖², 0) / ‖E C‖²) from paired batches d, c [B, D] (float64; row b of
    both from the same rollouts), each squared norm noise-corrected (‖mean‖² − tr Σ / B). The delete-one
    jackknife leaves batch b out of both. f is NaN where ‖E C‖² <= 0 (no drift to compare with). B >= 3."""

    def frac(x: Tensor, y: Tensor) -> float:
        n = x.shape[0]

        def sq(z: Tensor) -> float:
            m = z.mean(0)
            var = max((float(z.pow(2).sum()) - n * float(m @ m)) / (n - 1), 0.0)
            return float(m @ m) - var / n

        c2 = sq(y)
        return math.sqrt(max(sq(x), 0.0) / c2) if c2 > 0 else math.nan

    d, c = d.double(), c.double()
    n = d.shape[0]
    full = frac(d, c)
    keep = [torch.tensor([j for j in range(n) if j != i]) for i in range(n)]
    reps = [frac(d[idx], c[idx]) for idx in keep]
    mean = sum(reps) / n
    return full, math.sqrt((n - 1) / n * sum((r - mean) ** 2 for r in reps))


def t_interval(value: float, se: float, n: int) -> tuple[float, float]:
    """The 95% t-interval value ± t_{0.975, n−1} · se."""
    from scipy.stats import t

    half = float(t.ppf(0.975, n - 1)) * se
    return value - half, value + half


# ---------------------------------------------------------------------------------------------------- report


def _stats_of(cells) -> list[dict]:
    return next((c.token_stats for c in cells if c.token_stats), [])


def top_k_rows(cfg, reference, results: dict) -> list[dict]:
    """One row per (sampler, k) of ``probe.sc_top_ks`` (empty when null), and one per sampler and for the
    reference with the per-token statistics: k, the norm fraction and the fraction along u with SEs and 95%
    t-intervals (B − 1 degrees of freedom), ``matches`` (the upper bound of the norm fraction <= 0.05) and the
    tokens' percentiles (``token_summary``)."""
    from .probe import projected_drift

    ks = list(cfg.probe.get("sc_top_ks") or ())
    if not ks:
        return []
    rows = []
    for setting, cells in results.items():
        c = torch.stack(cells["none"].sketches["conditional"]).double()
        along = projected_drift(cells, None, "conditional")
        stats = _stats_of(cells.values())
        tokens = token_summary(stats, ks) if stats else None
        for k in ks:
            d = torch.stack(cells[row_name(k)].sketches["conditional"]).double()
            f, f_se = paired_fraction(d, c)
            u, u_se = along.get(row_name(k), (math.nan, math.nan))
            n = d.shape[0]
            row = {
                "setting": setting,
                "k": int(k),
                "batches": n,
                "kl": tokens["kl"] if tokens else math.nan,
            }
            row.update(norm_frac=f, norm_frac_se=f_se, norm_frac_ci=t_interval(f, f_se, n))
            row.update(along_u=u, along_u_se=u_se, along_u_ci=t_interval(u, u_se, n))
            row["matches"] = bool(row["norm_frac_ci"][1] <= 0.05)
            row["tokens"] = tokens[str(k)] if tokens else None
            row["gap"] = tokens["gap"] if tokens else None
            row["n_tokens"] = tokens["tokens"] if tokens else 0
            rows.append(row)
    if reference.token_stats:
        tokens = token_summary(reference.token_stats, ks)
        for k in ks:
            rows.append(
                {"setting": "(on-policy reference)", "k": int(k), "batches": len(reference.token_stats),
                 "kl": tokens["kl"], "tokens": tokens[str(k)], "gap": tokens["gap"], "n_tokens": tokens["tokens"]}
            )  # fmt: skip
    return rows


def _q(v: list[float] | None, fmt: str) -> str:
    return "–" if v is None else " / ".join("–" if not math.isfinite(x) else format(x, fmt) for x in v)


def format_top_k(rows: list[dict]) -> str:
    """The probe.md section of the top-k rows (``top_k_rows``); empty without them."""
    if not rows:
        return ""
    lines = [
        "",
        "## Score centering's top-k head against the full vocabulary (`probe.sc_top_ks`)",
        "",
        "| sampler (KL(μ‖π)/token) | k | norm fraction √(‖E D_k‖²/‖E C‖²) [95% CI] | along u / ‖E C‖ [95% CI] | "
        "≤ 0.05 | "
        "head μ-mass p50 / p10 / p1 | rel. error p50 / p90 / p99 | abs. error p50 / p90 / p99 | "
        "‖μ−π‖ p50 / p90 / p99 | tokens |",
        "|---|---:|---:|---:|:-:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["tokens"] or {}
        if "norm_frac" in r:
            lo, hi = r["norm_frac_ci"]
            ulo, uhi = r["along_u_ci"]
            grad = (
                f"{r['norm_frac']:.4f} ± {r['norm_frac_se']:.4f} [{lo:.4f}, {hi:.4f}] | "
                f"{r['along_u']:.4f} ± {r['along_u_se']:.4f} [{ulo:.4f}, {uhi:.4f}] | {'yes' if r['matches'] else 'no'}"
            )
        else:
            grad = "– | – | –"
        lines.append(
            f"| {r['setting']} ({r['kl']:.4f}) | {r['k']} | {grad} | {_q(t.get('mass'), '.4f')} | "
            f"{_q(t.get('rel_err'), '.3g')} | {_q(t.get('abs_err'), '.3g')} | {_q(r['gap'], '.3g')} | {r['n_tokens']} |"
        )
    lines += [
        "",
        "- D_k: `sc@k=K`'s conditional drift (the residual of the top-k head; 0 with the full vocabulary), C: `none`'s "
        "(the full drift); squared norms noise-corrected, paired delete-one jackknife over the batches, 95% "
        "t-interval with B − 1 degrees of freedom. ≤ 0.05: the interval's upper bound is at most 0.05.",
        "- Per generated token (all batches pooled): the head's μ-mass Σ_{v∈H} μ_v (its low percentiles), and the "
        "relative error ‖μ̂ − μ‖ / ‖μ − π‖ of the top-k centring vector in logit space (μ̂: μ on the head, the "
        "trainer's tail rescaled off it), its absolute error ‖μ̂ − μ‖ and the full vector's norm ‖μ − π‖; the "
        "on-policy reference's rows are the floor (μ = π up to rounding: read its absolute columns).",
    ]
    return "\n".join(lines) + "\n"


def plot_top_k(rows: list[dict], path: str) -> None:
    """The norm fraction against k per sampler, with its 95% intervals, on log-log axes; nothing without rows."""
    rows = [r for r in rows if "norm_frac" in r]
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for setting in dict.fromkeys(r["setting"] for r in rows):
        rs = [r for r in rows if r["setting"] == setting]
        ks = [r["k"] for r in rs]
        f = [r["norm_frac"] for r in rs]
        err = [[max(r["norm_frac"] - max(r["norm_frac_ci"][0], 1e-6), 0) for r in rs],
               [r["norm_frac_ci"][1] - r["norm_frac"] for r in rs]]  # fmt: skip
        ax.errorbar(ks, f, yerr=err, marker="o", capsize=3, label=setting)
    ax.axhline(0.05, color="k", ls="--", lw=1, label="0.05 (the rule)")
    ax.set(xscale="log", yscale="log", xlabel="head size k", ylabel="‖E D_k‖ / ‖E C‖ (conditional)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
