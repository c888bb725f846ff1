"""The trainer's no-gradient scoring passes with each linear weight cast to bf16 once against autocast's casts at
every forward, side by side in one process.

    python benchmarks/scoring_casts.py                    # SmolLM2-135M, bf16-mixed autocast, 1 thread
    python benchmarks/scoring_casts.py --rows 64 --prompt 64 --response 64 --repeats 5

Under Lightning's ``bf16-mixed`` (autocast entered with ``cache_enabled=False``) every ``F.linear`` of a forward
re-cast its float32 weight, and the trainer's output layer re-cast the (tied, 28M-value) vocabulary matrix at every
chunk of ``logprob_chunk_tokens``. ``RLModule.scoring_pass`` casts each weight once: per pass for the policy (pi_old,
``RLModule.snapshot``), for the run for the frozen reference (``reference_logprobs``). Times, alternately in one
process, the run's own module (``grpo_module`` with ``kl.beta``): (a) pi_old over the batch, (b) the reference over
the batch after its casts were made (a run's second step on), each with the casts and with ``scoring_pass`` replaced
by a block that casts nothing (the path before); asserts the log-probs are equal bit for bit; prints the best of
``--repeats`` of each and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import ensure_quiet, grpo_module  # noqa: E402

from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy  # noqa: E402
from lit_rl.rollout.types import RolloutBatch  # noqa: E402


def random_batch(rows: int, prompt: int, response: int, group: int, vocab: int) -> RolloutBatch:
    """``rows`` completions of ``response`` tokens (all valid) after prompts of ``prompt`` tokens, one prompt per
    group of ``group`` rows; ids drawn at random (seeded: the cost does not depend on them)."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, vocab, (rows // group, prompt), generator=g).repeat_interleave(group, 0)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
        response_ids=torch.randint(0, vocab, (rows, response), generator=g),
        response_mask=torch.ones(rows, response, dtype=torch.bool),
        rollout_logprobs=torch.zeros(rows, response),
        rewards=torch.zeros(rows),
        advantages=torch.zeros(rows),
        group_ids=torch.arange(rows) // group,
        policy_version=torch.zeros(rows, dtype=torch.long),
    )


def reference_pass(module, rb: RolloutBatch) -> torch.Tensor:
    out = torch.zeros(rb.response_ids.shape)
    for i in range(0, len(rb), module.micro_batch_size):
        lp = module.reference_logprobs(rb.select(slice(i, i + module.micro_batch_size)))
        out[i : i + lp.shape[0], : lp.shape[1]] = lp
    return out


def timed(fn) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    ap.add_argument("--response", type=int, default=32, help="response tokens per row")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ensure_quiet(args.force)
    policy, tok = load_policy(ModelConfig(args.model))
    module = grpo_module(
        policy,
        tok,
        args.response,
        args.group_size,
        "kl.beta=0.04",
        f"rollout.micro_batch_size={args.micro_batch}",
        "update.shared_prefix=false",
    )
    rb = random_batch(args.rows, args.prompt, args.response, args.group_size, policy.config.vocab_size)

    def pi_old() -> torch.Tensor:
        module.snapshot(rb)
        return rb.old_logprobs.clone()

    def casts_off():
        return contextlib.nullcontext()

    best = {(k, c): float("inf") for k in ("pi_old", "reference") for c in ("every forward", "once")}
    results = {}
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # as Lightning's bf16-mixed
        reference_pass(module, rb)  # the reference's casts made once, as at a run's first step
        for _ in range(args.repeats):
            for casts in ("every forward", "once"):
                if casts == "every forward":
                    module.scoring_pass = lambda model=None: casts_off()
                else:
                    vars(module).pop("scoring_pass", None)
                for name, fn in (("pi_old", pi_old), ("reference", lambda: reference_pass(module, rb))):
                    seconds, out = timed(fn)
                    best[name, casts] = min(best[name, casts], seconds)
                    expected = results.setdefault(name, out)
                    assert torch.equal(out, expected), f"{name}: the log-probs changed with the casts"
    tokens = args.rows * (args.prompt + args.response)
    print(
        f"# {args.model}, bf16 autocast (cache_enabled=False), {torch.get_num_threads()} thread(s); {args.rows} rows x "
        f"({args.prompt} prompt + {args.response} response) tokens = {tokens}, micro-batches of {args.micro_batch}, "
        f"best of {args.repeats}, alternately; log-probs equal bit for bit"
    )
    print("| pass | cast at every forward, s | cast once, s | ratio |")
    print("|---|---|---|---|")
    for name in ("pi_old", "reference"):
        slow, fast = best[name, "every forward"], best[name, "once"]
        print(f"| {name} | {slow:.3f} | {fast:.3f} | {slow / fast:.2f}x |")


if __name__ == "__main__":
    main()
