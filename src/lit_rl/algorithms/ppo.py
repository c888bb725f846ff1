"""PPO as actor-critic (Schulman et al. 2017), the RLHF way (Ouyang et al. 2022).

- A value head V_phi reads the hidden state that predicts each response token: on the policy's own
  backbone (``algo.value.model=shared``, one extra Linear) or on a separate copy of the backbone
  initialised from the policy (``separate``).
- The sequence reward sits on the last valid token; GAE(gamma, lambda) (Schulman et al. 2016) turns it
  into per-token advantages and returns (``objectives.gae``); advantages are whitened over the batch's
  valid tokens unless ``algo.whiten_advantages=false``.
- ``algo.ppo_epochs`` passes over the rollout batch, each cut into ``algo.num_minibatches`` shuffled
  minibatches, one optimizer step each. ``old_logprobs`` and ``old_values`` are computed once, from the
  snapshot that started the cycle, and stay fixed.
- Loss per token: PPO clipped surrogate + vf_coef * clipped value loss (``objectives.clipped_value_loss``).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from .. import objectives as obj
from ..logprobs import TokenScores, position_ids_from_mask
from ..rollout.datamodule import ScoredRollouts
from ..rollout.types import RolloutBatch
from ..schema import PpoConfig
from .base import MetricSums, RLAlgorithm


class PPO(RLAlgorithm):
    """Actor-critic PPO with GAE and several epochs of minibatch updates per rollout batch."""

    algo_config = PpoConfig
    kl_in_reward = True  # kl.mode=reward: -beta * KL in the per-token reward before GAE
    group_normalised = False  # advantage.std / advantage.scale are refused (its own advantage estimator)

    @classmethod
    def group_baseline(cls, algo) -> bool:
        """False: the critic's value is the baseline (GAE), not the group."""
        return False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        hidden = self.policy.config.hidden_size
        self.value_mode = self.algo_cfg.value.model
        if self.value_mode not in ("shared", "separate"):
            raise ValueError(f"algo.value.model={self.value_mode!r}: choose 'shared' or 'separate'")
        self.critic = copy.deepcopy(self.policy.get_decoder()) if self.value_mode == "separate" else None
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The policy, the value head and (``algo.value.model=separate``) the critic's backbone."""
        return [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("ref_policy.")]

    # -- critic --------------------------------------------------------------------------------------
    def _forward(self, mb: RolloutBatch) -> tuple[TokenScores, Tensor]:
        """(the policy's TokenScores, values [n, T] float32) for a micro-batch."""
        scores = self.logprobs_of(self.policy, mb, return_hidden=True)
        hidden = scores.hidden
        if self.critic is not None:
            p = mb.prompt_ids.shape[1]
            ids = torch.cat([mb.prompt_ids, mb.response_ids], 1)
            att = torch.cat([mb.prompt_mask, mb.response_mask], 1).long()
            h = self.critic(
                input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att), use_cache=False
            ).last_hidden_state
            hidden = h[:, p - 1 : p - 1 + mb.response_ids.shape[1]]
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return scores, values * mb.response_mask

    def advantages(self, scored: ScoredRollouts, rewards: Tensor) -> Tensor:
        """Placeholder [N] zeros: PPO's per-token advantages need the critic and are set in ``update``."""
        return torch.zeros_like(rewards)

    # -- the update ----------------------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self, rb: RolloutBatch) -> None:
        """pi_old and V_old [N, T] under the cycle's starting weights, then GAE advantages and returns."""
        n, t = rb.response_ids.shape
        device = rb.response_ids.device
        old_lp = torch.zeros(n, t, device=device)
        old_v = torch.zeros(n, t, device=device)
        for i in range(0, n, self.micro_batch_size):
            mb = rb.select(slice(i, i + self.micro_batch_size))
            scores, v = self._forward(mb)
            w = scores.logprobs.shape[1]
            old_lp[i : i + len(mb), :w] = scores.logprobs
            old_v[i : i + len(mb), :w] = v
            self.store_old_head(rb, i, scores)
        mask = rb.response_mask
        lengths = mask.sum(-1)
        token_rewards = torch.zeros_like(old_v)
        token_rewards[torch.arange(n, device=device), (lengths - 1).clamp(min=0)] = rb.rewards * (lengths > 0)
        rb.old_logprobs = old_lp
        if self.kl_cfg.mode == "reward":  # the classic RLHF reward: -beta * KL(pi_old || pi_ref) per token
            token_rewards = token_rewards - self.kl_coef * self.reference_kl(rb)
        gae = self.algo_cfg.gae
        adv, returns = obj.gae(token_rewards, old_v, mask, gae.gamma, gae.lam)
        if self.algo_cfg.whiten_advantages:
            adv = self.whiten(adv, mask)
        rb.advantages, rb.old_logprobs, rb.old_values, rb.returns = adv, old_lp, old_v, returns

    def start_update(self, rb: RolloutBatch) -> None:
        """The snapshot (pi_old, the critic's values, GAE advantages) runs even for a single update."""
        self.snapshot(rb)

    def micro_batch_loss(self, mb: RolloutBatch, stats: MetricSums, num_tokens: Tensor, num_seqs: Tensor) -> Tensor:
        m = mb.response_mask
        scores, values = self._forward(mb)
        pg, metrics = self.policy_loss(scores.logprobs, mb.old_logprobs, mb)
        vcfg = self.algo_cfg.value
        vf = obj.clipped_value_loss(values, mb.old_values, mb.returns, vcfg.clip)
        metrics.add("train/value_loss", vf, m)
        loss, loss_metrics = self.finish_loss(
            pg, scores, mb.old_logprobs, mb, num_tokens, num_seqs, extra_loss=vcfg.coef * vf
        )
        stats.record(metrics.extend(loss_metrics))
        return loss
