"""``<run>/train.log`` records the run: its start-up lines, one line per step, warnings and the error that ended
it (``lit_rl.run.runlog``), for ``python recipes/train.py`` and ``lit_rl.train`` alike."""

import sys

import pytest
from helpers import fast_config

import lit_rl.run.train as train_module
from lit_rl.config import ConfigError
from lit_rl.run.runlog import RUN_LOG, RunLog
from lit_rl.run.train import run


def test_console_lines_are_held_until_the_folder_is_checked_then_appended(tmp_path, capsys):
    stdout, stderr = sys.stdout, sys.stderr
    log = RunLog.start()
    try:
        print("lit_rl: threads=2 (auto)")
        print("half a ", end="")
        assert not (tmp_path / RUN_LOG).exists()  # not yet this run's folder: nothing written there
        log.attach(tmp_path / RUN_LOG)
        print("line", flush=True)
        print("x.py:7: UserWarning: a warning", file=sys.stderr)  # as Python's warnings write them
        log.note("lit_rl: step 1/2 (the log only)")
        sys.stderr.write("Writing shards:   0%|\rWriting shards: 100%|\n")  # a progress bar's redraws
        sys.stderr.write("\n")
        log.end(ConfigError("correction.sc.top_k=100000 is larger than the vocabulary"))
    finally:
        log.close()
    assert sys.stdout is stdout and sys.stderr is stderr  # the streams are restored
    print("after the run")
    assert (tmp_path / RUN_LOG).read_text().splitlines() == [
        "lit_rl: threads=2 (auto)",
        "half a line",
        "x.py:7: UserWarning: a warning",
        "lit_rl: step 1/2 (the log only)",
        "Writing shards: 100%|",
        "lit_rl: error: correction.sc.top_k=100000 is larger than the vocabulary",
    ]
    console = capsys.readouterr()
    assert "lit_rl: threads=2 (auto)\nhalf a line\nafter the run\n" == console.out  # the console has it all too
    assert "step 1/2" not in console.out + console.err


def test_a_run_logs_its_steps_even_where_the_console_does_not_show_them(tmp_path, capsys):
    out = tmp_path / "run"
    run(fast_config("trainer.max_steps=2", "log.plain_lines=false", "threads=1"), out)
    lines = (out / RUN_LOG).read_text().splitlines()
    threads = [line for line in lines if line.startswith("lit_rl: threads=")]
    assert len(threads) == 1 and threads[0].startswith(
        "lit_rl: threads=1 (set explicitly; GOMP_SPINCOUNT=1000); malloc:"
    )
    assert [line.split(" reward")[0] for line in lines if line.startswith("lit_rl: step ")] == [
        "lit_rl: step 1/2",
        "lit_rl: step 2/2",
    ]
    assert "lit_rl: step" not in capsys.readouterr().out  # log.plain_lines=false: the console shows none
    with pytest.raises(ConfigError, match="already holds a finished run"):
        run(fast_config("trainer.max_steps=2"), out)
    assert (out / RUN_LOG).read_text().splitlines() == lines  # a refused start writes nothing into that run's log


def test_the_error_that_ends_a_run_is_in_its_log_with_the_traceback(tmp_path, monkeypatch):
    def crash(prepared):
        raise RuntimeError("the engine died")

    monkeypatch.setattr(train_module, "build", crash)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="the engine died"):
        run(fast_config("trainer.max_steps=1"), out)
    text = (out / RUN_LOG).read_text()
    assert "lit_rl: the run ended with RuntimeError: the engine died\nTraceback (most recent call last):" in text
    assert text.rstrip().endswith("RuntimeError: the engine died")
