"""LoRA vs full fine-tuning: peak RSS and RL step time, SmolLM2-135M float32, the same work side by side.

    cpulock exclusive python benchmarks/lora.py

Each configuration runs in its own process (peak RSS is per process) and does the same 3 GRPO steps with a KL
penalty to the reference (kl.beta=0.04): the embedded engine samples 16 completions (4 prompts x 4, 64 new
tokens, seeded), then one update over them (micro-batches of 8, AdamW). Full fine-tuning keeps a deep copy of
the policy as the reference and Adam moments for every weight; LoRA (rank 16, alpha 32, the attention and MLP
projections) trains the adapter only and scores the reference on the shared base with the adapter disabled.
The learning rate is 0 in both, so both sample exactly the same tokens at every step (LoRA's B starts at 0: the
adapted model is the base model) and do the same work; the backward pass and AdamW still run in full.
Step time: the median of steps 2 and 3 (step 1 warms up). Ratios LoRA / full are printed below the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

CONFIGS = {
    "full fine-tuning": dict(r=0),
    "LoRA r=16, alpha 32 (attention + MLP projections)": dict(r=16, alpha=32),
}
QUESTIONS = ["What is 12 + 7?", "Name three colours.", "What is 9 x 8? Explain.", "Say hello in French."]
STEPS, NEW_TOKENS, GROUP = 3, 64, 4


def child(cfg: dict) -> None:
    import torch

    torch.set_num_threads(2)
    from _common import as_rollout_batch

    from lit_rl.algorithms import RLModule
    from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy

    lora = {"r": cfg["r"], "alpha": cfg.get("alpha", 16)}
    policy, tok = load_policy(ModelConfig(SMOLLM2_ID, lora=lora))
    module = RLModule(
        policy,
        tok,
        sampling={"max_new_tokens": NEW_TOKENS},
        eval_sampling={},
        group_size=GROUP,
        micro_batch_size=8,
        advantage={},
        loss={"reduction": "seq_mean_token_mean"},
        algo={"clip": {"eps_low": 0.2, "eps_high": 0.2}},
        kl={"beta": 0.04},
        optim={"lr": 0.0},
        logprob_chunk_tokens=256,
    )
    opt = torch.optim.AdamW(module.trainable_parameters(), lr=0.0)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
        for _ in range(GROUP)
    ]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    times, tokens = [], []
    for step in range(STEPS):
        t0 = time.perf_counter()
        r = module.engine.generate(prompts, module.sampling, seeds=[1000 * step + i for i in range(len(prompts))])
        rb = as_rollout_batch(module, r, GROUP)
        module.accumulate_gradients(rb)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        tokens.append(int(r.response_mask.sum()))
    trainable = sum(p.numel() for p in module.trainable_parameters())
    print(
        json.dumps(
            {
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                "step_s": statistics.median(times[1:]),
                "trainable": trainable,
                "params": sum(p.numel() for p in module.parameters()),
                "tokens": tokens,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    from _common import ensure_quiet

    ensure_quiet(args.force)
    print(
        f"# {STEPS} GRPO steps (kl.beta=0.04), SmolLM2-135M float32, {len(QUESTIONS) * GROUP} completions of "
        f"{NEW_TOKENS} new tokens per step, embedded engine, 2 threads"
    )
    print("| configuration | trainable params | params in the module | peak RSS (GB) | step (s) |")
    print("|---|---|---|---|---|")
    results = {}
    for name, cfg in CONFIGS.items():
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"| {name} | failed: {out.stderr.strip().splitlines()[-1][:100]} | | | |")
            continue
        res = results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {name} | {res['trainable'] / 1e6:.2f} M | {res['params'] / 1e6:.1f} M | {res['peak_rss_gb']:.2f} | "
            f"{res['step_s']:.1f} |"
        )
    full, lora = (results.get(n) for n in CONFIGS)
    if full and lora:
        print(
            f"\nLoRA / full: peak RSS {lora['peak_rss_gb'] / full['peak_rss_gb']:.2f}x, "
            f"step time {lora['step_s'] / full['step_s']:.2f}x, "
            f"trainable parameters {lora['trainable'] / full['trainable']:.4f}x "
            f"(generated tokens per step: full {full['tokens']}, LoRA {lora['tokens']})"
        )


if __name__ == "__main__":
    main()
