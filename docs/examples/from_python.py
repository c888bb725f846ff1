"""Train from Python with a reward function and rows of your own: python docs/examples/from_python.py

The recipe's run (``python recipes/train.py``) with the tiny random model for 4 steps; docs/python.md explains
each argument. Its rewards stay near 0 (the model is random): use ``model=smollm2-135m`` to learn.
"""

import lit_rl


def brevity(prompts, completions, completion_ids, max_completion_length, **columns):
    """TRL's batched convention: one reward per completion, -(tokens) / the cap, in [-1, 0]: shorter is better."""
    return [-len(ids) / max_completion_length for ids in completion_ids]


if __name__ == "__main__":  # the verifier workers import this file to call brevity: guard the run
    cfg = lit_rl.compose("model=tiny", "algo=dapo", "trainer.max_steps=4", "eval.num_examples=8")
    cfg.optim.lr = 1e-5  # typed fields; every value is checked when the run starts
    cfg.reward.weights = [1.0, 0.1]  # one per reward function
    rows = [
        {"prompt": f"What is {a} + {b}? Answer after ####.", "answer": str(a + b)} for a in range(9) for b in range(9)
    ]
    result = lit_rl.train(
        cfg,
        "outputs/from_python",
        reward_functions=["math", brevity],
        train_dataset=rows[:64],
        eval_dataset=rows[64:],
    )
    print(f"reward {result.metrics['rollout/reward_mean']:.3f}; the policy is in {result.policy_dir}")
