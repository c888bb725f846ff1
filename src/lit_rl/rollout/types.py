"""The typed objects that travel around the RL loop (see DESIGN.md, "The loop, as data")."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..schema.rollout import SamplingConfig  # noqa: F401  (how the engine samples: the sampling config group)


@dataclass
class Rollouts:
    """What an engine returns for N = len(prompts) sequences, T = longest response in the batch.

    prompt_ids: list of N lists of token ids (no padding).
    response_ids: [N, T] int64, right-padded with the tokenizer's pad id.
    response_mask: [N, T] bool, True on generated tokens (the stop token included).
    rollout_logprobs: [N, T] float32, log-prob (nats) of each sampled token under the distribution it was
        actually sampled from (after temperature and any top-k/top-p truncation); 0 on padding.
    topk_ids / topk_logprobs: [N, T, k + m] int64 / float32 of that same distribution, or None when k + m = 0: its
        top-k (``logprobs_top_k``), then m tail samples (``logprobs_tail_samples``: ids drawn from it with the top-k
        removed, their unconditional log-probs; −inf where the tail is empty).
    finish_reason: N strings, "stop" (a stop token was sampled) or "length" (hit max_new_tokens).
    policy_version: [N] int64, the weight version that generated each sequence (the oldest of its tokens' when
        they span several: what ``rollout.max_staleness`` bounds).
    token_versions: [N, T] int64, the weight version that sampled each token (padding: the row's
        ``policy_version``); None at construction means every token of a row has its ``policy_version``.
    env_mask: [N, T] bool or None: True on the environment's tokens between the model turns of a multi-turn
        episode (``rollout.multiturn``), which the sequence holds but the model did not sample (response_mask
        False there); None: single-turn, every response token is the model's.
    carried: [N] bool or None: ``rollout.partial``, True on the rows an earlier batch started (carried over,
        their first tokens sampled then); None: partial rollouts off.
    """

    prompt_ids: list[list[int]]
    response_ids: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    finish_reason: list[str]
    policy_version: Tensor
    topk_ids: Tensor | None = None
    topk_logprobs: Tensor | None = None
    token_versions: Tensor | None = None
    env_mask: Tensor | None = None
    carried: Tensor | None = None

    def __post_init__(self) -> None:
        if self.token_versions is None:
            self.token_versions = row_versions(self.policy_version, self.response_ids.shape[1])

    @property
    def response_length(self) -> Tensor:
        """[N] int64 number of generated tokens T_i."""
        return self.response_mask.sum(-1)


def row_versions(policy_version: Tensor, width: int) -> Tensor:
    """[N, width] int64: each row's ``policy_version`` [N] on every token (a sequence of one version)."""
    return policy_version.long()[:, None].expand(-1, width).clone()


