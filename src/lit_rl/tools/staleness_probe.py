"""The staleness form of the gradient-bias probe: a sampler holding earlier weights, and the statistics that read it.

A probe setting with ``sampler: <folder>`` (``probe.settings[i].sampler``) samples with that folder's weights — an
earlier ``policy_step{n}/`` of the same run (``checkpoint.export_at_steps``) — while every correction's gradient is
taken at the probe's policy θ_s: the rollout log-probs are μ = π_{s−k}'s, so the ratio each correction reads is the
staleness ratio π_s / π_{s−k}, as a lagged or async run of lag k has it. The reference g is the on-policy gradient
at θ_s (``tools.probe``).

Read-outs, from the probe's gradient sketches (``sketches.pt``; every statistic relative to ‖g‖², with a delete-one
jackknife SE over the batches of both samples, the cell's batches deleted as pairs where two corrections share them):

* ``progress``: the progress ratio ⟨E ĝ_c, g⟩ / ‖g‖² (1 = the on-policy step along g): ⟨ḡ_c, ḡ_π⟩ is unbiased for
  ⟨E ĝ_c, g⟩ (independent samples), and ‖g‖² is the reference's noise-corrected squared norm;
* ``paired_gap``: T(a, b) = ‖E ĝ_a − g‖² − ‖E ĝ_b − g‖² for two corrections on the same rollouts:
  ‖ḡ_a − ḡ_π‖² − ‖ḡ_b − ḡ_π‖² − (tr Σ_a − tr Σ_b) / B is unbiased for it (the reference's noise cancels), and the
  pairing removes the token-sampling noise the two share: T < 0 means a is closer to g than b.

Coupled forms (``coupled_*``): the on-policy batches drawn with the same seeds as the cell's (a setting without a
sampler in a probe with the same ``probe.seed_offset``). The engine samples by inverse CDF, one uniform per row and
step from the row's own seed, so a sampler θ_{s−k} close to θ_s writes mostly the same tokens as θ_s would with the
same seed: the difference d_b = ĝ_c(stale, b) − ĝ_none(on-policy, b) carries little of the token noise, and the
bias, progress ratio and T are read from d̄ (common random numbers) with the independent reference only scaling them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor


def batch_variance(x: Tensor) -> float:
    """tr Σ of the rows of x [n, D]: one batch's gradient variance E‖x_b − E x‖² (unbiased, n − 1; clipped at 0)."""
    m = x.mean(0)
    return max((float(x.pow(2).sum()) - x.shape[0] * float(m @ m)) / (x.shape[0] - 1), 0.0)


def noise_free_norm2(y: Tensor) -> float:
    """‖E y‖² without the noise of the mean: ‖ȳ‖² − tr Σ_y / R (unbiased), for the rows y [R, D]."""
    m = y.mean(0)
    return float(m @ m) - batch_variance(y) / y.shape[0]


def progress(x: Tensor, y: Tensor) -> float:
    """⟨E ĝ_x, g⟩ / ‖g‖² from a cell's batch gradients ``x`` [B, D] and the on-policy reference's ``y`` [R, D]
    (independent samples; float64 inside). nan when the reference has no signal (‖g‖² ≤ 0)."""
    x, y = x.double(), y.double()
    g2 = noise_free_norm2(y)
    return float(x.mean(0) @ y.mean(0)) / g2 if g2 > 0 else math.nan


def paired_gap(xa: Tensor, xb: Tensor, y: Tensor) -> float:
    """T(a, b) / ‖g‖²: (‖E ĝ_a − g‖² − ‖E ĝ_b − g‖²) / ‖g‖², unbiased in the numerator, from two corrections'
    gradients on the same B rollout batches ``xa``, ``xb`` [B, D] (row b of each from batch b) and the reference
    ``y`` [R, D]. nan when the reference has no signal."""
    xa, xb, y = xa.double(), xb.double(), y.double()
    g2 = noise_free_norm2(y)
    ma, mb, my = xa.mean(0), xb.mean(0), y.mean(0)
    t = float((ma - mb) @ (ma + mb - 2 * my)) - (batch_variance(xa) - batch_variance(xb)) / xa.shape[0]
    return t / g2 if g2 > 0 else math.nan


def coupled_bias2(x: Tensor, z: Tensor, y: Tensor) -> float:
    """‖E ĝ_x − g‖² / ‖g‖² from a cell's gradients ``x`` [B, D] and on-policy gradients ``z`` [B, D] drawn with the
    same seeds (row b of each from seed b: coupled rollouts), unbiased in the numerator: ‖d̄‖² − tr Σ_d / B with
    d = x − z; ‖g‖² from the independent reference ``y`` [R, D]. nan when the reference has no signal."""
    d = x.double() - z.double()
    g2 = noise_free_norm2(y.double())
    return noise_free_norm2(d) / g2 if g2 > 0 else math.nan


