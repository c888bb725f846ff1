"""A fixed RL step alone and beside a competing CPU-bound process, for several threading settings.

    python benchmarks/contention.py                         # SmolLM2-135M, 2 prompts x G=4 x 16 new tokens
    python benchmarks/contention.py --competitor torch      # the competitor: a 2-thread torch matmul loop

What a run loses when something else (a test suite, an editor's indexer, a second run) takes CPU time on the
same cores. Each setting runs in its own process, because OpenMP reads its settings once, when torch loads:

* ``old default``: lit_rl before issue 16: ``OMP_WAIT_POLICY`` unset (libgomp spins at barriers before it
  sleeps), torch's default thread count (one per core);
* ``PASSIVE`` (the default from issue 16 to 2026-12-01): ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps
  at once), ``threads: auto`` (``hardware.auto_threads``);
* ``GOMP_SPINCOUNT=1000`` (the adopted default since 2026-12-01): libgomp spins 1000 rounds at a barrier, then
  sleeps (a middle way); ``GOMP_SPINCOUNT=10000`` and ``=100000`` spin longer;
* ``adaptive threads``, ``PASSIVE + adaptive threads``: ``hardware.ThreadGovernor`` before each step sets as
  many threads as the cores other processes left free during the previous step (the first contended step
  still runs with the threads chosen alone);
* ``1 thread``: one intra-op thread (no barrier to wait at, half the cores when alone).

The step: the embedded engine samples the prompts (fixed seeds, so every step generates the same tokens),
then one GRPO update on them (micro-batches of 16, AdamW), in the precision ``auto`` picks here; the weights
are restored after each step. Per setting: a warm-up step, ``--steps`` steps alone, then the competitor is
started (by this script) and ``--steps`` more steps run beside it, then it is stopped. Medians are reported,
with each setting's contended / alone ratio.

The competitor (``--competitor``): ``busy`` is one Python process spinning on one core (any single-threaded
CPU-bound job); ``torch`` is a process multiplying [256, 576] x [576, 1536] float32 matrices in a loop with
torch's default two threads and no OMP settings (another training run or a test suite).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

HERE = os.path.abspath(__file__)

UNSET = {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, "OMP_NUM_THREADS": None}
SETTINGS = {  # name: (environment changes (None = remove), threads argument)
    "old default": (UNSET, "default"),
    "PASSIVE": ({**UNSET, "OMP_WAIT_POLICY": "PASSIVE"}, "auto"),
    "GOMP_SPINCOUNT=1000": ({**UNSET, "GOMP_SPINCOUNT": "1000"}, "auto"),
    "GOMP_SPINCOUNT=10000": ({**UNSET, "GOMP_SPINCOUNT": "10000"}, "auto"),
    "GOMP_SPINCOUNT=100000": ({**UNSET, "GOMP_SPINCOUNT": "100000"}, "auto"),
    "PASSIVE + adaptive threads": ({**UNSET, "OMP_WAIT_POLICY": "PASSIVE"}, "adaptive"),
    "adaptive threads": (UNSET, "adaptive"),
    "1 thread": (UNSET, "1"),
}

COMPETITORS = {
    "busy": "while True: pass",
    "torch": (
        "import torch\na = torch.randn(256, 576); b = torch.randn(1536, 576)\n"
        "while True: torch.nn.functional.linear(a, b)"
    ),
}


def child(args) -> None:
    """One setting: load the model, then run one step per line read from stdin, printing its times as JSON."""
    import copy

    import torch
    from _common import as_rollout_batch, grpo_module, update
    from rollout_throughput import prompts_for

    from lit_rl.models import ModelConfig, load_policy
    from lit_rl.rollout.torch_engine import TorchEngine
    from lit_rl.run.hardware import ThreadGovernor, configure_threads, resolve_precision

    governor = None
    if args.threads == "adaptive":
        governor = ThreadGovernor(configure_threads("auto"))
    elif args.threads != "default":
        configure_threads("auto" if args.threads == "auto" else int(args.threads))
    precision, _ = resolve_precision("auto", "cpu")
    policy, tok = load_policy(ModelConfig(args.model))
    initial = copy.deepcopy(policy.state_dict())
    module = grpo_module(policy, tok, args.new_tokens, args.group_size)
    module.engine = TorchEngine(policy, tok.pad_token_id, stop_token_ids=[])  # fixed-length completions
    prompts = [p for p in prompts_for(tok, args.prompts) for _ in range(args.group_size)]
    seeds = list(range(len(prompts)))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads(), "precision": precision}), flush=True)
    for _ in sys.stdin:
        if governor is not None:
            governor.update()  # as lit_rl.run.callbacks' AdaptiveThreads callback does before every RL step
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            t0 = time.perf_counter()
            r = module.engine.generate(prompts, module.sampling, seeds)
            t1 = time.perf_counter()
            update(module, opt, as_rollout_batch(module, r, args.group_size))
            t2 = time.perf_counter()
        policy.load_state_dict(initial)
        opt.state.clear()
        print(
            json.dumps(
                {
                    "rollout_s": t1 - t0,
                    "update_s": t2 - t1,
                    "tokens": int(r.response_mask.sum()),
                    "threads": torch.get_num_threads(),
                }
            ),
            flush=True,
        )


def run_setting(name: str, args, competitor: str) -> dict:
    changes, threads = SETTINGS[name]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for key, value in changes.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    cmd = [
        sys.executable,
        HERE,
        "--child",
        "--threads",
        threads,
        "--model",
        args.model,
        "--prompts",
        str(args.prompts),
        "--group-size",
        str(args.group_size),
        "--new-tokens",
        str(args.new_tokens),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def step() -> dict:
        proc.stdin.write("step\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    try:
        info = json.loads(proc.stdout.readline())
        step()  # warm-up
        alone = [step() for _ in range(args.steps)]
        if args.alone_only:
            return summarize(info, alone, None)
        rival = subprocess.Popen(
            [sys.executable, "-c", COMPETITORS[competitor]],
            env={k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))},
        )
        try:
            time.sleep(1.0)  # let it get going (torch: import and first products)
            contended = [step() for _ in range(args.steps)]
        finally:
            rival.kill()
            rival.wait()
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return summarize(info, alone, contended)


def summarize(info: dict, alone: list[dict], contended: list[dict] | None) -> dict:
    """Medians of each phase's step times and the thread counts used."""
    median = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    threads = lambda rows: "/".join(sorted({str(r["threads"]) for r in rows}))  # noqa: E731
    out = {
        "threads": threads(alone) + (f" → {threads(contended)}" if contended else ""),
        "precision": info["precision"],
        "tokens": alone[0]["tokens"],
    }
    for label, rows in (("alone", alone), ("contended", contended or alone)):
        out[label] = {k: median(rows, k) for k in ("rollout_s", "update_s")}
        out[label]["step_s"] = statistics.median(r["rollout_s"] + r["update_s"] for r in rows)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="timed steps alone and beside the competitor, per setting")
    ap.add_argument("--competitor", choices=list(COMPETITORS), default="busy")
    ap.add_argument(
        "--settings",
        default="old default,PASSIVE,PASSIVE + adaptive threads,1 thread",
        help=f"comma-separated names of {list(SETTINGS)}",
    )
    ap.add_argument("--alone-only", action="store_true", help="no competitor: what each setting costs alone")
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from _common import ensure_quiet, machine

    ensure_quiet(args.force)
    results = {name: run_setting(name, args, args.competitor) for name in args.settings.split(",")}
    first = next(iter(results.values()))
    if args.alone_only:
        print(f"\n# {machine()}")
        print(
            f"\n## {args.model}: {args.prompts} prompts x G={args.group_size} x {args.new_tokens} new tokens "
            f"({first['tokens']} generated), one GRPO update, {first['precision']} (auto); median of {args.steps} "
            f"steps, nothing else running\n| setting | threads | step s | rollout s | update s | step / "
            f"old default |\n|---|---|---|---|---|---|"
        )
        base = next(iter(results.values()))["alone"]["step_s"]
        for name, r in results.items():
            a = r["alone"]
            print(
                f"| {name} | {r['threads']} | {a['step_s']:.2f} | {a['rollout_s']:.2f} | {a['update_s']:.2f} "
                f"| {a['step_s'] / base:.2f}x |"
            )
        return
    print(f"\n# {machine()}")
    print(
        f"\n## {args.model}: {args.prompts} prompts x G={args.group_size} x {args.new_tokens} new tokens "
        f"({first['tokens']} generated), one GRPO update, {first['precision']} (auto); median of {args.steps} "
        f"steps alone, then {args.steps} beside the '{args.competitor}' competitor"
    )
    print(
        "| setting | threads alone → contended | step alone s | step contended s | contended / alone "
        "| rollout contended / alone | update contended / alone |\n|---|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        a, c = r["alone"], r["contended"]
        print(
            f"| {name} | {r['threads']} | {a['step_s']:.2f} | {c['step_s']:.2f} "
            f"| **{c['step_s'] / a['step_s']:.2f}x** "
            f"| {c['rollout_s'] / a['rollout_s']:.2f}x | {c['update_s'] / a['update_s']:.2f}x |"
        )
    best_alone = min(r["alone"]["step_s"] for r in results.values())
    print(
        f"\ncontended step / the fastest step alone ({best_alone:.2f} s): "
        + ", ".join(f"{name} {r['contended']['step_s'] / best_alone:.2f}x" for name, r in results.items())
    )


if __name__ == "__main__":
    main()
