"""Tests for lit_rl.tasks: answer extraction, rewards, arithmetic generation, GSM8K loading."""

from __future__ import annotations

import json
import operator
import re
from pathlib import Path

import pytest

from lit_rl.tasks import (
    ArithmeticTask,
    DatasetTask,
    Example,
    Gsm8kTask,
    Task,
    answers_match,
    build_task,
    extract_answer,
    math_reward,
)

GSM8K_DIR = Path("/work/shared/data/gsm8k")


# --------------------------------------------------------------------------- rewards


def test_hashes_answer_followed_by_long_text():
    trailing = " and then some more words, 99 and 1234 too." * 12
    trailing = trailing[:480]
    assert len(trailing) == 480
    completion = "Let me think. 40 + 2 = 42.\n#### 42" + trailing
    assert extract_answer(completion) == "42"
    assert math_reward(completion, "42") == 1.0
    assert math_reward(completion, "42", mode="strict") == 1.0
    assert math_reward(completion, "99") == 0.0


def test_last_hashes_wins():
    assert extract_answer("#### 5\nwait, no.\n#### 6 final") == "6"
    assert math_reward("#### 5\nwait, no.\n#### 6 final", "6") == 1.0


def test_hashes_with_commas():
    assert math_reward("#### 1,234", "1234") == 1.0
    assert math_reward("#### 1234", "1,234") == 1.0
    assert math_reward("#### 1,234", "1235") == 0.0


def test_hashes_negative():
    assert extract_answer("#### -3") == "-3"
    assert math_reward("#### -3", "-3") == 1.0
    assert math_reward("#### -3", "3") == 0.0
    assert math_reward("#### 3", "-3") == 0.0


def test_hashes_with_dollar_bold_and_period():
    assert math_reward("#### **$1,234.00**.", "1234") == 1.0
    assert math_reward("####18", "18") == 1.0


def test_boxed_flexible_and_strict():
    completion = "So the total is \\boxed{42}."
    assert extract_answer(completion) == "42"
    assert math_reward(completion, "42") == 1.0
    assert extract_answer(completion, mode="strict") is None
    assert math_reward(completion, "42", mode="strict") == 0.0


def test_boxed_nested_braces_and_last_one():
    assert extract_answer("\\boxed{1} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    # Unbalanced: falls back to the last number, which is the whole fraction (not its last digit).
    assert extract_answer("\\boxed{\\frac{3}{4}") == "\\frac{3}{4}"


def test_no_number_scores_zero():
    for text in ["I don't know.", "", "####", "#### lots of words", "\\boxed{}", "\\boxed{"]:
        assert math_reward(text, "7") == 0.0
        assert math_reward(text, "7", mode="strict") == 0.0
    assert extract_answer("I don't know.") is None


def test_non_string_completion_scores_zero():
    assert math_reward(None, "7") == 0.0  # type: ignore[arg-type]
    assert math_reward(7, "7") == 0.0  # type: ignore[arg-type]


def test_last_number_flexible_only():
    assert extract_answer("The answer is 7.") == "7"
    assert math_reward("The answer is 7.", "7") == 1.0
    assert math_reward("The answer is 7.", "7", mode="strict") == 0.0
    assert math_reward("3 apples and 4 pears make 7", "7") == 1.0
    assert math_reward("3 apples and 4 pears make 7", "3") == 0.0


def test_subtraction_is_not_a_negative_number():
    assert extract_answer("10-3") == "3"
    assert extract_answer("x = -3") == "-3"


def test_fraction_vs_decimal():
    assert math_reward("3/4", "0.75") == 1.0
    assert math_reward("#### 3/4", "0.75") == 1.0
    assert math_reward("#### 0.75", "3/4") == 1.0
    assert math_reward("3/4", "0.7") == 0.0


def test_boxed_latex_fraction_vs_decimal():
    assert math_reward("\\boxed{\\frac{3}{4}}", "0.75") == 1.0


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("\\frac{3}{4}", "0.75"),  # bare: was read as its last digit, 4
        ("#### \\frac{24}{2}", "12"),  # after ####: was read as 2
        ("The answer is \\dfrac{3}{4}", "3/4"),
        ("so it is \\tfrac{3}{4}.", "0.75"),
        ("\\frac34", "0.75"),  # TeX's brace-less form: 3 over 4, not 34
        ("x = -\\frac{3}{4}", "-0.75"),
        ("#### -\\frac{1}{2}", "-0.5"),
        ("so the share is $\\frac{3}{4}$.", "0.75"),
        ("$-\\dfrac{7}{2}$ in all", "-3.5"),
        ("\\boxed{\\dfrac{24}{2}}", "12"),
        ("#### \\frac{1,200}{4}", "300"),
    ],
)
def test_latex_fractions_are_one_number(completion, gold):
    assert math_reward(completion, gold) == 1.0
    # The same value read exactly: a wrong gold scores 0 (no digit of the fraction matches on its own).
    wrong = str(float(gold.split("/")[0]) / float(gold.split("/")[1]) + 1) if "/" in gold else str(float(gold) + 1)
    assert math_reward(completion, wrong) == 0.0


