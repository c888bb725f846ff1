"""The noise score centering's sampled tail adds (``correction.sc.tail=sampled``), per head size k and draws m.

Given the prefix h_t, the sampled tail's centring term differs from the exact one (the full vocabulary) by

    ξ_t = (1 − M_H) (1/m) Σ_j ∇log π_{u_j} − Σ_{v∉H} μ_v ∇log π_v,   u_1..u_m ~ μ_tail i.i.d.,

M_H = Σ_{v∈H} μ_v, μ_tail = μ off the head renormalised (``corrections.centering_term``): 0 in expectation over
the draws, so its bias is 0 and what it costs is variance. On a rollout batch ξ = Σ_t red_t ξ_t (the step's
reduction ``red_t``) is one backward of the surrogate Σ_t red_t Σ_{v∉H} sg(q_{t,v}) log π_{t,v} with
q_v = (1 − M_H) n_v / m − μ_v, n_v the number of draws equal to v (``tail_noise_weights``). The draws are
independent of the batch's own sampling, so the sampled tail's SC gradient has per-batch variance
Var(g_sc) + E‖ξ‖²: the ratio E‖ξ‖² / Var(g_sc) is the variance the tail adds in units of full score centring's
own (``noise_ratio``). Under a constant advantage (the probe's A = 1) full SC's gradient has mean exactly 0, so
Var(g_sc) = E‖g_sc‖². Plain SC (coefficient 1, no importance weight); the engine's record must cover the
vocabulary (``sampling.logprobs_top_k`` = V), in its order (largest first: the head is the first k entries).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .conditional import surrogate_backward


def tail_noise_weights(logmu: Tensor, head_size: int, tail_samples: int, generator: torch.Generator) -> Tensor:
    """q [..., V] float64: ξ = Σ_v q_v ∇log π_v for one draw of ``tail_samples`` tail tokens per position.

    Args:
        logmu: float [..., V], the sampler's log μ(·|h) in the engine's order (largest first; −inf: μ_v = 0).
        head_size: k >= 0, the head (the first k entries); q = 0 there.
        tail_samples: m >= 1 draws per position, i.i.d. from μ off the head, renormalised.
        generator: the draws' generator (CPU).

    Returns:
        float64 [..., V]; 0 on the head and at positions whose tail has no mass.

    Raises:
        ValueError: ``tail_samples`` < 1, or ``head_size`` outside [0, V].
    """
    vocab = logmu.shape[-1]
    if tail_samples < 1:
        raise ValueError(f"tail_samples must be >= 1, got {tail_samples}")
    if not 0 <= head_size <= vocab:
        raise ValueError(f"head_size must lie in [0, {vocab}], got {head_size}")
    mu = logmu.detach().double().exp().nan_to_num(0.0)
    q = torch.zeros_like(mu)
    if head_size == vocab:
        return q
    tail = mu[..., head_size:].reshape(-1, vocab - head_size)
    mass = (1.0 - mu[..., :head_size].sum(-1)).clamp(min=0.0).reshape(-1, 1)
    ok = (tail.sum(-1) > 0) & (mass[:, 0] > 0)
    counts = torch.zeros_like(tail)
    if bool(ok.any()):
        draws = torch.multinomial(tail[ok].float().cpu(), tail_samples, replacement=True, generator=generator)
        counts[ok] = torch.zeros_like(tail[ok]).scatter_add_(-1, draws.to(tail.device), torch.ones_like(draws).to(tail))
    noise = torch.where(ok[:, None], mass * counts / tail_samples - tail, torch.zeros_like(tail))
    q[..., head_size:] = noise.reshape(*mu.shape[:-1], vocab - head_size)
    return q


def tail_noise_backward(module, rb, head_size: int, tail_samples: int, generator: torch.Generator) -> None:
    """Backward, into the policy's ``.grad``, of one draw of the sampled tail's noise ξ on rollout batch ``rb``
    (module docstring), with ``module``'s reduction and sampling; one pass per micro-batch, normalised by the whole
    batch's totals. ``rb``: a ``RolloutBatch`` whose engine recorded its whole distribution (``topk_ids`` /
    ``topk_logprobs`` [N, T, V]). Raises ValueError when the record does not cover the vocabulary."""
    vocab = module.policy.get_output_embeddings().weight.shape[0]
    if rb.topk_ids is None or rb.topk_ids.shape[-1] < vocab:
        got = None if rb.topk_ids is None else rb.topk_ids.shape[-1]
        raise ValueError(f"the tail's noise needs the sampler's full distribution: top-k of {got}, vocabulary {vocab}")
    surrogate_backward(
        module, rb, lambda mb, logpi: tail_noise_weights(mb.topk_logprobs, head_size, tail_samples, generator)
    )


def noise_ratio(noise_sq: list[float], sc_sq: list[float]) -> tuple[float, float]:
    """(R, delete-one jackknife SE) of R = Σ_b ‖ξ_b‖² / Σ_b ‖g_sc,b‖², paired over B >= 3 batches (batch b's two
    squared norms from the same rollouts): the variance the sampled tail adds over full SC's (module docstring).
    Raises ValueError for fewer than 3 batches or lists of different lengths."""
    n = len(noise_sq)
    if n < 3 or len(sc_sq) != n:
        raise ValueError(f"need >= 3 paired batches, got {len(noise_sq)} and {len(sc_sq)}")
    full = sum(noise_sq) / sum(sc_sq)
    reps = [(sum(noise_sq) - a) / (sum(sc_sq) - s) for a, s in zip(noise_sq, sc_sq)]
    mean = sum(reps) / n
    return full, math.sqrt((n - 1) / n * sum((r - mean) ** 2 for r in reps))
