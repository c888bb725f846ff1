"""``<run>/train.log``: what a run printed (its start-up lines, one line per step, warnings, the error that ended
it), kept in the run folder as well as shown on the console.

``RunLog.start()`` tees ``sys.stdout`` and ``sys.stderr``: every line written through them still reaches the
console, and is also held in memory until ``attach`` names the run's file (once the run folder is checked as this
run's: a refused start never writes into another run's folder), then appended there, a line at a time. Under
``python recipes/train.py`` Hydra's own log handler writes Python ``logging`` records (Lightning's) into the same
file; its console handler writes to the original stream, so no line is written twice. A progress bar's redraws
(``\\r``) keep only their last state, as a terminal shows it. Output that bypasses ``sys.stdout`` (a subprocess, a
write to file descriptor 1) is not seen; the reward functions' output has its own file (``reward_output.log``).
"""

from __future__ import annotations

import sys
import threading
import traceback
from pathlib import Path

#: the run folder's log file (the name Hydra's job logging gives it for recipes/train.py)
RUN_LOG = "train.log"


class _Tee:
    """A text stream that writes to ``stream`` and hands every write to ``log`` as well; everything else
    (``isatty``, ``fileno``, ``encoding``...) is the stream's."""

    def __init__(self, stream, log: RunLog):
        self.stream, self.log = stream, log

    def write(self, text):
        written = self.stream.write(text)
        self.log.record(text)
        return written

    def __getattr__(self, name):
        return getattr(self.stream, name)


class RunLog:
    """The console's lines, also kept for the run folder's log (module docstring). ``note`` writes to the log
    only; ``end`` records the exception that ended the run; ``close`` restores the streams."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending = ""  # the current line, not yet ended
        self.held: list[str] | None = []  # complete lines before ``attach``; None once the file is open
        self.file = None
        self.tees: dict[str, _Tee] = {}

    @classmethod
    def start(cls) -> RunLog:
        """A ``RunLog`` teeing ``sys.stdout`` and ``sys.stderr`` from now on."""
        log = cls()
        for name in ("stdout", "stderr"):
            log.tees[name] = _Tee(getattr(sys, name), log)
            setattr(sys, name, log.tees[name])
        return log

    def attach(self, path: Path) -> None:
        """Append to ``path`` from now on, the lines held since ``start`` first."""
        with self.lock:
            self.file = open(path, "a", encoding="utf-8", errors="backslashreplace")
            self.file.writelines(self.held or [])
            self.file.flush()
            self.held = None

    def record(self, text: str) -> None:
        """Take ``text`` written to the console: complete lines go to the file (or are held until ``attach``)."""
        if self.file is None and self.held is None:
            return  # closed
        with self.lock:
            self.pending += text
            if "\n" not in self.pending:
                self.pending = self.pending[self.pending.rfind("\r") + 1 :]  # a redraw replaces the line
                return
            *lines, self.pending = self.pending.split("\n")
            self._keep([line[line.rfind("\r") + 1 :] + "\n" for line in lines])

    def _keep(self, lines: list[str]) -> None:
        lines = [line for line in lines if line.strip()]  # a progress bar's closing newline is no line
        if self.held is not None:
            self.held.extend(lines)
        elif self.file is not None:
            try:
                self.file.writelines(lines)
                self.file.flush()
            except OSError:  # a full disk must not end the run from inside a print: the log stops there
                self.file = None

    def note(self, line: str) -> None:
        """``line`` to the log only (the console shows something else, e.g. a progress bar)."""
        with self.lock:
            self._keep([line.rstrip("\n") + "\n"])

    def end(self, err: BaseException) -> None:
        """Record what ended the run: a config error as the one line the recipe prints, a signal's stop not
        again (``preemption.preempted`` printed it), anything else with its traceback."""
        from ..config import ConfigError

        if isinstance(err, ConfigError):
            self.note(f"lit_rl: error: {err}")
        elif not isinstance(err, SystemExit):
            text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            self.note(f"lit_rl: the run ended with {type(err).__name__}: {err}\n{text.rstrip()}")

    def close(self) -> None:
        """Stop teeing: the streams are restored (a tee something else has wrapped since only stops copying),
        the file closed."""
        with self.lock:
            if self.pending.strip():
                self._keep([self.pending[self.pending.rfind("\r") + 1 :] + "\n"])
            self.pending, self.held = "", None
            if self.file is not None:
                self.file.close()
                self.file = None
        for name, tee in self.tees.items():
            if getattr(sys, name) is tee:
                setattr(sys, name, tee.stream)
