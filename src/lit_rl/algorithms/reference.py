"""The frozen models the step scores the student's sampled tokens with: the KL reference (``kl``) and the
on-policy distillation teacher (``distill``).

``ReferenceMixin`` is part of ``RLModule`` (``algorithms.module``). Both models are scored by the trainer's own
log-prob pass (``RLModule.logprobs_of``: the sampler's temperature and top-k / top-p truncation, the same micro-
batches), without gradient, in eval mode, outside the optimizer and the checkpoints (``RLModule.saved_key``).

The teacher (``distill.teacher``, loaded by ``run.train.load_teacher``) enters the step in one of two ways
(``distill.mode``):

- ``advantage``: after the algorithm's advantages, A_t = A − coef · (log π_old(y_t) − log π_teacher(y_t))
  (``objectives.opd_advantages``; slime's ``--use-opd``), π_old scored here by the same pass as the teacher, so a
  teacher equal to the student adds exactly 0 and the run equals the plain run bit for bit. The term then goes
  through the objective and the corrections like the reward's advantage. ``train/opd_kl``: the step's mean
  log-ratio over its valid tokens (all ranks).
- ``loss``: its own term of the loss assembly (``loss.assemble_loss``, ``objectives.opd_loss``; prime-rl's form),
  over the step's valid tokens whatever ``loss.reduction``; ``train/opd_kl`` from the update's micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .. import objectives as obj
from ..logprobs import resolve_shared_prefix
from ..models import adapter_disabled
from ..rollout.types import RolloutBatch
from ..schema import DistillConfig, config_of


class ReferenceMixin:
    """The KL reference and the distillation teacher of a ``RLModule``: ``ref_policy`` / the LoRA base, ``teacher``."""

    # -- the distillation teacher ----------------------------------------------------------------------------------
    def setup_teacher(self, teacher: torch.nn.Module | None, distill: DistillConfig | Mapping | None) -> None:
        """Keep ``teacher`` frozen (eval mode, no gradient) as ``self.teacher`` for ``distill`` (the config group).
        Its forward shares each prompt's prefix when the student's does and its family allows it. Raises
        ValueError when ``distill.teacher`` is set without a teacher model, or a teacher comes without it."""
        self.distill_cfg = config_of(DistillConfig, distill)
        if (teacher is None) != (self.distill_cfg.teacher is None):
            raise ValueError(
                f"distill.teacher={self.distill_cfg.teacher!r} and the teacher model given "
                f"({type(teacher).__name__}) disagree: pass the model loaded from distill.teacher, or neither"
            )
        self.teacher = None if teacher is None else teacher.eval().requires_grad_(False)
        self.opd_kl: float | None = None
        self.teacher_shared_prefix = (
            teacher is not None
            and resolve_shared_prefix("auto" if self.shared_prefix else False, teacher, self.group_size)[0]
        )

    @property
    def distill_in_loss(self) -> bool:
        """True when the teacher's term is a loss term of its own (``distill.mode=loss``)."""
        return self.teacher is not None and self.distill_cfg.mode == "loss"

    @torch.no_grad()
    def teacher_logprobs(self, mb: RolloutBatch) -> Tensor:
        """[n, T] float32 log-probs of the micro-batch's response tokens under the frozen teacher, under the
        sampler's temperature / top-k / top-p (like the reference's). No gradient."""
        with self.scoring_pass(self.teacher):  # its weight casts kept for the run
            return self.logprobs_of(
                self.teacher, mb, with_entropy=False, shared_prefix=self.teacher_shared_prefix
            ).logprobs

    @torch.no_grad()
    def distill_advantages(self, rb: RolloutBatch, advantages: Tensor) -> Tensor:
        """The step's advantages with the teacher's term (``distill.mode=advantage``): float32 [N, T],
        ``objectives.opd_advantages`` of ``advantages`` ([N] or [N, T]) with π_old and the teacher scored here,
        ``micro_batch_size`` rows at a time; sets ``self.opd_kl`` (the mean log-ratio over the step's valid tokens,
        summed over ranks). ``advantages`` unchanged without a teacher or with ``distill.mode=loss``."""
        if self.teacher is None or self.distill_in_loss:
            return advantages
        student = torch.zeros(rb.response_ids.shape, device=rb.response_ids.device)
        teacher = torch.zeros_like(student)
        with self.scoring_pass():
            for i in range(0, len(rb), self.micro_batch_size):
                mb = rb.select(slice(i, i + self.micro_batch_size))
                s = self.logprobs_of(self.policy, mb, with_entropy=False).logprobs
                student[i : i + len(mb), : s.shape[1]] = s.float()
                t = self.teacher_logprobs(mb)
                teacher[i : i + len(mb), : t.shape[1]] = t.float()
        mask = rb.response_mask
        sums = torch.stack([obj.masked_sum(student - teacher, mask).double(), mask.sum().double()])
        total, count = self.all_reduce(sums).tolist()
        self.opd_kl = total / count if count else 0.0
        return obj.opd_advantages(advantages, student, teacher, float(self.distill_cfg.coef), mask)

    def distill_metrics(self) -> dict[str, float]:
        """``train/opd_kl`` of ``distill.mode=advantage`` (the loss mode logs it from the update); else empty."""
        return {} if self.opd_kl is None or self.distill_in_loss else {"train/opd_kl": self.opd_kl}

    # -- the KL reference ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def reference_logprobs(self, mb: RolloutBatch) -> Tensor:
        """[n, T] float32 log-probs of the micro-batch's response tokens under the frozen reference policy (the
        sampler's temperature / top-k / top-p, like the trainer's): the ``ref_policy`` copy, or with LoRA the
        policy itself with its adapter disabled (the shared base weights). No gradient."""
        if not self.lora:
            with self.scoring_pass(self.ref_policy):  # its weight casts kept for the run: it never changes
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
