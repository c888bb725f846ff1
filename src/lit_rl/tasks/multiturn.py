"""The multi-turn tasks: ``task=calculator`` (multi-step arithmetic with ``add`` / ``mul`` tools) and
``task=guess_number`` (a game answered "higher" / "lower"). Each gives its ``Environment`` (``environment``); the
rollout side runs the episodes (``rollout.multiturn``)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

from lit_rl.tasks.base import Example, Task, check_answer_format

__all__ = ["CalculatorTask", "GuessNumberTask"]

CALCULATOR_INSTRUCTION = "You may call the tools to compute. Give the final answer as a number after '####'."


class CalculatorTask(Task):
    """Two-step arithmetic on ``digits``-digit operands, ``a * b + c`` or ``(a + b) * c``, with the tools ``add``
    and ``mul`` (``rollout.environments``); reward: the final answer (``math_reward`` of the last model turn).
    ``example_call``: the question ends with its own first step written as a tool call (``example_call_text``),
    a demonstration of the call's format in the prompt (the second step and the answer are left to the model).

    Both splits are generated from ``seed`` (the eval split from ``f"{seed}:eval"``). Raises ValueError for
    ``digits`` < 1, a negative count or an unknown ``answer_format``.
    """

    name = "calculator"

    def __init__(
        self,
        seed: int = 0,
        num_train: int = 10000,
        num_eval: int = 200,
        digits: int = 2,
        answer_format: str = "flexible",
        format_reward: float = 0.0,
        example_call: bool = False,
    ):
        if int(digits) < 1:
            raise ValueError(f"task.digits={digits!r} must be >= 1")
        if int(num_train) < 0 or int(num_eval) < 0:
            raise ValueError(f"task.num_train / num_eval must be >= 0, got {num_train} / {num_eval}")
        self.answer_format = check_answer_format(answer_format)
        self.digits, self.format_reward, self.example_call = int(digits), float(format_reward), bool(example_call)
        self._train = self._problems(random.Random(seed), int(num_train))
        self._eval = self._problems(random.Random(f"{seed}:eval"), int(num_eval))

    def _problems(self, rng: random.Random, count: int) -> list[Example]:
        low, high = (0, 9) if self.digits == 1 else (10 ** (self.digits - 1), 10**self.digits - 1)
        out = []
        for i in range(count):
            a, b, c = (rng.randint(low, high) for _ in range(3))
            times = rng.random() < 0.5
            text, value = (f"{a} * {b} + {c}", a * b + c) if times else (f"({a} + {b}) * {c}", (a + b) * c)
            question = f"What is {text}? {CALCULATOR_INSTRUCTION}"
            if self.example_call:
                question += " " + example_call_text("mul" if times else "add", a, b)
            out.append(Example(i, question, str(value)))
        return out

    def train_examples(self) -> Sequence[Example]:
        return self._train

    def eval_examples(self) -> Sequence[Example]:
        return self._eval

    def environment(self, max_tool_calls: int = 4):
        """The ``ToolEnvironment`` with ``add`` and ``mul`` (``rollout.max_tool_calls`` calls per turn)."""
        from ..rollout.environments import ToolEnvironment, add, mul

        return ToolEnvironment([add, mul], max_tool_calls=max_tool_calls, format_reward=self.format_reward)


def example_call_text(tool: str, a: int, b: int) -> str:
    """``task.example_call``'s sentence: the problem's first step, ``tool`` (``add`` or ``mul``) on ``a`` and ``b``,
    written as the Hermes-format call the model may copy."""
    sign = "*" if tool == "mul" else "+"
    call = json.dumps({"name": tool, "arguments": {"a": a, "b": b}})
    return f"For example, {a} {sign} {b} is computed by the call\n<tool_call>\n{call}\n</tool_call>"


class GuessNumberTask(Task):
    """Guess an integer in [1, ``high``] (``GuessNumberEnvironment``): several turns, "higher" / "lower" after each
    wrong guess; reward 1 for the right guess, ``format_reward`` for a wrong one that is one integer alone
    (``rollout.environments.well_formed_guess``). Raises ValueError for ``high`` < 2 or ``format_reward``
    outside [0, 1). The secrets are drawn from ``seed`` (eval: ``f"{seed}:eval"``).
    The verifier (``reward``): the last integer of the final turn equals the secret."""

    name = "guess_number"

    def __init__(
        self,
        seed: int = 0,
        num_train: int = 10000,
        num_eval: int = 200,
        high: int = 20,
        answer_format: str = "flexible",
        format_reward: float = 0.0,
    ):
        self.answer_format = check_answer_format(answer_format)  # (the guess is the turn's last integer either way)
        if int(high) < 2:
            raise ValueError(f"task.high={high!r} must be >= 2")
        if not 0.0 <= float(format_reward) < 1.0:
            raise ValueError(f"task.format_reward={format_reward!r} must be in [0, 1)")
        self.high, self.format_reward = int(high), float(format_reward)
        from ..rollout.environments import guess_prompt

        text = guess_prompt(self.high)
        draw = lambda rng, n: [Example(i, text, str(rng.randint(1, self.high))) for i in range(n)]  # noqa: E731
        self._train = draw(random.Random(seed), int(num_train))
        self._eval = draw(random.Random(f"{seed}:eval"), int(num_eval))

    def train_examples(self) -> Sequence[Example]:
        return self._train

    def eval_examples(self) -> Sequence[Example]:
        return self._eval

    def reward(self, completion: str, ex: Example) -> float:
        numbers = re.findall(r"-?\d+", completion if isinstance(completion, str) else "")
        return 1.0 if numbers and numbers[-1] == ex.answer else 0.0

    def environment(self, max_tool_calls: int = 4):
        """The ``GuessNumberEnvironment`` of this range and ``format_reward`` (no tools)."""
        from ..rollout.environments import GuessNumberEnvironment

        return GuessNumberEnvironment(self.high, self.format_reward)
