"""The update with and without the shared-prefix forward (``update.shared_prefix``), on the same rollouts, in one run.

    python benchmarks/shared_prefix.py                      # the main job's batch: 8 prompts x G=8, arithmetic
    python benchmarks/shared_prefix.py --group-size 16      # G = 16 (more completions share each prompt)
    python benchmarks/shared_prefix.py --task gsm8k         # GSM8K-length prompts (/work/shared/data/gsm8k)

SmolLM2-135M-Instruct at the recipe's defaults: the task's prompts through the chat template, G completions of at
most 64 new tokens sampled once by the embedded engine (temperature 1), micro-batches of 16 completions, GRPO's
loss, at the precision ``trainer.precision=auto`` picks here (bf16-mixed autocast where the CPU multiplies
bfloat16 natively, else float32; ``--precision`` sets it). The update = ``accumulate_gradients`` over the whole
batch (forward + backward of every micro-batch) plus the AdamW step, as ``time/train_s`` counts it; the weights and
the optimizer are restored after each update, so every repeat does the same work. The two settings alternate
``--repeats`` times after one warm-up each; medians are printed, with the speed-up ratio, the tokens each setting
runs through the backbone, and the largest gradient difference (they must agree: the result does not change).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import as_rollout_batch, ensure_quiet, grpo_module, machine  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = "/work/shared/data/gsm8k"


def task_prompts(tok, task: str, n: int) -> list[list[int]]:
    """The first RL step's ``n`` prompts of the recipe's task (``task=arithmetic``, its default, or ``gsm8k``),
    chat-templated token ids as the engine receives them."""
    from hydra import compose, initialize_config_dir

    from lit_rl.rollout.datamodule import RolloutDataModule
    from lit_rl.run.train import build_task_from_cfg

    overrides = [f"task={task}"] + ([f"task.path={os.environ.get('LIT_RL_GSM8K', GSM8K)}"] if task == "gsm8k" else [])
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    dm = RolloutDataModule(build_task_from_cfg(cfg), tok, n, 1, seed=cfg.seed, eval_examples=0)
    return [list(dm.encode(ex)) for ex in dm.prompts_for(0)]


def timed_update(module, opt, rb, shared: bool) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one update (gradients of every micro-batch, then AdamW) and the gradient it stepped with."""
    module.shared_prefix = shared
    t = time.perf_counter()
    module.accumulate_gradients(rb)
    grads = [p.grad.detach().clone() for p in module.policy.parameters() if p.grad is not None]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t, grads


def backbone_tokens(rb, micro_batches, shared: bool) -> int:
    """Token positions the backbone runs over for ``rb`` cut into ``micro_batches``."""
    from lit_rl.logprobs import response_buckets

    total = 0
    for mb in micro_batches:
        p, t = mb.prompt_ids.shape[1], mb.response_ids.shape[1]
        distinct = torch.unique(torch.cat([mb.prompt_ids, mb.prompt_mask.long()], 1), dim=0).shape[0]
        if not (shared and distinct < len(mb)):
            total += len(mb) * (p + t)
            continue
        lengths = sorted(mb.response_mask.sum(-1).tolist(), reverse=True)
        start = 0
        for end in response_buckets(lengths):  # the completions' forwards (logprobs._shared_prefix_hidden)
            total += (end - start) * max(lengths[start], 1)
            start = end
        total += distinct * p
    return total


def main():
    from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy
    from lit_rl.run.hardware import resolve_precision

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--task", default="arithmetic", choices=["arithmetic", "gsm8k"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--precision", default="auto", help="auto (as trainer.precision=auto) | bf16-mixed | 32-true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    ensure_quiet(args.force)
    precision, why = resolve_precision(args.precision)
    bf16 = precision.startswith("bf16")
    policy, tok = load_policy(ModelConfig(args.model))
    module = grpo_module(policy, tok, args.new_tokens, args.group_size)
    prompts = [p for p in task_prompts(tok, args.task, args.prompts) for _ in range(args.group_size)]
    seeds = list(range(len(prompts)))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        t = time.perf_counter()
        r = module.engine.generate(prompts, module.sampling, seeds)
        rollout_s = time.perf_counter() - t
        rb = as_rollout_batch(module, r, args.group_size)
        opt = torch.optim.AdamW(module.policy.parameters(), lr=1e-6)
        weights = copy.deepcopy(module.policy.state_dict())
        times: dict[bool, list[float]] = {False: [], True: []}
        grads: dict[bool, list[torch.Tensor]] = {}
        for i in range(args.repeats + 1):
            for shared in (False, True):
                dt, g = timed_update(module, opt, rb, shared)
                module.policy.load_state_dict(weights)
                opt = torch.optim.AdamW(module.policy.parameters(), lr=1e-6)
                if i:
                    times[shared].append(dt)
                else:
                    grads[shared] = g
    plain, shared = (statistics.median(times[s]) for s in (False, True))
    gap = max(float((a - b).abs().max()) for a, b in zip(grads[False], grads[True]))
    scale = max(float(a.abs().max()) for a in grads[False])
    module.shared_prefix = False
    tok_plain = backbone_tokens(rb, module.micro_batches(rb), False)
    module.shared_prefix = True
    tok_shared = backbone_tokens(rb, module.micro_batches(rb), True)
    prompt_len = statistics.mean(len(p) for p in r.prompt_ids)
    print(f"# {machine()}")
    print(f"# precision {precision} ({why})")
    print(
        f"\n## the update of one GRPO step: {args.model.split('/')[-1]}, task={args.task}, {args.prompts} prompts x "
        f"G={args.group_size}, prompts {prompt_len:.0f} tokens on average, completions "
        f"{float(r.response_mask.sum(-1).float().mean()):.0f} (<= {args.new_tokens}), micro-batch 16, "
        f"median of {args.repeats} (rollout once: {rollout_s:.1f} s)"
    )
    print("| update.shared_prefix | update s | backbone token positions |")
    print("|---|---|---|")
    print(f"| false | {plain:.2f} | {tok_plain} |")
    print(f"| true | {shared:.2f} | {tok_shared} |")
    print(
        f"\nspeed-up {plain / shared:.2f}x (target >= 1.6x on the default task); backbone tokens "
        f"{tok_plain / tok_shared:.2f}x fewer; largest gradient difference {gap:.2e} (max |g| {scale:.2e})"
    )


if __name__ == "__main__":
    main()
