"""The multi-turn tasks as a run configures them (issue 36, stage 3): task=calculator / guess_number, the user's own
environment or tools, the start-up checks, and the data module collecting whole scored episodes."""

import pickle

import pytest
from helpers import ROOT, compose_config
from multiturn_tools import HangingEnvironment

from lit_rl.config import ConfigError, validate
from lit_rl.models import TINY_ID, ModelConfig, load_policy, load_tokenizer
from lit_rl.rollout.datamodule import RolloutDataModule
from lit_rl.rollout.environments import GuessNumberEnvironment, ToolEnvironment, task_environment
from lit_rl.rollout.multiturn import MultiTurnLimits
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.rollout.types import SamplingConfig
from lit_rl.run.train import build_environment, build_task_from_cfg
from lit_rl.schema import train_config
from lit_rl.tasks import build_task

HALF_VOCAB = list(range(0, 49152, 2))  # every even id ends a turn (the random tiny model's turns stay short)


def test_calculator_problems_take_two_steps_and_their_answers_are_right():
    task = build_task("calculator", seed=1, num_train=50, num_eval=5)
    for ex in task.train_examples():
        expression = ex.question.split("What is ")[1].split("?")[0]
        assert any(op in expression for op in ("* ", "+ ")) and expression.count(" ") == 4
        assert str(eval(expression)) == ex.answer  # noqa: S307 - our own generated arithmetic
    assert task.reward("so #### " + task.train_examples()[0].answer, task.train_examples()[0]) == 1.0
    assert [t.__name__ for t in task.environment().tools] == ["add", "mul"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task=guess_number", "rollout.mode=lagged", "rollout.lag=1"], r"rollout.mode=.lagged. is not allowed"),
        (["task=calculator", "rollout.mode=async"], r"rollout.mode='async' is not allowed: .*serves"),
        (["task=arithmetic", "task.tools=[a:b]", "task.environment=c:D"], r"task.tools=\['a:b'\] is not allowed"),
        (["task=calculator", "rollout.max_turns=0"], r"rollout.max_turns=0 is not allowed: must be an integer >= 1"),
        (["task=calculator", "rollout.max_total_tokens=0"], r"rollout.max_total_tokens=0 is not allowed"),
        # the user's code loads in the config check, before the trainer and the model (it took ~10 s more)
        (["task.environment=no_such_module:Env"], r"task.environment: 'no_such_module:Env': cannot import"),
        (["task.environment=multiturn_tools:Nope"], r"task.environment: .*has no class 'Nope'"),
        (["task.tools=[multiturn_tools:explode,multiturn_tools:explod]"], r"task.tools: .*has no function 'explod'"),
        # the reward built-ins are no tools: `math` loaded the math verifier and failed later on its docstring
        (["task=calculator", "task.tools=[math]"], r"task.tools: 'math' is not of the form 'module:function' /"),
        (["task=guess_number", "task.format_reward=1"], r"task.format_reward=1 is not allowed: .* and < 1 "),
        (["task=guess_number", "task.format_reward=-0.1"], r"task.format_reward=-0.1 is not allowed: must be a"),
        (["task=calculator", "task.format_reward=-1"], r"task.format_reward=-1 is not allowed: must be a finite"),
        (["task=guess_number", "task.high=1"], r"task.high=1 is not allowed: must be an integer >= 2"),
        (["task.environment=foo"], r"task.environment: 'foo' is not of the form 'module:class' / 'file.py:class'$"),
    ],
)
def test_multi_turn_settings_are_refused_by_name_at_start_up(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config("model=tiny", *overrides))


def test_the_users_own_tools_and_environment_are_loaded_by_spec():
    cfg = train_config(compose_config("model=tiny", "task=arithmetic", "task.tools=[multiturn_tools:explode]"))
    env = task_environment(build_task_from_cfg(cfg), max_tool_calls=2)
    assert isinstance(env, ToolEnvironment) and [t.__name__ for t in env.tools] == ["explode"]
    again = pickle.loads(pickle.dumps(env))  # travels to the verifier workers by spec, reloaded there
    assert again.tools[0] is env.tools[0] and again.max_tool_calls == 2
    cfg = train_config(compose_config("model=tiny", "task=arithmetic", "task.environment=multiturn_tools:Nope"))
    with pytest.raises(ConfigError, match="task.environment: 'multiturn_tools:Nope'"):
        build_environment(cfg, build_task_from_cfg(cfg), load_tokenizer(TINY_ID))
    assert task_environment(build_task("arithmetic")) is None
    assert isinstance(task_environment(build_task("guess_number", high=9)), GuessNumberEnvironment)


