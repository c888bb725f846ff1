"""Reward functions (``reward.functions``): a user's own from a file, weighted, per completion and batched (TRL's
signature), None = not applicable, a raising one counted; the built-ins; a verifier that would compute for
minutes killed at the limit with nothing left computing; the unbiased pass@k estimator; "correct" from one verifier
(``reward.correct_from``, a dict's ``correct``), never from a threshold on the weighted total (issue 33 item 1)."""

import json
import os
import time

import pytest
from helpers import fast_config
from helpers.scripted import script_completions

import lit_rl
from lit_rl.config import ConfigError, validate
from lit_rl.run.train import run
from lit_rl.schema import train_config
from lit_rl.tasks import ArithmeticTask, DatasetTask, Example
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
    s = {tag: values[0][1] for tag, values in read_scalars(tmp_path / "run").items()}
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
    Also: samples every step to samples.jsonl and TensorBoard's text tab, one plain line per step, the progress bar;
    all number the steps alike (from 1), evaluation after step 2 at step 2."""
    (tmp_path / "r.py").write_text(EVERY_FOURTH)
    cfg = fast_config(
        "trainer.max_steps=2",
        "eval.num_examples=3",
        "eval.every_n_steps=2",
        "eval.n=4",
        "eval.k=2",
        "eval.temperature=1.0",
        f"reward.functions=[{tmp_path}/r.py:every_fourth]",
        "reward.correct_from=every_fourth",  # task=arithmetic's own verifier would find the tiny model wrong
        "log.samples_every_n_steps=1",
        "log.num_samples=3",
        "log.plain_lines=true",
        "trainer.enable_progress_bar=true",
    )
    run(cfg, tmp_path / "run")
    s = read_scalars(tmp_path / "run")
    tags = ("eval/pass@2", "eval/mean@4", "eval/accuracy", "eval/reward_mean")
    assert {tag: [step for step, _ in s[tag]] for tag in tags} == {tag: [2] for tag in tags}
    assert [step for step, _ in s["train/loss"]] == [1, 2]
    values = {tag: [v for _, v in s[tag]] for tag in tags}
    assert values == {"eval/pass@2": [0.5], "eval/mean@4": [0.25], "eval/accuracy": [0.25], "eval/reward_mean": [0.25]}
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert set(rows[0]) == {"step", "prompt", "completion", "reward", "advantage"} and "What is" in rows[0]["prompt"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1, 2] and b"| prompt | completion |" in texts[0].tensor_proto.string_val[0]
    printed = capsys.readouterr().out
    assert "RL step" in printed and "Epoch 0/-2" not in printed  # the progress bar counts steps, not epochs
    lines = [line for line in printed.splitlines() if line.startswith("lit_rl: step ")]
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


# -- correctness: the verifier's verdict, never a threshold on the weighted total (issue 33 item 1) -------------
#: the issue's four eval samples of one problem with gold 7: one correct, two formatted and wrong, one unformatted
ISSUE_SAMPLES = ["#### 7", "I think it is\n#### 8", "#### 5", "The sum is 9"]
#: a training step's two groups of G = 4: every completion formatted and wrong (a total of 1 under [math, format]),
#: then every completion right (a total under 1 under [math, length_penalty])
ISSUE_GROUPS = ["#### 8", "#### 5", "I think it is\n#### 8", "#### 9"] + ["#### 7"] * 4
SUM = {"prompt": "What is 3 + 4? Answer after ####.", "answer": "7"}


@pytest.mark.parametrize("functions", [["math", "format"], ["math", "length_penalty"]])
def test_correct_comes_from_the_verifier_not_from_a_threshold_on_the_weighted_total(tmp_path, monkeypatch, functions):
    """The issue's case, as a user runs it (``lit_rl.train`` with rows; task=dataset, whose built-in verifier here
    is ``math``): eval.n=4, eval.k=2 on the four samples, one correct: eval/accuracy = eval/mean@4 = 1/4 and
    eval/pass@2 = 1 - C(3,2)/C(4,2) = 0.5 (a total >= 1 gave 1.0 with format, whose wrong answers total 1, and
    0.0 with the length penalty, whose right answer totals 1 - tokens/8 < 1). Each training step: one group all
    wrong, one all right, whatever the totals (a threshold counted 2 all-correct groups with format, and with the
    length penalty 0 all-correct, 1 all-wrong). eval/reward_mean is the weighted total's mean: with format
    (2 + 1 + 1 + 0) / 4 = 1; with the length penalty 1/4 minus a mean penalty in [0, 1]."""
    script_completions(monkeypatch, lambda n: ISSUE_SAMPLES if n == 4 else ISSUE_GROUPS)
    cfg = train_config(
        fast_config("trainer.max_steps=2", "eval.num_examples=1", "eval.n=4", "eval.k=2", "eval.temperature=1.0")
    )
    lit_rl.train(cfg, tmp_path / "run", reward_functions=functions, train_dataset=[SUM, SUM], eval_dataset=[SUM])
    s = {tag: [v for _, v in values] for tag, values in read_scalars(tmp_path / "run").items()}
    assert s["eval/accuracy"] == [0.25] and s["eval/mean@4"] == [0.25]
    assert s["eval/pass@2"] == [pytest.approx(0.5)]
    assert s["rollout/groups_all_correct"] == [1.0, 1.0] and s["rollout/groups_all_wrong"] == [1.0, 1.0]
    if functions[1] == "format":
        assert s["eval/reward_mean"] == [1.0]
    else:
        assert -0.75 <= s["eval/reward_mean"][0] < 0.25


DICT_REWARDS = """
def graded(prompt, completion, example):  # verl's convention: partial credit, and whether the answer is right
    right = completion.strip() == "#### " + example["answer"]
    return {"score": 1.0 if right else 0.25, "correct": right, "pred": completion[-1:]}

