"""Runs whose rewards cannot work (issue 33 items 8 and 9): a dataset without answers and a reward that needs them is
refused at start-up; a reward function that fails on every call stops the run after ``reward.max_failed_steps``
steps in a row, naming the function and its first error; the functions' prints go to ``<run>/reward_output.log``,
with one line on the console, never to the console itself."""

import os
import subprocess
import sys

import pytest
from helpers import ROOT, fast_config

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