@pytest.fixture(scope="module")
def tiny_policy():
    return load_policy(ModelConfig("tiny"))


def test_the_data_module_collects_scored_episodes_and_a_hanging_step_is_cut(tiny_policy):
    policy, tok = tiny_policy
    task = build_task("guess_number", num_train=8, num_eval=2)
    dm = RolloutDataModule(
        task,
        tok,
        1,
        2,
        eval_examples=0,
        reward_timeout_s=1.0,
        environment=HangingEnvironment(),
        limits=MultiTurnLimits(max_turns=2, max_total_tokens=256, step_timeout_s=1.0),
    )
    engine = TorchEngine(policy, tok.pad_token_id, HALF_VOCAB)
    scored = dm.collect(engine, dm.prompts_for(0), SamplingConfig(max_new_tokens=12), step=0)
    assert len(scored.episodes) == 2
    for ep, reward in zip(scored.episodes, scored.rewards.tolist()):
        # turn 0's step hung: cut after 1 s, an error observation, counted; turn 1's step ended the episode
        assert len(ep.turns) == 2 and ep.tool_errors == 1
        assert ep.messages[-2]["content"] == "error: the tool call failed: timed out after 1 s"
        assert reward == 0.5 == ep.reward  # the environment's last reward is the episode's
    # the environment keeps the task's prompt (its reset gives None)
    assert dm.messages(dm.prompts_for(0)[0]) == [{"role": "user", "content": task.train_examples()[0].question}]
    assert task.train_examples()[0].question.startswith("I am thinking of an integer between 1 and 20.")


@pytest.mark.slow
@pytest.mark.parametrize("task", ["calculator", "guess_number"])
def test_a_two_step_run_logs_the_episode_metrics_and_samples(tmp_path, task):
    import json

    from lit_rl.run.train import run

    overrides = ["trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_turns=2"]
    metrics = run(
        compose_config("model=tiny", f"task={task}", "sampling.max_new_tokens=8", "eval.num_examples=2", *overrides),
        tmp_path / "run",
    )
    for name in ("num_turns_mean", "tool_calls_mean", "tool_errors", "env_token_fraction"):
        assert f"rollout/{name}" in metrics
    assert 1.0 <= metrics["rollout/num_turns_mean"] <= 2.0
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["episode"]["turns"] and sample["episode"]["messages"][-1]["role"] == "assistant"


def test_an_episodes_model_tokens_count_against_max_total_tokens(tiny_policy):
    """L_max (loss.reduction=constant's denominator, DAPO's overlong penalty) of a multi-turn run is the episode's
    budget rollout.max_total_tokens; a single-turn run's stays sampling.max_new_tokens."""
    from lit_rl.run.train import build_module

    policy, tok = tiny_policy
    settings = ("model=tiny", "sampling.max_new_tokens=16", "rollout.max_total_tokens=300")
    assert build_module(compose_config(*settings, "task=calculator"), policy, tok).max_response_length == 300
    assert build_module(compose_config(*settings, "task=arithmetic"), policy, tok).max_response_length == 16


EXAMPLE = [
    "task=dataset",
    f"task.path={ROOT}/docs/examples/capitals.jsonl",
    "task.eval_fraction=0.25",
    f"task.environment={ROOT}/docs/examples/capital_env.py:CapitalEnvironment",
]


def test_the_documented_example_environment_runs_in_the_verifier_workers():
    """docs/environments.md's example, loaded from its file as a run loads it, its steps in worker processes."""
    from lit_rl.rollout.environments import load_environment
    from lit_rl.rollout.multiturn import Episode, _env_steps
    from lit_rl.tasks import Example
    from lit_rl.tasks.verifier_pool import shared_pool

    env = load_environment(f"{ROOT}/docs/examples/capital_env.py:CapitalEnvironment")  # as task.environment= does
    limits = MultiTurnLimits(step_timeout_s=10.0)
    turns = ['<tool_call>{"name": "lookup", "arguments": {"country": "Kenya"}}</tool_call>', "It is Nairobi."]
    episodes = []
    for text in turns:
        ex = Example(0, "What is the capital of Kenya?", "Nairobi")
        ep = Episode(ex, [1], [{"role": "assistant", "content": text}], 0, {"example": ex.as_dict(), "turn": 0})
        episodes.append(ep)
    _env_steps(shared_pool(2), env, "test-example-env", episodes, limits)
    assert episodes[0].pending == [{"role": "tool", "name": "lookup", "content": "Nairobi"}]
    assert episodes[0].tool_calls == 1 and episodes[0].rewards == [None]
    assert episodes[1].pending is None and episodes[1].rewards == [1.0]