def graded_batch(prompts, completions, answer, **columns):
    return [{"score": 0.5, "correct": c.endswith(a)} for c, a in zip(completions, answer)]

def lenient(prompt, completion, example):  # a dict without "correct": its score decides
    return {"score": 1.0 if "####" in completion else 0.0}

def no_score(prompt, completion, example):
    return {"correct": True}
"""


def _score(task, functions, texts=ISSUE_SAMPLES, **kwargs):
    rewards = RewardFunctions(task, functions=functions, num_workers=1, **kwargs)
    return rewards, rewards.score([Example(0, "What is 3 + 4?", "7")] * len(texts), texts, [[1]] * len(texts), "eval")


def test_a_function_may_return_a_dict_whose_score_is_summed_and_whose_correct_is_the_correctness(tmp_path):
    """graded: scores [1, 0.25, 0.25, 0.25], correct [T, F, F, F]; with format (weights 1, 1) the totals are
    [2, 1.25, 1.25, 0.25], yet only the first is correct. Batched dicts alike; a dict without "correct": the score
    (>= 1) decides; a dict without "score" is an error (scored 0, counted, not correct)."""
    (tmp_path / "d.py").write_text(DICT_REWARDS)
    task, f = ArithmeticTask(num_train=1, num_eval=0), f"{tmp_path}/d.py"
    _, s = _score(task, [f"{f}:graded", "format"], correct_from="graded")
    assert s.total == [2.0, 1.25, 1.25, 0.25] and s.parts["graded"] == [1.0, 0.25, 0.25, 0.25]
    assert s.correct == [True, False, False, False] and s.errors == 0
    _, s = _score(task, [f"{f}:graded_batch"], correct_from="graded_batch")
    assert s.total == [0.5] * 4 and s.correct == [True, False, False, False]
    _, s = _score(task, [f"{f}:lenient"], correct_from=f"{f}:lenient")  # named by its spec, too
    assert s.correct == [True, True, True, False]
    _, s = _score(task, [f"{f}:no_score", "format"], correct_from="no_score")
    assert s.errors == 4 and s.correct == [False] * 4 and s.total == [1.0, 1.0, 1.0, 0.0]


def test_correct_from_names_the_verifier_and_its_default_is_the_tasks(tmp_path, capsys):
    """correct_from=format: [T, T, T, F] (the user's choice). The default: task=arithmetic's verifier (math on the
    gold answer), run beside [format] and out of its total; task=dataset: math or exact when listed, else the first
    function, said once at start-up."""
    (tmp_path / "d.py").write_text(DICT_REWARDS)
    arithmetic = ArithmeticTask(num_train=1, num_eval=0)
    _, s = _score(arithmetic, ["math", "format"], correct_from="format")
    assert s.correct == [True, True, True, False]
    rewards, s = _score(arithmetic, ["format"])
    assert (rewards.correct_source, s.correct) == ("the task's verifier", [True, False, False, False])
    assert s.total == [1.0, 1.0, 1.0, 0.0] and list(s.parts) == ["format"]
    data = tmp_path / "sums.jsonl"
    data.write_text(json.dumps(SUM) + "\n")
    dataset = DatasetTask(str(data))
    rewards, s = _score(dataset, ["format", "exact"])
    assert rewards.correct_source == "reward function 'exact'" and rewards.correct_note is None
    assert s.correct == [True, False, False, False]
    rewards, s = _score(dataset, ["format", f"{tmp_path}/d.py:graded"])
    assert rewards.correct_source == "reward function 'format'" and "reward.correct_from" in rewards.correct_note
    assert s.correct == [True, True, True, False]
    from lit_rl.run.train import build_rewards

    cfg = train_config(
        fast_config("task=dataset", f"task.path={data}", f"reward.functions=[format,{tmp_path}/d.py:graded]")
    )
    capsys.readouterr()
    build_rewards(cfg, dataset)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "lit_rl: correctness (eval/accuracy, eval/pass@k, rollout/groups_all_correct) comes from reward function "
        "'format', the first of reward.functions: none of them is a built-in verifier (math, exact); set "
        "reward.correct_from to name another"
    ]


def test_a_bad_correct_from_is_refused_naming_the_field():
    cases = [
        (
            ["reward.functions=[math,format]", "reward.correct_from=nope"],
            "reward.correct_from='nope' is not allowed: choose one of reward.functions ['math', 'format']",
        ),
        (["reward.correct_from=math"], "reward.correct_from='math' is not allowed: needs reward.functions"),
    ]
    for overrides, expected in cases:
        with pytest.raises(ConfigError) as err:
            validate(fast_config(*overrides))
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=r"reward.correct_from='nope' is not one of reward.functions"):
        RewardFunctions(ArithmeticTask(num_train=1, num_eval=0), functions=["math"], correct_from="nope")
