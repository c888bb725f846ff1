"""The recipe end to end on the tiny model: TensorBoard tags, outputs, multirun, gsm8k, no overwrite."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import FAST, MOVING, ROOT, fast_config

from lit_rl.config import ConfigError
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars

TAGS = [
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "rollout/truncation_rate",
    "rollout/groups_all_correct",
    "rollout/groups_all_wrong",
    "train/loss",
    "train/pg_clipfrac",
    "train/ppo_kl",
    "train/entropy",
    "train/grad_norm",
    "train/logprob_abs_diff",
    "eval/accuracy",
    "time/rollout_s",
    "time/train_s",
    "time/step_s",
    "time/weight_sync_s",
    "time/generate_s",
    "perf/rollout_tokens_per_s",
    "perf/update_tflops",
    "perf/rollout_tflops",
    "perf/mfu",
]


cfg_for = fast_config


def test_tiny_run_writes_scalars_checkpoint_and_policy(tmp_path):
    out = tmp_path / "run"
    run(cfg_for("trainer.max_steps=4"), out)
    scalars = read_scalars(out)
    for tag in TAGS:
        assert tag in scalars, tag
    assert len(scalars["train/loss"]) == 4
    assert len(scalars["eval/accuracy"]) == 2  # after steps 2 and 4
    assert scalars["time/generate_s"] == scalars["time/rollout_s"]  # sync: the trainer's own generation time
    # TensorBoard names a run by the folder of its event files: the run folder's name, not "run/tensorboard"
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    assert list(EventMultiplexer().AddRunsFromDirectory(str(tmp_path)).Runs()) == ["run"]
    for _, v in scalars["rollout/reward_mean"]:
        assert 0.0 <= v <= 1.0
    # on-policy, one update per batch: pi_old is the trainer's own forward, so the PPO KL is exactly 0
    assert all(v == 0.0 for _, v in scalars["train/ppo_kl"])
    # same weights, two code paths (KV-cached decode vs full forward): a tiny but real gap
    assert all(0.0 <= v < 1e-4 for _, v in scalars["train/logprob_abs_diff"])
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert (out / "policy" / "model.safetensors").is_file()
    assert json.loads((out / "finished.json").read_text())["global_step"] == 4
    # a finished run is never overwritten
    with pytest.raises(ConfigError, match="already holds a finished run"):
        run(cfg_for("trainer.max_steps=4"), out)


# REINFORCE without a baseline on a constant reward: A = 1 on every token, so every update moves the weights
# (on the tiny model the arithmetic reward is always 0, and GRPO's update would be exactly zero)


def test_update_changes_weights_and_is_seeded(tmp_path, capsys):
    # checkpoint.export_at_steps: run a also writes the policy after steps 0 (the initial weights) and 2
    a = run(
        cfg_for("trainer.max_steps=2", "eval.num_examples=0", "checkpoint.export_at_steps=[0,2]", *MOVING),
        tmp_path / "a",
    )
    said = capsys.readouterr().out
    assert (
        f"the policy after RL step 2 written to {tmp_path / 'a' / 'policy_step2'}" in said
        and "RL step 1 written" not in said
    )
    b = run(cfg_for("trainer.max_steps=2", "eval.num_examples=0", *MOVING), tmp_path / "b")
    assert a == {**a, **{k: b[k] for k in a if not k.startswith(("time/", "perf/", "tok/s", "mfu"))}}
    from safetensors.torch import load_file

    from lit_rl.models import ModelConfig, load_policy

    wa = load_file(tmp_path / "a" / "policy" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "policy" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    initial = load_policy(ModelConfig("tiny"))[0].state_dict()
    changed = sum(int((wa[k] != initial[k]).sum()) for k in wa if k in initial)
    assert changed > 0.9 * sum(v.numel() for k, v in wa.items() if k in initial)
    w0 = load_file(tmp_path / "a" / "policy_step0" / "model.safetensors")
    w2 = load_file(tmp_path / "a" / "policy_step2" / "model.safetensors")
    assert all(torch.equal(w0[k], initial[k]) for k in w0) and all(torch.equal(w2[k], wa[k]) for k in wa)
    assert (tmp_path / "a" / "policy_step2" / "tokenizer_config.json").is_file()
    assert not (tmp_path / "a" / "policy_step1").exists() and not (tmp_path / "b" / "policy_step0").exists()


# GSM8K's format (question, worked answer ending "#### N"), written by the test: a clone has no ../shared
GSM8K_FIXTURE = [
    ("Ana has 3 boxes with 4 pens each. How many pens does she have?", "3 * 4 = <<3*4=12>>12\n#### 12"),
    ("A bus carries 20 people and 7 get off. How many are left?", "20 - 7 = <<20-7=13>>13\n#### 13"),
    ("Tom reads 15 pages a day for 4 days. How many pages does he read?", "15 * 4 = <<15*4=60>>60\n#### 60"),
    ("A cake costs $1,250 and a pie $250. What do both cost?", "1250 + 250 = <<1250+250=1500>>1500\n#### 1,500"),
]


def write_gsm8k_fixture(folder):
    """train.jsonl (all four problems) and test.jsonl (the first two) in GSM8K's format under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", GSM8K_FIXTURE), ("test.jsonl", GSM8K_FIXTURE[:2])):
        (folder / name).write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return folder


