"""The task interface: where prompts come from and how a completion is scored."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_rl.tasks.rewards import ANSWER_MODES, math_reward

__all__ = ["Example", "Task"]


@dataclass(frozen=True)
class Example:
    """One prompt with its verifiable answer.

    Attributes:
        id: stable index within its split (0-based).
        question: the user message content (instruction included).
        answer: gold final answer as a string, e.g. "42", "-3", "1234", "3/4" ("" when there is none).
        messages: the prompt as chat messages (``{"role", "content"}`` dicts), when the data gave them;
            ``question`` is then the last message's content. None: one user message ``question``.
        columns: the data row the example came from (``task=dataset``), handed to reward functions; None
            for generated tasks.
    """

    id: int
    question: str
    answer: str
    messages: tuple[Mapping[str, str], ...] | None = field(default=None, compare=False, hash=False, repr=False)
    columns: Mapping[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The example as reward functions see it: the data row's columns, then ``id``, ``question``
        (the prompt text) and ``answer``."""
        return {**(self.columns or {}), "id": self.id, "question": self.question, "answer": self.answer}


def first_non_utf8_line(file: Path) -> str | None:
    """``"<file> line N: not valid UTF-8 (...)"`` for the first line of ``file`` that is not UTF-8, else None
    (``datasets`` reports such a file as ``'utf-8' codec can't decode byte 0xe9 in position 23``, naming neither
    the file nor the line)."""
    with open(file, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            problem = utf8_problem(raw)
            if problem is not None:
                return f"{file} line {lineno}: {problem}"
    return None


def utf8_problem(raw: bytes) -> str | None:
    """Why the line ``raw`` is not UTF-8 (the byte and where it is), or None when it is."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return (
            f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line: {err.reason}); "
            "save the file as UTF-8"
        )
    return None


def no_text(value) -> bool:
    """Whether a prompt holds no text: null, an empty or white-space string, or chat messages (a list) whose
    contents outside the system message are all empty or white space."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        if not all(isinstance(m, Mapping) for m in value):
            return False  # not chat messages: reported as such
        return all(m.get("role") == "system" or not str(m.get("content") or "").strip() for m in value)
    return False


class Task:
    """Base class for a source of prompts with a verifiable reward.

    Subclasses set ``name``, ``system_prompt`` and ``answer_format`` and implement
    ``train_examples`` and ``eval_examples``. The default ``reward`` is ``math_reward`` on the
    example's gold answer.
    """

    name: str = "task"
    system_prompt: str | None = None
    answer_format: str = "flexible"

    def train_examples(self) -> Sequence[Example]:
        """Return the training split (same order every call)."""
        raise NotImplementedError

    def eval_examples(self) -> Sequence[Example]:
        """Return the evaluation split (same order every call)."""
        raise NotImplementedError

    def messages(self, ex: Example) -> list[dict[str, str]]:
        """Return chat messages for ``ex``: an optional system message, then the user message.

        The list is ready for ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``. An example
        with its own ``messages`` gives them, after the system message unless they start with their own.
        """
        msgs: list[dict[str, str]] = []
        own = [dict(m) for m in ex.messages] if ex.messages is not None else None
        if self.system_prompt and not (own and own[0]["role"] == "system"):
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs += own if own is not None else [{"role": "user", "content": ex.question}]
        return msgs

    def reward(self, completion: str, ex: Example) -> float:
        """Return 1.0 if ``completion`` answers ``ex`` correctly, else 0.0.

        Never raises for any completion text (or a non-string completion).
        """
        try:
            return math_reward(completion, ex.answer, self.answer_format)
        except Exception:  # noqa: BLE001 - a reward must never crash training
            return 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, answer_format={self.answer_format!r})"


class ConstantReward(Task):
    """``task``'s prompts with every completion rewarded ``value``: the constant-reward drift study.

    With a constant reward the true policy gradient is zero, so whatever moves the policy is noise or the
    train-inference mismatch (SPEC.md, score centering). Only training completions get the constant:
    ``eval_task`` (the wrapped task) scores the eval split with its real verifier.
    """

    def __init__(self, task: Task, value: float):
        self.task, self.value = task, float(value)
        self.eval_task = task
        self.name, self.system_prompt, self.answer_format = task.name, task.system_prompt, task.answer_format

    def train_examples(self) -> Sequence[Example]:
        return self.task.train_examples()

    def eval_examples(self) -> Sequence[Example]:
        return self.task.eval_examples()

    def messages(self, ex: Example) -> list[dict[str, str]]:
        return self.task.messages(ex)

    def reward(self, completion: str, ex: Example) -> float:
        return self.value


def check_answer_format(answer_format: str) -> str:
    """Return ``answer_format`` if it is one of ``ANSWER_MODES``; raise ValueError otherwise."""
    if answer_format not in ANSWER_MODES:
        raise ValueError(f"answer_format must be one of {ANSWER_MODES}, got {answer_format!r}")
    return answer_format
