"""Peak memory of one GRPO update: 64 sequences x 128 response tokens, SmolLM2-135M, float32.

    python benchmarks/train_memory.py

Each configuration runs in its own process (peak RSS is per process) and does exactly one optimizer step
of lit_rl's update path (``RLModule.update``: micro-batches, chunked log-probs, AdamW). The floor is
what any update needs: weights + gradients + Adam's two moments (4 x parameters x 4 bytes), plus the
process's own libraries. ``naive`` scores the whole batch at once with full [N, T, V] float32 logits
(what a straightforward implementation does); it is measured with 16 sequences and reported as measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

CONFIGS = {
    "lit_rl (checkpointing, micro-batch 4, logit chunks 256)": dict(gc=True, micro=4, n=64, chunk=256),
    "lit_rl (checkpointing, micro-batch 8)": dict(gc=True, micro=8, n=64),
    "lit_rl (no checkpointing, micro-batch 8)": dict(gc=False, micro=8, n=64),
    "naive full logits, 16 sequences": dict(gc=False, micro=16, n=16, naive=True),
}


def child(cfg: dict) -> None:
    import torch

    torch.set_num_threads(2)
    from lit_rl.algorithms import RLModule
    from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy
    from lit_rl.rollout.types import RolloutBatch

    policy, tok = load_policy(ModelConfig(SMOLLM2_ID, gradient_checkpointing=cfg["gc"]))
    n, p, t = cfg["n"], 32, 128
    g = torch.Generator().manual_seed(0)
    rb = RolloutBatch(
        prompt_ids=torch.randint(0, 40000, (n, p), generator=g),
        prompt_mask=torch.ones(n, p, dtype=torch.bool),
        response_ids=torch.randint(0, 40000, (n, t), generator=g),
        response_mask=torch.ones(n, t, dtype=torch.bool),
        rollout_logprobs=torch.zeros(n, t),
        rewards=torch.zeros(n),
        advantages=torch.randn(n, generator=g),
        group_ids=torch.arange(n) // 8,
        policy_version=torch.zeros(n, dtype=torch.long),
    )
    module = RLModule(
        policy,
        tok,
        sampling={"max_new_tokens": t},
        eval_sampling={},
        group_size=8,
        micro_batch_size=cfg["micro"],
        advantage={},
        loss={"reduction": "seq_mean_token_mean"},
        algo={"clip": {"eps_low": 0.2, "eps_high": 0.2}},
        kl={},
        optim={"lr": 1e-6},
        logprob_chunk_tokens=cfg.get("chunk", 1024),
    )
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    t0 = time.perf_counter()
    if cfg.get("naive"):
        ids = torch.cat([rb.prompt_ids, rb.response_ids], 1)
        logits = policy(input_ids=ids).logits[:, p - 1 : -1].float()  # [N, T, V] float32
        lp = torch.log_softmax(logits, -1).gather(-1, rb.response_ids[..., None]).squeeze(-1)
        (-(lp * rb.advantages[:, None]).mean()).backward()
    else:
        module.accumulate_gradients(rb)
    opt.step()
    dt = time.perf_counter() - t0
    n_params = sum(x.numel() for x in policy.parameters())
    with open("/proc/self/status") as f:
        rss_now = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1e6
    print(
        json.dumps(
            {
                "rss_end_gb": rss_now,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                "seconds": dt,
                "params": n_params,
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
    from _common import ensure_quiet, machine

    ensure_quiet(args.force)
    print("# one GRPO update, SmolLM2-135M float32, 32 prompt + 128 response tokens per sequence")
    print(f"# {machine()}")
    print("| configuration | sequences | peak RSS (GB) | seconds |\n|---|---|---|---|")
    floor = None
    for name, cfg in CONFIGS.items():
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"| {name} | {cfg['n']} | failed: {out.stderr.strip().splitlines()[-1][:80]} | |")
            continue
        res = json.loads(out.stdout.strip().splitlines()[-1])
        floor = 4 * res["params"] * 4 / 1e9
        print(f"| {name} | {cfg['n']} | {res['peak_rss_gb']:.2f} | {res['seconds']:.1f} |")
    if floor:
        print(f"\nweights + gradients + Adam moments alone: {floor:.2f} GB; target for lit_rl: <= 3 GB")


if __name__ == "__main__":
    main()
