"""Environments and tools (issue 36, stage 1): tool schemas from signatures, the Hermes tool-call format, and every
environment step in the verifier pool: a hanging tool is cut by the time limit, a raising one or a malformed call
becomes an error observation naming the problem, counted."""

import json
import time

import pytest
from multiturn_tools import explode, sleep_forever

from lit_rl.models import TINY_ID, load_tokenizer
from lit_rl.rollout.environments import (
    GuessNumberEnvironment,
    ToolEnvironment,
    add,
    mul,
    parse_tool_calls,
    template_states_tools,
    tool_schema,
    tool_system_prompt,
    well_formed_guess,
)
from lit_rl.rollout.multiturn import Episode, MultiTurnLimits, _env_steps, episode_metrics
from lit_rl.tasks import build_task
from lit_rl.tasks.base import Example
from lit_rl.tasks.verifier_pool import VerifierPool


def test_the_games_own_outcome_is_logged_apart_from_the_shaped_reward(pool):
    """rollout/solved_rate counts the episodes the environment said solved; the format reward moves the episode's
    reward (rollout.episode_reward=last) but never the solved rate. Four games, secret 14, format reward 0.25,
    stepped in the pool turn by turn: a well-formed wrong guess then the right one (solved, reward 1); two
    well-formed wrong guesses (0.25); a rambling wrong guess then a turn cut before its step (None, None: the
    verifier's 0); one cut turn, never stepped. Solved rate 1/4, turns 7/4."""
    env = GuessNumberEnvironment(high=20, format_reward=0.25)
    games = [["7", "14"], ["7", "15"], ["maybe 7?", None], [None]]
    eps = episodes_after(["" for _ in games])
    for turn in range(2):
        stepped = []
        for ep, game in zip(eps, games):
            if turn >= len(game):
                continue
            ep.turns.append((0, 1))
            if game[turn] is None:
                ep.rewards.append(None)  # a turn cut at max_new_tokens: the collector does not step it
            else:
                ep.messages[-1] = {"role": "assistant", "content": game[turn]}
                stepped.append(ep)
        _env_steps(pool, env, "test-guess-steps", stepped, MultiTurnLimits(step_timeout_s=10.0))
    assert [ep.solved for ep in eps] == [True, False, False, None]
    assert [ep.rewards for ep in eps] == [[0.25, 1.0], [0.25, 0.25], [None, None], [None]]
    assert [ep.score(0.0, "last") for ep in eps] == [1.0, 0.25, 0.0, 0.0]
    metrics = episode_metrics(eps)
    assert metrics["rollout/solved_rate"] == 0.25 and metrics["rollout/num_turns_mean"] == 1.75
    assert "rollout/solved_rate" not in episode_metrics(eps[3:])  # no step said either way


def test_last_takes_the_last_turns_reward_or_the_verifier_never_an_earlier_turns_format_reward(pool):
    """rollout.episode_reward=last on task=calculator with task.format_reward=0.2: three episodes make a
    well-formed mul call (the environment's format reward 0.2) and then answer 7 * 2 + 3 wrong (16), right (17),
    or in a turn cut before its step (None, as the collector appends for it). The answer turns carry no reward
    of their own, so the episode's reward is the task's verifier on the last turn: 0, 1, 0, not the earlier
    0.2 (which made a wrong final answer score as much as a right one). Under sum the format reward adds: 0.2,
    1.2, 0.2."""
    task = build_task("calculator", num_train=1, num_eval=1, format_reward=0.2)
    env = task.environment(max_tool_calls=4)
    call = '<tool_call>\n{"name": "mul", "arguments": {"a": 7, "b": 2}}\n</tool_call>'
    games = [[call, "#### 16"], [call, "#### 17"], [call, None]]
    eps = episodes_after(["" for _ in games], answer="17")
    for turn in range(2):
        stepped = []
        for ep, game in zip(eps, games):
            ep.turns.append((0, 1))
            if game[turn] is None:
                ep.messages.append({"role": "assistant", "content": "#### 1"})  # cut mid-answer: "#### 17..."
                ep.rewards.append(None)
                continue
            ep.messages.append({"role": "assistant", "content": game[turn]})
            stepped.append(ep)
        _env_steps(pool, env, "test-calculator-steps", stepped, MultiTurnLimits(step_timeout_s=10.0))
    assert [ep.rewards for ep in eps] == [[0.2, None], [0.2, None], [0.2, None]]
    assert [ep.tool_calls for ep in eps] == [1, 1, 1] and [ep.reward for ep in eps] == [None, None, None]
    verdicts = [task.reward(ep.last_turn_text, ep.example) for ep in eps]
    assert verdicts == [0.0, 1.0, 0.0]
    assert [ep.score(v, "last") for ep, v in zip(eps, verdicts)] == [0.0, 1.0, 0.0]
    assert [ep.score(v, "sum") for ep, v in zip(eps, verdicts)] == pytest.approx([0.2, 1.2, 0.2])


