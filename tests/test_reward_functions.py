"""Reward functions (``reward.functions``): a user's own from a file, weighted, per completion and batched (TRL's
signature), None = not applicable, a raising one counted; the built-ins; a verifier that would compute for
minutes killed at the limit with nothing left computing; the unbiased pass@k estimator."""

import json
import os
import time

import pytest
from helpers import fast_config

from lit_rl.config import ConfigError, validate
from lit_rl.run.train import run
from lit_rl.tasks import ArithmeticTask
from lit_rl.tasks.reward_functions import BUILTINS, RewardFunctions, pass_at_k
from lit_rl.tools.compare import read_scalars

USER_REWARDS = """
def level_reward(prompt, completion, example):
    return example["level"] / 4

def odd_only(prompts, completions, level, **columns):  # TRL's batched signature
    return [1.0 if lv % 2 else None for lv in level]

def fragile(prompt, completion, example):
    if example["level"] == 4:
        raise ValueError("level 4 is not handled\\nsecond line")
    return 0.0
"""


def test_two_user_functions_from_a_file_weighted_give_the_hand_computed_scalars(tmp_path, capsys):
    """4 prompts (levels 1-4) x G=2 in one step. level_reward: mean (1+2+3+4)/4/4 = 0.625; odd_only: 1 on odd
    levels, None on even ones, so its own mean is 1.0; fragile: raises on level 4 (2 completions: scored 0,
    counted), 0 otherwise. Weights 2, 0.5, 1: total mean = 2 * 0.625 + 0.5 * 4/8 (None counts 0) = 1.5."""
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Say {n}.", "answer": str(n), "level": n}) + "\n" for n in range(1, 5))
    )
    (tmp_path / "mine.py").write_text(USER_REWARDS)
    fns = ",".join(f"{tmp_path}/mine.py:{f}" for f in ("level_reward", "odd_only", "fragile"))
    cfg = fast_config(
        "task=dataset",
        f"task.path={data}",
        "eval.num_examples=0",
        "rollout.prompts_per_step=4",
        "rollout.group_size=2",
        "trainer.max_steps=1",
        f"reward.functions=[{fns}]",
        "reward.weights=[2.0,0.5,1.0]",
    )
    run(cfg, tmp_path / "run")
    s = {tag: values[0][1] for tag, values in read_scalars(tmp_path / "run" / "tensorboard").items()}
    assert s["rollout/reward/level_reward"] == pytest.approx(0.625)
    assert s["rollout/reward/odd_only"] == pytest.approx(1.0)
    assert s["rollout/reward/fragile"] == 0.0
    assert s["rollout/reward_mean"] == pytest.approx(1.5)
    assert s["rollout/reward_errors"] == 2.0
    out = capsys.readouterr().out
    assert out.count("reward function 'fragile' failed: ValueError: level 4 is not handled;") == 1
    assert "second line" not in out


