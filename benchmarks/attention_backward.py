"""The trainer's attention backward: torch's CPU flash backward against the explicit-softmax float32 one
(``kernels.attention_backward``; lit_rl's compiled kernel where built, else torch's products: the first line says
which), per shape and on the main job's update, side by side in one process.

    python benchmarks/attention_backward.py                       # SmolLM2-135M, bf16 autocast, the run's threads
    python benchmarks/attention_backward.py --lengths 32,64,128,256 --repeats 5

1. Per shape: ``kernels.attention_backward.measure`` on the model's head shape (16 rows of L positions, causal and
   left-padded, bf16 inputs as autocast gives them), and each backward's relative error against float64 autograd
   at the same bf16 values, and the threshold ``auto`` would take from these ratios.
2. The update: the main job's rollout (``task=arithmetic``, 8 prompts x G = 8, up to 64 new tokens, the embedded
   engine under bf16 autocast), then one GRPO update (``accumulate_gradients`` over micro-batches of 16 with the
   shared prompt forward, and AdamW) with the flash backward and with the explicit one up to the measured
   threshold (``auto``) and with it everywhere (``explicit``), alternately ``--repeats`` times after a warm-up each,
   the weights restored after every update;
   medians, their ratio, and that the loss is the same bits both ways (the forward is unchanged).
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
from _common import as_rollout_batch, ensure_quiet, grpo_module  # noqa: E402
from rollout_throughput import prompts_for  # noqa: E402

from lit_rl.kernels import attention_backward as ab  # noqa: E402
from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy  # noqa: E402
from lit_rl.run.hardware import keep_freed_memory  # noqa: E402


def errors(heads: int, kv_heads: int, head_dim: int, length: int) -> tuple[float, float]:
    """(flash, explicit) relative error of dQ, dK, dV together against float64 autograd at bf16 operands."""
    q, k, v, go, mask = ab._operands(length, heads, kv_heads, head_dim, torch.bfloat16)
    reps = heads // kv_heads
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    s = exact[0] @ exact[1].repeat_interleave(reps, 1).transpose(-1, -2) * head_dim**-0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    (p @ exact[2].repeat_interleave(reps, 1)).backward(go.double())
    ref = torch.cat([t.grad.flatten() for t in exact])
    leaves = [t.requires_grad_() for t in (q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1))]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask)
    dq, dkr, dvr = torch.autograd.grad(out, leaves, go)
    dk, dv = (g.double().view(g.shape[0], kv_heads, reps, *g.shape[2:]).sum(2) for g in (dkr, dvr))
    flash = torch.cat([dq.double().flatten(), dk.flatten(), dv.flatten()])
    explicit = torch.cat([g.double().flatten() for g in ab.explicit_grads(q, k, v, go, mask, False, head_dim**-0.5)])
    return (((flash - ref).norm() / ref.norm()).item(), ((explicit - ref).norm() / ref.norm()).item())


def timed_update(module, opt, rb, state, threshold) -> tuple[float, float]:
    """(seconds, loss) of one update with the explicit backward up to ``threshold`` (0: flash), then the
    weights and the optimizer restored."""
    with ab.active(threshold), torch.autocast("cpu", dtype=torch.bfloat16):
        t0 = time.perf_counter()
        _, loss = module.accumulate_gradients(rb)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
    module.policy.load_state_dict(state[0])
    opt.load_state_dict(state[1])
    return seconds, float(loss)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--lengths", default=",".join(map(str, ab.MEASURE_LENGTHS)))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    ensure_quiet(args.force)
    print(f"# {keep_freed_memory()}")  # as a run's process does (``lit_rl.run.resolve``)
    policy, tok = load_policy(ModelConfig(args.model))
    shape = ab.head_shape(policy)
    print(f"# heads {shape[0]} on {shape[1]} key/value heads of {shape[2]}; {torch.get_num_threads()} threads; "
          f"explicit backward: {ab.implementation(policy, torch.bfloat16)}")  # fmt: skip
    print("\n| L | flash backward / explicit (speed-up) | flash rel. error | explicit rel. error |\n|---|---|---|---|")
    lengths = tuple(int(x) for x in args.lengths.split(","))
    ratios = ab.measure(*shape, torch.bfloat16, lengths=lengths)
    for length, ratio in ratios.items():
        e_flash, e_explicit = errors(*shape, min(length, 256))
        at = "" if length <= 256 else " (errors at L = 256)"
        print(f"| {length}{at} | {ratio:.2f}x | {e_flash:.1e} | {e_explicit:.1e} |", flush=True)
    threshold = ab.threshold_from(ratios)
    print(f"\nauto's threshold from these: Lq x Lk <= {threshold}\n")

    module = grpo_module(policy, tok, args.new_tokens, args.group_size)
    opt = torch.optim.AdamW(module.policy.parameters(), lr=1e-6)
    prompts = [p for p in prompts_for(tok, args.prompts) for _ in range(args.group_size)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = module.engine.generate(prompts, module.sampling, list(range(len(prompts))))
    rb = as_rollout_batch(module, r, args.group_size)
    print(f"# rollout: {len(prompts)} rows, {int(r.response_mask.sum())} response tokens, prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens")  # fmt: skip
    state = (copy.deepcopy(module.policy.state_dict()), copy.deepcopy(opt.state_dict()))
    settings = {"flash": 0, "auto": threshold, "explicit": 1 << 62}
    times, losses = {name: [] for name in settings}, {name: set() for name in settings}
    for name, limit in settings.items():
        timed_update(module, opt, rb, state, limit)  # warm-up
    for i in range(args.repeats):
        for name, limit in settings.items():
            seconds, loss = timed_update(module, opt, rb, state, limit)
            times[name].append(seconds)
            losses[name].add(loss)
            print(f"# repeat {i + 1}: {name} {seconds:.2f} s", flush=True)
    flash, auto, explicit = (statistics.median(times[n]) for n in settings)
    print(f"\n| update, median of {args.repeats} | flash backward | auto (explicit up to {threshold}) | explicit "
          f"everywhere |\n|---|---|---|---|\n| seconds | {flash:.2f} | {auto:.2f} | {explicit:.2f} |\n"
          f"| / flash | 1 | {auto / flash:.3f}x | {explicit / flash:.3f}x |")  # fmt: skip
    same = len(set().union(*losses.values())) == 1
    print(f"loss: {'the same bits in every update' if same else f'DIFFERENT: {losses}'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
