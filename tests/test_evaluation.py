"""Evaluation as practitioners read it (issue 40): pass@k for every power of two k <= n, mean@n, maj@n by the
verifier's equivalence, best@n / worst@n, several eval sets each with its own task, eval.at_start, the generations
saved per set, eval.only on a policy/ folder."""

from __future__ import annotations

import json

import pytest
from helpers.config import fast_config
from helpers.scripted import script_completions

from lit_rl.config import ConfigError, validate
from lit_rl.run.train import run
from lit_rl.tasks.eval_metrics import majority_index, pass_ks, problem_scores
from lit_rl.tools.compare import read_scalars


def test_pass_at_k_for_every_power_of_two_with_the_issue_values():
    """n = 4, correct [1, 0, 0, 0]: pass@1 1/4, pass@2 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5, pass@4 1 (SPEC 17)."""
    assert pass_ks(4) == [1, 2, 4] and pass_ks(1) == [1] and pass_ks(8) == [1, 2, 4, 8]
    assert pass_ks(6, 3) == [1, 2, 3, 4]  # eval.k joins the powers of two
    s = problem_scores([True, False, False, False], [1.0, 0.0, 0.0, 0.0], pass_ks(4))
    assert s["pass@1"] == pytest.approx(0.25) and s["pass@2"] == pytest.approx(0.5) and s["pass@4"] == 1.0
    assert s["mean@n"] == 0.25 and s["best@n"] == 1.0 and s["worst@n"] == 0.0 and "maj@n" not in s
    with pytest.raises(ValueError, match="k must be in"):
        pass_ks(4, 5)


def test_maj_at_n_groups_by_the_verifiers_equivalence_with_the_stated_tie_break():
    """maj@4 of answers [3, 3, 5, 7] with gold 3 is 1, of [5, 5, 3, 7] is 0 (SPEC 17); 0.5 and 1/2 are one answer;
    an unparseable answer never forms the majority; equal groups: the one whose first sample comes first."""

    def maj(answers, gold):
        correct = [a is not None and a == gold for a in answers]
        return problem_scores(correct, [float(c) for c in correct], [1], answers)["maj@n"]

    assert maj(["3", "3", "5", "7"], "3") == 1.0
    assert maj(["5", "5", "3", "7"], "3") == 0.0
    assert majority_index(["1/2", "0.25", "0.5", "\\frac{1}{2}"]) == 0  # three answers equal 1/2
    assert majority_index([None, None, None, "7"]) == 3  # three unparseable samples are no majority
    assert majority_index([None, None]) is None
    assert majority_index(["5", "3", "3", "5"]) == 0  # tie 2-2: the group of sample 0
    assert majority_index(["3", "5", "5", "3"]) == 0


DATA = [{"prompt": "What is 1 + 2?", "answer": "3"}, {"prompt": "What is 2 + 1?", "answer": "3"}]
#: each problem's four samples answer 3, 3, 5, 7 (a prompt's samples are consecutive rows)
TEXTS = ["#### 3", "#### 3", "#### 5", "#### 7"]