def test_latex_fraction_digits_are_not_answers():
    assert math_reward("\\frac{3}{4}", "4") == 0.0
    assert math_reward("#### \\frac{24}{2}", "2") == 0.0
    assert extract_answer("#### \\frac{24}{2}", mode="strict") == "\\frac{24}{2}"
    assert answers_match("\\frac{24}{0}", "0") is False
    assert math_reward("\\boxed{\\dfrac{3}{4}}", "3/4") == 1.0
    assert math_reward("\\boxed{\\frac{3}{4}}", "0.5") == 0.0


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("1,234", "1234", True),
        ("$18", "18", True),
        ("18.", "18", True),
        ("+5", "5", True),
        ("2.50", "2.5", True),
        ("50%", "50", True),
        ("-3", "-3", True),
        ("-3", "3", False),
        ("3/4", "0.75", True),
        ("1/0", "0", False),
        ("42", "43", False),
    ],
)
def test_answers_match_numeric(pred, gold, expected):
    assert answers_match(pred, gold) is expected


def test_answers_match_never_raises():
    assert answers_match(None, "1") is False  # type: ignore[arg-type]
    assert answers_match("\\frac{", "1") is False
    assert answers_match("x" * 10_000, "1") is False


def test_bad_mode_is_a_config_error():
    with pytest.raises(ValueError, match="strict"):
        math_reward("#### 1", "1", mode="lenient")
    with pytest.raises(ValueError, match="answer_format"):
        ArithmeticTask(answer_format="lenient")


def test_model_text_is_not_executed():
    # Would have side effects (or raise) if anything eval'd the text.
    text = "__import__('os').system('exit 1') #### __import__('os')"
    assert math_reward(text, "1") == 1.0  # last number is the '1' in 'exit 1'
    assert math_reward("\\boxed{__import__('os').getcwd()}", "0") == 0.0


# --------------------------------------------------------------------------- arithmetic


def _operands(question: str) -> tuple[int, str, int]:
    m = re.match(r"What is (\d+) ([-+*]) (\d+)\?", question)
    assert m, question
    return int(m.group(1)), m.group(2), int(m.group(3))


def test_arithmetic_deterministic_per_seed():
    a = ArithmeticTask(seed=3, num_train=50, num_eval=20, digits=2, operators=("+", "-", "*"))
    b = ArithmeticTask(seed=3, num_train=50, num_eval=20, digits=2, operators=("+", "-", "*"))
    c = ArithmeticTask(seed=4, num_train=50, num_eval=20, digits=2, operators=("+", "-", "*"))
    assert a.train_examples() == b.train_examples()
    assert a.eval_examples() == b.eval_examples()
    assert a.train_examples() != c.train_examples()
    assert a.eval_examples() != c.eval_examples()
    assert a.train_examples() != a.eval_examples()


def test_arithmetic_sizes_ids_and_question_text():
    task = ArithmeticTask(seed=0, num_train=30, num_eval=7)
    assert len(task.train_examples()) == 30
    assert len(task.eval_examples()) == 7
    assert [ex.id for ex in task.train_examples()] == list(range(30))
    assert [ex.id for ex in task.eval_examples()] == list(range(7))
    q = task.train_examples()[0].question
    assert re.fullmatch(r"What is \d \+ \d\? Give the final answer as a number after '####'\.", q)
    custom = ArithmeticTask(num_train=2, num_eval=1, instruction="Answer briefly.")
    assert custom.train_examples()[0].question.endswith("? Answer briefly.")
    bare = ArithmeticTask(num_train=2, num_eval=1, instruction="")
    assert bare.train_examples()[0].question.endswith("?")


