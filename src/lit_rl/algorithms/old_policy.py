"""π_old, the denominator of every ratio of the update: the trainer's snapshot pass, or the rollout log-probs μ
themselves (``correction.bypass``), and the batch-level statistics that read it (M2PO's bound, TIS's batch
normalisation), each the whole step's over the data-parallel ranks.

``OldPolicyMixin`` is part of ``RLModule`` (``algorithms.module``). With one optimizer step per rollout batch the
training forward itself is π_old and nothing runs here; with several (``algo.ppo_epochs`` × ``num_minibatches``)
π_old is fixed for the whole cycle, so the trainer scores the batch once first (``snapshot``), unless
``correction.bypass=true``: then μ is taken as π_old and the pass is skipped.

Bypass (verl's ``apply_bypass_mode``, prime-rl's default). Under ``kernels=batch_invariant`` in sync mode, μ
equals the trainer's π_old bit for bit (the same model definition and kernels score the same weights), so bypass
is exact: every logged value and the final weights equal those of the snapshot (tests/test_bypass.py), and the
pass's time (``time/old_logprob_s``) is saved. Under other kernels μ ≠ π_old by the numerical gap, and bypass is
another estimator: the PPO ratio π_θ/μ, clipped, is then both the trust region and the train–inference
correction (verl's bypass with its PPO-clip loss); ``config.check_bypass`` allows that only for objectives with a
clipped ratio, and refuses the weight corrections whose π_old/μ bypass would make 1 (tis, mis, rs, m2po) and the
rollout modes whose rows come from older weights.

The proximal policy (``correction.proximal``; Fu et al. 2025, AReaL's decoupled objective). The ratio's denominator
is π_prox = π_old, the trainer at the version the update cycle started from, in every rollout mode; the sampler μ
enters only through the correction's weight (``correction=decoupled``: π_prox/μ, masked above 5). With
``correction.proximal=loglinear`` π_prox is not scored by the snapshot pass but interpolated per micro-batch
(``proximal_logprobs``, ``corrections.loglinear_proximal_logprobs``): exact on the cycle's first update, log μ for
tokens the proximal version sampled itself, between the two by weight version for stale tokens. Allowed with every
rollout mode, unlike bypass.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from .. import corrections as corr
from .. import rejection
from ..logprobs import TokenScores
from ..rollout.types import RolloutBatch, row_versions


class OldPolicyMixin:
    """π_old of the update cycle, for a LightningModule with ``policy``, ``correction``, ``updates_per_step``,
    ``micro_batch_size``, ``logprobs_of``, ``policy_version``, and the collectives ``all_reduce`` and
    ``all_gather_cat`` (identities on one rank)."""

    #: seconds the last update's π_old pass took (``time/old_logprob_s``; 0 when none ran)
    old_logprob_s: float = 0.0
    #: v_prox, the weight version the current update cycle started from (``start_update``)
    proximal_version: int = 0

    def start_update(self, rb: RolloutBatch) -> None:
        """What the update needs before its first optimizer step: π_old, as μ with ``correction.bypass`` or from
        the trainer (``snapshot``) when the batch gets several optimizer steps (with one, the training forward
        itself is π_old) or a batch-level correction reads it (M2PO's bound on the log-ratios,
        ``rejection.batch_log_ratio_bound``). Records the pass's time in ``old_logprob_s``."""
        self.old_logprob_s = 0.0
        self.proximal_version = self.policy_version
        if getattr(self.correction, "bypass", False):
            rb.old_logprobs = rb.rollout_logprobs.clone()
            if rb.topk_logprobs is not None and self.correction.sc.enabled:
                rb.old_head_logprobs = rb.topk_logprobs.clone()
        batch_level = rejection.needs_batch_pass(self.correction)
        several = self.updates_per_step > 1 and not self.interpolates_proximal
        if (several or batch_level) and rb.old_logprobs is None:
            t0 = time.perf_counter()
            self.snapshot(rb)
            self.old_logprob_s = time.perf_counter() - t0
        if batch_level:  # the whole step's statistics: every data-parallel rank's share (collectives)
            rb.log_ratio_bound = rejection.batch_log_ratio_bound(self.correction, rb, self.all_gather_cat)
            rb.weight_scale = corr.batch_weight_scale(self.correction, rb, self.all_reduce)

    @property
    def interpolates_proximal(self) -> bool:
        """True with ``correction.proximal=loglinear``: π_prox is interpolated per micro-batch, no π_old pass."""
        return getattr(self.correction, "proximal", "trainer") == "loglinear"

    def proximal_logprobs(self, mb: RolloutBatch, scores: TokenScores) -> Tensor:
        """float [n, T]: log π_prox of micro-batch ``mb``'s sampled tokens, the denominator of the update's ratios,
        without gradient: ``mb.old_logprobs`` where a pass filled it (the snapshot, bypass's μ, PPO's GAE), else
        with ``correction.proximal=loglinear`` the interpolation between μ and the current log-probs
        (``scores.logprobs`` [n, T]) by weight version (``corrections.loglinear_proximal_logprobs``: the cycle
        started at ``proximal_version``, the weights are now at ``policy_version``), else the current forward itself
        (one update per batch: it is π_old). With score centering, the loglinear case also fills
        ``mb.old_head_logprobs``, π_prox at the head ids, interpolated with each position's α."""
        if mb.old_logprobs is not None:
            return mb.old_logprobs
        logprobs = scores.logprobs
        if not self.interpolates_proximal:
            return logprobs.detach()
        versions = mb.token_versions  # None: each row's policy_version on every token
        if versions is None:
            versions = row_versions(mb.policy_version, mb.response_mask.shape[1])
        versions = versions.to(logprobs.device)
        v_prox, v_now = self.proximal_version, self.policy_version
        if scores.head_logprobs is not None and mb.topk_logprobs is not None:
            alpha = corr.loglinear_alpha(versions, v_prox, v_now)
            mb.old_head_logprobs = corr.loglinear_proximal_head(mb.topk_logprobs, scores.head_logprobs, alpha)
        return corr.loglinear_proximal_logprobs(
            mb.rollout_logprobs, logprobs, versions, v_prox, v_now, mb.response_mask
        )

    @torch.no_grad()
    def snapshot(self, rb: RolloutBatch) -> None:
        """Fill ``rb.old_logprobs`` [N, T]: pi_old, the weights this update cycle starts from, fixed for
        all its epochs and minibatches. (With a single update the training forward itself is pi_old and
        this pass is skipped.)"""
        n, t = rb.response_ids.shape
        rb.old_logprobs = torch.zeros(n, t, device=rb.response_ids.device)
        with self.scoring_pass():  # each weight cast to the autocast dtype once for the pass
            for i in range(0, n, self.micro_batch_size):
                mb = rb.select(slice(i, i + self.micro_batch_size))
                scores = self.logprobs_of(self.policy, mb, with_entropy=False)
                rb.old_logprobs[i : i + len(mb), : scores.logprobs.shape[1]] = scores.logprobs
                self.store_old_head(rb, i, scores)

    def store_old_head(self, rb: RolloutBatch, start: int, scores: TokenScores) -> None:
        """Keep pi_old at the engine's head ids (score centering's weights and ratios use it when one rollout
        batch gets several optimizer steps): rows ``start:`` of ``rb.old_head_logprobs`` [N, T, k] from a
        snapshot micro-batch's ``scores``. A no-op without score centering."""
        if scores.head_logprobs is None:
            return
        if rb.old_head_logprobs is None:
            rb.old_head_logprobs = torch.full_like(rb.topk_logprobs, float("-inf"))
        w = scores.head_logprobs.shape[1]
        rb.old_head_logprobs[start : start + scores.head_logprobs.shape[0], :w] = scores.head_logprobs
