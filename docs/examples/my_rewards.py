"""Reward functions for reward.functions (docs/data.md): one per completion, one in TRL's batched form."""

from lit_rl.tasks.rewards import math_reward


def correct(prompt, completion, example):  # -> float, or None: not applicable (left out of its mean)
    return math_reward(completion, example["solution"]) if example.get("solution") else None


def brevity(prompts, completions, completion_ids, **columns):  # TRL's form -> one float | None per completion
    return [1.0 - min(len(ids), 64) / 64 for ids in completion_ids]
