"""The RL step as one LightningModule, ``RLModule``: fixed, the same for every algorithm and rollout mode.

The class reads in call order. One step, as ``training_step`` runs it (DESIGN.md, "The loop"):

1. Rollouts. ``source.collect`` (``rollout.sources``: the rollout mode, its engine and every weight sync) asks
   the algorithm (``Algorithm.collect``) to fill this rank's share of the step's prompts -> ``ScoredRollouts``;
   ``rollout_metrics`` and ``Algorithm.metric_weights`` describe them.
2. The batch. ``build_batch``: the algorithm's ``shape_rewards``, a padded ``RolloutBatch`` on the device, the
   algorithm's ``advantages`` (once per step; PPO's GAE takes π_old there, ``snapshot``) and ``finish_batch``.
3. The update. ``update`` runs the PPO schedule, ``epochs`` x ``num_minibatches`` optimizer steps (1 x 1 by
   default; ``start_update`` / ``snapshot`` fix pi_old when there are several). Each optimizer step is
   ``accumulate_gradients`` over ``micro_batches``: ``micro_batch_loss`` takes the algorithm's
   ``policy_terms`` (the tokens scored, the objective's per-token loss) and ``loss.assemble_loss`` adds the
   train-inference corrections (with the objective's ``score_coefficients``), the KL and entropy terms and
   reduces to a scalar normalised by the whole step's totals (tokens, sequences), so the gradient does not
   depend on how the batch is cut. ``optimizer_step`` (``optimization``) steps through Lightning's precision
   plugin, which calls ``on_before_optimizer_step`` to clip the gradient and drop a non-finite update.
4. Logging (``step_logging``). ``step_flops`` / ``flop_rates`` add the efficiency metrics,
   ``reduce_step_metrics`` combines the ranks' values (``parallel``), ``write_step_metrics`` writes them at
   x = the RL step. Evaluation between steps: ``evaluation``.

What one paper changes is its ``Algorithm`` (``algorithms.base``, an ``nn.Module`` child: PPO's critic trains and
checkpoints with the policy); what a rollout mode changes is its ``RolloutSource``. This class never branches on
either.

Several data-parallel ranks (DDP or FSDP): each rank samples its contiguous share of the step's prompts (whole
groups), and the update reproduces the single-process gradient of the whole step (the step's totals summed over
ranks, each rank's loss times the world size, one all-reduce per optimizer step); every logged value is reduced
over ranks before rank 0 writes it. The bookkeeping lives in ``parallel``; the collectives are Lightning's.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Mapping
from typing import ClassVar

import lightning as L
import torch
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel

from .. import objectives as obj
from ..logprobs import TokenScores, resolve_shared_prefix, response_logprobs
from ..loss import LossSettings, assemble_loss
from ..models import adapter_key, has_lora
from ..rollout.datamodule import PromptBatch, RolloutDataModule, ScoredRollouts
from ..rollout.engines import build_engine
from ..rollout.sources import RolloutSource, source_class
from ..rollout.staleness import partial_fraction, token_staleness
from ..rollout.types import RolloutBatch
from ..rollout.weight_casts import WeightCasts
from ..schema import (
    AdvantageConfig,
    AlgoConfig,
    CorrectionConfig,
    DistillConfig,
    EngineConfig,
    KlConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    SamplingConfig,
    TrainConfig,
    UpdateConfig,
    config_of,
    plain_data,
)
from . import parallel
from .base import Algorithm, sequence_advantages, updates_per_step
from .evaluation import EvaluationMixin
from .old_policy import OldPolicyMixin
from .optimization import OptimizationMixin
from .parallel import MetricSums
from .reference import ReferenceMixin
from .step_logging import FIRST_LOGGED_STEP, StepLoggingMixin


def group_micro_batches(group_ids: Tensor, lengths: Tensor, size: int) -> list[Tensor]:
    """Row indices (int64 [m] each) of micro-batches of at most ``size`` rows that keep groups whole.

    group_ids: [N] int, the prompt each row belongs to (``RolloutBatch.group_ids``); lengths: [N] each row's
    prompt + response tokens. Groups are taken longest first (a group's length: its longest row) and packed in
    order: a group joins the current micro-batch if it fits, else starts the next; a group of more than
    ``size`` rows is cut into pieces of ``size`` (each piece runs its prompt once: still exact). Within a
    micro-batch, rows keep their group's order, longest first."""
    groups = [(group_ids == g).nonzero().squeeze(-1) for g in torch.unique(group_ids)]
    groups = [rows[torch.argsort(lengths[rows], descending=True, stable=True)] for rows in groups]
    groups.sort(key=lambda rows: -int(lengths[rows].max()))  # stable: equal lengths keep the group order
    out: list[list[Tensor]] = []
    filled = size
    for rows in groups:
        for piece in torch.split(rows, size):
            if filled + piece.numel() > size:
                out.append([])
                filled = 0
            out[-1].append(piece)
            filled += piece.numel()
    return [torch.cat(parts) for parts in out]


def algorithm_class(algo: AlgoConfig | Mapping | None) -> type[Algorithm]:
    """The ``Algorithm`` class of the ``algo`` config group's ``name`` (default grpo; ``algorithms.ALGORITHMS``).
    Raises ``UnknownChoice`` naming the field."""
    from . import ALGORITHMS

    name = algo.get("name", AlgoConfig.name) if isinstance(algo, Mapping) else getattr(algo, "name", AlgoConfig.name)
    return ALGORITHMS[name]


#: state-dict key prefixes of an algorithm's own modules in checkpoints written before the algorithm was a child of
#: the step (PPO's critic and value head were attributes of the LightningModule itself)
ALGORITHM_KEYS_BEFORE = ("value_head.", "critic.")


def upgraded_state_dict(state_dict: dict) -> dict:
    """``state_dict`` with the keys of a checkpoint written before the algorithm became the step's child module
    (``value_head.*``, ``critic.*``) under their names now (``algorithm.value_head.*``...); other keys as they are."""
    return {f"algorithm.{k}" if k.startswith(ALGORITHM_KEYS_BEFORE) else k: v for k, v in state_dict.items()}


class RLModule(OptimizationMixin, OldPolicyMixin, StepLoggingMixin, EvaluationMixin, ReferenceMixin, L.LightningModule):
    """The RL step: rollouts from the source, the algorithm's advantages and objective, the exact micro-batched
    update.

    Args:
        policy: a transformers causal LM (the embedded engine samples with this same object).
        tokenizer: its tokenizer (pad and stop ids).
        sampling: how the engine samples training rollouts (``schema.SamplingConfig``, or a mapping of its fields).
        eval_sampling: the same for evaluation (temperature 0 = greedy pass@1).
        group_size: G; micro_batch_size: sequences per forward/backward in the update.
        advantage, loss, algo, kl, optim, correction, engine, rollout_mode: the config groups of the same names
            (``rollout_mode`` is the ``rollout`` section), each a dataclass of ``lit_rl.schema`` or a mapping
            of its fields: what a mapping leaves out takes the same default as the YAML files (``algo`` its
            algorithm's own, ``Algorithm.algo_config``), and a key that is not a field raises TypeError.
            ``algo.name`` picks the ``Algorithm`` (``algorithms.ALGORITHMS``), ``rollout_mode.mode`` the
            ``RolloutSource`` (``rollout.sources.ROLLOUT_SOURCES``).
        logprob_chunk_tokens: rows of float32 logits alive at once in the trainer's log-prob pass.

    The engine (``rollout.engines.build_engine``) holds its own copy of the weights with an ``engine.dtype`` or the
    int8 round trip, always for vLLM, and where the source samples while the trainer updates (async).
    """

    # -- construction and Lightning's set-up -----------------------------------------------------------------------
    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        sampling: SamplingConfig | Mapping,
        eval_sampling: SamplingConfig | Mapping,
        group_size: int,
        micro_batch_size: int,
        advantage: AdvantageConfig | Mapping | None = None,
        loss: LossConfig | Mapping | None = None,
        algo: AlgoConfig | Mapping | None = None,
        kl: KlConfig | Mapping | None = None,
        optim: OptimConfig | Mapping | None = None,
        logprob_chunk_tokens: int = TrainConfig.logprob_chunk_tokens,
        correction: CorrectionConfig | Mapping | None = None,
        engine: EngineConfig | Mapping | None = None,
        rollout_mode: RolloutConfig | Mapping | None = None,
        update: UpdateConfig | Mapping | None = None,
        distill: DistillConfig | Mapping | None = None,
        teacher: torch.nn.Module | None = None,
    ):
        models = ("self", "policy", "tokenizer", "teacher", "__class__")
        hparams = {k: plain_data(v) for k, v in locals().items() if k not in models}
        super().__init__()
        self.save_hyperparameters(hparams)  # the config as plain data (``resume.check_checkpoint_fits`` reads algo)
        self.automatic_optimization = False
        self.policy, self.tokenizer = policy, tokenizer
        self.sampling = config_of(SamplingConfig, sampling)
        self.eval_sampling = config_of(SamplingConfig, eval_sampling)
        self.group_size, self.micro_batch_size = group_size, micro_batch_size
        #: L_max of a completion (``loss.reduction=constant``, DAPO's overlong penalty): a multi-turn run sets the
        #: episode's ``rollout.max_total_tokens`` (``run.train.build_module``)
        self.max_response_length = int(self.sampling.max_new_tokens)
        self.advantage_cfg, self.loss_cfg = config_of(AdvantageConfig, advantage), config_of(LossConfig, loss)
        algorithm = algorithm_class(algo)
        algo_cfg = config_of(algorithm.algo_config, algo)
        self.kl_cfg, self.optim_cfg = config_of(KlConfig, kl), config_of(OptimConfig, optim)
        self.chunk_tokens = logprob_chunk_tokens
        self.correction, self.update_cfg = config_of(CorrectionConfig, correction), config_of(UpdateConfig, update)
        #: each prompt's forward runs once per micro-batch for the rows that share it (``update.shared_prefix``,
        #: resolved by ``logprobs.resolve_shared_prefix``); micro-batches are then cut along whole groups
        self.shared_prefix, why = resolve_shared_prefix(self.update_cfg.shared_prefix, policy, group_size)
        if why and self.update_cfg.shared_prefix == "auto" and group_size >= 2:
            print(f"lit_rl: update.shared_prefix=auto is off: {why}", flush=True)
        stop_ids = [tokenizer.eos_token_id]
        gen_eos = getattr(policy.generation_config, "eos_token_id", None) if policy.generation_config else None
        stop_ids += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        rollout_cfg = config_of(RolloutConfig, rollout_mode)
        source = source_class(rollout_cfg)
        #: where the step's rollouts come from (``rollout.mode``): the engine, every weight sync into it, the
        #: weight versions a stale mode keeps (``lit_rl.rollout.sources``)
        self.source: RolloutSource = source(
            build_engine(
                engine,
                policy,
                tokenizer.pad_token_id,
                stop_ids,
                max_logprobs=self.sampling.logprobs_top_k,
                own_copy=source.engine_owns_weights(rollout_cfg),
            ),
            rollout_cfg,
        )
        #: beta, the KL coefficient this step uses: kl.beta, moved by the adaptive controller when kl.target is set
        self.kl_coef = float(self.kl_cfg.beta)
        #: the frozen models' weight casts (``scoring_pass``), kept for the run: id(model) -> WeightCasts
        self.frozen_casts: dict[int, WeightCasts] = {}
        self.ref_policy = None
        #: a LoRA policy (``model.lora.r > 0``): the reference is the frozen base the policy shares, scored with the
        #: adapter disabled (``models.adapter_disabled``), never a second copy of the weights
        self.lora = has_lora(policy)
        #: True when a reference policy is scored (kl.beta > 0 or kl.track): ``ref_policy`` or the shared base
        self.has_reference = bool(self.kl_cfg.beta > 0 or self.kl_cfg.track)
        if self.has_reference and not self.lora:
            self.ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
        self.setup_teacher(teacher, distill)  # distill.teacher: frozen, scored like the reference (``reference``)
        #: what the paper changes (``algorithms.base.Algorithm``); built last, as its parameters (PPO's critic)
        #: come after the policy's
        self.algorithm: Algorithm = algorithm(algo_cfg, policy)

    @property
    def algo_cfg(self) -> AlgoConfig:
        """The ``algo`` config group, the algorithm's own dataclass."""
        return self.algorithm.cfg

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates: the policy's trainable parameters (with LoRA the adapter's only), then the
        algorithm's (PPO's critic); never the frozen reference's."""
        return [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("ref_policy.")]

    def on_fit_start(self) -> None:
        self.datamodule.set_start_step(lambda: self.global_step // self.updates_per_step)

    @property
    def sharded(self) -> bool:
        """True when the trainer shards the weights over ranks (``trainer=fsdp``)."""
        return self._trainer is not None and isinstance(self.trainer.strategy, parallel.FSDPStrategy)

    #: the submodules FSDP shards, each its own FSDP root (``parallel.FSDPStrategy``): the policy and the frozen ones
    sharded_modules: ClassVar[tuple[str, ...]] = ("policy", "ref_policy", "teacher")

    def setup(self, stage: str) -> None:
        """Before the strategy wraps the module (``RolloutSource.setup``: under FSDP the engine's own copy)."""
        self.source.setup(self, self.sharded)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """``RolloutSource.before_step``: under FSDP the sync happens here, outside the wrapped forward."""
        self.source.before_step(self, self.sharded)

    @property
    def engine(self):
        """The rollout engine (``RolloutEngine``) of the source."""
        return self.source.engine

    @engine.setter
    def engine(self, engine) -> None:
        self.source.engine = engine

    def full_policy_weights(self) -> dict[str, Tensor] | None:
        """The policy's full weights for an engine sync: under FSDP gathered from the shards (a collective every
        rank joins); None otherwise (the engine reads the policy's own tensors)."""
        return parallel.full_policy_weights(self.trainer.strategy.model, "policy.") if self.sharded else None

    @property
    def datamodule(self) -> RolloutDataModule:
        return self.trainer.datamodule

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        """Prompt batches hold text, not tensors: nothing to move."""
        return batch

    # -- the RL step (Lightning's training_step), then its parts in the order it calls them ------------------------
    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        t0 = time.perf_counter()
        step = self.rl_steps_done() + FIRST_LOGGED_STEP  # its number in logs, samples, messages
        # this rank's share of the step's prompts, sampled with the weights the source chooses (rollout.mode)
        scored, collect_metrics, t_sync = self.source.collect(self, batch)
        self.count_reward_failures(scored, step)  # a reward function failing step after step stops the run here
        t_rollout = time.perf_counter() - t0
        metrics = {"time/generate_s": t_rollout, **self.rollout_metrics(scored), **collect_metrics}  # async: its own
        weights = self.algorithm.metric_weights(self, batch, scored, metrics)

        t1 = time.perf_counter()
        rb = self.build_batch(scored)  # the algorithm's advantages (PPO's GAE with its snapshot) count as training
        metrics.update(self.algorithm.batch_metrics(self, rb))  # e.g. rollout/advantage/<reward> (GDPO)
        # for the sample logger (``run.callbacks.SampleLogger``): one per completion (per-token: the first token's)
        self.last_step = (step, scored, sequence_advantages(rb.advantages, rb.response_mask))
        self.source.score_behaviour(self, rb)  # p_o of rows generated by older weights (stale sources)
        train_metrics = self.update(rb)  # already reduced over ranks
        train_metrics.update({**self.adapt_kl_coef(train_metrics, len(rb)), **self.distill_metrics()})
        t_train = time.perf_counter() - t1

        metrics["time/rollout_s"] = t_rollout
        metrics["time/weight_sync_s"] = t_sync  # pushing the weights into an engine with its own copy
        metrics["time/train_s"] = t_train
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["perf/rollout_tokens"] = int(scored.rollouts.response_mask.sum())
        metrics["perf/threads"] = float(torch.get_num_threads())  # threads=adaptive changes it per step
        metrics.update(self.step_flops(scored, rb))
        metrics = self.reduce_step_metrics(metrics, weights)
        tokens, t_generate = metrics.pop("perf/rollout_tokens"), metrics["time/generate_s"]
        metrics["perf/rollout_tokens_per_s"] = tokens / t_generate if t_generate > 0 else 0.0  # the engine's rate
        metrics.update(self.flop_rates(metrics))
        metrics.update(train_metrics)
        self.write_step_metrics(metrics, step)
        self.check_logprob_gap(metrics, step)  # correction.guard: warn or stop on the numerical gap
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(rb), logger=False)
        self.log("reward", metrics["rollout/reward_mean"], prog_bar=True, logger=False, batch_size=len(rb))
        self.log("tok/s", metrics["perf/rollout_tokens_per_s"], prog_bar=True, logger=False, batch_size=len(rb))
        self.log("mfu", metrics["perf/mfu"], prog_bar=True, logger=False, batch_size=len(rb))

    # -- 1. rollouts: this rank's share of the step's prompts, generated and scored --------------------------------
    def collect(self, batch: PromptBatch) -> tuple[ScoredRollouts, dict[str, float]]:
        """Generate and score this rank's share of the step's rollouts the algorithm's way (``Algorithm.collect``)
        with the engine as the source has set it. Returns (ScoredRollouts, rollout metrics of this rank)."""
        return self.algorithm.collect(self, batch)

    def rollout_metrics(self, scored: ScoredRollouts) -> dict[str, float]:
        r = scored.rollouts
        lengths = r.response_length.float()
        groups = scored.group_ids.unique()
        # correctness is the verifier's (reward.correct_from), not a threshold on the weighted reward
        all_correct = sum(bool(scored.correct[scored.group_ids == g].all()) for g in groups)
        all_wrong = sum(not bool(scored.correct[scored.group_ids == g].any()) for g in groups)
        parts = {}
        for name, values in scored.reward_parts.items():  # reward.functions: each one's mean, None left out
            applicable = ~values.isnan()
            parts[f"rollout/reward/{name}"] = float(values[applicable].mean()) if applicable.any() else 0.0
        return {
            **parts,
            "rollout/reward_mean": float(scored.rewards.mean()),
            "rollout/reward_errors": float(scored.reward_errors),
            "rollout/response_length_mean": float(lengths.mean()),
            "rollout/truncation_rate": sum(f == "length" for f in r.finish_reason) / max(len(r.finish_reason), 1),
            "rollout/groups_all_correct": float(all_correct),
            "rollout/groups_all_wrong": float(all_wrong),
            **token_staleness(r, self.global_step, self.updates_per_step),
            **partial_fraction(r),
        }

    # -- 2. the batch: rewards -> RolloutBatch -> advantages ------------------------------------------------------
    def build_batch(self, scored: ScoredRollouts) -> RolloutBatch:
        """Pad the scored rollouts into a ``RolloutBatch`` on the device, with the algorithm's shaped rewards
        (``shape_rewards``), its advantages (``advantages``) and its last changes (``finish_batch``)."""
        r = scored.rollouts
        rewards = self.algorithm.shape_rewards(self, scored)
        rb = RolloutBatch.of_rollouts(
            r, rewards, scored.group_ids, self.tokenizer.pad_token_id, scored.reward_parts
        ).to(self.device)
        rb.advantages = self.distill_advantages(rb, self.algorithm.advantages(self, rb))  # + distill.mode=advantage
        self.algorithm.finish_batch(self, scored, rb)
        return rb

    # -- 3. the update: the PPO schedule of exact micro-batched optimizer steps ------------------------------------
    def update(self, rb: RolloutBatch) -> dict[str, float]:
        """``epochs`` passes over the rollout batch, each cut into ``num_minibatches`` shuffled
        minibatches, one optimizer step each (the PPO schedule; 1 x 1 by default). Returns train/* metrics,
        reduced over data-parallel ranks (each rank shuffles and cuts its own share)."""
        opt = self.optimizers()
        self.start_update(rb)
        stats = MetricSums()
        loss_total, norms, lr = 0.0, [], float("nan")
        gen = torch.Generator().manual_seed(int(self.global_step))
        for _ in range(self.epochs):
            order = torch.randperm(len(rb), generator=gen) if self.num_minibatches > 1 else torch.arange(len(rb))
            for chunk in torch.tensor_split(order, self.num_minibatches):
                _, part_loss = self.accumulate_gradients(rb.select(chunk), stats)
                if self.world_size > 1:  # the whole step's loss: every rank then skips a non-finite update alike
                    part_loss = float(self.all_reduce(torch.tensor(part_loss, dtype=torch.float64)))
                loss_total += part_loss / self.updates_per_step
                lr = float(opt.param_groups[0]["lr"])  # the rate this update uses (the scheduler moves it after)
                norms.append(self.optimizer_step(opt, part_loss))
        if self.world_size > 1:
            stats.all_reduce(self.all_reduce_dict)
        out = stats.means()
        out["train/loss"] = loss_total
        out["train/grad_norm"] = sum(norms) / len(norms)
        out["train/lr"] = lr  # the rate the step's (last) update used, not the next step's
        out["train/skipped_updates"] = float(self.skipped_updates)
        out["time/old_logprob_s"] = self.old_logprob_s  # the pi_old pass (0 without one: bypass, one update)
        if self.grad_scaler is not None:  # 16-mixed: the loss scale the next step starts from
            out["train/grad_scale"] = float(self.grad_scaler.get_scale())
        return out

    @property
    def epochs(self) -> int:
        """Passes over each rollout batch (``algo.ppo_epochs``)."""
        return int(self.algo_cfg.ppo_epochs)

    @property
    def num_minibatches(self) -> int:
        """Optimizer steps per pass (``algo.num_minibatches``)."""
        return int(self.algo_cfg.num_minibatches)

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per RL step; Lightning's ``global_step`` counts these."""
        return updates_per_step(self.algo_cfg)

    def accumulate_gradients(self, rb: RolloutBatch, stats: MetricSums | None = None) -> tuple[MetricSums, float]:
        """Backward of the whole batch's loss into ``.grad``, one micro-batch at a time.

        Each micro-batch's loss is normalised by the totals of the whole batch (tokens, sequences), so the
        accumulated gradient equals that of the whole batch at once, whatever ``micro_batch_size`` is.

        With W > 1 data-parallel ranks ``rb`` is this rank's share and the whole batch is the union of the
        shares: the totals are summed over ranks, each rank's loss is multiplied by W (DDP and FSDP average
        gradients over ranks), so the synced gradient is the single-process gradient of the whole batch.
        Every rank runs the same number of forward/backward passes, the most any rank has (a rank with
        fewer, or none, pads with ``padding_micro_batch`` passes whose loss is multiplied by 0), and only
        the last pass syncs gradients (the others run under ``strategy.block_backward_sync``): one
        all-reduce per optimizer step, on every rank.

        Returns this rank's metric sums (token-weighted) and its part of the loss; summed over ranks the
        parts are the batch's loss. Raises ValueError when a rank must pad but ``rb`` has no rows.
        """
        mask = rb.response_mask
        num_tokens = mask.sum()
        num_seqs = (mask.sum(-1) > 0).sum()
        stats = MetricSums() if stats is None else stats
        # a micro-batch without valid tokens (e.g. every completion masked out) has nothing to learn from
        parts = [mb for mb in self.micro_batches(rb) if mb.response_mask.any()]
        world, passes = self.world_size, len(parts)
        if world > 1:
            local = torch.stack([num_tokens, num_seqs, torch.tensor(passes, device=num_tokens.device)])
            gathered = self.all_gather(local)  # [W, 3]
            num_tokens, num_seqs = gathered[:, 0].sum(), gathered[:, 1].sum()
            passes = int(gathered[:, 2].max())
        loss_total = 0.0
        with self.update_casts():
            for i in range(passes):
                real = i < len(parts)
                mb = parts[i] if real else self.padding_micro_batch(rb)
                mb_stats = stats if real else MetricSums()
                sync = world == 1 or i == passes - 1
                with contextlib.nullcontext() if sync else self.trainer.strategy.block_backward_sync():
                    loss = self.micro_batch_loss(mb, mb_stats, num_tokens=num_tokens, num_seqs=num_seqs)
                    scaled = loss if world == 1 else loss * (world if real else 0.0)
                    if self._trainer is not None:
                        self.manual_backward(scaled)
                    else:
                        scaled.backward()
                if real:
                    loss_total += float(loss.detach())
                else:
                    stats.touch(mb_stats)  # the same metric names on every rank, with nothing added
        return stats, loss_total

    def micro_batches(self, rb: RolloutBatch) -> list[RolloutBatch]:
        """Split into micro-batches of at most ``micro_batch_size`` rows and similar total length (less padding;
        results do not depend on it). With ``shared_prefix`` on, along whole groups (``group_micro_batches``)."""
        lengths = rb.prompt_mask.sum(-1) + rb.response_mask.sum(-1)
        if self.shared_prefix:
            return [rb.select(rows) for rows in group_micro_batches(rb.group_ids, lengths, self.micro_batch_size)]
        order = torch.argsort(lengths, descending=True, stable=True)
        return [rb.select(order[i : i + self.micro_batch_size]) for i in range(0, len(rb), self.micro_batch_size)]

    def padding_micro_batch(self, rb: RolloutBatch) -> RolloutBatch:
        """``parallel.padding_micro_batch`` of ``rb`` with this tokenizer's pad id."""
        return parallel.padding_micro_batch(rb, self.tokenizer.pad_token_id)

    def micro_batch_loss(self, mb: RolloutBatch, stats: MetricSums, num_tokens: Tensor, num_seqs: Tensor) -> Tensor:
        """The scalar loss of one micro-batch, already divided by the whole step's totals: the algorithm's
        ``policy_terms`` (the tokens scored, the objective's per-token loss), then ``loss.assemble_loss`` with
        this run's settings (the corrections with the objective's ``score_coefficients``, the extra term, the
        entropy bonus, the KL to the reference scored here); every term's metrics recorded once into ``stats``."""
        terms = self.algorithm.policy_terms(self, mb)
        loss, metrics = assemble_loss(
            terms.pg_loss,
            terms.scores,
            terms.old_logprobs,
            mb,
            self.loss_settings,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            score_coefficients=lambda log_ratio, sampled: self.algorithm.score_coefficients(log_ratio, sampled, mb),
            ref_logprobs=self.reference_logprobs(mb) if self.has_reference else None,
            kl_coef=self.kl_coef,
            extra_loss=terms.extra_loss,
            teacher_logprobs=self.teacher_logprobs(mb) if self.distill_in_loss else None,
            distill_coef=float(self.distill_cfg.coef),
        )
        stats.record(terms.metrics.extend(metrics))
        return loss

    def logprobs_of(self, model: torch.nn.Module, mb: RolloutBatch, **kwargs) -> TokenScores:
        """Trainer log-probs (and entropies, and the SC head when on) of a micro-batch, under the sampler's
        distribution: its temperature and its top-k / top-p truncation."""
        head_ids = mb.topk_ids if self.correction.sc.enabled and model is self.policy else None
        if model is self.policy and self.loss_cfg.entropy_coef and kwargs.get("with_entropy", True):
            kwargs.setdefault("entropy_grad", True)  # the entropy bonus differentiates it
        if isinstance(model, FullyShardedDataParallel):  # FSDP: score inside the unit's forward (its weights whole)
            return parallel.run_as_forward(model, self._score, mb, head_ids, kwargs)
        return self._score(model, mb, head_ids, kwargs)

    def update_casts(self) -> contextlib.AbstractContextManager:
        """The block of the update's micro-batches, in which each of the policy's linear weights is cast to
        the autocast dtype once per update (its weights change only at the optimizer step), not at every forward as
        autocast does under Lightning's ``bf16-mixed`` (``cache_enabled=False``): ``WeightCasts(track=True)``, the
        same values and gradients (``TrackedCast``). Nothing is cast outside autocast or under FSDP."""
        if self.sharded or isinstance(self.policy, FullyShardedDataParallel):
            return contextlib.nullcontext()
        return WeightCasts(track=True).installed(self.policy)

    def scoring_pass(self, model: torch.nn.Module | None = None) -> contextlib.AbstractContextManager:
        """A block of no-gradient forwards of ``model`` (default: the policy) in which each linear weight is cast to
        the autocast dtype once, not at every forward (``rollout.weight_casts.WeightCasts``: the same tensors reach
        ``F.linear``, so the same log-probs bit for bit). The policy's casts live for the block (its weights change
        at each optimizer step); a frozen model's (``ref_policy``, ``teacher``) for the run, ~2 bytes per linear
        parameter under bf16. Nothing is cast outside autocast, with gradients tracked, or under FSDP (sharded
        weights are gathered per forward)."""
        model = self.policy if model is None else model
        if self.sharded or isinstance(model, FullyShardedDataParallel):
            return contextlib.nullcontext()
        if model is self.policy:
            return WeightCasts().installed(model)
        return self.frozen_casts.setdefault(id(model), WeightCasts()).installed(model, keep=True)

    def _score(self, model: torch.nn.Module, mb: RolloutBatch, head_ids, kwargs) -> TokenScores:
        return response_logprobs(
            model,
            mb.prompt_ids,
            mb.prompt_mask,
            mb.response_ids,
            mb.response_mask,
            temperature=self.sampling.temperature,
            top_k=self.sampling.top_k,
            top_p=self.sampling.top_p,
            chunk_tokens=self.chunk_tokens,
            head_ids=head_ids,
            shared_prefix=kwargs.pop("shared_prefix", self.shared_prefix),  # the teacher's own (``reference``)
            env_mask=mb.env_mask,
            **kwargs,
        )

    @property
    def loss_settings(self) -> LossSettings:
        """What ``loss.assemble_loss`` reads from the config groups (``loss``, ``correction``, ``kl``, ``sampling``),
        read at each call."""
        return LossSettings.from_config(self.loss_cfg, self.correction, self.kl_cfg, self.max_response_length)

    def whiten(self, adv: Tensor, mask: Tensor) -> Tensor:
        """(adv - mean) / (std + 1e-8) over the valid tokens of the whole step (all data-parallel ranks);
        [N, T] in and out, 0 at invalid tokens; unchanged when the step has at most one valid token."""
        if self.world_size == 1:
            if mask.sum() <= 1:
                return adv
            mean = obj.masked_mean(adv, mask)
            std = obj.masked_mean((adv - mean) ** 2, mask).sqrt()
        else:  # the same two passes with sums and counts over ranks
            sums = torch.stack([mask.sum().double(), obj.masked_sum(adv, mask).double()])
            count, total = self.all_reduce(sums).tolist()
            if count <= 1:
                return adv
            mean = adv.new_tensor(total / count)
            sq = float(self.all_reduce(obj.masked_sum((adv - mean) ** 2, mask).double()))
            std = adv.new_tensor(sq / count).sqrt()
        return torch.where(mask, (adv - mean) / (std + 1e-8), torch.zeros_like(adv))

    # -- what stale rollouts need from the learner (``rollout.staleness.Learner``) ---------------------------------
    @property
    def policy_version(self) -> int:
        """Optimizer steps taken: the version of the policy's current weights (Lightning's ``global_step``)."""
        return self.global_step

    def prompt_batch(self, step: int) -> PromptBatch:
        """This rank's prompts of RL step ``step``."""
        return self.datamodule.batch_for(step)

    def precision_context(self) -> contextlib.AbstractContextManager:
        """The trainer's precision context (autocast), entered by threads that run the policy for it."""
        trainer = self._trainer
        return trainer.precision_plugin.train_step_context() if trainer is not None else contextlib.nullcontext()

    @torch.no_grad()
    def score_rows(self, rb: RolloutBatch, rows: Tensor) -> Tensor:
        """float32 [len(rows), T] log-probs of rows ``rows`` (int64 [n]) of ``rb`` [N, T] under the policy's
        current weights, ``micro_batch_size`` rows at a time; 0 past each micro-batch's longest response."""
        out = torch.zeros(rows.numel(), rb.response_ids.shape[1], device=rb.response_ids.device)
        with self.scoring_pass():
            for i in range(0, rows.numel(), self.micro_batch_size):
                idx = rows[i : i + self.micro_batch_size]
                lp = self.logprobs_of(self.policy, rb.select(idx), with_entropy=False).logprobs
                out[i : i + idx.numel(), : lp.shape[1]] = lp.float()
        return out

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lit_rl"] = {
            "skipped_updates": self.skipped_updates,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "kl_coef": self.kl_coef,  # the adaptive controller's beta
        }
        source_state = self.source.state_dict()  # lagged: the weight history, so a resume samples exactly as before
        if source_state is not None:
            checkpoint["lit_rl"]["stale_rollouts"] = source_state

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """The step's own state (the guard's counters, beta, the source's); the weights' keys of a checkpoint
        written before the algorithm became a child module are renamed first (``upgraded_state_dict``)."""
        if "state_dict" in checkpoint:
            checkpoint["state_dict"] = upgraded_state_dict(checkpoint["state_dict"])
        state = checkpoint.get("lit_rl", {})
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.kl_coef = float(state.get("kl_coef", self.kl_coef))
        if "stale_rollouts" in state:
            self.source.load_state_dict(state["stale_rollouts"], next(self.policy.parameters()).device)

    def saved_key(self, name: str) -> bool:
        """True for a state-dict key a checkpoint holds: not the frozen reference copy's nor the teacher's, and with
        LoRA not the frozen base weights': the policy's adapter only."""
        if name.startswith(("ref_policy.", "teacher.")):
            return False
        return not (self.lora and name.startswith("policy.") and not adapter_key(name))

    def state_dict(self, *args, **kwargs):
        """The trained weights only (``saved_key``): the policy's (with LoRA its adapter's), PPO's critic."""
        sd = super().state_dict(*args, **kwargs)
        return {k: v for k, v in sd.items() if self.saved_key(k)}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Strict about every key except those ``state_dict`` leaves out (``saved_key``).
        Raises RuntimeError naming missing and unexpected keys."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if self.saved_key(k)]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"checkpoint does not fit this module: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
            )
        return result

    # -- the end of the run ----------------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        self.source.close()  # no producer thread outlives the run (exceptions: ``RolloutSourceShutdown``)

    def teardown(self, stage: str) -> None:
        """Shut the rollout engine down (vLLM's engine core and its files) at the end of fit."""
        self.source.close_engine()