def test_bad_reward_settings_fail_at_validation_naming_them(tmp_path):
    (tmp_path / "mine.py").write_text(USER_REWARDS)
    cases = [
        (["reward.functions=[nope]"], "'nope' is neither a built-in"),
        ([f"reward.functions=[{tmp_path}/missing.py:f]"], "missing.py"),
        ([f"reward.functions=[{tmp_path}/mine.py:absent]"], "has no function 'absent'"),
        (["reward.functions=[no_such_module_xyz:f]"], "cannot import 'no_such_module_xyz'"),
        (["reward.functions=[math,format]", "reward.weights=[1.0]"], "reward.weights"),
        (["reward.num_workers=0"], "reward.num_workers=0"),
    ]
    for overrides, expected in cases:
        with pytest.raises(ConfigError) as err:
            validate(fast_config(*overrides))
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_builtins():
    ex = {"answer": "12"}
    assert BUILTINS["math"]("", "so #### 12", ex) == 1.0 and BUILTINS["math"]("", "#### 13", ex) == 0.0
    assert BUILTINS["math"]("", "#### 12", {"answer": ""}) is None  # no gold answer: not applicable
    assert BUILTINS["exact"]("", " 12 ", ex) == 1.0 and BUILTINS["exact"]("", "#### 12.0", ex) == 0.0
    fmt = BUILTINS["format"]
    assert [fmt("", c, ex) for c in ("#### 4", "\\boxed{x}", "<answer> 4 </answer>", "4", "####", "\\boxed{}")] == [
        1.0,
        1.0,
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    assert BUILTINS["length_penalty"](["p"] * 3, ["", "a", "b"], [[], [1, 2], [1] * 8], 8) == [0.0, -0.25, -1.0]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_factorial_the_verifier_would_compute_for_minutes_is_killed_at_the_limit():
    """``\\boxed{99999999!}``: math-verify hands it to sympy, which computes for minutes (issue 17: an abandoned
    thread slowed the trainer 611x). Killed at the 1 s limit: scored 0, counted, back within limit + 1 s, and
    afterwards nothing computes: the killed worker is gone and neither the other workers nor this process use
    CPU time."""
    task = ArithmeticTask(num_train=2, num_eval=0)
    ex = task.train_examples()[0]
    rewards = RewardFunctions(task, functions=["math"], num_workers=2, timeout_s=1.0)
    warm = rewards.score([ex] * 2, [f"#### {ex.answer}", "\\boxed{3/4}"], [[1], [1]], "train")  # math_verify loaded
    assert warm.total == [1.0, 0.0] and warm.errors == 0
    before = set(rewards.pool.pids)
    t0 = time.perf_counter()
    scores = rewards.score([ex, ex], ["The answer is \\boxed{99999999!}", f"#### {ex.answer}"], [[1], [1]], "train")
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0 + 1.0, elapsed
    assert scores.total == [0.0, 1.0] and scores.errors == 1 and scores.timeouts == 1
    killed = before - set(rewards.pool.pids)
    assert len(killed) == 1 and not any(os.path.exists(f"/proc/{pid}") for pid in killed)
    rewards.prepare()  # the replacement worker has started and loaded the functions
    pids = rewards.pool.pids
    cpu = {pid: _cpu_seconds(pid) for pid in pids}
    own = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - own < 0.1  # no thread of this process left computing
    for pid in pids:
        if os.path.exists(f"/proc/{pid}"):
            assert _cpu_seconds(pid) - cpu[pid] < 0.1, pid  # nor any worker
    # the pool keeps working with the replacement
    assert rewards.score([ex], [f"#### {ex.answer}"], [[1]], "train").total == [1.0]


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 0, 2, 0.0),
        (4, 4, 1, 1.0),
        (4, 2, 1, 0.5),  # pass@1 = c / n
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 10, 1.0),  # n - c < k
        (10, 1, 5, 0.5),  # 1 - C(9,5)/C(10,5) = 1 - 126/252
    ],
)
def test_pass_at_k_is_the_unbiased_estimator_of_chen_et_al(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


EVERY_FOURTH = """
def every_fourth(prompts, completions, **columns):
    return [1.0 if i % 4 == 0 else 0.0 for i in range(len(completions))]
"""


def test_eval_pass_at_k_and_mean_at_n_through_a_run(tmp_path, capsys):
    """eval.n=4 samples per problem, consecutive in the batched call, and a reward of 1 on the first of every
    four: c = 1 of n = 4 for every problem, so eval/pass@2 = 1 - C(3,2)/C(4,2) = 0.5 and eval/mean@4 = 0.25.
    Also: samples every step to samples.jsonl and TensorBoard's text tab, one plain line per step."""
    (tmp_path / "r.py").write_text(EVERY_FOURTH)
    cfg = fast_config(
        "trainer.max_steps=2",
        "eval.num_examples=3",
        "eval.every_n_steps=2",
        "eval.n=4",
        "eval.k=2",
        "eval.temperature=1.0",
        f"reward.functions=[{tmp_path}/r.py:every_fourth]",
        "log.samples_every_n_steps=1",
        "log.num_samples=3",
        "log.plain_lines=true",
    )
    run(cfg, tmp_path / "run")
    s = read_scalars(tmp_path / "run" / "tensorboard")
    values = {tag: [v for _, v in s[tag]] for tag in ("eval/pass@2", "eval/mean@4", "eval/accuracy")}
    assert values == {"eval/pass@2": [0.5], "eval/mean@4": [0.25], "eval/accuracy": [0.25]}
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1]
    assert set(rows[0]) == {"step", "prompt", "completion", "reward", "advantage"} and "What is" in rows[0]["prompt"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [0, 1] and b"| prompt | completion |" in texts[0].tensor_proto.string_val[0]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lit_rl: step ")]
    assert [line.split()[2] for line in lines] == [
        "1/2",
        "2/2",
    ]  # steps done and all("tokens/s" in line for line in lines)


def test_a_script_without_a_main_guard_can_score(tmp_path):
    """Workers are fresh interpreters that do not re-run the caller's script (multiprocessing's spawn does, and
    such a script then fails to start its pool)."""
    import subprocess
    import sys

    script = tmp_path / "score.py"
    script.write_text(
        "from lit_rl.tasks import ArithmeticTask\n"
        "from lit_rl.tasks.reward_functions import RewardFunctions\n"
        "task = ArithmeticTask(num_train=1, num_eval=0)\n"
        "ex = task.train_examples()[0]\n"
        "print(RewardFunctions(task, num_workers=1).score([ex], [f'#### {ex.answer}'], [[1]], 'train').total)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[1.0]", out.stderr[-2000:]
