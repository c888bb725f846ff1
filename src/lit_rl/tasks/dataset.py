"""``task=dataset``: prompts (and gold answers) from any dataset ``datasets.load_dataset`` reads.

Where the rows come from (``path``):

- a local file, its format from its extension: ``.jsonl``/``.json`` (json), ``.parquet``, ``.csv``,
  ``.tsv`` (csv with tabs), ``.arrow``; or ``data_files`` (a file, a list, or ``{split: file(s)}``);
- a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with
  ``datasets.load_from_disk``), or a folder of data files (``datasets.load_dataset(folder)``);
- a hub id (``org/name``, with ``config``), where the hub is reachable.

Which rows: ``split`` trains; ``eval_split`` evaluates, or, without one, ``eval_fraction`` of ``split`` is
held out with ``seed`` (``Dataset.train_test_split``). ``max_examples`` keeps the first rows of each split.

Each row becomes an ``Example``: the prompt from ``prompt_field`` (a string, formatted with
``prompt_template`` when one is given, or a list of chat messages ``{"role", "content"}``), the gold
answer from ``answer_field`` (text after a GSM8K ``####`` when it has one), and the row's columns
(``Example.columns``, handed to reward functions). Bad input fails at start-up, before the model loads,
with a one-line error naming the file, split, row or column (and listing the columns that exist); a text file
that is not UTF-8 is named with its first bad line. A row whose prompt holds no text (null, empty or white
space) is left out and counted (``empty_prompts=drop``, said in a start-up line: ``dropped_note``) or refused
(``error``), as an overlong prompt is (``overlong_prompts``).
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_rl.tasks.base import Example, Task, check_answer_format, first_non_utf8_line, no_text
from lit_rl.tasks.gsm8k import gold_from_solution

__all__ = ["DatasetTask", "EMPTY_PROMPTS", "FORMATS", "OVERLONG_PROMPTS"]

#: file extension -> the ``datasets`` builder that reads it (and its extra arguments)
FORMATS: dict[str, tuple[str, dict]] = {
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".arrow": ("arrow", {}),
}
#: what happens to a prompt that does not fit the context with its max_new_tokens: dropped (and counted) | error
OVERLONG_PROMPTS = ("drop", "error")
#: what happens to a row whose prompt holds no text (null, empty, white space): dropped (and counted) | error
EMPTY_PROMPTS = ("drop", "error")
#: the formats read as text: a file that is not UTF-8 is named with its first bad line
TEXT_FORMATS = (".jsonl", ".json", ".csv", ".tsv")
# files ``save_to_disk`` writes: a folder holding one of them is read with ``load_from_disk``
_SAVED_MARKERS = ("dataset_dict.json", "state.json")


def looks_local(path: str) -> bool:
    """Whether ``path`` names a local file or folder rather than a hub id: it exists, starts with ``.``, ``/``
    or ``~``, has a data file's extension, or has not exactly one ``/`` (a hub id is ``org/name``)."""
    p = Path(path).expanduser()
    return p.exists() or path.startswith((".", "/", "~")) or p.suffix.lower() in FORMATS or path.count("/") != 1


def _check_not_empty(file: Path, field: str) -> None:
    """Raise ``ValueError`` naming ``field`` and ``file`` when the file holds nothing but white space (datasets'
    own error for it is a bare ``StopIteration`` or "An error occurred while generating the dataset")."""
    with open(file, "rb") as fh:
        head = fh.read(1 << 16)
    size = file.stat().st_size
    if size == len(head) and not head.strip():
        raise ValueError(f"{field}: {file} is empty ({size} bytes, no rows)")


def _builder_of(files: Sequence[str], where: str) -> tuple[str, dict]:
    """The builder for ``files`` (all of one format); ValueError naming them otherwise."""
    kinds = {Path(f).suffix.lower() for f in files}
    unknown = sorted(k for k in kinds if k not in FORMATS)
    if unknown or len(kinds) != 1:
        raise ValueError(
            f"{where}: cannot tell the format of {list(files)} (extension {unknown or sorted(kinds)}); "
            f"use files of one format: {', '.join(FORMATS)}"
        )
    return FORMATS[kinds.pop()]


