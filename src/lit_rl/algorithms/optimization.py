"""The optimizer side of the RL step: AdamW with warm-up, one guarded optimizer step, and the non-finite guard.

``OptimizationMixin`` is part of ``RLModule`` (``algorithms.module``): the update calls ``optimizer_step`` once per
PPO minibatch; Lightning's precision plugin calls ``on_before_optimizer_step`` inside it, where the gradient is
clipped and a non-finite update dropped.
"""

from __future__ import annotations

import math

import torch

from . import parallel


class NonFiniteUpdates(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient (``optim.max_nonfinite_updates``)."""


class OptimizationMixin:
    """``configure_optimizers``, ``optimizer_step`` and the gradient clip with the non-finite guard, for a
    LightningModule with ``optim_cfg`` (``schema.OptimConfig``), ``trainable_parameters()``, ``sharded`` and
    ``updates_per_step``."""

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
                f"(loss={loss}, grad_norm={norm}); stopped at RL step {self.global_step // self.updates_per_step + 1}"
                f" (optimizer step {self.global_step}, optim.max_nonfinite_updates={limit}). "
                f"The last checkpoint holds the weights these updates started from: lower optim.lr (or check "
                f"the rewards) before continuing from it"
            )

    skipped_updates: int = 0

    nonfinite_in_a_row: int = 0
