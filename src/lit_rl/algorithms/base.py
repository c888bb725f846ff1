"""The shared base of every algorithm: one RL step per Lightning training step.

The class reads in call order. One step, as ``training_step`` runs it (DESIGN.md, "The loop"):

1. Rollouts. ``engine.sync_weights`` (sync mode; ``rollout.staleness`` for lagged / async), then
   ``collect``: the engine (a ``RolloutEngine``) samples G completions for this rank's prompts and the
   task's verifier scores them -> ``ScoredRollouts``; ``rollout_metrics`` and ``metric_weights`` describe them.
2. The batch. ``build_batch``: ``shape_rewards`` (DAPO's overlong penalty), ``advantages`` (the baseline)
   -> a padded ``RolloutBatch`` on the device.
3. The update. ``update`` runs the PPO schedule, ``epochs`` x ``num_minibatches`` optimizer steps (1 x 1 by
   default; ``start_update`` / ``snapshot`` fix pi_old when there are several). Each optimizer step is
   ``accumulate_gradients`` over ``micro_batches``: ``micro_batch_loss`` scores the tokens
   (``logprobs_of``), takes the objective's per-token loss (``policy_loss``) and hands it to ``finish_loss``,
   which applies the train-inference corrections (``correct`` -> ``corrections.correct_policy_loss``, with
   the objective's ``score_coefficients``), adds the KL and value terms and reduces to a scalar normalised by
   the whole step's totals (tokens, sequences), so the gradient does not depend on how the batch is cut.
   ``optimizer_step`` steps through Lightning's precision plugin (manual optimisation), which calls
   ``on_before_optimizer_step`` to clip the unscaled gradient and drop a non-finite update.
4. Logging. ``step_flops`` / ``flop_rates`` add the efficiency metrics (``lit_rl.flops``),
   ``reduce_step_metrics`` combines the ranks' values (``parallel``), ``write_step_metrics`` writes them at
   x = the RL step.

A subclass states only what differs, by overriding the pieces named in steps 1-3: ``advantages`` and
``group_baseline`` (the baseline), ``policy_loss`` and ``score_coefficients`` (the objective), and where an
algorithm needs them ``collect`` (DAPO's dynamic sampling), ``shape_rewards``, ``build_batch``,
``metric_weights``, ``snapshot``, ``micro_batch_loss`` and ``trainable_parameters`` (PPO's critic); its
``algo`` defaults are ``algo_config`` (``lit_rl.schema``).

Several data-parallel ranks (Lightning's DDP or FSDP, ``trainer=ddp``): each rank samples with its own
embedded engine on its contiguous share of the step's prompts (whole groups), and the update reproduces the
single-process gradient of the whole step: the step's totals are summed over ranks, each rank's loss is
multiplied by the world size (the strategy averages gradients over ranks), and gradients are all-reduced
once per optimizer step. Every logged value is reduced over ranks before rank 0 writes it. The bookkeeping
lives in ``parallel``; all collectives go through Lightning's strategy (``self.all_gather``,
``strategy.reduce``).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Mapping
from typing import ClassVar

import lightning as L
import torch
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel

from .. import corrections as corr
from .. import objectives as obj
from ..logprobs import TokenScores, resolve_shared_prefix, response_logprobs
from ..loss import LossSettings, TokenMetrics, assemble_loss
from ..models import adapter_disabled, adapter_key, has_lora
from ..rollout.datamodule import PromptBatch, RolloutDataModule, ScoredRollouts
from ..rollout.engines import build_engine
from ..rollout.sources import RolloutSource, source_class
from ..rollout.types import RolloutBatch, SamplingParams, left_pad
from ..run.flops import FlopModel
from ..schema import (
    AdvantageConfig,
    AlgoConfig,
    CorrectionConfig,
    EngineConfig,
    KlConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    UpdateConfig,
    config_of,
)
from ..tasks.reward_functions import pass_at_k
from . import parallel
from .parallel import MetricSums


class NonFiniteUpdates(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient (``optim.max_nonfinite_updates``)."""


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


def updates_per_step(algo: AlgoConfig | Mapping) -> int:
    """Optimizer steps per RL step of the ``algo`` config: ``ppo_epochs`` x ``num_minibatches``."""
    algo = config_of(AlgoConfig, algo)
    return int(algo.ppo_epochs) * int(algo.num_minibatches)