class DatasetTask(Task):
    """Prompts and answers from a dataset (see the module docstring for where and how).

    Args:
        path: a data file, a saved-dataset folder, a folder of data files or a hub id; None with ``data_files``.
        data_files: data files for ``split`` names (a path, a list of paths, or ``{split: path(s)}``); relative
            paths are taken from the working directory.
        config: the hub dataset's configuration (``load_dataset(path, config)``).
        split: the training split.
        eval_split: the evaluation split; None: ``eval_fraction`` of ``split`` held out (0 = no eval split).
        eval_fraction: in [0, 1): the held-out share of ``split`` when ``eval_split`` is None.
        seed: seeds the held-out draw.
        prompt_field: the column holding the prompt: text, or a list of chat messages (``role``, ``content``).
        answer_field: the column holding the gold answer (None: the reward functions need none).
        system_prompt: a system message put first (when the messages have no system message of their own).
        prompt_template: a ``str.format`` template over the row's columns for text prompts, e.g.
            ``"{question}\\n\\nAnswer after ####."``; None: the prompt column as it is.
        max_examples: keep the first rows of each split (before the held-out draw); None: all.
        answer_format: ``"flexible"`` or ``"strict"`` answer extraction of the ``math`` reward.
        overlong_prompts: ``drop`` (a prompt longer than the context allows is left out and counted) or ``error``
            (start-up fails naming it); applied by ``RolloutDataModule.drop_overlong``.
        empty_prompts: ``drop`` (a row whose prompt holds no text, null, empty or white space, is left out and
            counted: ``dropped_empty``, ``dropped_note``) or ``error`` (start-up fails naming the row).

    Raises:
        FileNotFoundError: a local file or folder does not exist (the message names it).
        ValueError: an unknown extension, a text file that is not UTF-8 (naming the file and line), a missing
            split or column, an empty split, a prompt that is neither text nor chat messages, an empty prompt
            with ``empty_prompts=error``, a bad template, or a bad option; one line naming it.
    """

    name = "dataset"

    def __init__(
        self,
        path: str | None = None,
        data_files: Any = None,
        config: str | None = None,
        split: str = "train",
        eval_split: str | None = None,
        eval_fraction: float = 0.0,
        seed: int = 0,
        prompt_field: str = "prompt",
        answer_field: str | None = "answer",
        system_prompt: str | None = None,
        prompt_template: str | None = None,
        max_examples: int | None = None,
        answer_format: str = "flexible",
        overlong_prompts: str = "drop",
        empty_prompts: str = "drop",
    ) -> None:
        if path is None and not data_files:
            raise ValueError("task.path or task.data_files must name the data (a file, a folder or a hub id)")
        if not 0.0 <= float(eval_fraction) < 1.0:
            raise ValueError(f"task.eval_fraction={eval_fraction!r} must lie in [0, 1)")
        if max_examples is not None and int(max_examples) < 1:
            raise ValueError(f"task.max_examples={max_examples!r} must be >= 1 or null")
        if overlong_prompts not in OVERLONG_PROMPTS:
            raise ValueError(f"task.overlong_prompts={overlong_prompts!r}: choose one of {list(OVERLONG_PROMPTS)}")
        if empty_prompts not in EMPTY_PROMPTS:
            raise ValueError(f"task.empty_prompts={empty_prompts!r}: choose one of {list(EMPTY_PROMPTS)}")
        self.path, self.data_files, self.config = path, data_files, config
        self.split, self.eval_split, self.eval_fraction = str(split), eval_split, float(eval_fraction)
        self.seed = int(seed)
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.system_prompt, self.prompt_template = system_prompt, prompt_template
        self.max_examples = None if max_examples is None else int(max_examples)
        self.answer_format = check_answer_format(answer_format)
        self.overlong_prompts, self.empty_prompts = overlong_prompts, empty_prompts
        self.source = str(path) if path is not None else str(data_files)
        #: rows left out for a prompt with no text (``empty_prompts=drop``): their ids, per role (train, eval)
        self.dropped_empty: dict[str, list[int]] = {"train": [], "eval": []}
        try:
            self._build()
        except Exception as err:
            if not _caused_by(err, UnicodeDecodeError):
                raise
            bad = next(filter(None, map(first_non_utf8_line, self._text_files())), None)
            raise ValueError(bad or f"{self.source}: not valid UTF-8 ({_first_line(err)})") from err

    def _build(self) -> None:
        """Read the splits and make their examples (``train_examples``, ``eval_examples``)."""
        splits = self._load()
        train = self._split(splits, self.split)
        if self.eval_split is not None:
            evaluation = self._split(splits, self.eval_split)
            eval_name = self.eval_split
        elif self.eval_fraction > 0:
            if len(train) < 2:
                raise ValueError(f"{self.source} split {self.split!r}: {len(train)} row, too few to hold some out")
            parts = train.train_test_split(test_size=self.eval_fraction, seed=self.seed, shuffle=True)
            train, evaluation, eval_name = parts["train"], parts["test"], f"{self.split} (held out)"
        else:
            evaluation, eval_name = None, None
        self._train = self._examples(train, self.split, "train")
        self._eval = self._examples(evaluation, eval_name, "eval") if evaluation is not None else ()

    # -- loading -------------------------------------------------------------------------------------------------
    def _load(self) -> Mapping:
        """A mapping split -> ``datasets.Dataset``, read from ``path`` / ``data_files``."""
        import datasets

        datasets.disable_progress_bars()
        if self.data_files:
            files = self.data_files
            if isinstance(files, Mapping):
                flat = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
            else:
                flat = [files] if isinstance(files, str) else list(files)
                files = {self.split: flat}
            for f in flat:
                if not Path(f).expanduser().is_file():
                    raise FileNotFoundError(f"task.data_files: {f}: file not found")
                _check_not_empty(Path(f).expanduser(), "task.data_files")
            builder, extra = _builder_of(flat, "task.data_files")
            files = {
                k: [str(Path(f).expanduser()) for f in ([v] if isinstance(v, str) else v)] for k, v in files.items()
            }
            return self._read(lambda: datasets.load_dataset(builder, data_files=files, **extra))
        path = str(self.path)
        local = Path(path).expanduser()
        if local.is_file():
            _check_not_empty(local, "task.path")
            builder, extra = _builder_of([str(local)], f"task.path={path}")
            return self._read(lambda: datasets.load_dataset(builder, data_files={self.split: str(local)}, **extra))
        if local.is_dir():
            if any((local / marker).is_file() for marker in _SAVED_MARKERS):
                loaded = self._read(lambda: datasets.load_from_disk(str(local)))
                return loaded if isinstance(loaded, Mapping) else {self.split: loaded}
            return self._read(lambda: datasets.load_dataset(str(local)))
        if looks_local(path):
            raise FileNotFoundError(f"task.path={path}: no such file or folder")
        return self._read(lambda: datasets.load_dataset(path, self.config))

    def _text_files(self) -> list[Path]:
        """The local files read as text (``TEXT_FORMATS``): the data files, the file ``path`` names, or the text
        files in the folder it names; none for a hub id or a saved dataset."""
        if self.data_files:
            files = self.data_files
            values = files.values() if isinstance(files, Mapping) else [files]
            flat = [Path(f).expanduser() for v in values for f in ([v] if isinstance(v, str) else v)]
        else:
            local = Path(str(self.path)).expanduser()
            flat = sorted(local.rglob("*")) if local.is_dir() else [local]
        return [f for f in flat if f.suffix.lower() in TEXT_FORMATS and f.is_file()]

    def _read(self, load):
        """``load()``, its errors turned into one line naming the data."""
        try:
            return load()
        except UnicodeDecodeError:
            raise  # named with its file and line by ``__init__``
        except (FileNotFoundError, ValueError) as err:
            first = _first_line(err)
            if "corresponds to no data" in first:  # datasets' words for a file without rows
                raise ValueError(f"{self.source} split {self.split!r} is empty (no rows)") from err
            kind = FileNotFoundError if isinstance(err, FileNotFoundError) else ValueError
            raise kind(f"{self.source}: cannot read it ({first})") from err
        except Exception as err:  # noqa: BLE001 - datasets' own errors (e.g. a malformed file): one line, named
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ValueError(f"{self.source}: cannot read it ({type(err).__name__}: {first})") from err

    def _split(self, splits: Mapping, name: str):
        """Split ``name`` (its first ``max_examples`` rows), checked: it exists, is not empty, has the columns."""
        if name not in splits:
            raise ValueError(f"{self.source}: no split {name!r}; splits: {sorted(splits)}")
        ds = splits[name]
        if self.max_examples is not None and len(ds) > self.max_examples:
            ds = ds.select(range(self.max_examples))
        if len(ds) == 0:
            raise ValueError(f"{self.source} split {name!r} is empty")
        for label in ("prompt_field", "answer_field"):
            column = getattr(self, label)
            if column is not None and column not in ds.column_names:
                raise ValueError(
                    f"{self.source} split {name!r}: no column {column!r} (task.{label}); columns: {ds.column_names}"
                )
        if self.prompt_template is not None:
            for _, key, _, _ in string.Formatter().parse(self.prompt_template):
                if key is not None and key.split(".")[0].split("[")[0] not in ds.column_names:
                    raise ValueError(
                        f"task.prompt_template names {{{key}}}, not a column of {self.source} split {name!r}; "
                        f"columns: {ds.column_names}"
                    )
        return ds

    def _examples(self, ds, split: str, role: str) -> tuple[Example, ...]:
        """One ``Example`` per row of ``ds`` (ids: the row's index in the split), but for a prompt with no text
        (``empty_prompts``: left out, its id in ``dropped_empty[role]``, or refused). ``role``: train or eval."""
        out = []
        for idx, row in enumerate(ds):
            where = f"{self.source} split {split!r} row {idx}"
            prompt = row[self.prompt_field]
            if no_text(prompt):
                if self.empty_prompts == "error":
                    raise ValueError(
                        f"{where}: column {self.prompt_field!r} holds no text ({_short(prompt)}; "
                        f"task.empty_prompts=error; drop leaves such rows out, counted)"
                    )
                self.dropped_empty[role].append(idx)
                continue
            messages = None
            if isinstance(prompt, str):
                if self.prompt_template is not None:
                    prompt = self.prompt_template.format(**{**row, self.prompt_field: prompt})
            elif _is_chat(prompt):
                messages = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
                prompt = messages[-1]["content"]
            else:
                raise ValueError(
                    f"{where}: column {self.prompt_field!r} must be text or a list of chat messages "
                    f"({{'role', 'content'}} strings), got {type(prompt).__name__} {_short(prompt)}"
                )
            answer = ""
            if self.answer_field is not None:
                value = row[self.answer_field]
                if value is None:
                    raise ValueError(f"{where}: column {self.answer_field!r} is empty (null)")
                answer = str(value)
                if "####" in answer:
                    answer = gold_from_solution(answer) or answer
            out.append(Example(id=idx, question=prompt, answer=answer, messages=messages, columns=dict(row)))
        if not out:
            raise ValueError(
                f"{self.source} split {split!r}: all {len(ds)} prompts hold no text (column {self.prompt_field!r} "
                "null, empty or white space)"
            )
        return tuple(out)

    @property
    def dropped_note(self) -> str | None:
        """The start-up line saying how many rows were left out for a prompt with no text; None if none was."""
        parts = []
        for role, ids in self.dropped_empty.items():
            if ids:
                total = len(ids) + len(self._train if role == "train" else self._eval)
                shown = ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")
                parts.append(f"{len(ids)} of {total} {role} prompts ({'row' if len(ids) == 1 else 'rows'} {shown})")
        if not parts:
            return None
        return (
            f"lit_rl: task=dataset: dropped {' and '.join(parts)} that hold no text "
            f"(column {self.prompt_field!r} null, empty or white space; task.empty_prompts=drop)"
        )

    # -- Task API ------------------------------------------------------------------------------------------------
    def train_examples(self) -> Sequence[Example]:
        """Return the training examples (a tuple, file order)."""
        return self._train

    def eval_examples(self) -> Sequence[Example]:
        """Return the evaluation examples (a tuple; empty without ``eval_split`` and ``eval_fraction``)."""
        return self._eval

    def __repr__(self) -> str:
        return f"DatasetTask({self.source!r}, split={self.split!r}, train={len(self._train)}, eval={len(self._eval)})"


def _caused_by(err: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``err`` or an error it was raised from or during is a ``kind``."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _is_chat(value) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
