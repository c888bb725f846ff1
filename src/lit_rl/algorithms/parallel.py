"""Data-parallel bookkeeping of the update and the step's metrics, apart from the RL logic.

With W > 1 ranks (``trainer=ddp|fsdp``) every rank holds its share of the step; what makes the result equal
the single-process one lives here:

- ``MetricSums``: token-weighted sums and counts of the train/* metrics, summed over ranks before the means;
- ``reduce_step_metrics``: the step's rollout/time/perf scalars, summed (``SUMMED_METRICS``), maximised
  (``MAX_METRICS``) or averaged with per-rank weights;
- ``all_reduce_dict``: a name -> float dict reduced over ranks, with a check that every rank holds the same names;
- ``all_gather_cat``: every rank's 1-D values in rank order (M2PO's batch cutoff, an order statistic of the step);
- ``padding_micro_batch``: the zero-loss pass a rank with fewer micro-batches runs so the collectives line up;
- ``FSDPStrategy``: Lightning's FSDP strategy, also on CPU processes (gloo); ``full_policy_weights``: the
  full weights gathered from its shards, for the engine's own copy; ``run_as_forward``: the trainer's scoring
  run as an FSDP unit's forward.

The collectives themselves are Lightning's (``RLModule.all_reduce`` calls ``strategy.reduce``); these
functions take the reduce as an argument, so they run (and are tested) without a process group.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy
from torch import Tensor

from .. import objectives as obj
from ..corrections import importance_diagnostics
from ..rollout.types import RolloutBatch

#: step metrics that add up over ranks (counts) and those whose maximum over ranks is logged; every other
#: rollout/time metric is a mean weighted by ``Algorithm.metric_weights`` (train/* are reduced in ``update``)
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
    "rollout/version_span_max",
    "rollout/generation_rounds",
    "time/rollout_s",
    "time/generate_s",
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

    def record(self, metrics) -> None:
        """Fold a micro-batch's ``loss.TokenMetrics`` in, entry by entry (``add`` / ``add_means``)."""
        for name, values, mask, averaged in metrics:
            if averaged:
                self.add_means({name: values}, mask)
            else:
                self.add(name, values, mask)

    def means(self) -> dict[str, float]:
        """name -> sum / count (0.0 where the count is 0); the importance weights' raw moments replaced by the ESS
        and χ² they give (``corrections.importance_diagnostics``: exact for the whole step, all ranks summed)."""
        means = {k: self.sums[k] / self.counts[k] if self.counts[k] else 0.0 for k in self.sums}
        return importance_diagnostics(means)

    def touch(self, other: MetricSums) -> None:
        """Register ``other``'s names here with zero sum and count (so every rank holds the same names)."""
        for k in other.sums:
            self.sums[k] += 0.0
            self.counts[k] += 0.0

    def all_reduce(self, reduce_sums: Callable[[dict[str, float]], dict[str, float]]) -> MetricSums:
        """Sums and counts summed over data-parallel ranks, in place, so ``means`` weighs every rank's
        tokens (or sequences) alike. ``reduce_sums`` maps a name -> float dict to its sum over ranks
        (``RLModule.all_reduce_dict``). Returns self."""
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


def all_gather_cat(values: Tensor, all_gather: Callable[[Tensor], Tensor], *, world_size: int) -> Tensor:
    """Every rank's 1-D ``values`` concatenated in rank order; the ranks may hold different lengths (0 included).
    ``all_gather(t)`` stacks an equal-shaped tensor of every rank into [W, ...] (Lightning's
    ``strategy.all_gather``, a collective): the lengths are gathered first, then each rank's values padded to the
    longest, and the padding dropped. With ``world_size`` 1: ``values``. Two collectives, every rank at the same
    point. Raises ValueError for ``values`` that are not 1-D."""
    if values.dim() != 1:
        raise ValueError(f"all_gather_cat takes a 1-D tensor, got shape {tuple(values.shape)}")
    if world_size == 1:
        return values
    lengths = all_gather(torch.tensor([values.numel()], dtype=torch.long, device=values.device)).reshape(-1)
    longest = int(lengths.max())
    padded = values.new_zeros(longest)
    padded[: values.numel()] = values
    rows = all_gather(padded).reshape(world_size, longest).to(values.device)
    return torch.cat([rows[r, : int(n)] for r, n in enumerate(lengths.tolist())])


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
    reduces a name -> float dict over ranks (``RLModule.all_reduce_dict``). A collective."""
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
        token_versions=None if row.token_versions is None else row.token_versions[:, :1],
        log_ratio_bound=row.log_ratio_bound,
        weight_scale=row.weight_scale,
        env_mask=None if row.env_mask is None else row.env_mask.new_zeros((1, 1)),
    )


class PromptBatchFSDPPrecision(FSDPPrecision):
    """Lightning's ``FSDPPrecision`` for a module whose batches are prompts (``PromptBatch``: text, frozen
    ``Example`` records, no tensors): the input is passed on as it is (Lightning's casts every float tensor of a
    batch and refuses frozen dataclasses); the step makes its tensors itself, under this precision's contexts."""

    def convert_input(self, data):
        return data