class RLAlgorithm(L.LightningModule):
    """Base LightningModule: rollouts with the embedded engine, exact micro-batched policy-gradient update.

    Args:
        policy: a transformers causal LM (the engine samples with this same object).
        tokenizer: its tokenizer (pad and stop ids).
        sampling: ``SamplingParams`` fields for training rollouts.
        eval_sampling: fields for evaluation (temperature 0 = greedy pass@1).
        group_size: G; micro_batch_size: sequences per forward/backward in the update.
        advantage, loss, algo, kl, optim, correction, engine, rollout_mode: the config groups of the same names
            (``rollout_mode`` is the ``rollout`` section), each a dataclass of ``lit_rl.schema`` or a mapping
            of its fields: what a mapping leaves out takes the same default as the YAML files (``algo`` this
            algorithm's own, ``algo_config``), and a key that is not a field raises TypeError.
        logprob_chunk_tokens: rows of float32 logits alive at once in the trainer's log-prob pass.

    The engine (``rollout.engines.build_engine``): for the embedded engine a dtype or the int8 round trip gives
    it its own copy of the weights; the vLLM engine always holds its own, pushed from the trainer at every
    step; stale rollout modes (``rollout.staleness``) give the engine its own copy too.
    """

    # -- construction and Lightning's set-up -----------------------------------------------------------------------
    #: this algorithm's ``algo`` defaults (its conf/algo/<name>.yaml, for modules built from Python)
    algo_config: ClassVar[type[AlgoConfig]] = AlgoConfig
    #: the objective is the PPO clipped surrogate (``policy_loss`` below), so ``algo.clip_ratio_c`` (dual clip) and
    #: ``algo.delta`` apply; an algorithm with another objective sets False and ``config.validate`` refuses them
    ppo_clip: ClassVar[bool] = True
    #: the objective reads ``algo.clip.eps_low`` / ``eps_high`` (a ratio clip or truncation); an algorithm without
    #: one (REINFORCE, SAPO's soft gate) sets False and ``config.validate`` refuses values other than the preset's
    uses_clip: ClassVar[bool] = True
    #: the advantages are ``objectives.group_advantages`` of the ``advantage`` group (alpha, eps, std, scale); an
    #: algorithm with its own estimator (PPO's GAE, REINFORCE's baselines) sets False and ``config.validate``
    #: refuses a non-default ``advantage.std`` / ``advantage.scale`` for it
    group_normalised: ClassVar[bool] = True
    #: the algorithm has per-token returns that ``kl.mode=reward`` folds the KL to the reference into (its
    #: ``snapshot`` calls ``reference_kl``); False: ``config.validate`` refuses kl.mode=reward for it
    kl_in_reward: ClassVar[bool] = False

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        sampling: dict,
        eval_sampling: dict,
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
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["policy", "tokenizer"])
        self.automatic_optimization = False
        self.policy = policy
        self.tokenizer = tokenizer
        self.sampling = SamplingParams(**sampling)
        self.eval_sampling = SamplingParams(**eval_sampling)
        self.group_size, self.micro_batch_size = group_size, micro_batch_size
        self.advantage_cfg = config_of(AdvantageConfig, advantage)
        self.loss_cfg = config_of(LossConfig, loss)
        self.algo_cfg = config_of(self.algo_config, algo)
        self.clip_cfg = self.algo_cfg.clip
        self.kl_cfg, self.optim_cfg = config_of(KlConfig, kl), config_of(OptimConfig, optim)
        self.chunk_tokens = logprob_chunk_tokens
        self.correction = config_of(CorrectionConfig, correction)
        self.update_cfg = config_of(UpdateConfig, update)
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
        self.ref_policy = None
        #: a LoRA policy (``model.lora.r > 0``): the reference is the frozen base the policy shares, scored with the
        #: adapter disabled (``models.adapter_disabled``), never a second copy of the weights
        self.lora = has_lora(policy)
        #: True when a reference policy is scored (kl.beta > 0 or kl.track): ``ref_policy`` or the shared base
        self.has_reference = bool(self.kl_cfg.beta > 0 or self.kl_cfg.track)
        if self.has_reference and not self.lora:
            self.ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)

    def configure_optimizers(self):
        """AdamW over ``trainable_parameters`` with a linear warm-up over ``optim.warmup_steps`` optimizer steps."""
        cfg = self.optim_cfg
        params = self.trainable_parameters()
        # torch's fused AdamW (one kernel per tensor: on the CPU 0.07 s against the per-tensor loop's 0.25 s for
        # SmolLM2-135M) where it applies: float tensors on the CPU or CUDA, and no 16-mixed gradient scaler (whose
        # unscale the precision plugin does itself before the step)
        fused = self.grad_scaler is None and all(
            p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
        )
        opt = torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), fused=fused or None
        )
        warmup = int(cfg.warmup_steps)
        if warmup <= 0:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates: the policy's trainable parameters (with LoRA the adapter's only; PPO adds
        its critic)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def on_fit_start(self) -> None:
        self.datamodule.set_start_step(lambda: self.global_step // self.updates_per_step)

    @property
    def sharded(self) -> bool:
        """True when the trainer shards the weights over ranks (``trainer=fsdp``)."""
        return self._trainer is not None and isinstance(self.trainer.strategy, parallel.FSDPStrategy)

    #: the submodules FSDP shards, each its own FSDP root (``parallel.FSDPStrategy``): the policy and the reference
    sharded_modules: ClassVar[tuple[str, ...]] = ("policy", "ref_policy")

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
        """The policy's full weights for an engine sync: under FSDP gathered from the shards
        (``parallel.full_policy_weights``, a collective every rank joins); None otherwise (the engine reads
        the policy's own tensors)."""
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
        rl_step = self.global_step // self.updates_per_step
        # this rank's share of the step's prompts, sampled with the weights the source chooses (rollout.mode)
        scored, collect_metrics, t_sync = self.source.collect(self, batch)
        t_rollout = time.perf_counter() - t0
        metrics = {**self.rollout_metrics(scored), **collect_metrics}
        weights = self.metric_weights(batch, scored, metrics)

        rb = self.build_batch(scored)
        self.last_step = (rl_step, scored, rb.advantages)  # for the sample logger (``train.SampleLogger``)
        t1 = time.perf_counter()
        self.source.score_behaviour(self, rb)  # p_o of rows generated by older weights (stale sources)
        train_metrics = self.update(rb)  # already reduced over ranks
        train_metrics.update(self.adapt_kl_coef(train_metrics, len(rb)))
        t_train = time.perf_counter() - t1

        metrics["time/rollout_s"] = t_rollout
        metrics["time/weight_sync_s"] = t_sync  # pushing the weights into an engine with its own copy
        metrics["time/train_s"] = t_train
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["perf/rollout_tokens"] = int(scored.rollouts.response_mask.sum())
        metrics["perf/threads"] = float(torch.get_num_threads())  # threads=adaptive changes it per step
        metrics.update(self.step_flops(scored, rb))
        metrics = self.reduce_step_metrics(metrics, weights)
        tokens, t_rollout = metrics.pop("perf/rollout_tokens"), metrics["time/rollout_s"]
        metrics["perf/rollout_tokens_per_s"] = tokens / t_rollout if t_rollout > 0 else 0.0
        metrics.update(self.flop_rates(metrics))
        metrics.update(train_metrics)
        self.write_step_metrics(metrics, rl_step)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(rb), logger=False)
        self.log("reward", metrics["rollout/reward_mean"], prog_bar=True, logger=False, batch_size=len(rb))
        self.log("tok/s", metrics["perf/rollout_tokens_per_s"], prog_bar=True, logger=False, batch_size=len(rb))
        self.log("mfu", metrics["perf/mfu"], prog_bar=True, logger=False, batch_size=len(rb))

    # -- 1. rollouts: this rank's share of the step's prompts, generated and scored --------------------------------
    def collect(self, batch: PromptBatch):
        """Generate and score this rank's share of the step's rollouts. Returns (ScoredRollouts, rollout
        metrics of this rank, reduced over ranks by ``reduce_step_metrics``)."""
        scored = self.datamodule.collect(
            self.engine, batch.examples, self.sampling, batch.step, first_index=batch.offset
        )
        return scored, {}

    def rollout_metrics(self, scored: ScoredRollouts) -> dict[str, float]:
        r = scored.rollouts
        lengths = r.response_length.float()
        groups = scored.group_ids.unique()
        all_correct = sum(bool((scored.rewards[scored.group_ids == g] >= 1).all()) for g in groups)
        all_wrong = sum(bool((scored.rewards[scored.group_ids == g] <= 0).all()) for g in groups)
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
            # in RL steps: versions count optimizer steps, updates_per_step of them per RL step
            "rollout/staleness_mean": float((self.global_step - r.policy_version).float().mean())
            / self.updates_per_step,
            "rollout/staleness_max": float((self.global_step - r.policy_version).max()) / self.updates_per_step,
        }

    def metric_weights(self, batch: PromptBatch, scored: ScoredRollouts, metrics: dict[str, float]) -> dict[str, float]:
        """The weight of each rank's mean when ``reduce_step_metrics`` averages it over ranks. Default: the
        rank's completions (rollout/* means are per completion); a subclass adds what it logs otherwise."""
        weights = {name: float(len(scored.rewards)) for name in metrics}
        for name, values in scored.reward_parts.items():  # a function's mean counts its applicable completions
            weights[f"rollout/reward/{name}"] = float((~values.isnan()).sum())
        return weights

    # -- 2. the batch: rewards -> advantages -> RolloutBatch -------------------------------------------------------
    def build_batch(self, scored: ScoredRollouts) -> RolloutBatch:
        """Pad the scored rollouts into a ``RolloutBatch`` with advantages."""
        r = scored.rollouts
        rewards = self.shape_rewards(scored)
        prompt_ids, prompt_mask = left_pad(r.prompt_ids, self.tokenizer.pad_token_id)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=r.response_ids,
            response_mask=r.response_mask,
            rollout_logprobs=r.rollout_logprobs,
            rewards=rewards,
            advantages=self.advantages(scored, rewards),
            group_ids=scored.group_ids,
            policy_version=r.policy_version,
            topk_ids=r.topk_ids,
            topk_logprobs=r.topk_logprobs,
        ).to(self.device)

    def shape_rewards(self, scored: ScoredRollouts) -> Tensor:
        """[N] rewards the advantages see. Default: the task reward as is."""
        return scored.rewards

    def advantages(self, scored: ScoredRollouts, rewards: Tensor) -> Tensor:
        """[N] float32 advantages. Default: group-normalised with exponent alpha (GRPO / Dr.GRPO)."""
        valid = scored.rollouts.response_length > 0
        a = self.advantage_cfg
        batch_std = None
        if a.scale == "batch" and self.world_size > 1:  # the step's std spans every rank's rewards
            r = torch.where(valid, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))
            moments = self.all_reduce(torch.stack([valid.sum().double(), r.sum(), (r**2).sum()]))
            batch_std = float(obj.std_from_moments(*moments.tolist(), a.std))
        return obj.group_advantages(
            rewards,
            scored.group_ids,
            alpha=a.alpha,
            eps=a.eps,
            valid=valid,
            std=a.std,
            scale=a.scale,
            batch_std=batch_std,
        )

    @classmethod
    def group_baseline(cls, algo) -> bool:
        """True when the advantage's baseline is a statistic of the prompt's group (so ``rollout.group_size``
        must be >= 2: a group of one has zero advantage). ``algo``: the ``algo`` config group. Default: True
        (``objectives.group_advantages``)."""
        return True

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

    def start_update(self, rb: RolloutBatch) -> None:
        """What the update needs before its first optimizer step: pi_old (``snapshot``) when the batch gets
        several optimizer steps (with one, the training forward itself is pi_old)."""
        if self.updates_per_step > 1 and rb.old_logprobs is None:
            self.snapshot(rb)

    @torch.no_grad()
    def snapshot(self, rb: RolloutBatch) -> None:
        """Fill ``rb.old_logprobs`` [N, T]: pi_old, the weights this update cycle starts from, fixed for
        all its epochs and minibatches. (With a single update the training forward itself is pi_old and
        this pass is skipped.)"""
        n, t = rb.response_ids.shape
        rb.old_logprobs = torch.zeros(n, t, device=rb.response_ids.device)
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
        """The scalar loss of one micro-batch, already divided by the whole step's totals: the tokens scored, the
        objective's per-token loss (``policy_loss``), the rest assembled by ``finish_loss``; the metrics of every
        term recorded once into ``stats``."""
        scores = self.logprobs_of(self.policy, mb)
        # One update per rollout batch: the trainer's own forward *is* the snapshot pi_old.
        old_logprobs = mb.old_logprobs if mb.old_logprobs is not None else scores.logprobs.detach()
        pg_loss, metrics = self.policy_loss(scores.logprobs, old_logprobs, mb)
        loss, loss_metrics = self.finish_loss(pg_loss, scores, old_logprobs, mb, num_tokens, num_seqs)
        stats.record(metrics.extend(loss_metrics))
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
            shared_prefix=self.shared_prefix,
            **kwargs,
        )

    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, mb: RolloutBatch) -> tuple[Tensor, TokenMetrics]:
        """(Per-token loss [n, T] to minimise, the objective's metrics). Default: PPO clipped surrogate (GRPO)."""
        a = self.algo_cfg
        loss, clip_low, clip_high = obj.ppo_clip_loss(
            logprobs,
            old_logprobs,
            mb.advantages,
            self.clip_cfg.eps_low,
            self.clip_cfg.eps_high,
            a.clip_ratio_c,
            a.delta,
        )
        mask = mb.response_mask
        metrics = TokenMetrics()
        metrics.add("train/pg_clipfrac", (clip_low | clip_high).float(), mask)
        metrics.add("train/pg_clipfrac_lower", clip_low.float(), mask)
        metrics.add("train/pg_clipfrac_upper", clip_high.float(), mask)
        if a.clip_ratio_c is not None or a.delta is not None:  # its own name: verl's pg_clipfrac_lower is this one
            dual = obj.dual_clip_binds(
                logprobs.detach() - old_logprobs, mb.advantages, self.clip_cfg.eps_high, a.clip_ratio_c, a.delta
            )
            metrics.add("train/pg_clipfrac_dual", dual.float(), mask)
        return loss, metrics

    @property
    def loss_settings(self) -> LossSettings:
        """What ``loss.assemble_loss`` reads from the config groups (``loss``, ``correction``, ``kl``, ``sampling``),
        read at each call."""
        return LossSettings(
            reduction=self.loss_cfg.reduction,
            max_response_length=self.sampling.max_new_tokens,
            weight_rule=corr.weight_function(self.correction),
            score_centering=self.correction.sc.enabled,
            entropy_coef=self.loss_cfg.entropy_coef,
            kl_estimator=self.kl_cfg.estimator,
            kl_in_loss=self.kl_cfg.mode == "loss",
        )

    def finish_loss(
        self,
        pg_loss: Tensor,
        scores: TokenScores,
        old_logprobs: Tensor,
        mb: RolloutBatch,
        num_tokens: Tensor,
        num_seqs: Tensor,
        extra_loss: Tensor | None = None,
    ) -> tuple[Tensor, TokenMetrics]:
        """``loss.assemble_loss`` of the objective's per-token loss with this run's settings: the corrections
        (with this objective's ``score_coefficients``), ``extra_loss``, the entropy bonus, the KL to the
        reference (scored here when there is one) and the reduction by the step's totals.
        Returns (the scalar loss, the terms' metrics)."""
        return assemble_loss(
            pg_loss,
            scores,
            old_logprobs,
            mb,
            self.loss_settings,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            score_coefficients=lambda log_ratio, sampled: self.score_coefficients(log_ratio, sampled, mb),
            ref_logprobs=self.reference_logprobs(mb) if self.has_reference else None,
            kl_coef=self.kl_coef,
            extra_loss=extra_loss,
        )

    @torch.no_grad()
    def reference_logprobs(self, mb: RolloutBatch) -> Tensor:
        """[n, T] float32 log-probs of the micro-batch's response tokens under the frozen reference policy (the
        sampler's temperature / top-k / top-p, like the trainer's): the ``ref_policy`` copy, or with LoRA the
        policy itself with its adapter disabled (the shared base weights). No gradient."""
        if not self.lora:
            return self.logprobs_of(self.ref_policy, mb, with_entropy=False).logprobs
        with adapter_disabled(self.policy):  # lora.dropout acts on the adapter's input only: off here too
            return self._score(self.policy, mb, None, {"with_entropy": False}).logprobs

    @torch.no_grad()
    def reference_kl(self, rb: RolloutBatch) -> Tensor:
        """[N, T] the per-token KL estimate (``kl.estimator``) of pi_old (``rb.old_logprobs``) to the frozen
        reference on the sampled tokens, 0 on padding; zeros without a reference. For ``kl.mode=reward``: a
        ``snapshot`` folds −beta times it into the per-token reward, and the step's KL per sequence goes to
        ``self.reward_kl`` (summed over ranks: the adaptive controller's measurement)."""
        kl = torch.zeros_like(rb.old_logprobs)
        if not self.has_reference:
            return kl
        for i in range(0, len(rb), self.micro_batch_size):
            mb = rb.select(slice(i, i + self.micro_batch_size))
            ref = self.reference_logprobs(mb)
            w = ref.shape[1]
            kl[i : i + len(mb), :w] = obj.approx_kl(rb.old_logprobs[i : i + len(mb), :w], ref, self.kl_cfg.estimator)
        kl = torch.where(rb.response_mask, kl, torch.zeros_like(kl))
        seqs = rb.response_mask.any(-1)
        sums = torch.stack([kl.sum().double(), seqs.sum().double()])
        total, count = self.all_reduce(sums).tolist()
        self.reward_kl = total / count if count else 0.0
        return kl

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

    def adapt_kl_coef(self, train_metrics: dict[str, float], rows: int) -> dict[str, float]:
        """Log this step's beta as ``train/kl_coef`` and, with ``kl.target`` set, move it for the next step with
        the adaptive controller (``objectives.adaptive_kl_coef``; Ziegler et al. 2019) from the step's KL per
        sequence (``kl.mode=loss``: ``train/ref_kl_seq`` of the update; ``reward``: the snapshot's, logged as
        ``train/ref_kl_seq`` too) and n_steps = the step's sequences over all ranks (``rows`` on this rank)."""
        out = {"train/kl_coef": self.kl_coef} if self.has_reference else {}
        if self.kl_cfg.mode == "reward" and self.has_reference:
            out["train/ref_kl_seq"] = float(getattr(self, "reward_kl", 0.0))
        cfg = self.kl_cfg
        if cfg.target is not None and self.has_reference:
            kl = out.get("train/ref_kl_seq", train_metrics.get("train/ref_kl_seq", 0.0))
            n_steps = rows * self.world_size
            self.kl_coef = obj.adaptive_kl_coef(self.kl_coef, kl, float(cfg.target), float(cfg.horizon), n_steps)
        return out

    def score_coefficients(self, log_ratio: Tensor, sampled_log_ratio: Tensor, mb: RolloutBatch) -> Tensor:
        """∂ℓ_t/∂log π of ``policy_loss`` had a token with log(π_θ / π_old) = ``log_ratio`` [n, T, J] been
        sampled at position t (``sampled_log_ratio`` [n, T]: the sampled tokens'); [n, T, J]. Score
        centering under a correction evaluates it at the engine's head ids (``corrections.centering_term``).
        Default: the PPO clipped surrogate's, −A·r where the clip does not bind (GRPO, DAPO, Dr.GRPO)."""
        a = self.algo_cfg
        return obj.ppo_clip_coef(
            log_ratio, mb.advantages, self.clip_cfg.eps_low, self.clip_cfg.eps_high, a.clip_ratio_c, a.delta
        )

    def optimizer_step(self, opt, loss: float = 0.0) -> float:
        """Step ``opt`` (Lightning's optimizer wrapper) on the accumulated gradient, zero it, advance the lr
        schedule; returns the pre-clip gradient norm (``train/grad_norm``).

        ``opt.step()`` goes through Lightning's precision plugin, which calls ``on_before_optimizer_step``
        (the clip, below) after unscaling 16-mixed's loss-scaled gradients and before the step; with a
        gradient scaler the step is the scaler's, which skips an update whose gradient overflowed and lowers
        the scale. ``loss`` (the step's loss, unscaled) decides, with the gradient, whether the update is kept.
        """
        self._step_loss, self._grad_norm = float(loss), float("nan")
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        return self._grad_norm

    @property
    def grad_scaler(self):
        """The precision plugin's gradient scaler (``torch.amp.GradScaler`` under 16-mixed), else None."""
        plugin = self.trainer.precision_plugin if self._trainer is not None else None
        return getattr(plugin, "scaler", None)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Clip the gradient to ``optim.grad_clip`` and keep or drop the update; Lightning calls this inside
        ``optimizer_step``'s ``opt.step()``, after the precision plugin has unscaled the gradient.

        A non-finite loss or gradient drops the update (the step still counts, so Lightning's step counter
        and the RL step stay aligned) and is counted in ``train/skipped_updates``. After
        ``optim.max_nonfinite_updates`` such updates in a row (0 = never) raises ``NonFiniteUpdates``
        naming the step; the last checkpoint stays the one written before. Under a gradient scaler
        (16-mixed) an overflow with a finite loss is the scaler's to handle while its scale is above 1 (it
        skips the step and halves the scale): counted as skipped, not towards the limit.
        """
        params = [p for group in optimizer.param_groups for p in group["params"]]
        max_norm = self.optim_cfg.grad_clip or float("inf")  # 0 / None = no clipping (validated >= 0)
        if self.sharded:  # each rank holds a shard of every gradient: the norm of all ranks' shards
            norm = float(parallel.clip_sharded_grad_norm_(params, max_norm, self.trainer.strategy))
        else:  # one device, or DDP (after the all-reduce every rank holds the same gradient)
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self._grad_norm = norm
        loss = getattr(self, "_step_loss", 0.0)
        if math.isfinite(norm) and math.isfinite(loss):
            self.nonfinite_in_a_row = 0
            return
        for p in params:
            p.grad = None  # AdamW skips parameters without a gradient (a scaler skips the step anyway)
        self.skipped_updates += 1
        scaler = self.grad_scaler
        if scaler is not None and math.isfinite(loss) and scaler.get_scale() > 1.0:
            return  # a loss-scale overflow: the scaler skips this step and lowers its scale
        self.nonfinite_in_a_row += 1
        limit = int(self.optim_cfg.max_nonfinite_updates or 0)
        if limit and self.nonfinite_in_a_row >= limit:
            raise NonFiniteUpdates(
                f"{self.nonfinite_in_a_row} updates in a row had a non-finite loss or gradient "
                f"(loss={loss}, grad_norm={norm}); stopped at RL step {self.global_step // self.updates_per_step}"
                f" (optimizer step {self.global_step}, optim.max_nonfinite_updates={limit}). "
                f"The last checkpoint holds the weights these updates started from: lower optim.lr (or check "
                f"the rewards) before continuing from it"
            )

    skipped_updates: int = 0

    nonfinite_in_a_row: int = 0

    # -- 4. logging: the step's metrics reduced over data-parallel ranks (``parallel``), then written --------------
    #: peak FLOP/s of one device at the run's precision (``hardware.peak_flops``), that ``perf/mfu`` divides
    #: by; ``lit_rl.train.run`` sets it at start-up, else the first step measures it
    peak_flops: float | None = None

    @property
    def flop_model(self) -> FlopModel:
        """The policy's ``FlopModel`` (verl's FlopsCounter convention), built once."""
        if getattr(self, "_flop_model", None) is None:
            self._flop_model = FlopModel.from_config(
                self.policy.config, num_parameters=sum(p.numel() for p in self.policy.parameters())
            )
        return self._flop_model

    def step_flops(self, scored: ScoredRollouts, rb: RolloutBatch) -> dict[str, float]:
        """This rank's FLOPs of the step (``lit_rl.flops``): ``perf/rollout_flops``, generating the scored
        completions (2·N per generated token + attention), and ``perf/update_flops``, ``epochs`` forward +
        backward passes over the rows that carry loss (6·N per valid prompt and response token + attention)."""
        r = scored.rollouts
        rollout = self.flop_model.rollout_flops([len(p) for p in r.prompt_ids], r.response_length.tolist())
        response = rb.response_mask.sum(-1)
        seq = (rb.prompt_mask.sum(-1) + response)[response > 0]
        update = self.epochs * self.flop_model.update_flops(seq.tolist())
        return {"perf/rollout_flops": rollout, "perf/update_flops": update}

    def flop_rates(self, metrics: dict[str, float]) -> dict[str, float]:
        """From the step's FLOPs and times, reduced over ranks (FLOPs summed, times the slowest rank's):
        ``perf/update_tflops`` and ``perf/rollout_tflops`` (TFLOP/s), ``perf/peak_tflops`` (all ranks' peak)
        and ``perf/mfu`` = update FLOP rate / peak. Measures ``peak_flops`` on first use if unset."""
        if self.peak_flops is None:
            from ..run.hardware import peak_flops

            accelerator = "cuda" if self.device.type == "cuda" else "cpu"
            precision = self.trainer.precision if self._trainer is not None else "32-true"
            self.peak_flops = peak_flops(precision, accelerator)[0]
        t_train, t_rollout = metrics["time/train_s"], metrics["time/rollout_s"]
        update = metrics["perf/update_flops"] / t_train if t_train > 0 else 0.0
        rollout = metrics["perf/rollout_flops"] / t_rollout if t_rollout > 0 else 0.0
        peak = self.peak_flops * self.world_size
        return {
            "perf/update_tflops": update / 1e12,
            "perf/rollout_tflops": rollout / 1e12,
            "perf/peak_tflops": peak / 1e12,
            "perf/mfu": update / peak if peak > 0 else 0.0,
        }

    #: step metrics summed / maximised over ranks (``parallel.reduce_step_metrics``); others are weighted means
    SUMMED_METRICS = parallel.SUMMED_METRICS

    MAX_METRICS = parallel.MAX_METRICS

    @property
    def world_size(self) -> int:
        """Data-parallel ranks (1 without a trainer or on one device)."""
        return self.trainer.world_size if self._trainer is not None else 1

    def all_reduce(self, values: Tensor, op: str = "sum") -> Tensor:
        """``values`` (any shape) summed (``op="sum"``) or maximised (``"max"``) elementwise over the
        data-parallel ranks with Lightning's ``strategy.reduce``, on ``values``' device; on one rank the
        tensor itself. A collective: every rank calls it at the same point with the same shape."""
        if self.world_size == 1:
            return values
        return self.trainer.strategy.reduce(values.detach().to(self.device).clone(), reduce_op=op).to(values.device)

    def all_reduce_dict(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        """``values`` reduced name by name over the ranks (``parallel.all_reduce_dict``)."""
        return parallel.all_reduce_dict(values, self.all_reduce, op, world_size=self.world_size, rank=self.global_rank)

    def reduce_step_metrics(self, metrics: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """This rank's step metrics combined with the other ranks' (``parallel.reduce_step_metrics`` with this
        class's ``SUMMED_METRICS`` and ``MAX_METRICS``). A collective (every rank calls it once per step)."""
        if self.world_size == 1:
            return dict(metrics)
        return parallel.reduce_step_metrics(
            metrics, weights, self.all_reduce_dict, summed=self.SUMMED_METRICS, maxima=self.MAX_METRICS
        )

    def write_step_metrics(self, metrics: dict[str, float], rl_step: int) -> None:
        """Write the step's scalars to the logger at x = ``rl_step`` and flush them, inside the step.

        Lightning hands ``self.log`` values to the logger only after the step's checkpoint is written, and
        TensorBoard buffers them; a kill in between would leave a checkpoint whose step has no metrics, and
        a resume would never log them. Written here, every checkpointed step has its scalars on disk.
        ``metrics`` must already be reduced over ranks (``reduce_step_metrics``): Lightning's loggers write
        on global rank 0 only, so one TensorBoard run holds the values of the whole step.
        Every configured logger (``logger=[tensorboard,csv,wandb,mlflow]``) gets the same scalars; TensorBoard's
        events and the CSV file are flushed to disk here (W&B and MLflow write as they receive).
        """
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        for logger in self.loggers:
            logger.log_metrics(metrics, step=rl_step)
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.flush()
            elif isinstance(logger, CSVLogger):
                logger.save()

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
        for i in range(0, rows.numel(), self.micro_batch_size):
            idx = rows[i : i + self.micro_batch_size]
            lp = self.logprobs_of(self.policy, rb.select(idx), with_entropy=False).logprobs
            out[i : i + idx.numel(), : lp.shape[1]] = lp.float()
        return out

    # -- evaluation: greedy pass@1 on the held-out split -----------------------------------------------------------
    def on_validation_start(self) -> None:
        self.source.pause(self)  # the engine is evaluation's, synced to the latest update

    #: ``eval.n`` samples per problem and ``eval.k`` for pass@k (``lit_rl.train.run`` sets them from the config)
    eval_n: int = 1

    eval_k: int = 1

    def on_validation_epoch_start(self) -> None:
        # reward sum, samples, pass@k sum, problems (this rank's share of the eval split)
        self._eval_sums = [0.0, 0.0, 0.0, 0.0]

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        if not batch.examples:  # this rank's share of the eval split is empty; it still joins the reduction
            return
        n = int(self.eval_n)
        scored = self.datamodule.collect(
            self.engine,
            batch.examples,
            self.eval_sampling,
            step=-1,
            group_size=n,
            split="eval",
            first_index=batch.offset,
        )
        self._eval_sums[0] += float(scored.rewards.sum())
        self._eval_sums[1] += len(scored.rewards)
        correct = (scored.rewards >= 1.0).view(len(batch.examples), n).sum(-1)  # a reward >= 1 counts as correct
        self._eval_sums[2] += sum(pass_at_k(n, int(c), int(self.eval_k)) for c in correct.tolist())
        self._eval_sums[3] += len(batch.examples)

    def on_validation_epoch_end(self) -> None:
        """eval/accuracy: the mean reward of the eval samples over the whole eval split (greedy pass@1 with
        ``eval.n=1``, mean@n otherwise), summed over the ranks' shares; with ``eval.n > 1`` also
        ``eval/mean@n`` (the same number, named) and ``eval/pass@k`` (Chen et al. 2021's unbiased estimator,
        ``reward_functions.pass_at_k``; a sample is correct when its reward is >= 1)."""
        total, count, passed, problems = self.all_reduce(torch.tensor(self._eval_sums, dtype=torch.float64)).tolist()
        # already the same on every rank; sync_dist=True averages equal values (and keeps Lightning quiet when
        # vLLM has set up a one-process torch.distributed group of its own)
        mean = total / count if count else 0.0
        self.log("eval/accuracy", mean, prog_bar=True, sync_dist=True)
        if int(self.eval_n) > 1:
            self.log(f"eval/mean@{int(self.eval_n)}", mean, sync_dist=True)
            self.log(f"eval/pass@{int(self.eval_k)}", passed / problems if problems else 0.0, sync_dist=True)

    def on_validation_end(self) -> None:
        self.source.resume(self)

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
        state = checkpoint.get("lit_rl", {})
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.kl_coef = float(state.get("kl_coef", self.kl_coef))
        if "stale_rollouts" in state:
            self.source.load_state_dict(state["stale_rollouts"], next(self.policy.parameters()).device)

    def saved_key(self, name: str) -> bool:
        """True for a state-dict key a checkpoint holds: not the frozen reference copy's, and with LoRA not the
        frozen base weights' (re-derivable from ``model.name_or_path``): only the adapter's of the policy."""
        if name.startswith("ref_policy."):
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