@pytest.mark.parametrize("digits, low, high", [(1, 0, 9), (2, 10, 99), (3, 100, 999)])
def test_arithmetic_digits_respected(digits, low, high):
    task = ArithmeticTask(seed=1, num_train=400, num_eval=50, digits=digits)
    seen = set()
    for ex in list(task.train_examples()) + list(task.eval_examples()):
        a, _, b = _operands(ex.question)
        assert low <= a <= high and low <= b <= high
        seen.update((a, b))
    assert min(seen) < low + (high - low) // 4 and max(seen) > high - (high - low) // 4


def test_arithmetic_operators_respected_and_answers_correct():
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    task = ArithmeticTask(seed=5, num_train=300, num_eval=50, digits=2, operators=("-", "*"))
    used = set()
    for ex in list(task.train_examples()) + list(task.eval_examples()):
        a, op, b = _operands(ex.question)
        used.add(op)
        assert ex.answer == str(ops[op](a, b))
    assert used == {"-", "*"}
    assert any(ex.answer.startswith("-") for ex in task.train_examples())


def test_arithmetic_known_answers():
    task = ArithmeticTask(num_train=1, num_eval=1, digits=2, operators=("+", "-", "*"))
    assert task._example(0, (12, "+", 30)).answer == "42"
    assert task._example(0, (12, "-", 30)).answer == "-18"
    assert task._example(0, (12, "*", 30)).answer == "360"


def test_arithmetic_eval_disjoint_when_space_allows():
    task = ArithmeticTask(seed=0, num_train=1000, num_eval=200, digits=2, operators=("+",))
    train_q = {ex.question for ex in task.train_examples()}
    eval_q = [ex.question for ex in task.eval_examples()]
    assert len(eval_q) == 200
    assert not train_q.intersection(eval_q)
    # 1-digit "+" has only 100 problems, all in a 10000-example train split: overlap is expected.
    small = ArithmeticTask(seed=0)
    assert len(small.eval_examples()) == 200
    assert {ex.question for ex in small.train_examples()} >= {ex.question for ex in small.eval_examples()}


def test_arithmetic_bad_arguments():
    with pytest.raises(ValueError, match="operators"):
        ArithmeticTask(operators=("/",))
    with pytest.raises(ValueError, match="operators"):
        ArithmeticTask(operators=())
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=0)


def test_arithmetic_reward_and_messages():
    task = ArithmeticTask(num_train=1, num_eval=1, system_prompt="You are a calculator.")
    ex = Example(id=0, question="What is 7 + 5?", answer="12")
    assert task.reward("7 + 5 = 12\n#### 12", ex) == 1.0
    assert task.reward("#### 13", ex) == 0.0
    assert task.reward("", ex) == 0.0
    assert task.messages(ex) == [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 7 + 5?"},
    ]
    assert ArithmeticTask(num_train=1, num_eval=1).messages(ex) == [{"role": "user", "content": "What is 7 + 5?"}]
    strict = ArithmeticTask(num_train=1, num_eval=1, answer_format="strict")
    assert strict.reward("The answer is 12", ex) == 0.0
    assert strict.reward("#### 12", ex) == 1.0


# --------------------------------------------------------------------------- gsm8k


def _count_lines(file: Path) -> int:
    with file.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


@pytest.fixture(scope="module")
def gsm8k_task() -> Gsm8kTask:
    if not GSM8K_DIR.is_dir():
        pytest.skip(f"GSM8K data not present at {GSM8K_DIR}")
    return Gsm8kTask(path=str(GSM8K_DIR))


def test_gsm8k_counts(gsm8k_task):
    assert len(gsm8k_task.train_examples()) == _count_lines(GSM8K_DIR / "train.jsonl")
    assert len(gsm8k_task.eval_examples()) == _count_lines(GSM8K_DIR / "test.jsonl")
    assert len(gsm8k_task.train_examples()) == 7473
    assert len(gsm8k_task.eval_examples()) == 1319


