"""The ``Algorithm`` contract: what one paper changes in the RL step, and nothing else.

An algorithm is an ``nn.Module`` (so PPO's critic is its child and trains and checkpoints with the policy) that
the fixed step (``algorithms.module.RLModule``) calls at four points, handing itself over as ``learner`` (the
trainer's services: its policy, engine and data, ``logprobs_of``, ``snapshot``, ``reference_kl``, ``whiten``,
``all_reduce``, ``world_size``, the config groups):

1. rollouts: ``collect`` fills this rank's share of a prompt batch (one round; DAPO: dynamic sampling) and
   ``metric_weights`` says how its rollout metrics average over ranks;
2. the batch: ``shape_rewards`` (DAPO's overlong penalty), then ``advantages`` — the advantages the loss uses,
   [N] per sequence or [N, T] per token, computed once per RL step on the padded batch (PPO's GAE and
   REINFORCE++'s returns take π_old there: ``learner.snapshot``) — and ``finish_batch`` (DAPO's truncated
   completions leaving the loss);
3. the loss: ``policy_terms`` scores a micro-batch and returns the objective's per-token loss (``policy_loss``)
   with its metrics, plus an extra per-token term (PPO's value loss); ``score_coefficients`` is the objective's
   ∂ℓ_t/∂log π that score centering evaluates at the engine's head ids. The rest of the loss (corrections,
   KL, entropy, reduction) is the same for every algorithm: ``lit_rl.loss.assemble_loss``.

Its options are its own ``algo`` dataclass (``algo_config``, ``lit_rl.schema``, torch-free; its conf/algo/<name>.yaml
sets the same defaults), which also answers what ``config.validate`` asks of the algorithm before torch loads
(``ppo_clip``, ``uses_clip``, ``group_normalised``, ``kl_in_reward``, ``group_baseline``). Adding an algorithm is a
module with its subclass and its config dataclass, registered with ``register_algorithm``, plus its YAML.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from .. import objectives as obj
from ..logprobs import TokenScores
from ..loss import TokenMetrics
from ..rollout.datamodule import PromptBatch, ScoredRollouts
from ..rollout.types import RolloutBatch
from ..schema import AlgoConfig, config_of


@dataclass
class PolicyTerms:
    """What an algorithm's objective makes of one micro-batch (``Algorithm.policy_terms``).

    scores: the trainer's ``TokenScores`` (log-probs with gradient, entropies, the SC head);
    old_logprobs: [n, T] float32 log π_old the ratios are taken against;
    pg_loss: [n, T] the objective's per-token loss ℓ_t (to minimise);
    metrics: the objective's own metrics (``train/pg_clipfrac`` ...);
    extra_loss: [n, T] added per token before the reduction (PPO's vf_coef · value loss), or None.
    """

    scores: TokenScores
    old_logprobs: Tensor
    pg_loss: Tensor
    metrics: TokenMetrics
    extra_loss: Tensor | None = None


class Algorithm(nn.Module):
    """Base of every algorithm: one round of rollouts, the task reward as is, the PPO clipped surrogate.

    Args:
        algo: the ``algo`` config group (this algorithm's ``algo_config`` dataclass or a mapping of its fields:
            what a mapping leaves out takes the YAML's default; a key that is not a field raises TypeError).
        policy: the trainer's policy (an algorithm with a critic builds it from the policy's config).
    """

    #: this algorithm's ``algo`` defaults (its conf/algo/<name>.yaml, for modules built from Python)
    algo_config: ClassVar[type[AlgoConfig]] = AlgoConfig

    def __init__(self, algo: AlgoConfig | Mapping | None = None, policy: nn.Module | None = None):
        super().__init__()
        self.cfg = config_of(self.algo_config, algo)

    @property
    def clip(self):
        """``algo.clip``: eps_low / eps_high of the ratio clip."""
        return self.cfg.clip

    @classmethod
    def group_baseline(cls, algo) -> bool:
        """True when the advantage's baseline is a statistic of the prompt's group (so ``rollout.group_size``
        must be >= 2: a group of one has zero advantage), for the ``algo`` config group (a dataclass or a
        mapping): its config dataclass's ``group_baseline``."""
        return config_of(cls.algo_config, algo).group_baseline()

    # -- 1. rollouts ---------------------------------------------------------------------------------------------
    def collect(self, learner, batch: PromptBatch) -> tuple[ScoredRollouts, dict[str, float]]:
        """Generate and score this rank's share of the step's rollouts with ``learner.engine``. Returns
        (ScoredRollouts, rollout metrics of this rank, reduced over ranks with ``metric_weights``)."""
        scored = learner.datamodule.collect(
            learner.engine, batch.examples, learner.sampling, batch.step, first_index=batch.offset
        )
        return scored, {}

    def metric_weights(
        self, learner, batch: PromptBatch, scored: ScoredRollouts, metrics: dict[str, float]
    ) -> dict[str, float]:
        """The weight of each rank's mean when the step's metrics are averaged over ranks. Default: the rank's
        completions (rollout/* means are per completion); a reward function's mean counts its applicable ones;
        ``rollout/staleness_mean``, a mean over tokens, counts the rank's valid tokens."""
        weights = {name: float(len(scored.rewards)) for name in metrics}
        for name, values in scored.reward_parts.items():
            weights[f"rollout/reward/{name}"] = float((~values.isnan()).sum())
        weights["rollout/staleness_mean"] = float(scored.rollouts.response_mask.sum())
        return weights

    # -- 2. the batch --------------------------------------------------------------------------------------------
    def shape_rewards(self, learner, scored: ScoredRollouts) -> Tensor:
        """[N] rewards the advantages see. Default: the task reward as is."""
        return scored.rewards

    def advantages(self, learner, rb: RolloutBatch) -> Tensor:
        """The advantages the loss uses: float32 [N] (one per completion) or [N, T] (per token, 0 on padding),
        from ``rb.rewards`` (shaped), ``rb.group_ids`` and, for per-token estimators, π_old (``learner.snapshot``
        fills ``rb.old_logprobs``). Called once per RL step, before the update."""
        raise NotImplementedError(f"{type(self).__name__} does not define its advantages")

    def batch_metrics(self, learner, rb: RolloutBatch) -> dict[str, float]:
        """This rank's metrics of the advantages just computed (averaged over ranks, each rank holding as many
        completions). Default: none (GRPO's family: each reward's own advantage under ``advantage.multi_reward``)."""
        return {}

    def finish_batch(self, learner, scored: ScoredRollouts, rb: RolloutBatch) -> None:
        """Last changes to the batch after its advantages (DAPO: truncated completions leave the loss).
        Default: none."""

    # -- 3. the loss ---------------------------------------------------------------------------------------------
    def policy_terms(self, learner, mb: RolloutBatch) -> PolicyTerms:
        """Score micro-batch ``mb`` with the policy and take the objective's per-token loss against π_prox
        (``learner.proximal_logprobs``: the snapshot π_old; with one update per rollout batch the trainer's own
        forward *is* π_old; ``correction.proximal=loglinear``: interpolated)."""
        scores = learner.logprobs_of(learner.policy, mb)
        old_logprobs = learner.proximal_logprobs(mb, scores)
        pg_loss, metrics = self.policy_loss(scores.logprobs, old_logprobs, mb)
        return PolicyTerms(scores, old_logprobs, pg_loss, metrics)

    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, mb: RolloutBatch) -> tuple[Tensor, TokenMetrics]:
        """(Per-token loss [n, T] to minimise, the objective's metrics). Default: the PPO clipped surrogate
        (``objectives.ppo_clip_loss``; the dual clip ``algo.clip_ratio_c`` / TRL's ``algo.delta`` when set)."""
        a = self.cfg
        loss, clip_low, clip_high = obj.ppo_clip_loss(
            logprobs, old_logprobs, mb.advantages, self.clip.eps_low, self.clip.eps_high, a.clip_ratio_c, a.delta
        )
        mask = mb.response_mask
        metrics = TokenMetrics()
        metrics.add("train/pg_clipfrac", (clip_low | clip_high).float(), mask)
        metrics.add("train/pg_clipfrac_lower", clip_low.float(), mask)
        metrics.add("train/pg_clipfrac_upper", clip_high.float(), mask)
        if a.clip_ratio_c is not None or a.delta is not None:  # its own name: verl's pg_clipfrac_lower is this one
            dual = obj.dual_clip_binds(
                logprobs.detach() - old_logprobs, mb.advantages, self.clip.eps_high, a.clip_ratio_c, a.delta
            )
            metrics.add("train/pg_clipfrac_dual", dual.float(), mask)
        return loss, metrics

    def score_coefficients(self, log_ratio: Tensor, sampled_log_ratio: Tensor, mb: RolloutBatch) -> Tensor:
        """∂ℓ_t/∂log π of ``policy_loss`` had a token with log(π_θ / π_old) = ``log_ratio`` [n, T, J] been
        sampled at position t (``sampled_log_ratio`` [n, T]: the sampled tokens'); [n, T, J]. Score
        centering under a correction evaluates it at the engine's head ids (``corrections.centering_term``).
        Default: the PPO clipped surrogate's, −A·r where the clip does not bind."""
        a = self.cfg
        return obj.ppo_clip_coef(
            log_ratio, mb.advantages, self.clip.eps_low, self.clip.eps_high, a.clip_ratio_c, a.delta
        )


def updates_per_step(algo: AlgoConfig | Mapping) -> int:
    """Optimizer steps per RL step of the ``algo`` config: ``ppo_epochs`` x ``num_minibatches``."""
    algo = config_of(AlgoConfig, algo)
    return int(algo.ppo_epochs) * int(algo.num_minibatches)


def sequence_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """[N] one advantage per completion, for the sample logger: ``advantages`` itself when [N]; for per-token
    advantages [N, T] (PPO's GAE, REINFORCE++'s returns) the first response token's, the advantage of the whole
    completion from its prompt (a mean over the tokens would hide it: whitened advantages of equal-length rows
    average to 0). ``mask`` [N, T] bool, right-padded; 0 for a row without a response token."""
    if advantages.dim() == 1:
        return advantages
    first = advantages[:, 0]
    return torch.where(mask[:, 0], first, torch.zeros_like(first))