@pytest.fixture(scope="module")
def pool():
    p = VerifierPool(2)
    yield p
    p.close()


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def episodes_after(texts, answer="14"):
    eps = []
    for i, text in enumerate(texts):
        ex = Example(i, "q", answer)
        ep = Episode(ex, [1], [{"role": "user", "content": "q"}], 0, {"example": ex.as_dict(), "turn": 0})
        ep.messages.append({"role": "assistant", "content": text})
        eps.append(ep)
    return eps


def test_tool_schema_comes_from_the_signature_and_docstring():
    schema = tool_schema(mul)
    assert schema["function"]["name"] == "mul"
    assert schema["function"]["description"] == "Multiply two numbers."
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "number", "description": "the first number"}
    assert schema["function"]["parameters"]["required"] == ["a", "b"]

    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ValueError, match="'undocumented'.*Args"):
        tool_schema(undocumented)


def test_smollm2_template_has_no_tool_support_so_the_system_prompt_states_them():
    tok = load_tokenizer(TINY_ID)  # SmolLM2's tokenizer and template
    assert not template_states_tools(tok, [add, mul])
    prompt = tool_system_prompt([add, mul])
    assert json.dumps(tool_schema(add)) in prompt and "<tool_call>" in prompt


def test_tool_calls_are_parsed_in_order_and_malformed_ones_say_why():
    text = call("add", a=2, b=3) + " then " + call("mul", a=5, b=4)
    parsed = [(c.name, c.arguments) for c in parse_tool_calls(text)]
    assert parsed == [("add", {"a": 2, "b": 3}), ("mul", {"a": 5, "b": 4})]
    assert parse_tool_calls("the answer is 14") == []
    (bad,) = parse_tool_calls("<tool_call>{name: add}</tool_call>")
    assert "not valid JSON" in bad.error
    (nameless,) = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert '"name"' in nameless.error
    (unclosed,) = parse_tool_calls('<tool_call>{"name": "add"')
    assert "not closed" in unclosed.error


def test_tool_environment_serves_calls_in_order_and_names_every_error():
    env = ToolEnvironment([add, mul], max_tool_calls=4)
    turn = call("add", a=2, b=3) + call("mul", a=5, b=4) + call("div", a=1) + call("add", a=1) + call("add", a=1, b=1)
    obs, reward, info = env.step({"turn": 0}, turn)
    assert [m["content"] for m in obs[:2]] == ["5", "20"]
    assert "unknown tool 'div'" in obs[2]["content"] and "['add', 'mul']" in obs[2]["content"]
    assert "wrong arguments for 'add'" in obs[3]["content"] and "missing a required argument: 'b'" in obs[3]["content"]
    assert "at most 4 tool calls per turn" in obs[4]["content"]
    assert all(m["role"] == "tool" for m in obs) and reward is None
    assert info == {"tool_calls": 5, "tool_errors": 3}
    assert env.step({"turn": 1}, "So the answer is 14.") == (None, None, {"tool_calls": 0, "tool_errors": 0})


def test_guess_number_answers_higher_lower_and_rewards_the_right_guess():
    env = GuessNumberEnvironment(high=20)
    state = {"example": {"answer": "13"}, "turn": 0}
    assert env.step(state, "I guess 7")[0] == [{"role": "user", "content": "7 is wrong: higher."}]
    assert env.step(state, "maybe 15?")[0] == [{"role": "user", "content": "15 is wrong: lower."}]
    assert env.step(state, "13") == (None, 1.0, {"solved": True})
    assert env.step(state, "no idea") == (None, 0.0, {"solved": False})
    assert env.step(state, "7")[1:] == (None, {"solved": False})  # no format reward by default


