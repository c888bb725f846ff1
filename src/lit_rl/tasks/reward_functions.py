"""Reward functions: the built-in verifiers and a user's own, weighted, run in the verifier pool.

``reward.functions`` lists them by name:

- built-ins (``BUILTINS``): ``math`` (``math_reward``: the final answer against the gold one, math-verify for
  LaTeX), ``exact`` (the final answer, or the whole completion, equal to the gold text), ``format`` (1 when the
  completion gives its answer as ``#### N``, ``\\boxed{...}`` or ``<answer>...</answer>``, else 0) and
  ``length_penalty`` (-(completion tokens) / sampling.max_new_tokens, in [-1, 0]);
- ``package.module:function``, or ``path/to/file.py:function`` (a file, relative to the working directory).

A function is called either per completion, ``fn(prompt, completion, example) -> float | None``, or, TRL's
convention, once per batch, ``fn(prompts, completions, **columns) -> list[float | None]`` (chosen by the
names of its first two parameters: ``prompts`` and ``completions``). ``prompt`` is the prompt text (the last
user message for chat data), ``completion`` the generated text, ``example`` a dict of the data row's
columns with ``id``, ``question`` and ``answer``; the batched form gets each of those as a list (one entry
per completion) plus ``completion_ids`` (token ids) and ``max_completion_length``. None means "not
applicable": left out of the function's own mean (``rollout/reward/<name>``) and counted as 0 in the
weighted total, as TRL's ``nansum`` does. A function that raises, returns something else (a NaN, a string) or
runs past ``reward_timeout_s`` scores 0 and is counted in ``rollout/reward_errors``; its first error is printed once.
One that fails on every call of ``reward.max_failed_steps`` (3) training steps in a row stops the run
(``RewardFunctionFailed``, naming it and its first error; ``RewardFunctions.count_failed_step``). What the
functions print (their workers' stdout and stderr) goes to ``output_log`` (a run's ``reward_output.log``), and
one console line says so, with the count and the first lines, the first time they print.

A function may also return, verl's convention, a dict ``{"score": float | None, "correct": bool}``: ``score``
enters the weighted total, ``correct`` says whether the completion is right (a batched one: a list of such dicts).

Correctness (``eval/accuracy``, ``eval/pass@k``, ``rollout/groups_all_correct`` / ``_wrong``) comes from one
verifier, never from a threshold on the weighted total (with ``[math, format]`` a formatted wrong answer totals 1;
with ``[math, length_penalty]`` a right one totals less than 1). ``reward.correct_from`` names the function; null
(the default) takes the task's verifier: the reward itself when ``reward.functions`` is null; the ``math``
function when it is listed (it is the built-in tasks' verifier); for ``task=dataset`` the first built-in verifier
listed (``math``, ``exact``), else the first function (said at start-up); for the other tasks their verifier, run
beside the functions. A completion is correct when that function's dict says ``correct``, or, for a number (or a
dict without ``correct``), when the score is >= 1 (a verifier's 1.0); None or a failed call is not correct.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from lit_rl.registry import Registry
from lit_rl.tasks.base import Example, Task
from lit_rl.tasks.dataset import DatasetTask
from lit_rl.tasks.rewards import extract_answer, math_reward
from lit_rl.tasks.verifier_pool import Outcome, shared_pool

__all__ = ["BUILTINS", "RewardFunctionFailed", "RewardFunctions", "Scores", "load_function", "pass_at_k"]


# -- built-ins ---------------------------------------------------------------------------------------------------
def math_builtin(prompt: str, completion: str, example: dict, answer_format: str = "flexible") -> float | None:
    """``math_reward`` of the completion against ``example["answer"]``; None when the example has no answer."""
    gold = example.get("answer", "")
    return None if gold in ("", None) else math_reward(completion, str(gold), answer_format)


def exact_builtin(prompt: str, completion: str, example: dict, answer_format: str = "flexible") -> float | None:
    """1.0 when the extracted final answer, or the whole completion, equals ``example["answer"]`` as text
    (surrounding whitespace ignored), else 0.0; None when the example has no answer."""
    gold = str(example.get("answer", "")).strip()
    if not gold:
        return None
    pred = extract_answer(completion, answer_format)
    return 1.0 if completion.strip() == gold or (pred is not None and pred.strip() == gold) else 0.0


_FORMAT_RE = re.compile(r"####\s*\S|\\boxed\{\s*[^\s}]|<answer>\s*[^\s<].*?</answer>", re.DOTALL)


def format_builtin(prompt: str, completion: str, example: dict) -> float:
    """1.0 when the completion marks a final answer (``#### N``, ``\\boxed{...}`` or ``<answer>...</answer>``,
    not empty), else 0.0."""
    return 1.0 if _FORMAT_RE.search(completion) else 0.0


def length_penalty_builtin(prompts, completions, completion_ids, max_completion_length, **columns) -> list[float]:
    """-(completion tokens) / max_completion_length per completion: 0 for an empty one, -1 at the cap."""
    return [-len(ids) / max(int(max_completion_length), 1) for ids in completion_ids]


#: the built-in reward functions by name (``reward.functions``); those that read ``task.answer_format`` get it
BUILTINS: Registry[Callable] = Registry(
    "reward.functions",
    {"math": math_builtin, "exact": exact_builtin, "format": format_builtin, "length_penalty": length_penalty_builtin},
)
_TAKES_ANSWER_FORMAT = ("math", "exact")


# -- loading -----------------------------------------------------------------------------------------------------
def _is_batched(fn: Callable) -> bool:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return params[:2] == ["prompts", "completions"]


def load_function(spec: str, builtins: bool = True) -> Callable:
    """The function ``spec`` names: a built-in name, ``module:function`` or ``path/to/file.py:function``.
    ``builtins=False`` (``task.tools``, ``task.environment``) leaves the reward built-ins out: a tool named ``math``
    is the user's typo, not the math verifier.

    Raises:
        ValueError: ``spec`` has no ``:`` and is no built-in, or the file / module has no such function,
            or it is not callable; FileNotFoundError: the file does not exist; ImportError: the module cannot
            be imported. Each message names ``spec``.
    """
    if builtins and spec in BUILTINS:
        return BUILTINS[spec]
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        builtin = f"is neither a built-in ({', '.join(BUILTINS)}) nor " if builtins else "is not of the form "
        raise ValueError(f"reward.functions: {spec!r} {builtin}'module:function' / 'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where:
        file = Path(where).expanduser().resolve()
        if not file.is_file():
            raise FileNotFoundError(f"reward.functions: {spec!r}: no file {file}")
        name = f"lit_rl_user_rewards_{abs(hash(str(file)))}"
        module = sys.modules.get(name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except Exception:
                del sys.modules[name]
                raise
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ImportError(f"reward.functions: {spec!r}: cannot import {where!r} ({err})") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.functions: {spec!r}: {where} has no function {attr!r}")
    return fn


@dataclass(frozen=True)
class FunctionRef:
    """A reward function as it travels to a worker: by ``spec`` (loaded there with ``load_function``),
    with ``answer_format`` bound for the built-ins that read it."""

    spec: str
    batched: bool
    answer_format: str | None = None

    def load(self) -> Callable:
        fn = load_function(self.spec)
        return partial(fn, answer_format=self.answer_format) if self.answer_format else fn


@dataclass(frozen=True)
class BoundReward:
    """``task.reward(completion, example)`` of a task as a per-completion function (``reward.functions``
    null: the task's own verifier). The task travels to the workers pickled, once per run."""

    task: Task
    batched: bool = False

    def load(self) -> Callable:
        task = self.task

        def reward(prompt: str, completion: str, example: Example) -> float:
            return task.reward(completion, example)

        return reward


def _absolute(spec: str) -> str:
    """``spec`` with a file path made absolute (workers resolve it wherever they run)."""
    where, sep, attr = spec.rpartition(":")
    if sep and (where.endswith(".py") or "/" in where):
        return f"{Path(where).expanduser().resolve()}:{attr}"
    return spec


def function_name(spec: str) -> str:
    """The name a function's scalar is logged under: a built-in's name, else the part after the last ``:``."""
    return spec if spec in BUILTINS else spec.rpartition(":")[2]


class RewardFunctionFailed(RuntimeError):
    """A reward function failed on every call of ``reward.max_failed_steps`` training steps in a row: it raised,
    returned something that is not a reward, ran past ``reward_timeout_s`` or killed its worker. The message names
    it, its first error and the step the run stopped at."""


@dataclass
class Scores:
    """The rewards of N completions.

    total: N weighted totals (a None counts 0); parts: name -> N values of each function (nan = None or failed;
    empty with the task's own verifier); errors: calls that raised, returned a non-number or timed out (a batched
    call counts once per completion it covered); timeouts: those that timed out; correct: N bools from the
    correctness verifier (``RewardFunctions.correct_source``; empty: not verified, no completion correct);
    failures: name -> (completions whose call of it failed, completions it was called on), for every function
    that ran (the correctness verifier beside the functions included)."""

    total: list[float]
    parts: dict[str, list[float]]
    errors: int = 0
    timeouts: int = 0
    correct: list[bool] = field(default_factory=list)
    failures: dict[str, tuple[int, int]] = field(default_factory=dict)


class RewardFunctions:
    """The reward of a run: the task's own verifier, or ``reward.functions`` weighted by ``reward.weights``,
    computed in the verifier pool (``verifier_pool.shared_pool``), and each completion's correctness from one
    verifier (``reward.correct_from``; the module docstring says which by default).

    Args:
        task: the task (its ``reward`` is the verifier when ``functions`` is None; a ``ConstantReward`` task
            gives its constant to training completions, whose correctness its wrapped task's verifier still
            decides, and scores the eval split with the wrapped task).
        functions: names (see the module docstring) or None.
        weights: one weight per function, or None (all 1).
        num_workers: verifier processes (``reward.num_workers``).
        timeout_s: the time limit of one call (``reward_timeout_s``).
        max_completion_length: the generation cap in tokens, handed to batched functions (``length_penalty``).
        correct_from: the name (or the spec as listed) of the function whose verdict is the correctness; None:
            the task's verifier.
        max_failed_steps: training steps in a row in which every call of one function fails before
            ``count_failed_step`` stops the run (``reward.max_failed_steps``); 0: never.
        output_log: the file the workers' stdout and stderr go to while they run these functions (appended to;
            ``verifier_pool``), None: the console.

    Attributes:
        correct_source: what decides correctness, in words (e.g. ``"reward function 'math'"``).
        correct_note: a line to print at start-up when the default fell back to the first function, else None.
        first_errors: name -> the first failure of each function that failed, in words (``"ValueError: boom"``).

    Raises:
        ValueError, FileNotFoundError, ImportError: a function cannot be loaded here (each names it), weights of
            the wrong length, two functions with one name, or ``correct_from`` naming none of them.
    """

    def __init__(
        self,
        task: Task,
        functions: Sequence[str] | None = None,
        weights: Sequence[float] | None = None,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        max_completion_length: int = 64,
        correct_from: str | None = None,
        max_failed_steps: int = 3,
        output_log: str | os.PathLike | None = None,
    ):
        self.task, self.num_workers, self.timeout_s = task, int(num_workers), float(timeout_s)
        self.max_failed_steps = int(max_failed_steps)
        self.max_completion_length = int(max_completion_length)
        self.constant = getattr(task, "value", None) if hasattr(task, "eval_task") else None
        verifier = getattr(task, "eval_task", task)
        self.correct_note: str | None = None
        if functions is None:
            if correct_from is not None:
                raise ValueError(
                    f"reward.correct_from={correct_from!r} needs reward.functions (it names one of them); "
                    "with reward.functions null the task's verifier decides"
                )
            self.names = ["task"]
            self.refs: list = [BoundReward(verifier)]
            self.weights = [1.0]
            self.own_verifier = True
            self.correct_index, self.correct_source = 0, "the task's verifier"
        else:
            functions = list(functions)
            if not functions:
                raise ValueError("reward.functions is empty: list at least one, or null for the task's own verifier")
            self.names = [function_name(s) for s in functions]
            duplicate = sorted({n for n in self.names if self.names.count(n) > 1})
            if duplicate:
                raise ValueError(f"reward.functions: two functions are named {duplicate[0]!r}; rename one")
            self.refs = []
            for spec in map(_absolute, functions):
                fn = load_function(spec)  # here first: a bad name fails at start-up, naming it
                fmt = verifier.answer_format if spec in _TAKES_ANSWER_FORMAT else None
                self.refs.append(FunctionRef(spec, _is_batched(fn), fmt))
            self.weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
            if len(self.weights) != len(functions):
                raise ValueError(
                    f"reward.weights has {len(self.weights)} values for {len(functions)} reward.functions; "
                    f"give one weight per function (or null: all 1)"
                )
            self.own_verifier = False
            self._choose_correct(functions, correct_from, verifier)
        self.key = uuid.uuid4().hex  # what the workers load for this run
        self._reported: set[str] = set()
        self.first_errors: dict[str, str] = {}
        self.output_log = None if output_log is None else str(output_log)
        self._output_start: int | None = None  # the log's size before these functions first ran
        self._output_told = False
        self.failed_steps: dict[str, int] = {}  # name -> training steps in a row in which every call failed

    def _choose_correct(self, functions: list[str], correct_from: str | None, verifier: Task) -> None:
        """Set ``correct_index`` (into ``refs``; ``len(weights)``: the task's verifier, appended to ``refs`` and
        left out of the total), ``correct_source`` and ``correct_note``."""
        if correct_from is not None:
            names = {**{s: n for s, n in zip(functions, self.names)}, **{n: n for n in self.names}}
            if correct_from not in names:
                raise ValueError(
                    f"reward.correct_from={correct_from!r} is not one of reward.functions: choose one of "
                    f"{self.names} (or null for the task's verifier)"
                )
            self.correct_index = self.names.index(names[correct_from])
            self.correct_source = f"reward function {names[correct_from]!r} (reward.correct_from)"
            return
        if isinstance(verifier, DatasetTask):  # no verifier of its own beyond the functions chosen for it
            listed = [n for n in ("math", "exact") if n in functions]
            self.correct_index = functions.index(listed[0]) if listed else 0
            self.correct_source = f"reward function {self.names[self.correct_index]!r}"
            if not listed:
                self.correct_note = (
                    f"lit_rl: correctness (eval/accuracy, eval/pass@k, rollout/groups_all_correct) comes from "
                    f"{self.correct_source}, the first of reward.functions: none of them is a built-in verifier "
                    f"(math, exact); set reward.correct_from to name another"
                )
            return
        own = type(verifier).reward is Task.reward  # math_reward on the gold answer: the ``math`` built-in
        if own and "math" in functions:
            self.correct_index = functions.index("math")
            self.correct_source = "reward function 'math' (the task's verifier)"
            return
        self.correct_index = len(self.refs)  # run beside the functions, out of the total
        self.refs.append(FunctionRef("math", False, verifier.answer_format) if own else BoundReward(verifier))
        self.names.append("task verifier")
        self.correct_source = "the task's verifier"

    @property
    def pool(self):
        return shared_pool(self.num_workers)

    def prepare(self) -> None:
        """Start the verifier workers and load the functions in each now (``VerifierPool.prepare``), their output
        to ``output_log``; raises RuntimeError when a worker cannot load them (an ``output_log`` it left empty is
        removed; one the functions printed to is named)."""
        self._mark_output()
        try:
            self.pool.prepare(self.key, self.refs, log=self.output_log)
        except RuntimeError as err:
            if self.output_log is None or not os.path.exists(self.output_log):
                raise
            if os.path.getsize(self.output_log) == 0:
                os.remove(self.output_log)
                raise
            raise RuntimeError(f"{err} (what the functions printed: {self.output_log})") from err

    def _mark_output(self) -> None:
        if self.output_log is not None and self._output_start is None:
            self._output_start = os.path.getsize(self.output_log) if os.path.exists(self.output_log) else 0

    def report_output(self) -> None:
        """Print one line the first time the functions have printed to ``output_log``: how many lines so far, the
        first ones and the file (the lines never reach the console). Later output is only written to the file."""
        if self.output_log is None or self._output_start is None or self._output_told:
            return
        try:
            if os.path.getsize(self.output_log) <= self._output_start:
                return
            with open(self.output_log, "rb") as f:
                f.seek(self._output_start)
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return
        self._output_told = True
        first = " | ".join(repr(line[:100] + ("..." if len(line) > 100 else "")) for line in lines[:3])
        print(
            f"lit_rl: the reward functions printed {len(lines)} lines so far, written to {self.output_log} with the "
            f"rest of their output (their workers' stdout and stderr), not here; the first: {first} (printed once)",
            flush=True,
        )

    def score(
        self,
        examples: Sequence[Example],
        completions: Sequence[str],
        completion_ids: Sequence[Sequence[int]],
        split: str,
    ) -> Scores:
        """Score completion i of ``examples[i]`` (N of each); ``split`` "train" or "eval". With a constant reward
        on "train" only the correctness verifier runs."""
        n = len(completions)
        constant = self.constant is not None and split == "train"
        scored = len(self.weights)  # refs[:scored] enter the total; a ref beyond them only decides correctness
        if n == 0:
            return Scores([], {} if self.own_verifier or constant else {name: [] for name in self.names[:scored]})
        failures = {self.names[f]: [0, 0] for f in ([self.correct_index] if constant else range(len(self.refs)))}
        run = [self.correct_index] if constant else range(len(self.refs))
        prompts = [ex.question for ex in examples]
        rows = [ex if self.own_verifier else ex.as_dict() for ex in examples]
        jobs, owners = [], []
        for f in run:
            if self.refs[f].batched:
                columns = {k: [r.get(k) for r in rows] for k in rows[0] if k not in ("prompts", "completions")}
                kwargs = dict(
                    columns,
                    completion_ids=[list(map(int, ids)) for ids in completion_ids],
                    max_completion_length=self.max_completion_length,
                )
                jobs.append((f, (prompts, list(completions)), kwargs))
                owners.append((f, None))
            else:
                for i in range(n):
                    jobs.append((f, (prompts[i], completions[i], rows[i]), {}))
                    owners.append((f, i))
        self._mark_output()
        outcomes = self.pool.run(self.key, self.refs, jobs, self.timeout_s, log=self.output_log)
        self.report_output()
        parts = [[math.nan] * n for _ in self.refs]
        correct = [False] * n
        errors = timeouts = 0
        for (f, i), outcome in zip(owners, outcomes):
            covered = range(n) if i is None else [i]
            if outcome.status == "ok" and i is None and len(outcome.value) != n:
                outcome = Outcome("error", message=f"returned {len(outcome.value)} rewards for {n} completions")
            failures[self.names[f]][1] += len(covered)
            if outcome.status != "ok":
                failures[self.names[f]][0] += len(covered)
                errors += len(covered)
                timeouts += len(covered) * (outcome.status == "timeout")
                self._report(f, outcome)
                for j in covered:
                    parts[f][j] = 0.0
                continue
            values = outcome.value if i is None else [outcome.value]
            for j, v in zip(covered, values):
                said = None
                if isinstance(v, dict):  # verl's {"score": ..., "correct": ...}
                    v, said = v["score"], v["correct"]
                parts[f][j] = math.nan if v is None else float(v)
                if f == self.correct_index:
                    correct[j] = said if said is not None else (v is not None and v >= 1.0)
        failed = {name: (a, b) for name, (a, b) in failures.items()}
        if constant:
            return Scores([float(self.constant)] * n, {}, errors, timeouts, correct, failed)
        total = [
            sum(w * (0.0 if math.isnan(p[j]) else p[j]) for w, p in zip(self.weights, parts[:scored])) for j in range(n)
        ]
        named = {} if self.own_verifier else dict(zip(self.names[:scored], parts[:scored]))
        return Scores(total, named, errors, timeouts, correct, failed)

    def count_failed_step(self, failures: Mapping[str, tuple[float, float]], rl_step: int) -> None:
        """Count one training step's ``failures`` (name -> (completions whose call failed, completions called),
        summed over the ranks): a function that failed on every call of the step extends its run of failed steps,
        one that scored a completion ends it (a step that did not call it changes nothing).

        Raises:
            RewardFunctionFailed: a function's run reached ``max_failed_steps`` (not 0), naming it, its first
                error and ``rl_step``, the step the run stops at (before its update).
        """
        for name, (failed, called) in failures.items():
            if called > 0:
                self.failed_steps[name] = self.failed_steps.get(name, 0) + 1 if failed >= called else 0
        limit = self.max_failed_steps
        for name in self.names:
            steps = self.failed_steps.get(name, 0)
            if limit and steps >= limit:
                first = self.first_errors.get(name, "(its error was reported on another rank)")
                raise RewardFunctionFailed(
                    f"reward function {name!r} failed on every call in {steps} RL steps in a row (steps "
                    f"{rl_step - steps + 1}-{rl_step}, reward.max_failed_steps={limit}); its first error: {first}. "
                    f"Every completion scored 0 from it, so the run could not learn from it: stopped at RL step "
                    f"{rl_step}, before its update. Fix the function (call it on one completion by hand), then "
                    f"start again or continue from the run's last checkpoint (ckpt_path=last); "
                    f"reward.max_failed_steps=0 never stops"
                )

    def _report(self, f: int, outcome: Outcome) -> None:
        """Print a function's first failure of each kind once (later ones are counted, not printed)."""
        name = self.names[f]
        if outcome.status == "timeout":
            error = f"ran past reward_timeout_s={self.timeout_s:g} s"
            what = f"{error} (its worker process was killed and replaced)"
        else:
            error = outcome.message
            what = f"failed: {error}"
        self.first_errors.setdefault(name, error)
        if (name, outcome.status) in self._reported:
            return
        self._reported.add((name, outcome.status))
        stop = (
            f"; a run in which every call of it fails for reward.max_failed_steps={self.max_failed_steps} steps "
            f"in a row stops"
            if self.max_failed_steps
            else ""
        )
        print(
            f"lit_rl: reward function {name!r} {what}; the completion scores 0, counted in rollout/reward_errors "
            f"(printed once){stop}",
            flush=True,
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1), computed as the product
    1 - prod_{i=n-c+1}^{n} (1 - k / i) for numerical stability. Raises ValueError unless 0 <= c <= n and
    1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod
