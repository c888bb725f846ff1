"""Runs whose rewards cannot work (issue 33 items 8 and 9): a dataset without answers and a reward that needs them is
refused at start-up; a reward function that fails on every call stops the run after ``reward.max_failed_steps``
steps in a row, naming the function and its first error; the functions' prints go to ``<run>/reward_output.log``,
with one line on the console, never to the console itself."""

import os
import subprocess
import sys

import pytest
from helpers import FAST, ROOT, fast_config

from lit_rl.config import ConfigError, validate

SUMS = os.path.join(ROOT, "docs", "examples", "sums.jsonl")
#: task=dataset on docs/examples/sums.jsonl with no answer column
NO_ANSWERS = ["task=dataset", f"task.path={SUMS}", "task.prompt_field=problem", "task.answer_field=null"]


# -- item 8 (a): a run that can never be rewarded is refused at start-up ---------------------------------------
@pytest.mark.parametrize(
    "overrides, named",
    [
        ([], "with reward.functions null the task's verifier compares each completion with it"),
        (["reward.functions=[math]"], "reward.functions lists 'math'"),
        (["reward.functions=[format,exact]"], "reward.functions lists 'exact'"),
    ],
)
def test_a_dataset_without_answers_and_a_reward_that_needs_them_is_refused(overrides, named):
    """With task.answer_field=null the default verifier scores every completion 0 (math_reward against ""), and
    math / exact return None (not applicable) on every one: the message names task.answer_field, the reward that
    needs the answer, and both ways out."""
    with pytest.raises(ConfigError) as err:
        validate(fast_config(*NO_ANSWERS, "eval.num_examples=0", *overrides))
    message = str(err.value)
    assert message.startswith("task.answer_field=null: the rows have no gold answer") and "\n" not in message
    assert named in message
    assert "task.answer_field=<column>" in message and "reward.functions that need no answer" in message


@pytest.mark.parametrize(
    "overrides",
    [["reward.functions=[format]"], ["reward.functions=[format,length_penalty]"], ["task.constant_reward=1"]],
)
def test_a_dataset_without_answers_is_fine_with_rewards_that_need_none(overrides):
    validate(fast_config(*NO_ANSWERS, "eval.num_examples=0", *overrides))