class FSDPStrategy(LightningFSDPStrategy):
    """Lightning's ``FSDPStrategy``, unchanged, except that it also runs on CPU processes (gloo).

    Lightning 2.6's accelerator connector refuses FSDP without a GPU by an exact-type check on the strategy
    (``type(strategy) is FSDPStrategy``), although torch's FSDP shards, gathers and reduces on CPU with gloo
    and Lightning handles a CPU root device everywhere else; a subclass passes the check. The one other
    difference: on CPU the module is wrapped with ``device_id=cpu`` (Lightning passes the device's index, None
    for a CPU, and torch's FSDP then looks for an accelerator and refuses). On GPUs it is Lightning's strategy
    as it is, so ``trainer=fsdp`` runs and is tested on a CPU machine with the code that runs on GPUs."""

    @property
    def precision_plugin(self):
        return LightningFSDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if type(plugin) is FSDPPrecision:  # what Lightning's connector gives FSDP: the prompt batches' variant
            plugin = PromptBatchFSDPPrecision(plugin.precision, plugin.scaler)
        LightningFSDPStrategy.precision_plugin.fset(self, plugin)

    def lightning_module_state_dict(self) -> dict[str, Tensor]:
        """The full state dict for a checkpoint. On CPU processes it is gathered without Lightning's
        ``offload_to_cpu`` (for tensors already on the CPU FSDP's offload clone crashed the process, seen on
        torch 2.13: a segmentation fault in the state-dict hook): ``get_model_state_dict`` with
        ``full_state_dict=True``, on every rank. On GPUs: Lightning's, unchanged."""
        if self.root_device.type != "cpu" or self._state_dict_type != "full":
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap each of the module's ``sharded_modules`` (the policy, the reference) as an FSDP root of its own,
        its transformer blocks as inner units (``auto_wrap_policy``); the LightningModule itself stays
        unwrapped, so Lightning then leaves it as it is (it wraps a module only when no FSDP unit is inside).
        Lightning would wrap the LightningModule, and run ``training_step`` inside that root's forward, where
        the RL step's own forwards, backwards and the gradient clip (FSDP asserts an idle root) cannot run."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        pl_module = getattr(model, "module", model)  # Lightning hands the module (or its wrapper) over
        for name in getattr(pl_module, "sharded_modules", ()):
            child = getattr(pl_module, name, None)
            if child is None or isinstance(child, FullyShardedDataParallel):
                continue
            setattr(
                pl_module,
                name,
                FullyShardedDataParallel(
                    module=child,
                    cpu_offload=self.cpu_offload,
                    mixed_precision=self.mixed_precision_config,
                    sharding_strategy=self.sharding_strategy,
                    device_id=self.root_device if self.root_device.type != "cpu" else torch.device("cpu"),
                    **self.kwargs,
                ),
            )
        return super()._setup_model(model)


def full_policy_weights(model: torch.nn.Module, prefix: str) -> dict[str, Tensor]:
    """The full (unsharded) weights of ``model``'s submodule at ``prefix`` (e.g. ``"policy."``), by name within
    that submodule, on every rank: ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with
    ``full_state_dict=True`` (FSDP's all-gather, a collective every rank must join). ``model``: the wrapped
    root (``trainer.strategy.model``); the values are detached copies, on the shards' device and dtype."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {name[len(prefix) :]: value for name, value in full.items() if name.startswith(prefix)}


def run_as_forward(unit: torch.nn.Module, fn: Callable, *args):
    """``fn(module, *args)`` run as the forward of the FSDP unit ``unit`` wrapping ``module``.

    The trainer scores responses with the policy's backbone and its output layer in chunks
    (``logprobs.response_logprobs``), not with the model's ``forward``. Under FSDP a unit's parameters are
    whole only inside its forward (its pre-forward hook gathers them; its post-forward hook frees them and
    registers the backward's gradient reduce-scatter on the outputs), so the scoring runs as that forward: the
    wrapped module's ``forward`` is ``fn`` for this one call. Inner units (decoder layers) run their own
    forwards inside it as usual. Returns what ``fn`` returns (tensors, or a dataclass of tensors)."""
    module = unit.module
    module.forward = lambda *a: fn(module, *a)  # an instance attribute: nn.Module.__call__ finds it first
    try:
        return unit(*args)
    finally:
        del module.forward


def clip_sharded_grad_norm_(params: list[torch.nn.Parameter], max_norm: float, strategy) -> Tensor:
    """Clip FSDP-sharded gradients to a global L2 norm of ``max_norm`` (in place); returns the norm before the
    clip, a float32 scalar, the same on every rank (``torch.nn.utils.clip_grad_norm_``'s contract).

    Each rank's ``params`` (FSDP's original parameters, ``use_orig_params``) hold its shard of each gradient,
    so the squared norm is the sum over ranks of each rank's squares (one all-reduce, ``strategy.reduce``);
    the clip coefficient min(1, max_norm / (norm + 1e-6)) is then applied to every shard, as FSDP's own
    ``clip_grad_norm_`` does for one root (the policy and the reference are two roots here)."""
    with_grad = [p for p in params if p.grad is not None]
    squares = [p.grad.detach().float().square().sum() for p in with_grad]
    local = torch.stack(squares).sum() if squares else torch.zeros((), device=strategy.root_device)
    total = strategy.reduce(local.to(strategy.root_device), reduce_op="sum").sqrt().float()
    if with_grad and math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    return total