def test_gsm8k_from_jsonl_folder(tmp_path):
    data = write_gsm8k_fixture(tmp_path / "gsm8k")
    run(
        cfg_for(
            "task=gsm8k", f"task.path={data}", "trainer.max_steps=1", "eval.num_examples=2", "eval.every_n_steps=1"
        ),
        tmp_path / "g",
    )
    scalars = read_scalars(tmp_path / "g")
    assert "rollout/reward_mean" in scalars and len(scalars["eval/accuracy"]) == 1
    assert "task:\n  name: gsm8k" in (tmp_path / "g" / "config.yaml").read_text()


@pytest.mark.slow  # ~20 s: a real 4-job sweep; compare is covered on written runs in test_compare.py
def test_multirun_2x2_then_compare(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "recipes", "train.py"),
        "-m",
        *FAST,
        "trainer.max_steps=2",
        "eval.num_examples=0",
        "advantage.alpha=0,1",
        "loss.reduction=token_mean,seq_mean_token_mean",
        f"hydra.sweep.dir={sweep}",
    ]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = sorted(p for p in os.listdir(sweep) if "advantage.alpha" in p)
    # folders (and TensorBoard run names) are named by what the sweep varies, nothing else
    assert runs == [
        "advantage.alpha=0,loss.reduction=seq_mean_token_mean",
        "advantage.alpha=0,loss.reduction=token_mean",
        "advantage.alpha=1,loss.reduction=seq_mean_token_mean",
        "advantage.alpha=1,loss.reduction=token_mean",
    ]
    for r in runs:
        assert (sweep / r / "finished.json").is_file() and (sweep / r / "config.yaml").is_file()

    out = tmp_path / "cmp"
    res = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "recipes", "compare.py"),
            str(sweep),
            "--tags",
            "rollout/reward_mean,train/entropy",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "rollout_reward_mean.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "summary.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| advantage.alpha=")]
    assert len(rows) == 4
    # the numbers come from the event files: the final reward of each setting
    for r in runs:
        final = read_scalars(sweep / r)["rollout/reward_mean"][-1][1]
        row = next(line for line in rows if line.startswith(f"| {r} "))
        assert f"{final:.4g}" in row, (row, final)


