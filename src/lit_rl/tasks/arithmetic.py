"""Synthetic arithmetic problems ("What is 7 + 5?") with exact answers; a quick, cheap RL task."""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence

from lit_rl.tasks.base import Example, Task, check_answer_format

__all__ = ["ArithmeticTask", "DEFAULT_ARITHMETIC_INSTRUCTION"]

DEFAULT_ARITHMETIC_INSTRUCTION = "Give the final answer as a number after '####'."

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

# Up to this many possible problems we enumerate the unseen ones to draw a disjoint eval split;
# above it we draw at random and reject problems that appear in the training split.
_ENUMERATE_LIMIT = 200_000

Problem = tuple[int, str, int]


class ArithmeticTask(Task):
    """Problems ``a op b`` with ``a`` and ``b`` of ``digits`` digits each.

    Operands: ``digits=1`` gives 0..9, ``digits=d>1`` gives ``10**(d-1) .. 10**d - 1``.
    Results may be negative (with ``"-"``); the gold answer is ``str(result)``. The reward is
    ``math_reward(completion, answer, answer_format)`` (the base class ``Task.reward``).

    Both splits are generated deterministically: the training split with
    ``random.Random(seed)``, the evaluation split with a second generator seeded from
    ``f"{seed}:eval"``. Problems are drawn with replacement, so a split may repeat problems.
    The evaluation split is disjoint from the training split when enough unseen problems
    exist (e.g. 2-digit ``+`` has 8100 problems); otherwise it is drawn from the whole space
    and overlaps the training split. With 1-digit ``+`` there are only 100 problems and the
    default 10000 training examples cover them all, so there the splits overlap entirely.

    Args:
        seed: seed for both splits.
        num_train: number of training examples.
        num_eval: number of evaluation examples.
        digits: number of digits of each operand (>= 1).
        operators: non-empty subset of ``"+"``, ``"-"``, ``"*"``.
        answer_format: ``"flexible"`` or ``"strict"`` answer extraction, see ``math_reward``.
        system_prompt: optional system message.
        instruction: text appended to each question (empty string for none).

    Raises:
        ValueError: a bad ``digits``, ``operators``, ``answer_format`` or a negative count.
    """

    name = "arithmetic"

    def __init__(
        self,
        seed: int = 0,
        num_train: int = 10000,
        num_eval: int = 200,
        digits: int = 1,
        operators: Sequence[str] = ("+",),
        answer_format: str = "flexible",
        system_prompt: str | None = None,
        instruction: str = DEFAULT_ARITHMETIC_INSTRUCTION,
    ) -> None:
        if isinstance(operators, str):
            operators = tuple(operators.split()) if " " in operators else tuple(operators)
        operators = tuple(str(op) for op in operators)
        if not operators or any(op not in _OPS for op in operators):
            raise ValueError(f"operators must be a non-empty subset of {tuple(_OPS)}, got {operators!r}")
        if int(digits) < 1:
            raise ValueError(f"digits must be >= 1, got {digits!r}")
        if int(num_train) < 0 or int(num_eval) < 0:
            raise ValueError(f"num_train and num_eval must be >= 0, got {num_train}, {num_eval}")
        self.seed = int(seed)
        self.num_train = int(num_train)
        self.num_eval = int(num_eval)
        self.digits = int(digits)
        self.operators = tuple(dict.fromkeys(operators))  # drop duplicates, keep order
        self.answer_format = check_answer_format(answer_format)
        self.system_prompt = system_prompt
        self.instruction = instruction
        self.low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        self.high = 10**self.digits - 1

        train_problems = self._draw(random.Random(self.seed), self.num_train)
        eval_problems = self._draw_eval(random.Random(f"{self.seed}:eval"), set(train_problems))
        self._train = tuple(self._example(i, p) for i, p in enumerate(train_problems))
        self._eval = tuple(self._example(i, p) for i, p in enumerate(eval_problems))

    # -- generation -------------------------------------------------------------------------

    @property
    def num_problems(self) -> int:
        """Return the number of distinct problems the settings allow."""
        n = self.high - self.low + 1
        return len(self.operators) * n * n

    def _draw_one(self, rng: random.Random) -> Problem:
        a = rng.randint(self.low, self.high)
        op = rng.choice(self.operators)
        b = rng.randint(self.low, self.high)
        return (a, op, b)

    def _draw(self, rng: random.Random, count: int) -> list[Problem]:
        return [self._draw_one(rng) for _ in range(count)]

    def _draw_eval(self, rng: random.Random, seen: set[Problem]) -> list[Problem]:
        """Draw the eval split, avoiding ``seen`` problems when enough unseen ones exist."""
        if self.num_problems <= _ENUMERATE_LIMIT:
            unseen = [
                (a, op, b)
                for op in self.operators
                for a in range(self.low, self.high + 1)
                for b in range(self.low, self.high + 1)
                if (a, op, b) not in seen
            ]
            if len(unseen) >= self.num_eval:
                return rng.sample(unseen, self.num_eval)
            return self._draw(rng, self.num_eval)
        # Large space: rejection sampling; give up on disjointness only if it is very unlucky.
        problems: list[Problem] = []
        attempts_left = 100 * self.num_eval + 1000
        while len(problems) < self.num_eval:
            p = self._draw_one(rng)
            attempts_left -= 1
            if p not in seen or attempts_left <= 0:
                problems.append(p)
        return problems

    def _example(self, idx: int, problem: Problem) -> Example:
        a, op, b = problem
        question = f"What is {a} {op} {b}?"
        if self.instruction:
            question = f"{question} {self.instruction}"
        return Example(id=idx, question=question, answer=str(int(_OPS[op](a, b))))

    # -- Task API ---------------------------------------------------------------------------

    def train_examples(self) -> Sequence[Example]:
        """Return the ``num_train`` training examples (a tuple, same every call)."""
        return self._train

    def eval_examples(self) -> Sequence[Example]:
        """Return the ``num_eval`` evaluation examples (a tuple, same every call)."""
        return self._eval