def coupled_progress(x: Tensor, z: Tensor, y: Tensor) -> float:
    """The progress ratio ⟨E ĝ_x, g⟩ / ‖g‖² = 1 + ⟨E ĝ_x − g, g⟩ / ‖g‖² from coupled ``x``, ``z`` [B, D] (as
    ``coupled_bias2``) and the independent reference ``y`` [R, D]: ⟨d̄, ȳ⟩ is unbiased for ⟨E ĝ_x − g, g⟩, and with
    coupled rollouts d = x − z has a small variance where the sampler is near the policy. nan without a signal."""
    y = y.double()
    g2 = noise_free_norm2(y)
    return 1.0 + float((x.double() - z.double()).mean(0) @ y.mean(0)) / g2 if g2 > 0 else math.nan


def coupled_gap(xa: Tensor, xb: Tensor, z: Tensor, y: Tensor) -> float:
    """T(a, b) / ‖g‖² from two corrections' gradients on the same rollouts ``xa``, ``xb`` and the coupled on-policy
    ``z`` (all [B, D], row b from seed b): ‖d̄_a‖² − ‖d̄_b‖² − (tr Σ_{d_a} − tr Σ_{d_b}) / B with d = x − z, unbiased
    in the numerator; ‖g‖² from ``y`` [R, D]. nan without a signal."""
    return coupled_bias2(xa, z, y) - coupled_bias2(xb, z, y)


def jackknife_groups(fn: Callable[..., float], *samples: Tensor, paired: int = 1) -> tuple[float, float]:
    """(fn(*samples), its delete-one jackknife SE) where the first ``paired`` samples share their rows (row b of
    each is batch b: deleted together) and each later sample is independent (its rows deleted one at a time);
    SE² = Σ_groups (n − 1)/n Σ_i (θ_(−i) − θ̄)² (Efron & Stein 1981). Every group needs >= 3 rows."""
    full = fn(*samples)
    groups = [list(range(paired))] + [[i] for i in range(paired, len(samples))]
    var = 0.0
    for group in groups:
        n = samples[group[0]].shape[0]
        if n < 3:
            raise ValueError(f"the jackknife needs >= 3 rows per sample, got {n}")
        reps = []
        for i in range(n):
            keep = torch.arange(n) != i
            reps.append(fn(*(s[keep] if j in group else s for j, s in enumerate(samples))))
        mean = sum(reps) / n
        var += (n - 1) / n * sum((r - mean) ** 2 for r in reps)
    return full, math.sqrt(var)


#: the config fields that fix a causal LM's parameter shapes (compared where both configs have them)
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def check_sampler_folder(folder: str, model, field: str) -> None:
    """Before any model loads: ``folder`` (``probe.settings[i].sampler``) is a save_pretrained folder (config.json
    and one of transformers' weight files) whose config has the shapes of ``model`` (the run's ``model`` group:
    ``SHAPE_FIELDS`` equal where both configs set them). Raises ConfigError naming ``field``, the folder and the
    first fields that differ, as "sampler X, policy Y"."""
    from pathlib import Path

    from transformers import AutoConfig
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    from ..config import ConfigError
    from ..run.model_checks import model_config

    weight_files = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{field}={folder}: not a model folder (no config.json); use a save_pretrained folder, e.g. "
                          "<run>/policy_step{n}/ of a run with checkpoint.export_at_steps")  # fmt: skip
    if not any((path / f).is_file() for f in weight_files):
        raise ConfigError(f"{field}={folder}: config.json but no weights (none of {', '.join(weight_files)})")
    theirs = AutoConfig.from_pretrained(str(path)).to_dict()
    policy = model_config(model)  # None when unreadable: the policy's own load reports that, by name
    mine = policy.to_dict() if policy is not None else {}
    odd = [f"{k}: sampler {theirs[k]}, policy {mine[k]}" for k in SHAPE_FIELDS
           if k in theirs and k in mine and theirs[k] != mine[k]]  # fmt: skip
    if odd:
        raise ConfigError(
            f"{field}={folder}: a model of another shape than model.name_or_path={model.name_or_path} "
            f"({'; '.join(odd)}); the sampler must be an earlier policy of this model"
        )


def load_sampler_policy(spec, folder: str, policy, tokenizer, field: str):
    """The sampler's model: ``spec`` (the run's ``model`` config: dtype, attention) with the weights of ``folder``,
    in eval mode without gradients. Raises ConfigError naming ``field`` when its parameters do not match the
    policy's names and shapes (another architecture or vocabulary), FileNotFoundError for a missing folder."""
    import dataclasses

    from ..config import ConfigError
    from ..models import load_policy

    sampler, _ = load_policy(dataclasses.replace(spec, name_or_path=str(folder)), tokenizer)
    mine = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in sampler.state_dict().items()}
    if mine != theirs:
        odd = [f"{k}: sampler {theirs.get(k)}, policy {mine.get(k)}" for k in sorted(set(mine) | set(theirs))
               if mine.get(k) != theirs.get(k)][:3]  # fmt: skip
        raise ConfigError(f"{field}={folder}: its weights do not fit the policy's names and shapes ({'; '.join(odd)})")
    sampler.eval().requires_grad_(False)
    return sampler
