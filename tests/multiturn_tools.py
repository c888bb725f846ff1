"""The tests' own tools and environments for multi-turn rollouts, in a module that imports no torch (a verifier
worker that is killed and replaced re-imports it)."""

import time

from lit_rl.rollout.environments import Environment


def sleep_forever(seconds: float) -> str:
    """A tool that never returns in time.

    Args:
        seconds: ignored: it sleeps for an hour
    """
    time.sleep(3600)
    return "woke up"


def explode(x: int) -> int:
    """A tool that raises.

    Args:
        x: any integer
    """
    raise RuntimeError(f"boom at {x}")


class CountingEnvironment(Environment):
    """Answers every model turn with 'turn <k> seen' (a user message) until ``turns`` turns; reward 1 at its end."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def step(self, state, model_turn):
        if state["turn"] + 1 >= self.turns:
            return None, 1.0, {}
        return [{"role": "user", "content": f"turn {state['turn']} seen"}], None, {}


class HangingEnvironment(Environment):
    """Every step of turn 0 sleeps for an hour (cut by the pool's time limit); turn 1 ends the episode."""

    def step(self, state, model_turn):
        if state["turn"] == 0:
            time.sleep(3600)
        return None, 0.5, {}
