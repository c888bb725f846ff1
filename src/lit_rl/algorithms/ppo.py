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
from ..rollout.types import RolloutBatch
from ..schema import PpoConfig
from .base import Algorithm, PolicyTerms


class PPO(Algorithm):
    """Actor-critic PPO with GAE and several epochs of minibatch updates per rollout batch."""

    algo_config = PpoConfig

    def __init__(self, algo=None, policy: nn.Module | None = None):
        super().__init__(algo, policy)
        hidden = policy.config.hidden_size
        self.value_mode = self.cfg.value.model
        if self.value_mode not in ("shared", "separate"):
            raise ValueError(f"algo.value.model={self.value_mode!r}: choose 'shared' or 'separate'")
        self.critic = copy.deepcopy(policy.get_decoder()) if self.value_mode == "separate" else None
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    # -- critic --------------------------------------------------------------------------------------
    def _forward(self, learner, mb: RolloutBatch) -> tuple[TokenScores, Tensor]:
        """(the policy's TokenScores, values [n, T] float32) for a micro-batch."""
        scores = learner.logprobs_of(learner.policy, mb, return_hidden=True)
        hidden = scores.hidden
        if self.critic is not None:
            p = mb.prompt_ids.shape[1]
            ids = torch.cat([mb.prompt_ids, mb.response_ids], 1)
            att = torch.cat([mb.prompt_mask, mb.attention_mask], 1).long()
            h = self.critic(
                input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att), use_cache=False
            ).last_hidden_state
            hidden = h[:, p - 1 : p - 1 + mb.response_ids.shape[1]]
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return scores, values * mb.response_mask

    # -- the advantages: the snapshot of the cycle's starting weights, then GAE ----------------------
    @torch.no_grad()
    def advantages(self, learner, rb: RolloutBatch) -> Tensor:
        """[N, T] GAE advantages (whitened over the step's valid tokens unless ``algo.whiten_advantages=false``)
        from pi_old and V_old under the cycle's starting weights, which are kept in ``rb`` (``old_logprobs``,
        ``old_values``, ``returns``) for every epoch and minibatch of the update."""
        n, t = rb.response_ids.shape
        device = rb.response_ids.device
        old_lp = torch.zeros(n, t, device=device)
        old_v = torch.zeros(n, t, device=device)
        with learner.scoring_pass():  # each policy weight cast to the autocast dtype once for the pass
            for i in range(0, n, learner.micro_batch_size):
                mb = rb.select(slice(i, i + learner.micro_batch_size))
                scores, v = self._forward(learner, mb)
                w = scores.logprobs.shape[1]
                old_lp[i : i + len(mb), :w] = scores.logprobs
                old_v[i : i + len(mb), :w] = v
                learner.store_old_head(rb, i, scores)
        mask = rb.response_mask
        lengths = mask.sum(-1)
        token_rewards = torch.zeros_like(old_v)
        # on the last model token (in a multi-turn episode environment tokens lie between the model's turns)
        last = torch.where(mask, torch.arange(t, device=device).expand(n, t), -1).max(-1).values
        token_rewards[torch.arange(n, device=device), last.clamp(min=0)] = rb.rewards * (lengths > 0)
        rb.old_logprobs = old_lp
        if learner.kl_cfg.mode == "reward":  # the classic RLHF reward: -beta * KL(pi_old || pi_ref) per token
            token_rewards = token_rewards - learner.kl_coef * learner.reference_kl(rb)
        gae = self.cfg.gae
        adv, returns = obj.gae(token_rewards, old_v, mask, gae.gamma, gae.lam)
        if self.cfg.whiten_advantages:
            adv = learner.whiten(adv, mask)
        rb.old_values, rb.returns = old_v, returns
        return adv

    # -- the loss ------------------------------------------------------------------------------------
    def policy_terms(self, learner, mb: RolloutBatch) -> PolicyTerms:
        """The clipped surrogate on pi_old of the snapshot, plus vf_coef x the clipped value loss per token."""
        scores, values = self._forward(learner, mb)
        pg, metrics = self.policy_loss(scores.logprobs, mb.old_logprobs, mb)
        vcfg = self.cfg.value
        vf = obj.clipped_value_loss(values, mb.old_values, mb.returns, vcfg.clip)
        metrics.add("train/value_loss", vf, mb.response_mask)
        return PolicyTerms(scores, mb.old_logprobs, pg, metrics, extra_loss=vcfg.coef * vf)
