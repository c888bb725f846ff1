"""Multi-turn collection time with the embedded engine continuing each episode's KV across turns (issue 36) against
re-prefilling every turn's whole episode, A/B interleaved; plus the two paths' log-prob gap and the trainer's.

    python benchmarks/kv_continuation.py --model tiny --env echo             # the tiny random model, 4 turns
    python benchmarks/kv_continuation.py --model smollm2 --env guess         # SmolLM2-135M on task=guess_number
    python benchmarks/kv_continuation.py --model smollm2 --env echo --max-new 96 --repeats 3 --force

Each repeat collects the same episodes (same prompts and seeds) once each way, the order alternating, with
``collect_episodes`` (``--env guess``: the project's ``GuessNumberEnvironment``; ``echo``: this file's ``Echo``,
which answers every turn with one short user message until ``--turns``). Printed: the wall seconds of each
collection and of its engine calls after the first turn (where the two ways differ), the median ratios re-prefill /
continued, the ids each way prefilled after the first turn, the largest
|log-prob difference| between the two paths over the model tokens before an episode's ids part (same tokens,
same contexts), and the float32
trainer's max and mean |log-prob gap| to each path's rollout log-probs (torch's kernels, or ``--kernels``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import ensure_quiet  # noqa: E402

from lit_rl.rollout.environments import Environment  # noqa: E402


class Echo(Environment):
    """Answers every model turn with 'noted, go on (turn k)' until the collection's last turn; reward 1 at the end."""

    def step(self, state, model_turn):
        return [{"role": "user", "content": f"noted, go on (turn {state['turn'] + 1})"}], None, {}


class Counting:
    """The engine with its prefills counted (ids fed to the model in calls after the first, padding included)."""

    def __init__(self, engine):
        self.engine, self.prefilled, self.calls, self.later_s = engine, 0, 0, 0.0
        self.version, self.pad_token_id, self.stop_token_ids = 0, engine.pad_token_id, engine.stop_token_ids
        if engine.continue_kv:
            self.kv_continuation = self._session

    def _session(self):
        import contextlib

        @contextlib.contextmanager
        def counted():
            with self.engine.kv_continuation() as kept:
                yield kept
                self.prefilled += kept.prefilled if kept is not None else 0

        return counted()

    def generate(self, prompts, params, seeds):
        if self.engine.kept is None and self.calls:  # re-prefill: every prompt whole, left-padded
            self.prefilled += len(prompts) * max(len(p) for p in prompts)
        t = time.perf_counter()
        out = self.engine.generate(prompts, params, seeds)
        self.later_s += (time.perf_counter() - t) if self.calls else 0.0
        self.calls += 1
        return out


def collect(policy, tok, args, continued: bool):
    from lit_rl.rollout.environments import GuessNumberEnvironment, load_environment
    from lit_rl.rollout.multiturn import MultiTurnLimits, collect_episodes
    from lit_rl.rollout.torch_engine import TorchEngine
    from lit_rl.rollout.types import SamplingConfig
    from lit_rl.tasks import build_task
    from lit_rl.tasks.verifier_pool import shared_pool

    task = build_task("guess_number", num_train=args.prompts, num_eval=1)
    examples = [ex for ex in task.train_examples()[: args.prompts] for _ in range(args.group)]
    env = GuessNumberEnvironment() if args.env == "guess" else load_environment(f"{os.path.abspath(__file__)}:Echo")
    messages = [[{"role": "user", "content": ex.question}] for ex in examples]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in messages]
    prompts = [list(p if isinstance(p, list) else p["input_ids"]) for p in prompts]
    stops = list(range(0, len(tok), 2)) if args.model == "tiny" else [tok.eos_token_id]
    engine = TorchEngine(policy, tok.pad_token_id, stops)
    engine.continue_kv = continued
    counting = Counting(engine)
    params = SamplingConfig(max_new_tokens=args.max_new, temperature=1.0)
    limits = MultiTurnLimits(max_turns=args.turns, max_total_tokens=args.max_total)
    t = time.perf_counter()
    r, episodes = collect_episodes(
        counting, tok, env, examples, prompts, messages, params, list(range(len(examples))), limits,
        shared_pool(1), f"bench-{args.env}-{args.turns}",
    )  # fmt: skip
    return (time.perf_counter() - t, counting.later_s), counting.prefilled, r, episodes


