"""Environments and tools for multi-turn rollouts: the interface, tool calls, and the shipped environments.

An environment turns an example into a conversation and answers each model turn::

    class Environment:
        def reset(self, example: Example) -> list[dict] | None     # the prompt's chat messages (None: the task's)
        def step(self, state: dict, model_turn: str) -> tuple[list[dict] | None, float | None, dict]

``step`` gets the episode's ``state`` (a dict: ``example`` (``Example.as_dict()``), ``turn`` (0-based index of the
model turn just ended), ``rewards`` (the per-turn rewards so far), and whatever the environment keeps there) and
the model turn's text; it returns the observation messages to append (None: the episode is over), the turn's
reward (None: none) and an info dict (``tool_calls``, ``tool_errors``: counts, summed into the rollout metrics;
``solved``: the environment's own verdict on the episode, when it has one, ``rollout/solved_rate``).
Under ``rollout.episode_reward=last`` the episode's reward is the last model turn's reward, or the task's verifier
on that turn when the environment gave it none (an earlier turn's reward never stands in for it; per-turn rewards
are kept for the logs).

Every ``step`` runs in the verifier pool (``tasks.verifier_pool``), one worker process per call, under the pool's
time limit: a tool that hangs or crashes its process becomes an observation saying so (counted as a tool error),
never a stalled or crashed run. ``state`` travels to the worker and back (it must pickle).

Tools are plain Python functions with type hints and a Google-style docstring (``Args:``); their JSON schema is
transformers' ``get_json_schema``, the one chat templates take as ``tools=``. A model calls them in the Hermes /
Qwen format, one call per ``<tool_call>`` block::

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

Where the chat template renders ``tools=`` itself, it states the tools; where it has no tool support (SmolLM2's),
``tool_system_prompt`` states them in a system message in that same format. Results go back as ``tool``-role
messages, in the order of the calls; a malformed call (bad JSON, unknown tool, wrong arguments) or a tool that
raises is an error observation naming the problem.
"""

from __future__ import annotations

import inspect
import json
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..tasks.base import Example

__all__ = [
    "Environment",
    "ToolEnvironment",
    "ToolCall",
    "parse_tool_calls",
    "tool_schema",
    "tool_system_prompt",
    "template_states_tools",
    "GuessNumberEnvironment",
    "well_formed_guess",
    "add",
    "mul",
]

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Environment:
    """The base environment: one model turn, no observation (a single-turn task).

    Subclasses override ``reset`` and ``step`` (module docstring). ``tools``: the plain functions the model may
    call (their schemas go into the prompt), empty for an environment that answers in words only.
    """

    tools: Sequence[Callable] = ()

    def reset(self, example: Example) -> list[dict] | None:
        """The prompt's chat messages for ``example``; None (the base): the task's own (``Task.messages``)."""
        return None

    def step(self, state: dict, model_turn: str) -> tuple[list[dict] | None, float | None, dict]:
        """(observation messages or None when the episode is over, the turn's reward or None, info)."""
        return None, None, {}


