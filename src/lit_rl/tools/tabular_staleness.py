"""Staleness measured exactly: each correction's expected gradient under an older policy's samples, on a tabular policy.

The question (the documents' Q1 and Q2): an asynchronous run samples with the weights of k steps ago, μ = π_{s−k},
while the trainer is at θ_s. How far is each correction's expected update E_{μ}[ĝ_c] from the on-policy one
g = E_{π_s}[ĝ], as k grows? On a real model this needs hundreds of batches per cell; on a tabular policy
(``lit_rl.expectation``: a logit row per prefix, every sequence enumerable) it is an exact sum, with no sampling
noise at all.

The procedure (``staleness_curves``):

1. Train: from θ_0 (a seeded N(0, 1) table), ``steps`` updates θ_{i+1} = Adam(θ_i, E_{π_i}[ĝ]), each gradient
   the exact expectation of the training module's own update (``expected_gradient``: ``build_batch``,
   ``start_update``, ``accumulate_gradients``), every table θ_i kept. Deterministic: the trajectory a run with
   infinitely many rollouts per step would take.
2. At θ_s (s = ``steps``), for each lag k and each correction c: E_{μ = π_{s−k}}[ĝ_c] exactly, through the
   correction's module built around the same policy (the rollout log-probs are μ's, the trainer's are θ_s's, so
   the ratio π_θ/μ the corrections read is the staleness ratio), against g = E_{π_s}[ĝ_none].
3. Per (c, k): bias ‖E ĝ_c − g‖ / ‖g‖, the progress ratio ⟨E ĝ_c, g⟩ / ‖g‖² (1 = on-policy speed along g),
   the cosine, and the realised KL(μ ‖ π_s) per token on μ's own prefixes.

At k = 0 the sampler is the trainer, so every correction's curve starts at g exactly (tested).
Used by ``recipes/tabular_staleness.py``; results in docs/results/tabular_staleness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..expectation import TabularPolicy, all_sequences, expected_gradient, prefix_rows, sequence_logprobs


def train_tables(
    module, policy: TabularPolicy, reward: Callable[[Tensor], Tensor], steps: int, lr: float, group_size: int = 1
) -> list[Tensor]:
    """θ_0 .. θ_steps (float64 [S, V] logit tables) of ``steps`` Adam updates (β = (0.9, 0.999), no weight decay,
    learning rate ``lr``) of ``policy``, each on the exact on-policy expected gradient E_{π_θ}[ĝ] of ``module``'s
    update (groups of ``group_size``, every group enumerated). Leaves ``policy`` at θ_steps.

    Raises ValueError for steps < 1 or lr <= 0."""
    if steps < 1 or not lr > 0:
        raise ValueError(f"steps must be >= 1 and lr > 0, got steps={steps}, lr={lr}")
    opt = torch.optim.Adam([policy.lm_head.weight], lr=lr)
    tables = [policy.table()]
    for _ in range(steps):
        grad = expected_gradient(module, policy, policy.table(), reward, group_size, policy.vocab_size).mean
        opt.zero_grad(set_to_none=True)
        policy.lm_head.weight.grad = grad.T.to(policy.lm_head.weight.dtype).contiguous()
        opt.step()
        tables.append(policy.table())
    policy.zero_grad(set_to_none=True)
    return tables


def realised_kl(sampler: Tensor, table: Tensor, length: int) -> float:
    """KL(μ ‖ π) per token on μ's own prefixes: E_{y~μ}[(1/L) Σ_t KL(μ(·|h_t) ‖ π(·|h_t))], exact (float64);
    ``sampler``, ``table``: logit tables [S, V]."""
    vocab = table.shape[1]
    seqs = all_sequences(vocab, length)
    p_seq = sequence_logprobs(sampler, seqs).sum(-1).exp()  # [N]
    logmu, logpi = torch.log_softmax(sampler.double(), -1), torch.log_softmax(table.double(), -1)
    kl_rows = (logmu.exp() * (logmu - logpi)).sum(-1)  # [S]
    return float((p_seq[:, None] * kl_rows[prefix_rows(seqs, vocab)]).sum() / length)


@dataclass
class StalenessPoint:
    """One (correction, lag) cell: the exact E_μ[ĝ_c] compared with the on-policy g (all floats, exact)."""

    correction: str
    lag: int
    kl: float  # KL(μ ‖ π_s) per token on μ's prefixes
    bias: float  # ‖E ĝ_c − g‖ / ‖g‖
    progress: float  # ⟨E ĝ_c, g⟩ / ‖g‖²
    cosine: float
    gradient: Tensor = field(repr=False)  # float64 [S, V], E_μ[ĝ_c]


def staleness_curves(
    modules: dict[str, object],
    policy: TabularPolicy,
    tables: list[Tensor],
    reward: Callable[[Tensor], Tensor],
    lags: list[int],
    group_size: int = 1,
    reference: str = "none",
) -> tuple[Tensor, list[StalenessPoint]]:
    """The exact bias-vs-lag curves at θ_s = ``tables[-1]``.

    Args:
        modules: {correction name: an ``RLModule`` built around ``policy``} (head k = V for score centering).
        policy: the ``TabularPolicy`` they train; set to θ_s here.
        tables: θ_0 .. θ_s (``train_tables``).
        reward: sequences int64 [N, L] -> rewards float [N].
        lags: the k's; each needs 0 <= k <= s.
        group_size: G, every group of G enumerated (V^(L·G) groups: keep it small).
        reference: the module whose on-policy E_{π_s}[ĝ] is g.

    Returns:
        (g float64 [S, V], one ``StalenessPoint`` per (correction, lag), corrections in ``modules``' order).

    Raises:
        ValueError: a lag outside [0, s], no ``reference`` module, or an on-policy gradient of 0 (no scale).
    """
    s = len(tables) - 1
    bad = [k for k in lags if not 0 <= k <= s]
    if bad:
        raise ValueError(f"lags must lie in [0, {s}] (the trained steps), got {bad}")
    if reference not in modules:
        raise ValueError(f"reference correction {reference!r} is not among the modules {list(modules)}")
    with torch.no_grad():
        policy.lm_head.weight.copy_(tables[s].T.to(policy.lm_head.weight.dtype))
    vocab = policy.vocab_size

    def grad(name: str, sampler: Tensor) -> Tensor:
        return expected_gradient(modules[name], policy, sampler, reward, group_size, vocab).mean

    g = grad(reference, tables[s])
    g2 = float((g * g).sum())
    if not g2 > 0:
        raise ValueError("the on-policy expected gradient is 0: no scale to measure a bias against")
    points = []
    for name in modules:
        for k in lags:
            mu = tables[s - k]
            e = grad(name, mu)
            norm = float(e.norm())
            points.append(
                StalenessPoint(
                    correction=name,
                    lag=k,
                    kl=realised_kl(mu, tables[s], policy.length),
                    bias=float((e - g).norm()) / math.sqrt(g2),
                    progress=float((e * g).sum()) / g2,
                    cosine=float((e * g).sum()) / (norm * math.sqrt(g2)) if norm > 0 else math.nan,
                    gradient=e,
                )
            )
    return g, points


def tolerated_lag(points: list[StalenessPoint], correction: str, threshold: float) -> int | None:
    """The largest lag k of the grid such that ``correction``'s bias is <= ``threshold`` at every lag <= k (the
    verdict rule of docs/results/tabular_staleness); None if even the smallest lag fails."""
    best = None
    for p in sorted((p for p in points if p.correction == correction), key=lambda p: p.lag):
        if p.bias > threshold:
            break
        best = p.lag
    return best
