"""One GRPO update of fixed rollout batches on W CPU processes (Lightning DDP, gloo); tests/test_ddp.py runs it.

    python tests/helpers/ddp_probe.py <devices> <out_dir>

Rank r takes the r-th contiguous half of every batch in ``CASES`` and runs the module's own ``update``
(``accumulate_gradients``, the strategy's gradient sync, the reductions over ranks, the optimizer step);
the gradient is captured just before the optimizer step. Each rank writes ``<out_dir>/rank<r>.pt``:
{case: {"grads": {parameter name: tensor}, "metrics": update()'s train/* dict}}; under "batch_rules" the same
for ``batch_rules_batch`` with ``correction=BATCH_RULES`` plus the share's M2PO bound and TIS scale; under
"step_metrics" ``reduce_step_metrics`` of the rank's ``STEP_METRICS``. Weights are restored between cases, so every case
starts from the same tiny model.
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

torch.set_num_threads(1)

from lit_rl.algorithms import RLModule  # noqa: E402
from lit_rl.rollout.datamodule import shard  # noqa: E402
from lit_rl.rollout.types import RolloutBatch  # noqa: E402
from lit_rl.schema import CorrectionConfig, config_of  # noqa: E402

# the two halves of each batch have different completion lengths: rank 0 short, rank 1 long with two empty
# rows (so with micro-batches of 2 rank 1 has one pass fewer and pads); "rank1_empty" masks all of rank 1's
# rows out (rank 1 has no valid token and takes part with padding passes only)
RESPONSE_LENGTHS = [2, 3, 1, 4, 2, 5, 9, 12, 0, 0, 11, 7]
PROMPT_LENGTHS = [4, 6, 5]  # one prompt per group of 4, shared by its completions (update.shared_prefix)
CASES = {  # name: (loss.reduction, rows of rank 1 masked out)
    "token_mean": ("token_mean", False),
    "seq_mean_token_mean": ("seq_mean_token_mean", False),
    "token_mean_rank1_empty": ("token_mean", True),
}
MICRO_BATCH = 2
#: the batch-level rules (issue 38): M2PO's cutoff and TIS's batch normalisation, each the whole step's over ranks
BATCH_RULES = {"name": "tis+m2po", "tis": {"enabled": True, "batch_normalize": True}, "m2po": {"enabled": True}}
# (metrics, weights) per rank for reduce_step_metrics: a weighted mean, a sum, a maximum
STEP_METRICS = [
    ({"rollout/reward_mean": 0.5, "rollout/reward_errors": 1.0, "time/step_s": 2.0}, {"rollout/reward_mean": 4.0}),
    ({"rollout/reward_mean": 1.0, "rollout/reward_errors": 2.0, "time/step_s": 3.0}, {"rollout/reward_mean": 12.0}),
]


def make_batch(rank1_empty: bool = False, vocab: int = 49152) -> RolloutBatch:
    """The fixed batch: 12 completions (3 groups of 4, each group's prompt the same: rank 0 holds group 0 and
    half of group 1, so its prompt forward is shared on both ranks), left-padded prompts, right-padded
    responses."""
    g = torch.Generator().manual_seed(1234)
    n, p_max, t_max = len(RESPONSE_LENGTHS), max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompt_ids = torch.randint(0, vocab, (len(PROMPT_LENGTHS), p_max), generator=g).repeat_interleave(4, 0)
    lengths = torch.tensor(PROMPT_LENGTHS).repeat_interleave(4)
    prompt_mask = torch.arange(p_max)[None, :] >= (p_max - lengths)[:, None]
    response_ids = torch.randint(0, vocab, (n, t_max), generator=g)
    response_mask = torch.arange(t_max)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    if rank1_empty:
        response_mask[n // 2 :] = False
    return RolloutBatch(
        prompt_ids=prompt_ids * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=response_ids * response_mask,
        response_mask=response_mask,
        rollout_logprobs=torch.zeros(n, t_max),
        rewards=torch.zeros(n),
        advantages=torch.randn(n, generator=g),
        group_ids=torch.arange(n) // 4,
        policy_version=torch.zeros(n, dtype=torch.long),
    )


def batch_rules_batch() -> RolloutBatch:
    """``make_batch`` (no empty row) with sampler log-probs μ near the tiny model's (log 1/V ≈ −10.8), the log-ratios
    log π_old − log μ 5x as spread on rank 1's rows as on rank 0's: each rank's own M2PO cutoff and Z differ
    from the whole step's."""
    rb = make_batch()
    rb.response_mask[:, 0] = True  # every row one token at least (the pi_old pass of a micro-batch of empty rows fails)
    g = torch.Generator().manual_seed(77)
    spread = torch.where(torch.arange(len(rb)) < len(rb) // 2, 0.1, 0.5)[:, None]
    noise = torch.randn(rb.rollout_logprobs.shape, generator=g) * spread
    rb.rollout_logprobs = (-10.8 + noise) * rb.response_mask
    return rb


def make_module(policy, tok, module_cls=RLModule, **kwargs):
    """A GRPO module around ``policy``: no gradient clipping (the raw gradient is compared), float32."""
    return module_cls(
        policy=policy,
        tokenizer=tok,
        sampling={"max_new_tokens": max(RESPONSE_LENGTHS)},
        eval_sampling={},
        group_size=4,
        micro_batch_size=MICRO_BATCH,
        advantage={},
        loss={"reduction": "token_mean"},
        algo={"name": "grpo", "clip": {"eps_low": 0.2, "eps_high": 0.2}},
        kl={},
        optim={"lr": 1e-3, "grad_clip": 0.0},
        **kwargs,
    )


class Probe(RLModule):
    """GRPO whose training step runs ``update`` on its rank's share of each case and saves the gradient."""

    def __init__(self, out_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.out_dir = out_dir
        self.captured = None

    def on_fit_start(self) -> None:  # no RolloutDataModule: the batches are fixed
        pass

    def train_dataloader(self):
        return DataLoader([0], batch_size=None)

    def optimizer_step(self, opt, loss: float = 0.0) -> float:
        self.captured = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters()}
        return super().optimizer_step(opt, loss)

    def training_step(self, batch, batch_idx) -> None:
        start = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        results = {}
        for name, (reduction, rank1_empty) in CASES.items():
            self.policy.load_state_dict(start)
            self.loss_cfg.reduction = reduction
            rb = make_batch(rank1_empty)
            rows = shard(len(rb), self.global_rank, self.world_size)
            metrics = self.update(rb.select(torch.arange(len(rb))[rows]))
            results[name] = {"grads": self.captured, "metrics": metrics}
        self.policy.load_state_dict(start)
        self.loss_cfg.reduction, correction = "token_mean", self.correction
        self.correction = config_of(CorrectionConfig, BATCH_RULES)
        rb = batch_rules_batch()
        share = rb.select(torch.arange(len(rb))[shard(len(rb), self.global_rank, self.world_size)])
        metrics = self.update(share)  # start_update fills the share's bound and scale: the step's
        results["batch_rules"] = {
            "grads": self.captured,
            "metrics": metrics,
            "bound": share.log_ratio_bound,
            "scale": share.weight_scale,
        }
        self.correction = correction
        results["step_metrics"] = self.reduce_step_metrics(*STEP_METRICS[self.global_rank])
        torch.save(results, os.path.join(self.out_dir, f"rank{self.global_rank}.pt"))


def main() -> None:
    devices, out_dir = int(sys.argv[1]), sys.argv[2]
    from lit_rl.models import ModelConfig, load_policy

    policy, tok = load_policy(ModelConfig("tiny"))
    module = make_module(policy, tok, module_cls=Probe, out_dir=out_dir)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        precision="32-true",
        max_epochs=1,
        limit_train_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module)


if __name__ == "__main__":
    main()
