"""``lit_rl.train``: the recipe's run from Python, with in-memory reward functions and datasets."""

import copy
import functools
import json
import os
import subprocess
import sys

import pytest
from helpers import FAST, ROOT, compose_config
from omegaconf import OmegaConf

import lit_rl
from lit_rl.config import ConfigError
from lit_rl.run.entry import reward_spec
from lit_rl.schema import TrainConfig, train_config
from lit_rl.tools.compare import read_scalars

#: sums the model cannot get wrong in the answer's format: the rows a user would hand over as a list
ROWS = [{"prompt": f"What is {a} + {b}? Answer after ####.", "answer": str(a + b)} for a in range(3) for b in range(3)]


def brevity(prompts, completions, **columns):
    """TRL's batched convention: a reward per completion, shorter is better."""
    return [-len(c) / 100 for c in completions]


def test_compose_is_the_recipes_config_typed():
    """``lit_rl.compose(*overrides)`` is what ``python recipes/train.py <overrides>`` runs with, as the typed
    config; the defaults of ``TrainConfig()`` are the recipe's (algo defaults come from the algorithm's file)."""
    composed = lit_rl.compose("model=tiny", "algo=dapo")
    assert composed == train_config(compose_config("model=tiny", "algo=dapo"))
    assert (composed.algo.name, composed.algo.clip.eps_high, composed.model.name_or_path) == ("dapo", 0.28, "tiny")
    assert train_config(TrainConfig()) == lit_rl.compose()


def test_a_bad_value_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="rollout.group_size=0 is not allowed"):
        lit_rl.train(lit_rl.compose("rollout.group_size=0"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_reward_callables_are_named_for_the_workers_or_refused():
    """A top-level function travels by name (the workers import it); what cannot be imported by name is refused
    with the reason, before any run starts."""
    assert reward_spec(brevity) == "test_entry:brevity"
    assert reward_spec("math") == "math"

    def nested(prompt, completion, example):
        return 0.0

    class Scorer:
        def __call__(self, prompt, completion, example):
            return 0.0

    for bad in [lambda p, c, e: 0.0, nested, functools.partial(brevity), Scorer()]:
        with pytest.raises(ValueError, match=r"reward_functions: .*cannot reach the verifier workers \(it is not a"):
            reward_spec(bad)


def test_train_from_python_with_a_list_of_rows_and_a_reward_callable_then_resume(tmp_path, capsys):
    """The in-memory dataset is saved to <run>/data and read as task=dataset; the callable is recorded by name in
    config.yaml; the caller's config object is left as it was; the run continues from its folder alone."""
    cfg = train_config(compose_config(*FAST, "trainer.max_steps=2", "eval.num_examples=3"))
    before = copy.deepcopy(cfg)
    out = tmp_path / "run"
    result = lit_rl.train(cfg, out, reward_functions=["format", brevity], train_dataset=ROWS[:6], eval_dataset=ROWS[6:])
    assert cfg == before
    assert f"lit_rl: run folder {out} (tensorboard --logdir {out})" in capsys.readouterr().out  # where to look
    assert result.out_dir == out and (result.policy_dir / "config.json").is_file()
    saved = OmegaConf.load(out / "config.yaml")
    assert saved.task.name == "dataset" and saved.task.path == str((out / "data").resolve())
    assert (saved.task.split, saved.task.eval_split) == ("train", "test")
    assert list(saved.reward.functions) == ["format", "test_entry:brevity"]
    scalars = read_scalars(out)
    assert [s for s, _ in scalars["rollout/reward/brevity"]] == [1, 2]
    assert all(-1.0 <= v < 0.0 for _, v in scalars["rollout/reward/brevity"])  # -len / 100 of 8 tokens' text
    assert len(scalars["eval/accuracy"]) == 1
    assert result.metrics["rollout/reward/format"] == scalars["rollout/reward/format"][-1][1]

    longer = train_config(saved)
    longer.trainer["max_steps"] = 3
    lit_rl.train(longer, resume=out)  # no dataset, no callables: the folder has both
    assert [s for s, _ in read_scalars(out)["rollout/reward/brevity"]] == [1, 2, 3]
    steps = [
        line.split(" reward")[0]
        for line in (out / "train.log").read_text().splitlines()
        if line.startswith("lit_rl: step ")
    ]
    assert steps == ["lit_rl: step 1/2", "lit_rl: step 2/2", "lit_rl: step 3/3"]  # the run folder records both runs
    assert json.loads((out / "finished.json").read_text())["global_step"] == 3


def test_an_out_dir_with_another_runs_data_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.txt").write_text("the user's")
    with pytest.raises(ConfigError, match="already holds data/"):
        lit_rl.train(TrainConfig(), tmp_path, train_dataset=ROWS)
    assert os.listdir(tmp_path / "data") == ["mine.txt"]
    with pytest.raises(TypeError, match="train_dataset: give a datasets.Dataset or a list of row dicts"):
        lit_rl.train(TrainConfig(), tmp_path / "new", train_dataset="rows.jsonl")


SCRIPT = """
import lit_rl


def short(prompt, completion, example):
    return -len(completion) / 100


def main():
    lit_rl.train(
        lit_rl.compose({overrides}),
        {out!r},
        reward_functions=[short],
        train_dataset=[{{"question": "1 + 1 = ?", "gold": "2"}}] * 4,
    )


{call}
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_reward_function_of_the_running_script(tmp_path, guarded):
    """A function defined in the script that calls ``lit_rl.train`` reaches the workers by the script's path; a
    script without the ``__main__`` guard gets a clear error instead of a second run started by the worker."""
    out = tmp_path / "run"
    overrides = [*FAST, "trainer.max_steps=1", "eval.num_examples=0", "task=dataset", "task.path=unused"]
    overrides += ["task.prompt_field=question", "task.answer_field=gold"]
    call = 'if __name__ == "__main__":\n    main()' if guarded else "main()"
    script = tmp_path / "my_script.py"
    script.write_text(SCRIPT.format(overrides=", ".join(map(repr, overrides)), out=str(out), call=call))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, env=env)
    if guarded:
        assert proc.returncode == 0, proc.stderr[-3000:]
        saved = OmegaConf.load(out / "config.yaml")
        assert list(saved.reward.functions) == [f"{script.resolve()}:short"]
        assert saved.task.prompt_field == "question"  # the dataset options of task=dataset are kept
        assert "rollout/reward/short" in read_scalars(out)
    else:
        assert proc.returncode != 0
        assert 'if __name__ == "__main__":' in proc.stderr and "reward.functions" in proc.stderr, proc.stderr[-3000:]
        assert not (out / "checkpoints").exists()
