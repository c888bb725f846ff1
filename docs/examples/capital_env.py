"""A complete multi-turn environment with a tool (docs/environments.md): the model may look a capital up."""

from lit_rl.rollout.environments import ToolEnvironment

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima"}


def lookup(country: str) -> str:
    """The capital city of a country.

    Args:
        country: the country's English name
    """
    return CAPITALS.get(country, f"no capital known for {country!r}")


class CapitalEnvironment(ToolEnvironment):
    def __init__(self):
        super().__init__([lookup], max_tool_calls=2)

    def step(self, state, model_turn):
        observation, reward, info = super().step(state, model_turn)  # the calls served, None when it answered
        if observation is None:  # the final answer: 1 when it names the gold capital
            reward = float(state["example"]["answer"].lower() in model_turn.lower())
        return observation, reward, info