def tool_schema(fn: Callable) -> dict:
    """The JSON schema (``{"type": "function", "function": {name, description, parameters}}``) of ``fn``, from
    its signature and docstring (transformers' ``get_json_schema``). Raises ValueError naming the function when
    its docstring or type hints do not describe every argument."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(
            f"tool {getattr(fn, '__name__', fn)!r}: its schema cannot be built from the signature and docstring "
            f"({err}); give every argument a type hint and an 'Args:' line"
        ) from err


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments`` (a dict), or ``error`` (why the block is not a valid call)."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of a model turn, in order.

    A block that is not a JSON object with a string ``name`` and an object ``arguments`` (absent: ``{}``) is a
    ``ToolCall`` whose ``error`` says so; an unclosed ``<tool_call>`` is one too. Returns [] for a turn without
    any call (the model answered).
    """
    calls = []
    for body in TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as err:
            calls.append(ToolCall(error=f"the tool call is not valid JSON ({err.msg} at char {err.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(error='the tool call needs a JSON object {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], error=f"the arguments of {obj['name']!r} must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    tail = text.rsplit("</tool_call>", 1)[-1]
    if "<tool_call>" in tail:
        calls.append(ToolCall(error="a <tool_call> block is not closed with </tool_call>"))
    return calls


def call_tool(tools: dict[str, Callable], call: ToolCall) -> tuple[str, bool]:
    """(result text, whether it is an error) of one parsed call: the tool's return value as text (``json.dumps``
    for what is not a string), or ``"error: ..."`` naming the problem (a parse error, an unknown tool and the
    known ones, arguments that do not bind to the signature, the exception the tool raised)."""
    if call.error:
        return f"error: {call.error}", True
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r}; the tools are {sorted(tools)}", True
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as err:
        return f"error: wrong arguments for {call.name!r}: {err}", True
    try:
        value = fn(**call.arguments)
    except Exception as err:  # noqa: BLE001 - the model sees what went wrong
        return f"error: {call.name} raised {type(err).__name__}: {err}", True
    return value if isinstance(value, str) else json.dumps(value), False


class ToolEnvironment(Environment):
    """A tool-using environment: each model turn's tool calls are run in order (at most ``max_tool_calls``, the
    rest answered with an error) and their results are the observation; a turn without a call ends the episode
    (reward None: the task's verifier scores the final answer).

    Args:
        tools: the plain functions the model may call.
        max_tool_calls: calls served per turn (``rollout.max_tool_calls``).
        format_reward: reward a well-formed call turn with this (logged per turn; the episode's reward stays
            the verifier's when the last turn gives none), 0 = off.
    """

    def __init__(self, tools: Sequence[Callable | str], max_tool_calls: int = 4, format_reward: float = 0.0):
        if int(max_tool_calls) < 1:
            raise ValueError(f"rollout.max_tool_calls={max_tool_calls!r} must be >= 1")
        if not tools:
            raise ValueError("task.tools: a tool environment needs at least one tool")
        # tools named by spec ('module:function', 'path/to/file.py:function') travel to the workers by spec
        self._specs = [t for t in tools if isinstance(t, str)]
        self.tools = [_load_tool(t) if isinstance(t, str) else t for t in tools]
        names = [fn.__name__ for fn in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"task.tools: two tools share a name: {names}")
        self.max_tool_calls, self.format_reward = int(max_tool_calls), float(format_reward)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._specs and len(self._specs) == len(self.tools):  # reloaded by spec in the worker
            state["tools"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.tools is None:
            self.tools = [_load_tool(spec) for spec in self._specs]

    def step(self, state: dict, model_turn: str) -> tuple[list[dict] | None, float | None, dict]:
        calls = parse_tool_calls(model_turn)
        if not calls:
            return None, None, {"tool_calls": 0, "tool_errors": 0}
        by_name = {fn.__name__: fn for fn in self.tools}
        messages, errors = [], 0
        for i, call in enumerate(calls):
            if i >= self.max_tool_calls:
                text, bad = f"error: at most {self.max_tool_calls} tool calls per turn; this one was not run", True
            else:
                text, bad = call_tool(by_name, call)
            errors += bad
            messages.append({"role": "tool", "name": call.name or "invalid", "content": text})
        reward = self.format_reward if self.format_reward and errors == 0 else None
        return messages, reward, {"tool_calls": len(calls), "tool_errors": errors}


def _load_tool(spec: str) -> Callable:
    """The function ``spec`` names (``module:function`` or ``path/to/file.py:function``); ValueError naming it."""
    from ..tasks.reward_functions import load_function

    try:
        return load_function(spec, builtins=False)
    except (ValueError, ImportError, FileNotFoundError) as err:
        raise ValueError(f"task.tools: {str(err).removeprefix('reward.functions: ')}") from err


def load_environment(spec: str, **kwargs) -> Environment:
    """``task.environment=<module:Class>``: the class ``spec`` names, built with ``kwargs`` (none when it takes
    none). Raises ValueError naming ``spec`` when it cannot be loaded, its constructor raises (the error's type
    and message quoted) or it is not an ``Environment``."""
    from ..tasks.reward_functions import load_function

    try:
        cls = load_function(spec, builtins=False)
    except (ValueError, ImportError, FileNotFoundError) as err:
        message = str(err).removeprefix("reward.functions: ").replace(" has no function ", " has no class ")
        raise ValueError(f"task.environment: {message}") from err
    try:
        env = cls(**kwargs) if kwargs else cls()
    except Exception as err:  # the user's constructor: a start-up error naming it, not a traceback
        name = getattr(cls, "__name__", spec)
        raise ValueError(f"task.environment={spec!r}: {name}() raised {type(err).__name__}: {err}") from err
    if not isinstance(env, Environment):
        raise ValueError(f"task.environment={spec!r}: {type(env).__name__} is not a lit_rl Environment subclass")
    env._lit_rl_spec = spec  # a class from a file travels to the verifier workers by its spec (``EnvStep``)
    return env


def task_environment(task, max_tool_calls: int = 4) -> Environment | None:
    """The run's environment: ``task.environment=<module:Class>`` (the user's class), else ``task.tools=[...]``
    (a ``ToolEnvironment`` of the user's functions), else the task's own (``task.environment(max_tool_calls)``:
    ``task=calculator``, ``task=guess_number``); None: a single-turn task. Raises ValueError when both the
    environment and the tools are given (an environment lists its own tools) or either cannot be loaded."""
    inner = getattr(task, "task", task)  # ConstantReward wraps the task
    spec, tools = getattr(inner, "env_spec", None), getattr(inner, "tool_specs", None)
    if spec and tools:
        raise ValueError(
            f"task.environment={spec!r} and task.tools={tools}: give one; an Environment lists its own tools in "
            "its 'tools' attribute"
        )
    if spec:
        return load_environment(spec)
    if tools:
        return ToolEnvironment(tools, max_tool_calls=max_tool_calls)
    own = getattr(inner, "environment", None)
    return own(max_tool_calls) if callable(own) else None


def chat_tools(tokenizer, env: Environment) -> tuple[str | None, list[dict] | None]:
    """How the prompt states ``env``'s tools: (None, their schemas) when the chat template renders ``tools=``
    itself, (the system text of ``tool_system_prompt``, None) when it does not, (None, None) without tools."""
    if not env.tools:
        return None, None
    if template_states_tools(tokenizer, env.tools):
        return None, [tool_schema(fn) for fn in env.tools]
    return tool_system_prompt(env.tools), None


def with_system_text(messages: list[dict], text: str | None) -> list[dict]:
    """``messages`` with ``text`` added to their system message (one made first when there is none)."""
    if not text:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def template_states_tools(tokenizer, tools: Sequence[Callable]) -> bool:
    """Whether the tokenizer's chat template renders ``tools=`` (the first tool's name appears in the prompt)."""
    if not tools:
        return True
    schemas = [tool_schema(fn) for fn in tools]
    messages = [{"role": "user", "content": "x"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that chokes on tools= does not support them
        return False
    return schemas[0]["function"]["name"] in text


def tool_system_prompt(tools: Sequence[Callable]) -> str:
    """The system message that states ``tools`` in the Hermes / Qwen format, for a template without tool support."""
    lines = "\n".join(json.dumps(tool_schema(fn)) for fn in tools)
    return (
        "You may call functions to help you. The functions are given as JSON schemas in <tools></tools>:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
        "The results come back in tool messages. When you know the answer, reply without a tool call."
    )


# -- the shipped environments -------------------------------------------------------------------------------------
def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def mul(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b


class GuessNumberEnvironment(Environment):
    """Guess-the-number (``task=guess_number``): a secret integer in [1, ``high``], drawn from the example's
    answer; each model turn's last integer is a guess, answered "higher" / "lower", reward 1 on the right guess
    (which ends the episode), 0 on a turn without a number (which ends it too), else no reward until the
    episode runs out of turns (its reward is then 0: the task's verifier sees no correct guess).

    ``format_reward`` (``task.format_reward``, 0 = off): the reward of a wrong guess that is well formed
    (``well_formed_guess``), so that under ``rollout.episode_reward=last`` an episode that ends on one scores it
    (the right guess scores 1 however it is written). Only turns that ended on their stop token reach ``step``
    (a turn cut at ``sampling.max_new_tokens`` ends its episode unstepped), so only those can earn it.
    Every step's info says ``solved`` (the right guess: the game's own 0/1 outcome, ``rollout/solved_rate``).
    """

    def __init__(self, high: int = 20, format_reward: float = 0.0):
        if int(high) < 2:
            raise ValueError(f"task.high={high!r} must be >= 2")
        if not 0.0 <= float(format_reward) < 1.0:
            raise ValueError(f"task.format_reward={format_reward!r} must be in [0, 1)")
        self.high, self.format_reward = int(high), float(format_reward)

    def reset(self, example: Example) -> list[dict]:
        return [{"role": "user", "content": guess_prompt(self.high)}]

    def step(self, state: dict, model_turn: str) -> tuple[list[dict] | None, float | None, dict]:
        numbers = re.findall(r"-?\d+", model_turn)
        if not numbers:
            return None, 0.0, {"solved": False}
        guess, secret = int(numbers[-1]), int(state["example"]["answer"])
        if guess == secret:
            return None, 1.0, {"solved": True}
        hint = "higher" if guess < secret else "lower"
        reward = self.format_reward if self.format_reward and well_formed_guess(model_turn) else None
        return [{"role": "user", "content": f"{guess} is wrong: {hint}."}], reward, {"solved": False}


#: what may surround a well-formed guess: ASCII whitespace and punctuation
GUESS_SURROUND = string.whitespace + string.punctuation


def well_formed_guess(model_turn: str) -> bool:
    """Whether a model turn's text (decoded without its stop token) is one guess and nothing else: stripped of
    ASCII whitespace and punctuation at both ends, it is one run of ASCII digits. "7", " 7.", "**12**" and "-3"
    (a sign is punctuation) are; "I guess 7", "7 or 8", "7, 8" and "" are not."""
    return re.fullmatch(r"[0-9]+", model_turn.strip(GUESS_SURROUND)) is not None


def guess_prompt(high: int) -> str:
    """The guess-the-number game's opening message."""
    return (
        f"I am thinking of an integer between 1 and {high}. Guess it: answer with one number. "
        "I will say 'higher' or 'lower'."
    )


@dataclass(frozen=True)
class EnvStep:
    """An environment's ``step`` as it travels to a verifier worker (``load`` gives the function the worker
    calls): ``run(state, model_turn) -> (state, observation, reward, info)``, the state sent back with its
    changes. ``raw``: the pool returns the value as it is (not a reward to convert). An environment made from
    ``task.environment=<spec>`` travels as its spec and is built again in the worker (a class defined in a file
    cannot be unpickled there by reference)."""

    env: Environment | None
    batched: bool = False
    raw: bool = True
    spec: str | None = None

    @classmethod
    def of(cls, env: Environment) -> "EnvStep":
        """The step of ``env``: by its spec when it was loaded from one (``load_environment``)."""
        spec = getattr(env, "_lit_rl_spec", None)
        return cls(None, spec=spec) if spec else cls(env)

    def load(self) -> Callable:
        env = load_environment(self.spec) if self.spec else self.env

        def run(state: dict, model_turn: str) -> tuple[dict, Any, Any, dict]:
            obs, reward, info = env.step(state, model_turn)
            return state, obs, reward, dict(info or {})

        return run