def test_an_environment_that_cannot_be_built_is_refused_with_its_name_and_error(tmp_path):
    """task.environment= naming a missing class says "class"; a constructor that raises is a ValueError quoting
    the class and its error (the recipe prints it as ``lit_rl: error: ...``), not a traceback from the trainer."""
    from lit_rl.rollout.environments import load_environment

    (tmp_path / "envs.py").write_text(
        "from lit_rl.rollout.environments import Environment\n\n"
        "class Broken(Environment):\n"
        "    def __init__(self):\n"
        "        raise RuntimeError('cannot reach the game server')\n\n"
        "    def step(self, state, model_turn):\n"
        "        return None, 1.0, {}\n"
    )
    with pytest.raises(ValueError, match=r"envs\.py has no class 'Brokn'"):
        load_environment(f"{tmp_path}/envs.py:Brokn")
    message = r"task\.environment='.*envs\.py:Broken': Broken\(\) raised RuntimeError: cannot reach the game server"
    with pytest.raises(ValueError, match=message):
        load_environment(f"{tmp_path}/envs.py:Broken")


@pytest.mark.slow
def test_the_documented_example_trains_two_steps(tmp_path):
    from lit_rl.run.train import run

    overrides = ["trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.num_examples=1"]
    metrics = run(compose_config("model=tiny", *EXAMPLE, "sampling.max_new_tokens=8", *overrides), tmp_path / "run")
    assert "rollout/num_turns_mean" in metrics


def test_example_call_shows_the_problems_own_first_step_as_a_call_the_environment_serves():
    """task.example_call=true: the same problems (same seed, same answers) with the question ending on its first
    step as a Hermes call: (8 + 7) * 6 shows add(8, 7), 6 * 6 + 0 shows mul(6, 6); the call, copied as a model
    turn, parses and the calculator's tools answer it (15, 36)."""
    from lit_rl.rollout.environments import call_tool, parse_tool_calls

    plain = build_task("calculator", seed=0, num_train=3, num_eval=1, digits=1)
    shown = build_task("calculator", seed=0, num_train=3, num_eval=1, digits=1, example_call=True)
    answers = [e.answer for e in shown.train_examples()]
    assert answers == [e.answer for e in plain.train_examples()] == ["36", "90", "55"]
    first = shown.train_examples()[1].question
    assert first.startswith(plain.train_examples()[1].question + " For example, 8 + 7 is computed by the call\n")
    tools = {fn.__name__: fn for fn in shown.environment().tools}
    results = []
    for ex in shown.train_examples()[:2]:
        (call,) = parse_tool_calls(ex.question[ex.question.index("<tool_call>") :])
        results.append((call.name, call_tool(tools, call)))
    assert results == [("mul", ("36", False)), ("add", ("15", False))]
    cfg = compose_config("model=tiny", "task=calculator", "task.example_call=true")
    validate(cfg)
    assert cfg.task.example_call is True


def test_per_turn_rewards_feed_the_episode_reward_with_episode_reward_sum():
    from lit_rl.rollout.multiturn import Episode
    from lit_rl.tasks import Example

    def episode(rewards):
        ep = Episode(Example(0, "q", "1"), [1], [], 0, {})
        ep.rewards = rewards
        return ep

    # a format reward on the tool turns, none on the answer: the verifier scores the answer (here 1), under last
    # alone (an earlier turn's reward never stands in for it) and added to the turns' under sum
    assert episode([0.1, 0.1, None]).score(1.0, "last") == 1.0
    assert episode([0.1, 0.1, None]).score(0.0, "last") == 0.0
    assert episode([0.1, 0.1, None]).score(1.0, "sum") == pytest.approx(1.2)
    assert episode([None, 1.0]).score(0.0, "sum") == 1.0 == episode([None, 1.0]).score(0.0, "last")
    assert episode([None, None]).score(0.5, "last") == 0.5 == episode([None, None]).score(0.5, "sum")
    with pytest.raises(ConfigError, match=r"rollout.episode_reward='mean' is not allowed: choose last or sum"):
        validate(compose_config("model=tiny", "task=calculator", "rollout.episode_reward=mean"))