def test_gsm8k_known_examples(gsm8k_task):
    first_test = gsm8k_task.eval_examples()[0]
    assert first_test.id == 0
    assert first_test.question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first_test.question.endswith("give the final answer as a number after '####'.")
    assert first_test.answer == "18"
    assert gsm8k_task.train_examples()[0].answer == "72"
    # Line 346 of train.jsonl ends with "#### 1,080": commas are stripped from the gold.
    line = (GSM8K_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines()[345]
    assert json.loads(line)["answer"].endswith("#### 1,080")
    assert gsm8k_task.train_examples()[345].answer == "1080"
    assert gsm8k_task.train_examples()[345].id == 345
    assert all(re.fullmatch(r"-?[\d.]+", ex.answer) for ex in gsm8k_task.train_examples())


def test_gsm8k_reward(gsm8k_task):
    ex = gsm8k_task.eval_examples()[0]
    assert gsm8k_task.reward("She makes 9 * 2 = $18.\n#### 18", ex) == 1.0
    assert gsm8k_task.reward("#### 17", ex) == 0.0


def _write_split(tmp_path: Path, train_lines: list, test_lines: list[str] | None = None) -> Path:
    """train.jsonl and test.jsonl of ``tmp_path``, one line each of ``train_lines`` (str, or bytes as they are)."""
    good = json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"})
    raw = [line if isinstance(line, bytes) else line.encode() for line in train_lines]
    (tmp_path / "train.jsonl").write_bytes(b"".join(line + b"\n" for line in raw))
    (tmp_path / "test.jsonl").write_text("".join(line + "\n" for line in (test_lines or [good])))
    return tmp_path


def _good(n: int) -> str:
    return json.dumps({"question": f"q{n}", "answer": f"work\n#### {n},000"})


def test_gsm8k_small_local_copy_and_limits(tmp_path):
    path = _write_split(tmp_path, [_good(i) for i in range(5)], [_good(7), _good(8)])
    task = Gsm8kTask(path=str(path), instruction="")
    assert [ex.answer for ex in task.train_examples()] == ["0000", "1000", "2000", "3000", "4000"]
    assert [ex.question for ex in task.eval_examples()] == ["q7", "q8"]
    limited = build_task("gsm8k", path=str(path), max_train=2, max_eval=1)
    assert len(limited.train_examples()) == 2 and len(limited.eval_examples()) == 1


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """The Hugging Face caches pointed at empty folders; returns (hub cache, datasets cache)."""
    from huggingface_hub import constants

    hub, home = tmp_path / "hub", tmp_path / "home"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return hub, home / "datasets"


def test_gsm8k_from_the_hub_offline_says_so_at_once(empty_hub_cache, monkeypatch):
    """Without ``path`` and with the hub unreachable: a one-line error naming ``task.path``, at once (datasets
    retried for half a minute, then raised a ConnectionError)."""
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        Gsm8kTask()
    assert time.monotonic() - start < 5
    assert str(err.value) == (
        "task=gsm8k without task.path reads openai/gsm8k from the Hugging Face hub, which is not reachable "
        "(HF_HUB_OFFLINE=1), and the local cache has no copy of it: set task.path to a local folder holding "
        "train.jsonl and test.jsonl (GSM8K's, or your own in its format: docs/data.md)"
    )


def test_hub_dataset_cached_looks_in_both_caches(empty_hub_cache):
    from lit_rl.hub import hub_dataset_cached

    hub, datasets_cache = empty_hub_cache
    assert not hub_dataset_cached("openai/gsm8k")
    (hub / "datasets--openai--gsm8k").mkdir(parents=True)
    assert hub_dataset_cached("openai/gsm8k") and not hub_dataset_cached("other/set")
    (datasets_cache / "other___set").mkdir(parents=True)
    assert hub_dataset_cached("other/set")


def test_gsm8k_missing_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        Gsm8kTask(path=str(missing))


def test_gsm8k_missing_file(tmp_path):
    path = _write_split(tmp_path, [_good(1)])
    (path / "test.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(path / "test.jsonl"))):
        Gsm8kTask(path=str(path))


def test_gsm8k_empty_file(tmp_path):
    path = _write_split(tmp_path, [_good(1)])
    (path / "train.jsonl").write_text("")
    with pytest.raises(ValueError, match=re.escape(f"{path / 'train.jsonl'}: file is empty")):
        Gsm8kTask(path=str(path))


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ('{"question": "q", "answer": "#### 3"', "not valid JSON"),
        ('{"question": "q"}', "missing field 'answer'"),
        ('{"answer": "#### 3"}', "missing field 'question'"),
        ('["q", "#### 3"]', "expected a JSON object"),
        ('{"question": "q", "answer": 3}', "field 'answer' must be a string"),
        ('{"question": "q", "answer": "no final answer"}', "no final answer after '####'"),
        ('{"question": " ", "answer": "#### 3"}', "field 'question' is empty (a prompt with no text)"),
        (b'{"question": "caf\xe9", "answer": "#### 3"}', "not valid UTF-8 (byte 0xe9 at byte 18 of the line"),
    ],
)
def test_gsm8k_bad_line_names_file_and_line(tmp_path, bad_line, problem):
    path = _write_split(tmp_path, [_good(1), _good(2), bad_line, _good(4)])
    with pytest.raises(ValueError) as err:
        Gsm8kTask(path=str(path))
    message = str(err.value)
    assert message.startswith(f"{path / 'train.jsonl'} line 3: ")
    assert problem in message