def test_two_eval_sets_log_apart_with_at_start_and_their_generations(tmp_path, monkeypatch):
    """The task's own split (gold 5) and a second set (its own dataset task, gold 3), n = 4 samples answering
    [3, 3, 5, 7] per problem. The task's split: one correct, accuracy = mean@4 = pass@1 0.25, pass@2
    1 - C(3,2)/C(4,2) = 0.5, pass@4 1, maj@4 0 (the majority 3 is wrong). The set: two correct, 0.5, pass@2
    1 - C(2,2)/C(4,2) = 5/6, pass@4 1, maj@4 1. eval.at_start logs one evaluation at the step before the first
    training step, the second after step 2."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": "5"}) + "\n" for r in DATA * 2))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in DATA))
    script_completions(monkeypatch, lambda n: TEXTS * (n // 4))
    cfg = fast_config(
        "task=dataset",
        f"task.path={train}",
        "task.eval_fraction=0.5",
        "trainer.max_steps=2",
        "eval.at_start=true",
        "eval.n=4",
        "eval.temperature=1.0",
        "eval.num_examples=2",
        f"eval.sets=[{{name: other, task: {{name: dataset, path: '{other}'}}, split: train}}]",
    )
    run(cfg, tmp_path / "run")
    s = read_scalars(tmp_path / "run")
    first = s["train/loss"][0][0]
    for prefix, c, pass2, maj in (("eval/", 0.25, 0.5, 0.0), ("eval/other/", 0.5, round(5 / 6, 6), 1.0)):
        got = {k: s[prefix + k] for k in ("accuracy", "mean@4", "pass@1", "pass@2", "pass@4", "maj@4", "best@4")}
        assert [x for x, _ in got["accuracy"]] == [first - 1, s["train/loss"][1][0]]  # at start, after step 2
        values = {k: [round(v, 6) for _, v in points] for k, points in got.items()}
        assert values == {
            "accuracy": [c] * 2,
            "mean@4": [c] * 2,
            "pass@1": [c] * 2,
            "pass@2": [pass2] * 2,
            "pass@4": [1.0] * 2,
            "maj@4": [maj] * 2,
            "best@4": [1.0] * 2,
        }
    assert "eval/other/accuracy" in s and not any(t.startswith("eval/main") for t in s)
    folder = tmp_path / "run" / "eval_generations"
    assert sorted(p.name for p in folder.iterdir()) == ["main.jsonl", "other.jsonl"]
    rows = [json.loads(line) for line in (folder / "other.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 4  # two evaluations x two problems x four samples
    assert [r["answer"] for r in rows[:4]] == ["3", "3", "5", "7"] and [r["correct"] for r in rows[:4]] == [
        True,
        True,
        False,
        False,
    ]
    assert {r["gold"] for r in rows} == {"3"} and rows[0]["set"] == "other"


def test_eval_only_evaluates_a_policy_folder_without_training(tmp_path, capsys):
    """eval.only=true on the policy/ a run exported: one evaluation, no training step, no policy/ written; its
    scores printed as one plain line (the only place besides the event files a user sees them). A distill.teacher
    in the config is not loaded (nothing is trained): a folder that does not exist is no error here."""
    run(fast_config("trainer.max_steps=1", "eval.num_examples=0", "log.plain_lines=true"), tmp_path / "a")
    policy = tmp_path / "a" / "policy"
    capsys.readouterr()
    config = fast_config(
        f"model.name_or_path={policy}",
        "eval.only=true",
        "eval.num_examples=2",
        "log.plain_lines=true",
        f"distill.teacher={tmp_path / 'no_teacher_here'}",
    )
    run(config, tmp_path / "b")
    s = read_scalars(tmp_path / "b")
    assert [v for _, v in s["eval/accuracy"]] == [0.0] and "train/loss" not in s
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("lit_rl: eval ")]
    assert lines == ["lit_rl: eval step 0 eval/accuracy 0.0000 eval/reward_mean 0.0000"]
    assert not (tmp_path / "b" / "policy").exists() and (tmp_path / "b" / "eval_generations" / "main.jsonl").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.sets=[{name: main, task: {name: arithmetic}}]", r"eval.sets\[0\].name='main' is not allowed"),
        ("eval.sets=[{name: a, task: {name: arithmetic}},{name: a, task: {name: arithmetic}}]", "given twice"),
        ("eval.sets=[{name: a}]", r"eval.sets\[0\].task=null is not allowed: must be a task config"),
        ("eval.sets=[{name: a, task: {name: arithmetic}, split: test}]", "must be eval or train"),
        ("eval.sets=[{name: a, task: {name: arithmetic}, size: 3}]", "unknown keys"),
        ("eval.only=true", "eval.only=true is not allowed: needs something to evaluate"),
    ],
)
def test_eval_set_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(fast_config("eval.num_examples=0", override))
