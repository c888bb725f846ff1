"""Data-parallel bookkeeping of the update and the step's metrics, apart from the RL logic.

With W > 1 ranks (``trainer=ddp|fsdp``) every rank holds its share of the step; what makes the result equal
the single-process one lives here:

- ``MetricSums``: token-weighted sums and counts of the train/* metrics, summed over ranks before the means;
- ``reduce_step_metrics``: the step's rollout/time/perf scalars, summed (``SUMMED_METRICS``), maximised
  (``MAX_METRICS``) or averaged with per-rank weights;
- ``all_reduce_dict``: a name -> float dict reduced over ranks, with a check that every rank holds the same names;
- ``padding_micro_batch``: the zero-loss pass a rank with fewer micro-batches runs so the collectives line up.

The collectives themselves are Lightning's (``RLAlgorithm.all_reduce`` calls ``strategy.reduce``); these
functions take the reduce as an argument, so they run (and are tested) without a process group.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from .. import objectives as obj
from ..rollout.types import RolloutBatch

#: step metrics that add up over ranks (counts) and those whose maximum over ranks is logged; every other
#: rollout/time metric is a mean weighted by ``RLAlgorithm.metric_weights`` (train/* are reduced in ``update``)
SUMMED_METRICS = (
    "rollout/reward_errors",
    "rollout/groups_all_correct",
    "rollout/groups_all_wrong",
    "rollout/groups_kept",
    "perf/rollout_tokens",
    "rollout/dropped_samples",
    "rollout/dropped_samples_total",
    "perf/update_flops",
    "perf/rollout_flops",
)
MAX_METRICS = (
    "rollout/staleness_max",
    "rollout/generation_rounds",
    "time/rollout_s",
    "time/train_s",
    "time/weight_sync_s",
    "time/step_s",
)


class MetricSums:
    """Accumulates sums and counts so that a metric is a mean over all valid tokens of the step."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)

    def add(self, name: str, values: Tensor, mask: Tensor) -> None:
        """Add the masked sum of ``values`` (any shape) and the mask's count under ``name``."""
        self.sums[name] += float(obj.masked_sum(values.detach().float(), mask))
        self.counts[name] += float(mask.sum())

    def add_means(self, means: dict[str, Tensor | float], mask: Tensor) -> None:
        """Add metrics already averaged over ``mask``'s valid tokens, weighted by their count."""
        count = float(mask.sum())
        for name, value in means.items():
            self.sums[name] += float(value) * count
            self.counts[name] += count

    def means(self) -> dict[str, float]:
        """name -> sum / count (0.0 where the count is 0)."""
        return {k: self.sums[k] / self.counts[k] if self.counts[k] else 0.0 for k in self.sums}

    def touch(self, other: MetricSums) -> None:
        """Register ``other``'s names here with zero sum and count (so every rank holds the same names)."""
        for k in other.sums:
            self.sums[k] += 0.0
            self.counts[k] += 0.0

    def all_reduce(self, reduce_sums: Callable[[dict[str, float]], dict[str, float]]) -> MetricSums:
        """Sums and counts summed over data-parallel ranks, in place, so ``means`` weighs every rank's
        tokens (or sequences) alike. ``reduce_sums`` maps a name -> float dict to its sum over ranks
        (``RLAlgorithm.all_reduce_dict``). Returns self."""
        flat = {**{f"sum:{k}": v for k, v in self.sums.items()}, **{f"count:{k}": v for k, v in self.counts.items()}}
        total = reduce_sums(flat)
        for k in list(self.sums):
            self.sums[k], self.counts[k] = total[f"sum:{k}"], total[f"count:{k}"]
        return self


def all_reduce_dict(
    values: dict[str, float],
    reduce: Callable[[Tensor, str], Tensor],
    op: str = "sum",
    *,
    world_size: int,
    rank: int = 0,
) -> dict[str, float]:
    """``values`` reduced name by name over the ranks with ``reduce(tensor, op)`` (``op`` "sum" | "max",
    float64); with ``world_size`` 1 a copy. Raises RuntimeError when the ranks hold different names (checked
    with one small collective first, so a mismatch fails instead of pairing the wrong numbers or hanging)."""
    if world_size == 1:
        return dict(values)
    names = sorted(values)
    crc = float(zlib.crc32("\n".join(names).encode()))
    check = reduce(torch.tensor([crc, -crc], dtype=torch.float64), "max")
    if check[0].item() != -check[1].item():
        raise RuntimeError(f"rank {rank} reduces metrics {names}, another rank different ones")
    total = reduce(torch.tensor([float(values[n]) for n in names], dtype=torch.float64), op)
    return dict(zip(names, total.tolist()))


def reduce_step_metrics(
    metrics: dict[str, float],
    weights: dict[str, float],
    reduce_dict: Callable[[dict[str, float], str], dict[str, float]],
    *,
    summed=SUMMED_METRICS,
    maxima=MAX_METRICS,
) -> dict[str, float]:
    """Combine this rank's step metrics with the other ranks': names in ``summed`` are summed, in ``maxima``
    maximised, every other one is a mean weighted by ``weights`` (default 1). ``reduce_dict(values, op)``
    reduces a name -> float dict over ranks (``RLAlgorithm.all_reduce_dict``). A collective."""
    sums, maxes = {}, {}
    for name, value in metrics.items():
        if name in maxima:
            maxes[name] = float(value)
        elif name in summed:
            sums[name] = float(value)
        else:
            w = float(weights.get(name, 1.0))
            sums[f"sum:{name}"], sums[f"weight:{name}"] = float(value) * w, w
    sums, maxes = reduce_dict(sums, "sum"), reduce_dict(maxes, "max")
    out = {}
    for name in metrics:
        if name in maxes or name in sums:
            out[name] = maxes.get(name, sums.get(name))
        else:
            w = sums[f"weight:{name}"]
            out[name] = sums[f"sum:{name}"] / w if w else 0.0
    return out


def padding_micro_batch(rb: RolloutBatch, pad_token_id: int) -> RolloutBatch:
    """A one-row micro-batch for a rank that has fewer passes than the others: ``rb``'s first prompt and
    one pad token as its only valid response token. It runs the same forward and backward as a real
    micro-batch (so it reaches every parameter the strategy syncs) and its loss is multiplied by 0.
    Raises ValueError if ``rb`` has no rows."""
    if len(rb) == 0:
        raise ValueError(
            "a rank with no rollout rows cannot take part in the update; lower "
            "algo.num_minibatches or raise rollout.prompts_per_step"
        )
    row = rb.select(slice(0, 1))

    def one(x, fill=0.0):
        return None if x is None else x.new_full((1, 1, *x.shape[2:]), fill)

    return replace(
        row,
        response_ids=row.response_ids.new_full((1, 1), pad_token_id),
        response_mask=row.response_mask.new_ones((1, 1)),
        rollout_logprobs=row.rollout_logprobs.new_zeros((1, 1)),
        advantages=row.advantages if row.advantages.dim() == 1 else row.advantages.new_zeros((1, 1)),
        old_logprobs=one(row.old_logprobs),
        behaviour_logprobs=one(row.behaviour_logprobs),
        ref_logprobs=one(row.ref_logprobs),
        topk_ids=one(row.topk_ids, 0),
        topk_logprobs=one(row.topk_logprobs, float("-inf")),
        old_head_logprobs=one(row.old_head_logprobs, float("-inf")),
        old_values=one(row.old_values),
        returns=one(row.returns),
    )
