"""The main job's step time with ``trainer.precision=auto`` against every explicit precision, side by side.

    python benchmarks/precision_auto.py                     # the main job (8 prompts x G=8 x 64 tokens), 3 steps each
    python benchmarks/precision_auto.py --emulate-no-bf16   # the same with oneDNN capped below its bf16 kernels

Each setting is ``recipes/train.py`` with the main job's defaults (what ``scripts/train.sh`` runs), its own
process and run folder, ``--steps`` RL steps, no evaluation; the mean of ``time/step_s`` over steps 2..N is
compared (step 1 warms up). ``auto`` must be within 1.15x of the fastest explicit precision (issue 16).

``--emulate-no-bf16`` sets ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` for every run: oneDNN (torch's bf16 matrix
products) then uses its AVX-512 kernels without the bf16 dot-product instructions, so bf16 is converted to
float32 and back as on an AVX-512 CPU without AVX512-BF16, and ``auto`` (which reads the cap) picks 32-true.
Only the matrix products are emulated; figures measured that way are labelled EMULATED and are not a
measurement of such a CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPLICIT = ("bf16-mixed", "32-true")


def run_recipe(precision: str, args, folder: str, env: dict) -> dict:
    """Mean step, rollout and update seconds over steps 2..N of one run, and the precision it used."""
    from lit_rl.compare import read_scalars

    out = os.path.join(folder, precision)
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "train.py"), f"trainer.precision={precision}",
           f"trainer.max_steps={args.steps}", "eval.num_examples=0", "checkpoint.every_n_steps=1000",
           "trainer.enable_progress_bar=false", f"hydra.run.dir={out}", *args.overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder)
    if res.returncode != 0:
        raise SystemExit(f"{precision}: the run failed:\n{res.stderr[-3000:]}")
    chosen = next(line for line in open(os.path.join(out, "config.yaml")) if line.startswith("# trainer.precision="))
    s = read_scalars(os.path.join(out, "tensorboard"))
    mean = lambda tag: statistics.mean(v for step, v in s[tag] if step >= 1)  # noqa: E731
    return {"used": chosen.split("=", 1)[1].split()[0], "step_s": mean("time/step_s"),
            "rollout_s": mean("time/rollout_s"), "update_s": mean("time/train_s"), "mfu": mean("perf/mfu")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="RL steps per setting (the first is not counted)")
    ap.add_argument("--emulate-no-bf16", action="store_true",
                    help="ONEDNN_MAX_CPU_ISA=AVX512_CORE for every run (bf16 matrix products emulated)")
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. rollout.prompts_per_step=4")
    args = ap.parse_args()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if args.emulate_no_bf16:
        env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE"
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE"  # so the header below names the cap
    from _common import ensure_quiet, machine

    ensure_quiet(args.force)
    folder = tempfile.mkdtemp(prefix="lit_rl_precision_auto_")
    try:
        results = {p: run_recipe(p, args, folder, env) for p in ("auto", *EXPLICIT)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    label = " — EMULATED no-bf16 CPU (ONEDNN_MAX_CPU_ISA=AVX512_CORE)" if args.emulate_no_bf16 else ""
    print(f"\n# {machine()}")
    print(f"\n## the main job ({' '.join(args.overrides) or 'defaults'}), mean of steps 2-{args.steps}{label}")
    print("| trainer.precision | runs as | step s | rollout s | update s | perf/mfu |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['used']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['update_s']:.2f} | {r['mfu']:.3f} |")
    best = min(EXPLICIT, key=lambda p: results[p]["step_s"])
    ratio = results["auto"]["step_s"] / results[best]["step_s"]
    print(f"\nauto ({results['auto']['used']}) / fastest explicit ({best}): **{ratio:.2f}x** step time "
          f"(target <= 1.15x){label}")


if __name__ == "__main__":
    main()