def test_resume_from_last_checkpoint_continues_exactly(tmp_path):
    """Two steps, then resume to four with ckpt_path=last, equals four steps straight through."""
    common = ["eval.num_examples=0", "checkpoint.every_n_steps=1", *MOVING]
    run(cfg_for("trainer.max_steps=4", *common), tmp_path / "straight")
    run(cfg_for("trainer.max_steps=2", *common), tmp_path / "resumed")
    run(cfg_for("trainer.max_steps=4", "ckpt_path=last", *common), tmp_path / "resumed")
    a = read_scalars(tmp_path / "straight")
    b = read_scalars(tmp_path / "resumed")
    for tag in [
        "rollout/reward_mean",
        "rollout/response_length_mean",
        "train/loss",
        "train/grad_norm",
        "train/entropy",
    ]:
        assert [s for s, _ in b[tag]] == [s for s, _ in a[tag]], tag
        assert [v for _, v in b[tag]] == pytest.approx([v for _, v in a[tag]], rel=1e-5, abs=1e-7), tag
    from safetensors.torch import load_file

    wa = load_file(tmp_path / "straight" / "policy" / "model.safetensors")
    wb = load_file(tmp_path / "resumed" / "policy" / "model.safetensors")
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-7) for k in wa)


def test_run_name_keeps_only_swept_keys():
    from lit_rl.run.runfolder import run_name

    job = ["model=tiny", "algo=dapo", "seed=1", "trainer.max_steps=20"]
    assert (
        run_name(job, None, argv=["-m", "model=tiny", "algo=grpo,dapo", "seed=0,1", "trainer.max_steps=20"])
        == "algo=dapo,seed=1"
    )
    # a preset's hydra.sweeper.params count as swept too
    assert (
        run_name(["experiment=algo_zoo", "algo=ppo"], {"algo": "reinforce,ppo"}, argv=["experiment=algo_zoo", "-m"])
        == "algo=ppo"
    )
    assert run_name(["model=tiny"], None, argv=["model=tiny"]) == "run"


def test_constant_reward_and_tracked_kl_to_the_initial_policy(tmp_path):
    """task.constant_reward rewards every completion alike; kl.track logs KL to the initial policy at
    beta = 0: exactly 0 before the first update, > 0 once the weights moved."""
    run(
        cfg_for(
            "algo=reinforce",
            "algo.baseline=none",
            "task.constant_reward=1.0",
            "kl.track=true",
            "optim.lr=1e-3",
            "trainer.max_steps=2",
            "eval.num_examples=0",
        ),
        tmp_path / "c",
    )
    s = read_scalars(tmp_path / "c")
    assert [v for _, v in s["rollout/reward_mean"]] == [1.0, 1.0]
    assert s["train/ref_kl"][0][1] == 0.0 and s["train/ref_kl"][1][1] > 0.0


@pytest.mark.parametrize("algo, expected", [("grpo", [1 / 8, 2 / 8]), ("ppo", [4 / 8, 1.0])])
def test_warmup_counts_optimizer_steps_for_every_algorithm(tmp_path, algo, expected):
    """optim.warmup_steps=8 ramps the lr linearly per optimizer step: GRPO takes 1 per RL step, PPO 2x2 = 4;
    train/lr is the rate the step's (last) update used (LambdaLR factor (s + 1) / 8 at optimizer step s):
    issue 17's bug logged the next step's rate (GRPO's step 0 trained at 1/8 and logged 2/8)."""
    run(
        cfg_for(f"algo={algo}", "optim.lr=1e-4", "optim.warmup_steps=8", "trainer.max_steps=2", "eval.num_examples=0"),
        tmp_path / algo,
    )
    lrs = [v for _, v in read_scalars(tmp_path / algo)["train/lr"]]
    assert lrs == pytest.approx([1e-4 * e for e in expected], rel=1e-6)


def test_run_name_reads_sweeps_the_way_hydra_parses_them():
    from lit_rl.run.runfolder import run_name

    assert run_name(["seed=1", "model=tiny"], None, argv=["-m", "seed=range(2)", "model=tiny"]) == "seed=1"
    assert run_name(["algo=grpo"], None, argv=["--multirun", "algo=glob(g*)"]) == "algo=grpo"
    assert (
        run_name(["optim.betas=[0.9,0.99]", "seed=0"], None, argv=["-m", "optim.betas=[0.9,0.99],[0.8,0.9]", "seed=0"])
        == "optim.betas=[0.9,0.99]"
    )
    # a list value alone is not a sweep
    assert run_name(["optim.betas=[0.9,0.99]"], None, argv=["optim.betas=[0.9,0.99]"]) == "run"