def trainer_gap(policy, tok, r) -> tuple[float, float]:
    from lit_rl.logprobs import response_logprobs
    from lit_rl.rollout.types import left_pad

    prompt, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        scores = response_logprobs(policy, prompt, pmask, r.response_ids, r.response_mask, env_mask=r.env_mask)
    gap = (scores.logprobs - r.rollout_logprobs).abs()[r.response_mask]
    return gap.max().item(), gap.mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--env", choices=["echo", "guess"], default="echo")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--max-total", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kernels", default="default", choices=["default", "batch_invariant"])
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    from lit_rl.kernels import kernel_mode
    from lit_rl.models import ModelConfig, load_policy

    ensure_quiet(args.force)
    policy, tok = load_policy(ModelConfig("tiny" if args.model == "tiny" else "HuggingFaceTB/SmolLM2-135M-Instruct"))
    policy.eval()
    seconds, last = {True: [], False: []}, {}
    with kernel_mode(args.kernels, policy):
        collect(policy, tok, args, True)  # warm-up (the verifier worker, the allocator)
        for i in range(args.repeats):
            for continued in (True, False) if i % 2 == 0 else (False, True):
                s, prefilled, r, episodes = collect(policy, tok, args, continued)
                seconds[continued].append(s)
                last[continued] = (prefilled, r, episodes)
        gaps = {c: trainer_gap(policy, tok, last[c][1]) for c in (True, False)}
    (pa, a, ea), (pb, b, _) = last[True], last[False]
    # the two ways' log-probs of the same tokens in the same contexts: each episode up to where its ids part
    width = min(a.response_ids.shape[1], b.response_ids.shape[1])
    differs = (a.response_ids[:, :width] != b.response_ids[:, :width]).long()
    before = (differs.cumsum(-1) == 0) & a.response_mask[:, :width] & b.response_mask[:, :width]
    gap_ab = (a.rollout_logprobs[:, :width] - b.rollout_logprobs[:, :width]).abs()[before]
    same = [i for i in range(len(ea)) if torch.equal(a.response_ids[i], b.response_ids[i])]
    ratios = [b_[0] / a_[0] for a_, b_ in zip(seconds[True], seconds[False])]
    later = [b_[1] / a_[1] for a_, b_ in zip(seconds[True], seconds[False])]
    turns = sum(len(ep.turns) for ep in ea) / len(ea)
    print(f"\n## {args.model}, env {args.env}: {len(ea)} episodes ({args.prompts} prompts x G={args.group}), "
          f"up to {args.turns} turns of {args.max_new} tokens (mean {turns:.2f} turns, response width "
          f"{a.response_ids.shape[1]}), kernels={args.kernels}")  # fmt: skip
    print("| way | seconds per collection | engine seconds of the turns after the first | ids they prefilled |")
    print("|---|---|---|---|")
    for c, name, p in ((True, "continued", pa), (False, "re-prefill", pb)):
        whole, turns_after = (" ".join(f"{s[i]:.2f}" for s in seconds[c]) for i in (0, 1))
        print(f"| {name} | {whole} | {turns_after} | {p} |")
    for what, x in (("collection", ratios), ("turns after the first", later)):
        print(f"re-prefill / continued, {what}, per repeat: {' '.join(f'{v:.2f}' for v in x)}; "
              f"median {statistics.median(x):.2f}x")  # fmt: skip
    largest = gap_ab.max().item() if gap_ab.numel() else 0.0
    print(f"episodes with the same ids both ways: {len(same)}/{len(ea)}; max |log-prob difference| over the "
          f"{gap_ab.numel()} model tokens before an episode's ids part: {largest:.3g}")  # fmt: skip
    for c, name in ((True, "continued"), (False, "re-prefill")):
        print(f"trainer vs engine ({name}): max |gap| {gaps[c][0]:.3g}, mean {gaps[c][1]:.3g}")


if __name__ == "__main__":
    main()
