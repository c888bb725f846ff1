"""GSM8K grade-school math word problems, scored on the final number after ``####``."""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from pathlib import Path

from lit_rl.tasks.base import Example, Task, check_answer_format, no_text, utf8_problem

__all__ = ["Gsm8kTask", "DEFAULT_GSM8K_INSTRUCTION", "gold_from_solution", "validate_jsonl"]

DEFAULT_GSM8K_INSTRUCTION = "Solve the problem step by step, then give the final answer as a number after '####'."

_FIELDS = ("question", "answer")
# File name for each split of a local copy; the eval split is GSM8K's "test" split.
_SPLIT_FILES = {"train": "train.jsonl", "test": "test.jsonl"}


def gold_from_solution(solution: str) -> str | None:
    """Return the gold final answer of a GSM8K solution: the text after the last ``####``.

    Surrounding whitespace and thousands commas are removed ("#### 1,234" gives "1234").
    Returns None when there is no ``####`` or nothing follows it.
    """
    head, sep, tail = solution.rpartition("####")
    if not sep:
        return None
    gold = tail.strip().replace(",", "")
    return gold or None


def validate_jsonl(file: Path) -> int:
    """Check a GSM8K-style JSONL file line by line before ``datasets`` reads it.

    Every line must be a JSON object with string fields ``question`` (not empty) and ``answer``,
    and the answer must end with ``#### N``. As ``task=dataset`` (``datasets``' JSON reader) does,
    a UTF-8 byte-order mark at the start and blank lines (trailing ones, as editors write them,
    or between records) are accepted; CRLF line ends too.

    Returns:
        The number of records.

    Raises:
        FileNotFoundError: ``file`` does not exist (the message names it).
        ValueError: ``file`` has no record, or a line is bad; the message names the file and
            the 1-based line number, e.g. ``"/x/train.jsonl line 3: not valid JSON (...)"``.
    """
    if not file.is_file():
        raise FileNotFoundError(f"{file}: file not found")
    count = 0
    with file.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{file} line {lineno}"
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            problem = utf8_problem(raw)
            if problem is not None:
                raise ValueError(f"{where}: {problem}")
            line = raw.decode("utf-8")
            if not line.strip():
                continue  # a blank line: datasets' JSON reader skips it too
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for field in _FIELDS:
                if field not in record:
                    raise ValueError(f"{where}: missing field {field!r}")
                if not isinstance(record[field], str):
                    raise ValueError(f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}")
            if not record["question"].strip():
                raise ValueError(f"{where}: field 'question' is empty (a prompt with no text)")
            if gold_from_solution(record["answer"]) is None:
                raise ValueError(f"{where}: field 'answer' has no final answer after '####'")
            count += 1
    if count == 0:
        raise ValueError(f"{file}: file is empty" + (" (only blank lines)" if file.stat().st_size else ""))
    return count


class Gsm8kTask(Task):
    """GSM8K: training examples from the ``train`` split, evaluation examples from ``test``.

    With ``path``, the data come from ``path/train.jsonl`` and ``path/test.jsonl`` (fields
    ``question`` and ``answer``; the answer text ends with ``#### N``), validated line by
    line and then loaded with ``datasets.load_dataset("json", ...)``. Without ``path``, from
    the Hugging Face hub: ``datasets.load_dataset(hub_id, hub_config)``. Data are loaded when
    the task is built.

    Each example's question is the problem text followed by ``instruction`` (separated by a
    blank line); its answer is the text after ``####`` with commas removed. Example ids are
    the row index within the split file.

    Args:
        path: directory with ``train.jsonl`` and ``test.jsonl``, or None for the hub.
        hub_id: hub dataset id used when ``path`` is None.
        hub_config: hub dataset configuration used when ``path`` is None.
        answer_format: ``"flexible"`` or ``"strict"`` answer extraction, see ``math_reward``.
        max_train: keep only the first ``max_train`` training rows (None: all).
        max_eval: keep only the first ``max_eval`` test rows (None: all).
        system_prompt: optional system message.
        instruction: text appended to each question (empty string for none).

    Raises:
        FileNotFoundError: ``path`` or one of its files does not exist (the message names it).
        ValueError: a file is empty or has a bad line (file and line number in the message),
            a hub row has no ``####`` answer, a bad ``answer_format``, or a negative limit; without
            ``path``, the hub is not reachable and the cache has no copy (said at once, naming ``task.path``).
    """

    name = "gsm8k"

    def __init__(
        self,
        path: str | None = None,
        hub_id: str = "openai/gsm8k",
        hub_config: str = "main",
        answer_format: str = "flexible",
        max_train: int | None = None,
        max_eval: int | None = None,
        system_prompt: str | None = None,
        instruction: str = DEFAULT_GSM8K_INSTRUCTION,
    ) -> None:
        for label, limit in (("max_train", max_train), ("max_eval", max_eval)):
            if limit is not None and int(limit) < 0:
                raise ValueError(f"{label} must be >= 0 or None, got {limit!r}")
        self.path = None if path is None else str(path)
        self.hub_id = hub_id
        self.hub_config = hub_config
        self.answer_format = check_answer_format(answer_format)
        self.max_train = None if max_train is None else int(max_train)
        self.max_eval = None if max_eval is None else int(max_eval)
        self.system_prompt = system_prompt
        self.instruction = instruction

        dataset = self._load()
        self._train = self._examples(dataset["train"], self.max_train, "train")
        self._eval = self._examples(dataset["test"], self.max_eval, "test")

    def _load(self):
        """Validate (local files only) and load the dataset; returns a ``datasets.DatasetDict``."""
        import datasets

        if self.path is None:
            from lit_rl.hub import hub_dataset_cached, hub_offline_reason
            from lit_rl.schema.task import gsm8k_offline_message

            offline = None if hub_dataset_cached(self.hub_id) else hub_offline_reason()
            if offline is not None:  # datasets would retry for half a minute, then raise a ConnectionError
                raise ValueError(gsm8k_offline_message(self.hub_id, offline))
            try:
                return datasets.load_dataset(self.hub_id, self.hub_config)
            except ConnectionError as err:  # a cached copy that is incomplete, or the hub went away
                raise ValueError(gsm8k_offline_message(self.hub_id, str(err).splitlines()[0])) from err
        root = Path(self.path).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"GSM8K data directory not found: {root}")
        data_files = {}
        for split, filename in _SPLIT_FILES.items():
            file = root / filename
            validate_jsonl(file)
            data_files[split] = str(file)
        return datasets.load_dataset("json", data_files=data_files)

    def _examples(self, split, limit: int | None, split_name: str) -> tuple[Example, ...]:
        """Turn a ``datasets.Dataset`` split into Examples, keeping the first ``limit`` rows."""
        if limit is not None:
            split = split.select(range(min(limit, len(split))))
        examples = []
        for idx, (question, solution) in enumerate(zip(split["question"], split["answer"])):
            gold = gold_from_solution(solution)
            if gold is None:
                raise ValueError(f"GSM8K {split_name} row {idx}: answer has no '####' final answer")
            if no_text(question):
                raise ValueError(f"GSM8K {split_name} row {idx}: the question is empty (a prompt with no text)")
            text = f"{question}\n\n{self.instruction}" if self.instruction else question
            examples.append(Example(id=idx, question=text, answer=gold))
        return tuple(examples)

    def train_examples(self) -> Sequence[Example]:
        """Return the training examples (a tuple, file order, same every call)."""
        return self._train

    def eval_examples(self) -> Sequence[Example]:
        """Return the evaluation examples from the test split (a tuple, file order)."""
        return self._eval