@dataclass
class RolloutBatch:
    """The training batch of one RL step: N completions of P prompts (G = N / P each).

    Tensors, N rows (T = padded response length, P_max = longest prompt):
    prompt_ids [N, P_max] int64 left-padded; prompt_mask [N, P_max] bool;
    response_ids [N, T] int64 right-padded; response_mask [N, T] bool (valid response tokens: the loss,
    and every statistic, is taken over these only); rollout_logprobs [N, T] float32;
    rewards [N] float32; advantages [N] (or [N, T] for token-level estimators) float32, None until the algorithm
    has computed them (``RLModule.build_batch``);
    group_ids [N] int64 (the prompt id — groups are identified by it, never by row position);
    policy_version [N] int64 (a row's oldest token's version); token_versions [N, T] int64 or None (the version
    that sampled each token; None: the row's policy_version on every token); old_logprobs [N, T] float32 or None
    (filled by the trainer);
    behaviour_logprobs [N, T] float32 or None: the trainer's log-probs under the weights that sampled each
    token (p_o of SPEC's decomposition), filled only when some row is stale (``rollout.mode=lagged|async``);
    None means every row was generated with the weights being trained, so p_o = old_logprobs;
    topk_ids / topk_logprobs [N, T, k] or None; old_head_logprobs [N, T, k] float32 or None: pi_old at the
    head ids, kept by the snapshot for score centering when a batch gets several optimizer steps;
    old_values / returns [N, T] float32 or None (critic);
    reward_parts [N, K] float32 or None: each of the K ``reward.functions``' own reward (NaN: None), for the
    advantages that normalise each reward apart (``advantage.multi_reward=normalize_then_sum``).
    log_ratio_bound [N] float64 or None: a batch-level correction's bound on |log π_old/μ| of a kept token (M2PO's
    cutoff, ``rejection.m2po_bound``; the same for every row of a batch), None: no such correction;
    weight_scale [N] float64 or None: 1/Z, the batch normalisation of the correction's weights
    (``corrections.batch_weight_scale``), None: none.
    env_mask [N, T] bool or None: environment tokens of multi-turn episodes (``Rollouts.env_mask``), attended to
    by the trainer's forward (``attention_mask``) but never scored: response_mask is False there, so they are in
    no ratio, correction weight, KL, entropy, reduction or denominator.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    rewards: Tensor
    advantages: Tensor | None
    group_ids: Tensor
    policy_version: Tensor
    old_logprobs: Tensor | None = None
    behaviour_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    topk_ids: Tensor | None = None
    topk_logprobs: Tensor | None = None
    old_head_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None
    token_versions: Tensor | None = None
    reward_parts: Tensor | None = None
    log_ratio_bound: Tensor | None = None
    weight_scale: Tensor | None = None
    env_mask: Tensor | None = None

    @classmethod
    def of_rollouts(
        cls, r: Rollouts, rewards: Tensor, group_ids: Tensor, pad_token_id: int, reward_parts: dict | None = None
    ) -> "RolloutBatch":
        """The batch of an engine's ``Rollouts`` (prompts left-padded with ``pad_token_id``) with their ``rewards``
        [N] and ``group_ids`` [N] (and each reward function's own [N] rewards, ``reward_parts``, stacked [N, K]);
        advantages None (the algorithm's to compute)."""
        prompt_ids, prompt_mask = left_pad(r.prompt_ids, pad_token_id)
        return cls(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=r.response_ids,
            response_mask=r.response_mask,
            rollout_logprobs=r.rollout_logprobs,
            rewards=rewards,
            advantages=None,
            group_ids=group_ids,
            policy_version=r.policy_version,
            topk_ids=r.topk_ids,
            topk_logprobs=r.topk_logprobs,
            env_mask=r.env_mask,
            token_versions=r.token_versions,
            reward_parts=torch.stack(list(reward_parts.values()), -1) if reward_parts else None,
        )

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def to(self, device) -> "RolloutBatch":
        """Every tensor moved to ``device``."""
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), Tensor)
            },
        )

    def select(self, index: Tensor | slice) -> "RolloutBatch":
        """Rows ``index`` of every tensor, trimmed to the longest prompt and response they contain."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value[index] if isinstance(value, Tensor) else value
        part = RolloutBatch(**out)
        return part.trimmed()

    @property
    def attention_mask(self) -> Tensor:
        """[N, T] bool: the response tokens the sequence holds, the model's and the environment's."""
        return self.response_mask if self.env_mask is None else self.response_mask | self.env_mask

    def trimmed(self) -> "RolloutBatch":
        """Drop all-padding columns: left columns of the prompt, right columns of the response."""
        keep_p = self.prompt_mask.any(0)
        p0 = int(keep_p.nonzero()[0]) if keep_p.any() else self.prompt_mask.shape[1]
        keep_r = self.response_mask.any(0)
        t1 = int(keep_r.nonzero()[-1]) + 1 if keep_r.any() else 0
        changes = {"prompt_ids": self.prompt_ids[:, p0:], "prompt_mask": self.prompt_mask[:, p0:]}
        for name in (
            "response_ids",
            "response_mask",
            "rollout_logprobs",
            "old_logprobs",
            "behaviour_logprobs",
            "ref_logprobs",
            "topk_ids",
            "topk_logprobs",
            "old_head_logprobs",
            "old_values",
            "returns",
            "token_versions",
            "env_mask",
        ):
            value = getattr(self, name)
            if value is not None:
                changes[name] = value[:, :t1]
        if self.advantages is not None and self.advantages.dim() == 2:  # None: not computed yet (build_batch)
            changes["advantages"] = self.advantages[:, :t1]
        return replace(self, **changes)


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists into ([N, L] int64 ids, [N, L] bool mask)."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = True
    return ids, mask


class InFlightSwaps:
    """In-flight weight updates, shared by the engines: ``between_steps`` (set by the async producer; None: no
    in-flight updates) is asked for newer weights before every decode / engine step after the first, and each
    swap's count and pause add to ``_swaps`` ([swaps, seconds] of the current generate call)."""

    between_steps = None

    def _swapped(self, step: int) -> bool:
        """Ask ``between_steps`` for newer weights before step ``step`` (> 0); True when it loaded them (counted,
        with the pause)."""
        if self.between_steps is None or step == 0:
            return False
        t0 = time.perf_counter()
        if not self.between_steps(step):
            return False
        self._swaps[0] += 1
        self._swaps[1] += time.perf_counter() - t0
        return True


@runtime_checkable
class RolloutEngine(Protocol):
    """What the learner asks of a rollout engine; ``TorchEngine`` (embedded) and ``VLLMEngine`` implement it
    (``rollout.engines.ENGINES`` builds them; a test checks both against this Protocol).

    An engine knows no loss: it samples completions with a version of the trainer's weights and reports the
    log-probs it sampled from.

    Attributes:
        version: the trainer's optimizer step whose weights the engine samples with (-1: none loaded yet).
        own_copy: True when the engine holds its own copy of the weights (vLLM always; the embedded engine
            with a mismatch injection or stale rollouts), so ``sync_weights`` may load an older version.
        cancel: a ``threading.Event`` or None; once set, a ``generate`` in progress may stop early
            (the embedded engine raises ``GenerationCancelled``; a vLLM batch runs to its end).
    """

    version: int
    own_copy: bool
    cancel: Any

    def generate(self, prompts: list[list[int]], params: SamplingConfig, seeds: list[int]) -> Rollouts:
        """One completion per prompt (N token-id lists), seeded per sequence; ``Rollouts`` [N, ...]."""
        ...

    def sync_weights(self, version: int, weights: dict[str, Tensor] | None = None) -> None:
        """Sample with the trainer's current weights (of ``version``) or with ``weights`` (a state dict of an
        older version; own copy only) from now on."""
        ...

    def sleep(self) -> None:
        """Release what the engine holds between rollouts (vLLM's sleep mode on GPUs; else a no-op)."""
        ...

    def close(self) -> None:
        """Shut the engine down (idempotent)."""
        ...