def test_guess_number_format_reward_goes_to_a_wrong_guess_that_is_one_integer_alone():
    env = GuessNumberEnvironment(high=20, format_reward=0.25)
    state = {"example": {"answer": "13"}, "turn": 0}
    for well_formed in ("7", " 7.", "**15**", "15!\n", "(7)"):
        assert well_formed_guess(well_formed)
        assert env.step(state, well_formed)[1:] == (0.25, {"solved": False}), well_formed
    for rambling in ("I guess 7", "7 or 8", "7, 8", "7.5", "Is it 15?"):
        assert not well_formed_guess(rambling)
        assert env.step(state, rambling)[1:] == (None, {"solved": False}), rambling
    assert not well_formed_guess("") and not well_formed_guess("seven")
    # the right guess scores 1 however it is written; a turn without a number 0, both end the episode
    assert env.step(state, "13") == env.step(state, "It is 13") == (None, 1.0, {"solved": True})
    assert env.step(state, "hmm.") == (None, 0.0, {"solved": False})
    with pytest.raises(ValueError, match=r"task.format_reward=1.0 must be in \[0, 1\)"):
        GuessNumberEnvironment(format_reward=1.0)


def test_steps_run_in_the_pool_a_hanging_tool_is_cut_and_errors_are_observations(pool):
    env = ToolEnvironment([add, sleep_forever, explode])
    limits = MultiTurnLimits(step_timeout_s=2.0, max_tool_output_chars=60)
    turns = [
        call("add", a=2, b=3),
        call("sleep_forever", seconds=1),
        call("explode", x=7),
        "<tool_call>{not json</tool_call>",
        call("add", a="x" * 100, b="y"),  # a long (string) result, cut at 60 characters and marked
        "The answer is 14.",
    ]
    eps = episodes_after(turns)
    start = time.monotonic()
    _env_steps(pool, env, "test-env-steps", eps, limits)
    assert time.monotonic() - start < 30  # the hour-long tool was cut after 2 s (plus worker start-ups)
    assert eps[0].pending == [{"role": "tool", "name": "add", "content": "5"}]
    assert eps[1].pending[0]["content"] == "error: the tool call failed: timed out after 2 s"
    assert eps[2].pending[0]["content"] == "error: explode raised RuntimeError: boom at 7"
    assert "not valid JSON" in eps[3].pending[0]["content"]
    assert eps[4].pending[0]["content"] == "x" * 60 + "... [cut: 41 more characters]"
    assert eps[5].pending is None
    assert [ep.tool_errors for ep in eps] == [0, 1, 1, 1, 0, 0]
    assert [ep.tool_calls for ep in eps] == [1, 0, 1, 1, 1, 0]  # the timed-out step's count is lost with it
    # the pool is still serving after the kill
    again = episodes_after([call("add", a=1, b=1)])
    _env_steps(pool, env, "test-env-steps", again, limits)
    assert again[0].pending[0]["content"] == "2"


def test_the_python_tool_runs_code_without_network_time_or_memory_to_spare(monkeypatch):
    from lit_rl.rollout import python_tool
    from lit_rl.rollout.python_tool import network_isolation, python

    monkeypatch.setattr(python_tool, "TIME_LIMIT_S", 1.0)  # (5 s by default)

    if network_isolation() is None:
        assert python("print(1)").startswith("error: this machine cannot run code without network")
        pytest.skip("no user namespaces here: the tool refuses to run code (checked above)")
    assert python("print(6 * 7)") == "42\n"
    assert "ZeroDivisionError" in python("1 / 0")
    connect = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\nexcept OSError as e:\n"
    assert python(connect + "    print('no network:', type(e).__name__)").startswith("no network:")
    assert "MemoryError" in python("x = bytearray(2 * 1024**3)")
    assert python("while True: pass") == "error: the program ran past 1 s and was stopped"
    assert tool_schema(python)["function"]["parameters"]["required"] == ["code"]
