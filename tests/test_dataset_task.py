"""``task=dataset``: local parquet / csv / jsonl / saved folders with custom columns, chat messages, a held-out
share, and one-line errors naming the file, split or column for each kind of bad input."""

import json

import pytest
from helpers import fast_config

from lit_rl.config import ConfigError, validate
from lit_rl.run.train import run
from lit_rl.tasks import DatasetTask, build_task
from lit_rl.tools.compare import read_scalars

ROWS = [
    {"problem": "What is 2 + 3?", "solution": "5", "level": 1},
    {"problem": "What is 4 + 4?", "solution": "8", "level": 1},
    {"problem": "What is 10 - 7?", "solution": "3", "level": 2},
    {"problem": "What is 6 * 7?", "solution": "42", "level": 3},
]


def write(path, rows=ROWS):
    """``rows`` as a data file of ``path``'s extension, written with pandas (parquet via pyarrow)."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    if path.suffix == ".parquet":
        frame.to_parquet(path)
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


COLUMNS = ["task=dataset", "task.prompt_field=problem", "task.answer_field=solution", "task.eval_fraction=0.25"]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_parquet_and_a_csv_file_with_custom_columns_train_two_steps(tmp_path, suffix):
    data = write(tmp_path / f"train{suffix}")
    cfg = fast_config(*COLUMNS, f"task.path={data}", "trainer.max_steps=2", "eval.num_examples=1")
    run(cfg, tmp_path / "run")
    scalars = read_scalars(tmp_path / "run")
    assert len(scalars["train/loss"]) == 2 and len(scalars["eval/accuracy"]) == 1
    task = build_task({**dict(cfg.task), "seed": 0})
    assert len(task.train_examples()) == 3 and len(task.eval_examples()) == 1  # 25 % of 4 rows held out
    seen = {ex.question: ex.answer for ex in (*task.train_examples(), *task.eval_examples())}
    assert seen == {r["problem"]: r["solution"] for r in ROWS}
    assert task.train_examples()[0].columns["level"] in (1, 2, 3)  # the row travels with the example


def test_chat_messages_system_prompt_template_and_a_saved_dataset_folder(tmp_path):
    import datasets

    chat = [
        {"messages": [{"role": "user", "content": "Add 2 and 3."}], "answer": "5"},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Add 1 and 1."},
            ],
            "answer": "2",
        },
    ]
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(chat), "test": datasets.Dataset.from_list(chat[:1])}
    ).save_to_disk(str(folder))
    task = DatasetTask(path=str(folder), prompt_field="messages", eval_split="test", system_prompt="Think.")
    first, second = task.train_examples()
    assert task.messages(first) == [
        {"role": "system", "content": "Think."},
        {"role": "user", "content": "Add 2 and 3."},
    ]
    assert task.messages(second) == chat[1]["messages"]  # its own system message stays the only one
    assert second.question == "Add 1 and 1." and second.answer == "2" and len(task.eval_examples()) == 1

    text = write(tmp_path / "t.jsonl")
    templated = DatasetTask(
        path=str(text), prompt_field="problem", answer_field="solution", prompt_template="Level {level}: {problem}"
    )
    assert templated.train_examples()[3].question == "Level 3: What is 6 * 7?"

    cfg = fast_config(
        "task=dataset",
        f"task.path={folder}",
        "task.prompt_field=messages",
        "task.eval_split=test",
        "trainer.max_steps=1",
    )
    run(cfg, tmp_path / "run")
    assert len(read_scalars(tmp_path / "run")["train/loss"]) == 1


def one_line_error(exc_type, fn):
    with pytest.raises(exc_type) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_each_bad_input_gives_a_one_line_error_naming_it(tmp_path):
    data = write(tmp_path / "d.parquet")
    missing = tmp_path / "nope.csv"
    # a missing file: config validation, before anything loads
    msg = one_line_error(ConfigError, lambda: validate(fast_config(*COLUMNS, f"task.path={missing}")))
    assert str(missing) in msg and "no such file" in msg
    msg = one_line_error(FileNotFoundError, lambda: DatasetTask(path=str(missing)))
    assert str(missing) in msg
    # a missing column: named, with the columns that exist
    msg = one_line_error(ValueError, lambda: DatasetTask(path=str(data), prompt_field="question"))
    assert "'question'" in msg and "task.prompt_field" in msg and "['problem', 'solution', 'level']" in msg
    msg = one_line_error(ValueError, lambda: DatasetTask(path=str(data), prompt_field="problem", answer_field="gold"))
    assert "'gold'" in msg and "task.answer_field" in msg
    # a missing split, an empty split
    msg = one_line_error(
        ValueError, lambda: DatasetTask(path=str(data), prompt_field="problem", answer_field="solution", eval_split="x")
    )
    assert "no split 'x'" in msg and "['train']" in msg
    empty = tmp_path / "empty.csv"
    empty.write_text("problem,solution\n")
    msg = one_line_error(ValueError, lambda: DatasetTask(path=str(empty), prompt_field="problem"))
    assert str(empty) in msg and "'train' is empty" in msg
    for ext in ("jsonl", "csv", "json", "parquet"):  # no bytes at all (datasets: a bare StopIteration)
        blank = tmp_path / f"blank.{ext}"
        blank.write_text("\n" if ext == "jsonl" else "")
        msg = one_line_error(ValueError, lambda: DatasetTask(path=str(blank)))
        assert msg == f"task.path: {blank} is empty ({blank.stat().st_size} bytes, no rows)", msg
        msg = one_line_error(ValueError, lambda: DatasetTask(data_files=str(blank)))
        assert msg.startswith(f"task.data_files: {blank} is empty"), msg
    # a prompt that is neither text nor chat messages: the row and column named
    numbers = write(tmp_path / "n.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": 7, "answer": "2"}])
    msg = one_line_error(ValueError, lambda: DatasetTask(path=str(numbers)))
    assert "row 1" in msg and "'prompt'" in msg and "got int" in msg
    # an unknown extension, a template naming no column
    odd = tmp_path / "d.xlsx"
    odd.write_text("x")
    msg = one_line_error(ValueError, lambda: DatasetTask(path=str(odd)))
    assert "d.xlsx" in msg and ".parquet" in msg
    msg = one_line_error(
        ValueError,
        lambda: DatasetTask(path=str(data), prompt_field="problem", answer_field=None, prompt_template="{question}"),
    )
    assert "{question}" in msg and "columns" in msg
    # no evaluation split while evaluation is on
    msg = one_line_error(
        ConfigError, lambda: validate(fast_config("task=dataset", f"task.path={data}", "eval.num_examples=2"))
    )
    assert "eval.num_examples" in msg and "task.eval_fraction" in msg
    # at start-up (before the model loads) the task's error becomes a ConfigError naming the column
    cfg = fast_config("task=dataset", f"task.path={data}", "eval.num_examples=0", "trainer.max_steps=1")
    msg = one_line_error(ConfigError, lambda: run(cfg, tmp_path / "r"))
    assert "no column 'prompt'" in msg


def test_a_text_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    """datasets said only "'utf-8' codec can't decode byte 0xe9 in position 23" (json: while the rows were
    read; csv: inside "An error occurred while generating the dataset"): the file and its first bad line."""
    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    csv = tmp_path / "latin1.csv"
    csv.write_bytes(b"prompt,answer\na,1\nb,2\ncaf\xe9,3\n")
    why = "not valid UTF-8 (byte 0xe9 at byte {} of the line: {}); save the file as UTF-8"
    expected = {
        jsonl: f"{jsonl} line 2: " + why.format(16, "invalid continuation byte"),
        csv: f"{csv} line 4: " + why.format(4, "invalid continuation byte"),
    }
    for file, message in expected.items():
        assert one_line_error(ValueError, lambda: DatasetTask(path=str(file))) == message
        assert one_line_error(ValueError, lambda: DatasetTask(data_files=[str(file)])) == message
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    (folder / "b.jsonl").write_bytes(jsonl.read_bytes())
    assert one_line_error(ValueError, lambda: DatasetTask(path=str(folder))).startswith(
        f"{folder / 'b.jsonl'} line 2: "
    )


def test_empty_prompts_are_dropped_and_counted_or_refused(tmp_path, capsys):
    """A prompt with no text (empty, white space, null, chat messages with no text) was trained on silently;
    ``task.empty_prompts=drop`` (the default, as for overlong prompts) leaves the rows out and counts them,
    ``error`` refuses the first, naming it."""
    rows = [
        {"prompt": "What is 2 + 3?", "answer": "5"},
        {"prompt": "", "answer": "1"},
        {"prompt": " \n\t", "answer": "2"},
        {"prompt": None, "answer": "3"},
        {"prompt": "What is 4 + 4?", "answer": "8"},
    ]
    data = write(tmp_path / "d.jsonl", rows)
    task = DatasetTask(path=str(data))
    assert [(ex.id, ex.answer) for ex in task.train_examples()] == [(0, "5"), (4, "8")]
    assert task.dropped_empty == {"train": [1, 2, 3], "eval": []}
    assert task.dropped_note == (
        "lit_rl: task=dataset: dropped 3 of 5 train prompts (rows 1, 2, 3) that hold no text "
        "(column 'prompt' null, empty or white space; task.empty_prompts=drop)"
    )
    msg = one_line_error(ValueError, lambda: DatasetTask(path=str(data), empty_prompts="error"))
    assert msg == (
        f"{data} split 'train' row 1: column 'prompt' holds no text (''; task.empty_prompts=error; "
        "drop leaves such rows out, counted)"
    )
    # chat messages with no text but the system message's, in an eval split; an empty CSV cell (read as null)
    chat = [
        {"messages": [{"role": "user", "content": "Add 2 and 3."}], "answer": "5"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " "}], "answer": "1"},
    ]
    train, test = write(tmp_path / "chat.jsonl", chat), write(tmp_path / "chat_test.jsonl", chat[::-1])
    task = DatasetTask(data_files={"train": str(train), "test": str(test)}, prompt_field="messages", eval_split="test")
    assert [ex.id for ex in task.train_examples()] == [0] and [ex.id for ex in task.eval_examples()] == [1]
    assert task.dropped_empty == {"train": [1], "eval": [0]}
    assert "dropped 1 of 2 train prompts (row 1) and 1 of 2 eval prompts (row 0) that hold no text" in task.dropped_note
    csv = tmp_path / "cells.csv"
    csv.write_text("prompt,answer\n,1\nWhat is 1 + 1?,2\n")
    task = DatasetTask(path=str(csv))
    assert [ex.question for ex in task.train_examples()] == ["What is 1 + 1?"] and task.dropped_empty["train"] == [0]
    # nothing left to train on; a bad option value
    blank = write(tmp_path / "blank.jsonl", rows[1:4])
    msg = one_line_error(ValueError, lambda: DatasetTask(path=str(blank)))
    assert msg == f"{blank} split 'train': all 3 prompts hold no text (column 'prompt' null, empty or white space)"
    with pytest.raises(
        ConfigError, match=r"task.empty_prompts='skip' is not allowed: choose one of \['drop', 'error'\]"
    ):
        validate(fast_config("task=dataset", f"task.path={data}", "eval.num_examples=0", "task.empty_prompts=skip"))


def test_overlong_prompts_are_dropped_and_counted_or_refused(tmp_path, capsys):
    rows = [
        {"prompt": "short", "answer": "1"},
        {"prompt": "word " * 3000, "answer": "2"},
        {"prompt": " ", "answer": "3"},
    ]
    data = write(tmp_path / "long.jsonl", rows)
    base = ("task=dataset", f"task.path={data}", "eval.num_examples=0", "trainer.max_steps=1")
    run(fast_config(*base), tmp_path / "drop")
    out = capsys.readouterr().out
    assert "dropped 1 of 2 train prompts" in out  # overlong, of the rows with text
    assert "lit_rl: task=dataset: dropped 1 of 3 train prompts (row 2) that hold no text" in out  # said at start-up
    with pytest.raises(ConfigError, match="longest train prompt"):
        run(fast_config(*base, "task.overlong_prompts=error"), tmp_path / "error")


def test_data_files_per_split_tsv_and_max_examples(tmp_path):
    train, test = tmp_path / "train.tsv", tmp_path / "test.tsv"
    for path, rows in ((train, ROWS), (test, ROWS[:2])):
        path.write_text("problem\tsolution\n" + "".join(f"{r['problem']}\t{r['solution']}\n" for r in rows))
    task = DatasetTask(
        data_files={"train": str(train), "test": str(test)},
        eval_split="test",
        prompt_field="problem",
        answer_field="solution",
        max_examples=3,
    )
    assert [ex.answer for ex in task.train_examples()] == ["5", "8", "3"]  # the first 3 rows
    assert [ex.question for ex in task.eval_examples()] == ["What is 2 + 3?", "What is 4 + 4?"]
    msg = one_line_error(FileNotFoundError, lambda: DatasetTask(data_files=[str(tmp_path / "x.csv")]))
    assert "x.csv" in msg and "task.data_files" in msg
