"""16-mixed under manual optimisation: the gradient is unscaled before it is clipped and logged, and the
gradient scaler skips overflowing steps (issue 16: the norm was logged 65536x too large, the clipped update
was 65536x too small, and an overflow stopped the run with "No inf checks were recorded").

The update runs through Lightning's own precision plugin (float16 autocast and ``torch.amp.GradScaler`` on
the CPU, as ``lit_rl.run.train.precision_plugins`` builds it for ``trainer.precision=16-mixed``), on one fixed
batch, against the same update in 32-true."""

import lightning as L
import pytest
import torch
from helpers import MOVING
from helpers import fast_config as cfg_for
from helpers.ddp_probe import make_batch
from torch.utils.data import DataLoader

from lit_rl.algorithms import RLModule
from lit_rl.models import ModelConfig, load_policy
from lit_rl.run.train import precision_plugins, run
from lit_rl.tools.compare import read_scalars


class FixedBatchGRPO(RLModule):
    """GRPO whose every training step is ``update`` on one fixed batch (no rollouts)."""

    def on_fit_start(self) -> None:
        pass

    def train_dataloader(self):
        return DataLoader(list(range(8)), batch_size=None)

    def training_step(self, batch, batch_idx) -> None:
        self.results.append(self.update(self.fixed))


def update_on_fixed_batch(precision: str, steps: int = 1, scaler=None):
    """(train/* metrics of each step, the weights' change as one flat vector) after ``steps`` updates of
    the tiny model on ``ddp_probe.make_batch()`` with gradient clipping at 1.0 and lr 1e-3."""
    torch.manual_seed(0)
    policy, tok = load_policy(ModelConfig("tiny"))
    start = torch.cat([p.detach().flatten().clone() for p in policy.parameters()])
    module = FixedBatchGRPO(
        policy=policy,
        tokenizer=tok,
        sampling={"max_new_tokens": 12},
        eval_sampling={},
        group_size=4,
        micro_batch_size=4,
        advantage={},
        loss={"reduction": "token_mean"},
        algo={"name": "grpo", "clip": {"eps_low": 0.2, "eps_high": 0.2}},
        kl={},
        optim={"lr": 1e-3, "grad_clip": 1.0, "max_nonfinite_updates": 3},
    )
    module.fixed, module.results = make_batch(), []
    kwargs = {"precision": precision, "accelerator": "cpu"}
    plugins = precision_plugins(kwargs)
    if scaler is not None:
        plugins[0].scaler = scaler
    trainer = L.Trainer(
        **kwargs,
        plugins=plugins,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return module.results, torch.cat([p.detach().flatten() for p in policy.parameters()]) - start


@pytest.fixture(scope="module")
def float32_step():
    return update_on_fixed_batch("32-true")


def test_sixteen_mixed_logs_the_unscaled_norm_and_takes_the_float32_step(float32_step):
    (ref,), ref_delta = float32_step
    (got,), delta = update_on_fixed_batch("16-mixed")
    assert ref["train/grad_norm"] > 1.0  # the clip at 1.0 binds: clipping scaled gradients would show
    assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=0.01)  # was 65536x
    assert got["train/grad_scale"] == 65536.0  # GradScaler's initial scale, no overflow
    # the update itself: the same step as float32's (was 0.06x of it: the clip saw S x the gradient)
    assert float(delta.norm()) == pytest.approx(float(ref_delta.norm()), rel=0.01)
    assert float(torch.nn.functional.cosine_similarity(delta, ref_delta, dim=0)) > 0.99
    assert got["train/skipped_updates"] == 0.0


def test_the_scaler_skips_overflowing_steps_and_the_run_goes_on(float32_step):
    """A scale of 2^40 overflows float16; each overflow skips the step (weights unchanged, counted) and cuts the
    scale by 2^-8, so steps 1-3 are skipped and step 4 (scale 2^16) is float32's first step. Three overflows
    in a row do not stop the run (optim.max_nonfinite_updates=3): the scaler handles them while its scale > 1."""
    (ref,), ref_delta = float32_step
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-8)
    results, delta = update_on_fixed_batch("16-mixed", steps=4, scaler=scaler)
    assert [r["train/skipped_updates"] for r in results] == [1.0, 2.0, 3.0, 3.0]
    assert [r["train/grad_scale"] for r in results] == [2.0**32, 2.0**24, 2.0**16, 2.0**16]
    assert results[3]["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=0.01)
    assert float(delta.norm()) == pytest.approx(float(ref_delta.norm()), rel=0.01)  # one real step


def test_sixteen_mixed_recipe_runs_on_cpu(tmp_path):
    """trainer.precision=16-mixed through the recipe: float16 autocast (Lightning would have swapped in bf16),
    the scale logged, and the update moves the weights."""
    run(cfg_for("trainer.precision=16-mixed", "trainer.max_steps=2", "eval.num_examples=0", *MOVING), tmp_path / "r")
    s = read_scalars(tmp_path / "r")
    assert [v for _, v in s["train/grad_scale"]] == [65536.0, 65536.0]
    assert all(v > 0 for _, v in s["train/grad_norm"]) and s["train/skipped_updates"][-1][1] == 0.0
    assert "precision: 16-mixed" in (tmp_path / "r" / "config.yaml").read_text()
