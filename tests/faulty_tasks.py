"""The tests' own tasks (leading space; a verifier that fails), in a module that imports no torch: a verifier
worker that is killed and replaced re-imports the task's module, and importing a test module (torch,
Lightning) would cost seconds each time."""

import time

from lit_rl.tasks import Example, Task


class LeadingSpaceTask(Task):
    """Reward 1 when the completion starts with a space. Sampling keeps the top 8 tokens (``sampling.top_k``),
    so learning means re-ranking a few specific tokens — something a random tiny model can do in a few
    dozen steps (an unrestricted random 49k-token distribution offers no such handle)."""

    name = "leading_space"

    def __init__(self, n=64):
        self._ex = [Example(i, f"Say something {i}", "x") for i in range(n)]

    def train_examples(self):
        return self._ex

    def eval_examples(self):
        return self._ex[:4]

    def reward(self, completion, ex):
        return 1.0 if completion.startswith(" ") else 0.0


class FaultyVerifierTask(LeadingSpaceTask):
    """Reward 1 when the completion starts with a space; prompt 0's verifier raises, prompt 1's hangs for 30 s."""

    name = "faulty_verifier"

    def __init__(self, n=4):
        super().__init__(n)

    def reward(self, completion, ex):
        if ex.id == 0:
            raise RuntimeError("verifier crashed")
        if ex.id == 1:
            time.sleep(30)
        return super().reward(completion, ex)


class UnevenPromptsTask(LeadingSpaceTask):
    """LeadingSpaceTask with prompts of 0-5 extra words: the prompts of a step differ in length (left padding)."""

    name = "uneven_prompts"

    def __init__(self, n=12):
        self._ex = [Example(i, "Say something" + " again" * (i % 6) + f" {i}", "x") for i in range(n)]
