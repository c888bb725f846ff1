"""``log.drift_prompts``: a directional measure of the drift a train–inference mismatch puts into training.

Under a constant advantage the true gradient is 0, and the expected batch gradient of an uncorrected policy
gradient is the sampler's expected score Σ_v μ_v ∇log π_v at each prefix: the gradient of −CE(μ, π), which moves
π towards the sampler's distribution μ (docs/corrections.md). So the KL from the sampler's distribution to the
policy,

    D(θ) = mean over fixed prefixes h of KL(μ₀(·|h) ‖ π_θ(·|h)),

falls at first order in the learning rate while that drift acts, whereas the zero-mean noise of a finite batch
moves it only at second order (up, on average). ``ref_kl`` cannot tell the two apart (both make the policy
move); D can: a run whose D falls has been pulled towards its sampler.

μ₀ is recorded once, before step 1: the run's sampler (engine, ``engine.*`` mismatch dials, sampling settings)
draws ``rollout.group_size`` completions for each of the first ``log.drift_prompts`` prompts of step 1 (seeds
of their own, ``DRIFT_STEP``) with its whole distribution recorded at every generated token
(``sampling.logprobs_top_k`` = the vocabulary for this one call). Under logit noise μ₀ is the realised noisy
distribution at each token; its expectation over the noise is what the drift pulls towards, so D's first-order
fall holds on average over the tokens. After every RL step the policy scores those tokens (no gradient, float32,
no autocast: the same arithmetic at every step) and the callback logs, at the step's x:

- ``drift/sampler_kl``: D(θ), nats per generated token (environment tokens of multi-turn episodes excluded);
- ``drift/sampler_kl_change``: D(θ) − D(θ₀), negative when the policy moved towards the sampler;
- ``drift/entropy``: the policy's mean entropy at the same prefixes, nats per token.

At x = 0 (before step 1) they are logged for θ₀. Entries outside either distribution's support (a truncating
``sampling.top_k`` / ``top_p``) are left out of the sums. A continued run (from a checkpoint) logs none of them:
the record of θ₀'s sampler is not kept in checkpoints, and a record of later weights would measure from
another origin. Cost: one record (a rollout of P × G sequences) and, per step, one no-gradient forward of them
plus ~4 bytes × tokens × vocabulary of memory (about 100 MB for 16 sequences of 32 tokens on a 49k vocabulary).
"""

from __future__ import annotations

from dataclasses import replace

import lightning as L
import torch
from torch import Tensor

#: the record's completions sample with the seeds of this step, apart from every training and evaluation step's
DRIFT_STEP = 2_000_000


def sampler_drift(logpi: Tensor, logmu: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Token sums of KL(μ‖π) and of π's entropy over the valid tokens, and their count.

    Args:
        logpi: float [N, T, V], log π over the vocabulary (or the ids the engine recorded), any order.
        logmu: float [N, T, V], log μ at the same ids; −inf / NaN where the sampler gave no mass.
        mask: bool [N, T], the generated tokens to count.

    Returns:
        (Σ_t KL_t, Σ_t H_t, number of tokens), float64 scalars; an entry counts in KL_t where μ_v > 0 and π_v > 0,
        in H_t where π_v > 0.

    Raises:
        ValueError: the shapes differ.
    """
    if logpi.shape != logmu.shape or logpi.shape[:2] != mask.shape:
        raise ValueError(f"logpi {tuple(logpi.shape)}, logmu {tuple(logmu.shape)} and mask {tuple(mask.shape)} differ")
    lp, lmu = logpi.double(), logmu.double()
    zeros = torch.zeros_like(lp)
    has_pi = torch.isfinite(lp) & mask[..., None]
    both = has_pi & torch.isfinite(lmu)
    kl = torch.where(both, lmu.exp() * (lmu - torch.where(both, lp, zeros)), zeros).sum()
    entropy = -torch.where(has_pi, lp.exp() * torch.where(has_pi, lp, zeros), zeros).sum()
    return kl, entropy, mask.sum().double()


class SamplerDriftMonitor(L.Callback):
    """Records the sampler's distribution on fixed prefixes before step 1 and logs ``drift/*`` after every step
    (module docstring). ``prompts``: ``log.drift_prompts`` (> 0)."""

    def __init__(self, prompts: int):
        if int(prompts) < 1:
            raise ValueError(f"log.drift_prompts={prompts!r}: the monitor needs at least 1 prompt")
        self.prompts = int(prompts)
        self.record = None  # the RolloutBatch of the recorded completions, with their whole distributions
        self.origin: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step > 0:
            print(
                "lit_rl: log.drift_prompts: a continued run logs no drift/* (the record of the first weights' "
                "sampler is not kept in checkpoints)",
                flush=True,
            )
            return
        module, dm = pl_module, pl_module.datamodule
        vocab = module.policy.get_output_embeddings().weight.shape[0]
        sampling = replace(module.sampling, logprobs_top_k=vocab)
        examples = dm.prompts_for(0)[: self.prompts]
        module.source.pause(module)  # the engine synced to the first weights, as evaluation takes it
        try:
            with torch.no_grad():
                scored = dm.collect(module.engine, examples, sampling, step=DRIFT_STEP)
        finally:
            module.source.resume(module)
        self.record = module.build_batch(scored)
        values = self.measure(module)
        self.origin = values["drift/sampler_kl"]
        self._write(trainer, module, values, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.record is not None:
            self._write(trainer, pl_module, self.measure(pl_module), pl_module.rl_steps_done())

    def measure(self, module) -> dict[str, float]:
        """``drift/*`` of the policy's current weights on the record (module docstring)."""
        kl = entropy = tokens = 0.0
        with torch.no_grad(), torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            for mb in module.micro_batches(self.record):
                if not mb.response_mask.any():
                    continue
                kwargs = {"with_entropy": False, "shared_prefix": False}
                scores = module._score(module.policy, mb, mb.topk_ids, kwargs)
                a, b, n = sampler_drift(scores.head_logprobs, mb.topk_logprobs, mb.response_mask)
                kl, entropy, tokens = kl + float(a), entropy + float(b), tokens + float(n)
        tokens = max(tokens, 1.0)
        values = {"drift/sampler_kl": kl / tokens, "drift/entropy": entropy / tokens}
        origin = values["drift/sampler_kl"] if self.origin is None else self.origin
        values["drift/sampler_kl_change"] = values["drift/sampler_kl"] - origin
        return values

    @staticmethod
    def _write(trainer, module, values: dict[str, float], step: int) -> None:
        if trainer.is_global_zero:
            module.write_step_metrics(values, step)