def test_the_recipe_exits_2_on_a_dataset_without_answers_before_torch_loads(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "train.py"), "model=tiny", *NO_ANSWERS]
    res = subprocess.run(
        cmd + ["eval.num_examples=0", f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "lit_rl: error: task.answer_field=null: the rows have no gold answer" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not run_dir.exists()  # refused before the run wrote anything


# -- item 8 (b): a reward function that fails on every call stops the run ---------------------------------------
FAILING = """
import math, os, time

def raises(prompt, completion, example):
    raise ValueError("no parser for this\\nsecond line")

def nan(prompt, completion, example):
    return math.nan

def text(prompt, completion, example):
    return "1.0"

def sleeps(prompt, completion, example):
    time.sleep(60)

def exits(prompt, completion, example):
    os._exit(3)  # the worker process dies

def wrong_length(prompts, completions, **columns):
    return [1.0]

def fine(prompt, completion, example):
    return 0.5
"""

#: what each kind of failure is reported as (the first error the stop names)
FIRST_ERRORS = {
    "raises": "ValueError: no parser for this",
    "nan": "TypeError: reward nan is not finite",
    "text": "TypeError: a reward must be a number, None or a dict with 'score', got str",
    "sleeps": "ran past reward_timeout_s=1 s",
    "exits": "the verifier process died",
    "wrong_length": "returned 1 rewards for 2 completions",
}


def test_every_kind_of_failure_is_tallied_per_function_with_its_first_error(tmp_path):
    """Two completions: each failing function fails on both (2 of 2 calls), the working one on none; the tally
    and the first error of each are what ``count_failed_step`` reads."""
    from lit_rl.tasks import ArithmeticTask
    from lit_rl.tasks.reward_functions import RewardFunctions

    (tmp_path / "f.py").write_text(FAILING)
    names = [*FIRST_ERRORS, "fine"]
    task = ArithmeticTask(num_train=2, num_eval=0)
    rewards = RewardFunctions(task, [f"{tmp_path}/f.py:{n}" for n in names], num_workers=2, timeout_s=1.0)
    examples = task.train_examples()[:2]
    scores = rewards.score(examples, ["#### 1", "#### 2"], [[1], [2]], "train")
    assert scores.failures == {**{n: (2, 2) for n in FIRST_ERRORS}, "fine": (0, 2), "task verifier": (0, 2)}
    assert rewards.first_errors == FIRST_ERRORS
    assert scores.total == [0.5, 0.5] and scores.errors == 12


def test_the_run_of_failed_steps_is_bounded_and_ends_at_a_step_with_one_success(tmp_path):
    """max_failed_steps=3: steps 0-1 all failed, step 2 one success (the run of failed steps ends), steps 3-5 all
    failed: the third of those, step 5, raises, naming the function, its first error and steps 3-5."""
    from lit_rl.tasks import ArithmeticTask
    from lit_rl.tasks.reward_functions import RewardFunctionFailed, RewardFunctions

    (tmp_path / "f.py").write_text(FAILING)
    rewards = RewardFunctions(ArithmeticTask(num_train=1, num_eval=0), [f"{tmp_path}/f.py:raises"])
    rewards.first_errors["raises"] = "ValueError: no parser for this"
    all_failed, task_fine = {"raises": (8, 8), "task verifier": (0, 8)}, {"task verifier": (0, 8)}
    for step, tally in enumerate([all_failed, all_failed, {"raises": (7, 8)}, all_failed, all_failed]):
        rewards.count_failed_step({**task_fine, **tally}, step)
    assert rewards.failed_steps == {"raises": 2, "task verifier": 0}
    with pytest.raises(RewardFunctionFailed) as err:
        rewards.count_failed_step(all_failed, 5)
    message = str(err.value)
    assert message.startswith(
        "reward function 'raises' failed on every call in 3 RL steps in a row (steps 3-5, reward.max_failed_steps=3); "
        "its first error: ValueError: no parser for this. "
    )
    assert "stopped at RL step 5, before its update" in message
    never = RewardFunctions(ArithmeticTask(num_train=1, num_eval=0), ["format"], max_failed_steps=0)
    for step in range(10):
        never.count_failed_step({"format": (8, 8)}, step)  # 0: never stops


@pytest.mark.parametrize("algo", [["algo=grpo"], ["algo=dapo", "algo.overlong.buffer_length=4"]])
def test_a_function_that_fails_on_every_call_stops_the_run_before_the_steps_update(tmp_path, algo):
    """In-process (``run``), max_failed_steps=2: step 0 trains, step 1 raises RewardFunctionFailed before its
    update and metrics, so TensorBoard holds step 0 only and there is no finished.json. DAPO's dynamic sampling
    draws rounds until algo.dynamic_sampling.max_rounds (every reward is 0: every group is dropped); all its
    rounds' calls count for the step."""
    from lit_rl.run.train import run
    from lit_rl.tasks.reward_functions import RewardFunctionFailed
    from lit_rl.tools.compare import read_scalars

    (tmp_path / "f.py").write_text(FAILING)
    cfg = fast_config(
        *algo,
        "trainer.max_steps=4",
        "eval.num_examples=0",
        f"reward.functions=[{tmp_path}/f.py:nan,format]",
        "reward.max_failed_steps=2",
    )
    with pytest.raises(RewardFunctionFailed) as err:
        run(cfg, tmp_path / "run")
    assert str(err.value).startswith(
        "reward function 'nan' failed on every call in 2 RL steps in a row (steps 1-2, reward.max_failed_steps=2); "
        "its first error: TypeError: reward nan is not finite. "
    )
    assert [step for step, _ in read_scalars(tmp_path / "run")["train/loss"]] == [1]
    assert not (tmp_path / "run" / "finished.json").exists()


def _recipe(*args, timeout=600):
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "train.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_a_function_that_fails_on_every_call_stops_the_recipe_with_its_first_error_and_a_run_that_continues(tmp_path):
    """6 steps, reward.max_failed_steps=3, a function that always raises: steps 1 and 2 train (each printing
    nothing more than the one line), step 3 stops before its update: exit 1, ``lit_rl: stopped: ...`` naming it and
    its first error, no traceback, no finished.json; the run folder holds steps 1-2 and the checkpoint after step
    2 (checkpoint.every_n_steps=2). Continuing it with reward.max_failed_steps=0 trains steps 3-6 and finishes:
    each step logged once (steps numbered from 1)."""
    from lit_rl.tools.compare import read_scalars

    (tmp_path / "f.py").write_text(FAILING)
    run_dir = tmp_path / "run"
    res = _recipe(
        *FAST,
        "trainer.max_steps=6",
        "eval.num_examples=0",
        f"reward.functions=[{tmp_path}/f.py:raises]",
        f"hydra.run.dir={run_dir}",
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert (
        "lit_rl: stopped: reward function 'raises' failed on every call in 3 RL steps in a row (steps 1-3, "
        "reward.max_failed_steps=3); its first error: ValueError: no parser for this. " in res.stderr
    )
    assert "stopped at RL step 3, before its update" in res.stderr  # steps 1 and 2 trained
    assert "Traceback" not in res.stderr + res.stdout
    assert res.stdout.count("reward function 'raises' failed: ValueError: no parser for this;") == 1
    assert not (run_dir / "finished.json").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step=2.ckpt"]
    s = read_scalars(run_dir)
    assert [step for step, _ in s["train/loss"]] == [1, 2]
    assert [v for _, v in s["rollout/reward_errors"]] == [8.0, 8.0]  # 2 prompts x G = 4, each failed

    res = _recipe("--resume", str(run_dir), "reward.max_failed_steps=0")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (run_dir / "finished.json").exists()
    assert [step for step, _ in read_scalars(run_dir)["train/loss"]] == [1, 2, 3, 4, 5, 6]


# -- item 9: what the reward functions print goes to <run>/reward_output.log, not to the console -----------------
NOISY = """
import sys

def noisy(prompt, completion, example):
    for i in range(2000):
        print(f"noisy {example['id']:04d} line {i:04d} " + "x" * 40)
    print(f"noisy {example['id']:04d} to stderr", file=sys.stderr)
    return 0.0
"""
#: every line ``noisy`` prints, whole
NOISY_LINE = r"noisy \d{4} (line \d{4} x{40}|to stderr)"


def _noisy_rewards(tmp_path, log):
    from lit_rl.tasks import ArithmeticTask
    from lit_rl.tasks.reward_functions import RewardFunctions

    (tmp_path / "noisy.py").write_text(NOISY)
    task = ArithmeticTask(num_train=8, num_eval=0)
    return task, RewardFunctions(task, [f"{tmp_path}/noisy.py:noisy"], num_workers=2, output_log=log)


def test_the_functions_output_goes_to_the_log_whole_lines_and_one_console_line(tmp_path, capfd):
    """Two workers, 8 completions, 2,001 lines per call: the log holds all 16,008 lines, each whole (none cut
    mid-line by the other worker), stdout and stderr alike; the console gets one line, once, with the count and
    the first line, and none of theirs. The pool is shared by later runs in the process: a second set of
    functions writes to its own log, and one without a log prints to the console again."""
    import re

    from lit_rl.tasks.verifier_pool import close_shared_pool

    close_shared_pool()  # fresh workers, started on this test's console (capfd)
    log = tmp_path / "reward_output.log"
    task, rewards = _noisy_rewards(tmp_path, log)
    examples, texts = task.train_examples(), ["#### 1"] * 8
    rewards.prepare()
    rewards.score(examples, texts, [[1]] * 8, "train")
    lines = log.read_text().splitlines()
    assert len(lines) == 8 * 2001 and all(re.fullmatch(NOISY_LINE, line) for line in lines)
    assert sorted({line[:10] for line in lines}) == [f"noisy {ex.id:04d}" for ex in examples]
    out, err = capfd.readouterr()
    assert "noisy" not in err and out.count("noisy") == 3  # only the first three lines, quoted in the note
    first = " | ".join(repr(line) for line in lines[:3])
    assert out.splitlines() == [
        f"lit_rl: the reward functions printed 16008 lines so far, written to {log} with the rest of their output "
        f"(their workers' stdout and stderr), not here; the first: {first} (printed once)"
    ]
    rewards.score(examples[:1], texts[:1], [[1]], "eval")
    assert len(log.read_text().splitlines()) == 9 * 2001 and capfd.readouterr().out == ""  # printed once

    other = tmp_path / "other" / "reward_output.log"
    other.parent.mkdir()
    _, second = _noisy_rewards(tmp_path, other)
    second.score(examples[:2], texts[:2], [[1]] * 2, "train")
    assert len(other.read_text().splitlines()) == 2 * 2001 and len(log.read_text().splitlines()) == 9 * 2001
    assert f"printed 4002 lines so far, written to {other}" in capfd.readouterr().out  # its own note
    _, console = _noisy_rewards(tmp_path, None)
    console.score(examples[:1], texts[:1], [[1]], "train")
    out, err = capfd.readouterr()
    assert out.count("noisy 0000 line") == 2000 and err == "noisy 0000 to stderr\n"
    assert len(other.read_text().splitlines()) == 2 * 2001


def test_a_run_writes_its_reward_output_log(tmp_path, capfd):
    """One step of 2 prompts x G = 4 with the noisy function: <run>/reward_output.log holds 8 x 2,001 lines and the
    console one line about them."""
    from lit_rl.run.train import run

    (tmp_path / "noisy.py").write_text(NOISY)
    cfg = fast_config("trainer.max_steps=1", "eval.num_examples=0", f"reward.functions=[{tmp_path}/noisy.py:noisy]")
    run(cfg, tmp_path / "run")
    log = tmp_path / "run" / "reward_output.log"
    lines = log.read_text().splitlines()
    assert len(lines) == 8 * 2001
    out, err = capfd.readouterr()
    assert out.count(f"lit_rl: the reward functions printed {8 * 2001} lines so far, written to {log}") == 1
    assert out.count("noisy") == 3 and "noisy" not in err


WORKER_ONLY_FAILURE = """
import os
if os.environ.get("LIT_RL_VERIFIER_WORKER"):  # loads in the trainer, fails in the workers
    if os.path.exists(os.path.join(os.path.dirname(__file__), "say_why")):
        print("cannot reach the grading server")
    raise ConnectionError("no grading server")

def grade(prompt, completion, example):
    return 1.0
"""


@pytest.mark.parametrize("say_why", [False, True])
def test_functions_that_cannot_load_in_the_workers_leave_no_empty_log(tmp_path, say_why):
    """A refused start leaves no empty reward_output.log behind (the run folder of a refused start is removed
    when it holds nothing a run wrote); one the workers printed to is kept and named in the error."""
    from lit_rl.tasks import ArithmeticTask
    from lit_rl.tasks.reward_functions import RewardFunctions

    if say_why:
        (tmp_path / "say_why").touch()
    (tmp_path / "g.py").write_text(WORKER_ONLY_FAILURE)
    log = tmp_path / "reward_output.log"
    task = ArithmeticTask(num_train=1, num_eval=0)
    rewards = RewardFunctions(task, [f"{tmp_path}/g.py:grade"], num_workers=1, output_log=log)
    with pytest.raises(RuntimeError) as err:
        rewards.prepare()
    assert "ConnectionError: no grading server" in str(err.value)
    if say_why:
        assert str(err.value).endswith(f"(what the functions printed: {log})")
        assert log.read_text() == "cannot reach the grading server\n"
    else:
        assert not log.exists()


def test_workers_outlive_a_signal_to_the_process_group_so_the_step_can_finish():
    """Ctrl-C, ``timeout``, SLURM's scancel and its ``--signal=USR1@<s>`` warning signal the whole process group:
    the verifier workers must leave the signal to the trainer (which finishes its step, scoring with them, then
    checkpoints). A SIGTERM that killed them broke the step's scoring with BrokenPipeError (seen with
    ``timeout -s TERM`` on the main job), and so did a SIGUSR1 (tests/test_faults.py, to an async run's group)."""
    import signal
    import time

    from lit_rl.tasks.reward_functions import FunctionRef
    from lit_rl.tasks.verifier_pool import VerifierPool

    pool = VerifierPool(num_workers=1)
    try:
        refs = [FunctionRef("format", batched=False)]
        pool.prepare("k", refs)
        (worker,) = pool._workers
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            os.kill(worker.process.pid, sig)
        time.sleep(0.5)
        assert worker.process.poll() is None  # still running
        outcome = pool.run("k", refs, [(0, ("q", "#### 7", {}), {})], timeout_s=10.0)
        assert [(o.status, o.value) for o in outcome] == [("ok", 1.0)]
    finally:
        pool.close()


def test_a_worker_still_loading_another_keys_functions_is_not_sent_this_keys_calls():
    """A multi-turn run alternates two keys on one pool: the environment's steps and the rewards. When another
    worker served all of a key's jobs before this one answered its setup, this worker's key is still the old one
    with the new key's setup on its way; a call for the old key sent then ran the new key's function (seen on
    task=calculator: "EnvStep.load.<locals>.run() takes 2 positional arguments but 3 were given", every reward
    scored 0). The pool loads the old key again first."""
    from lit_rl.rollout.environments import EnvStep, GuessNumberEnvironment
    from lit_rl.tasks.reward_functions import FunctionRef
    from lit_rl.tasks.verifier_pool import VerifierPool

    pool = VerifierPool(num_workers=1)
    try:
        refs = [FunctionRef("format", batched=False)]
        pool.prepare("rewards", refs)
        (worker,) = pool._workers
        steps = [EnvStep.of(GuessNumberEnvironment())]
        worker.conn.send(("setup", "environment", pool._file_for("environment", steps), None))
        worker.loading = "environment"  # the state the environment's run left: its answer not yet read
        outcome = pool.run("rewards", refs, [(0, ("q", "#### 7", {}), {})], timeout_s=10.0)
        assert [(o.status, o.value) for o in outcome] == [("ok", 1.0)]
        state = {"example": {"answer": "3"}, "turn": 0}
        (step,) = pool.run("environment", steps, [(0, (state, "3"), {})], timeout_s=10.0)
        assert step.status == "ok" and step.value[1:] == (None, 1.0, {"solved": True})
    finally:
        pool.close()


def test_a_pool_leaves_no_folder_behind():
    """The function files' folder is made at the first file and removed by ``close``, which makes none again (each
    suite run left three empty ``lit_rl-verifiers-*`` folders in the temp directory, made by ``close`` itself); used
    again, the pool makes a new one."""
    from lit_rl.tasks.reward_functions import FunctionRef
    from lit_rl.tasks.verifier_pool import VerifierPool

    pool = VerifierPool(num_workers=1)
    assert pool._folder is None
    refs = [FunctionRef("format", batched=False)]
    try:
        pool.run("k", refs, [(0, ("q", "#### 7", {}), {})], timeout_s=10.0)
        first = pool._folder
        assert first is not None and os.listdir(first) == ["0.pkl"]
    finally:
        pool.close()
    assert pool._folder is None and not os.path.exists(first)
    try:
        (outcome,) = pool.run("k", refs, [(0, ("q", "#### 7", {}), {})], timeout_s=10.0)
        assert outcome.value == 1.0 and os.path.isdir(pool._folder) and pool._folder != first
    finally:
        pool.close()
    assert pool._folder is None