def test_gsm8k_reads_a_byte_order_mark_crlf_and_blank_lines_as_task_dataset_does(tmp_path):
    """A UTF-8 BOM, CRLF line ends and blank lines (between records and trailing, as editors write them) were
    refused by task=gsm8k ('line 1: not valid JSON', 'empty line') and read by task=dataset: both read them."""
    records = [{"question": "q1", "answer": "w\n#### 1"}, {"question": "q2", "answer": "w\n#### 2"}]
    text = "\ufeff" + json.dumps(records[0]) + "\r\n\r\n  \t\r\n" + json.dumps(records[1]) + "\r\n\n\n"
    (tmp_path / "train.jsonl").write_bytes(text.encode("utf-8"))
    (tmp_path / "test.jsonl").write_bytes(text.encode("utf-8"))
    task = Gsm8kTask(path=str(tmp_path), instruction="")
    for examples in (task.train_examples(), task.eval_examples()):
        assert [(ex.id, ex.question, ex.answer) for ex in examples] == [(0, "q1", "1"), (1, "q2", "2")]
    data = tmp_path / "d.jsonl"  # the same file read by task=dataset
    data.write_bytes(text.replace("question", "prompt").encode("utf-8"))
    assert [ex.question for ex in DatasetTask(path=str(data)).train_examples()] == ["q1", "q2"]
    (tmp_path / "train.jsonl").write_text("\n \n")  # nothing but blank lines is still no data
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'train.jsonl'}: file is empty (only blank lines)")):
        Gsm8kTask(path=str(tmp_path))


def test_gsm8k_bad_line_in_test_file(tmp_path):
    path = _write_split(tmp_path, [_good(1)], [_good(1), _good(2), _good(3), _good(4), '{"question": "q"}'])
    with pytest.raises(ValueError, match=re.escape(f"{path / 'test.jsonl'} line 5: missing field 'answer'")):
        Gsm8kTask(path=str(path))


# --------------------------------------------------------------------------- build_task


def test_build_task_by_name_and_mapping():
    task = build_task("arithmetic", seed=2, num_train=4, num_eval=2, digits=2)
    assert isinstance(task, ArithmeticTask) and isinstance(task, Task)
    assert task.digits == 2 and len(task.train_examples()) == 4
    from_cfg = build_task({"name": "arithmetic", "seed": 2, "num_train": 4, "num_eval": 2, "digits": 2})
    assert from_cfg.train_examples() == task.train_examples()
    overridden = build_task({"name": "arithmetic", "num_train": 4, "num_eval": 2}, num_train=3)
    assert len(overridden.train_examples()) == 3


def test_build_task_from_omegaconf():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"name": "arithmetic", "num_train": 3, "num_eval": 1, "operators": ["*"]})
    task = build_task(cfg)
    assert task.operators == ("*",)
    assert all(" * " in ex.question for ex in task.train_examples())


def test_build_task_unknown_name():
    with pytest.raises(ValueError, match=r"unknown task 'mnist'.*arithmetic.*gsm8k"):
        build_task("mnist")
    with pytest.raises(ValueError, match="name"):
        build_task({"digits": 2})


def test_base_task_is_abstract():
    with pytest.raises(NotImplementedError):
        Task().train_examples()
    with pytest.raises(NotImplementedError):
        Task().eval_examples()
