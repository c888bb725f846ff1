"""The main job's step time with ``trainer.precision=auto`` against every explicit precision, side by side.

    python benchmarks/precision_auto.py                     # the main job, 2 rounds x (auto, bf16-mixed, 32-true)
    python benchmarks/precision_auto.py --emulate-no-bf16   # the same with oneDNN capped below its bf16 kernels

Each setting runs the recipe (``lit_rl.run.train.run``) with the main job's defaults (what ``scripts/train.sh``
runs), ``--steps`` RL steps and no evaluation, in this process, under the OpenMP defaults
``recipes/train.py`` sets. All settings do the same work (same seed, same prompts; the sampled tokens differ
only by precision), and step 1 (kernel warm-up) is not counted: a setting's time is the mean of
``time/step_s`` over steps 2..N, its best over ``--rounds`` rounds, which run the settings in turn (round r
starts at the r-th setting: later runs in one process were seen slower, so no setting is always last). Beside
each round the table shows the CPU other processes used meanwhile (cores; should be ~0). ``auto`` must be
within 1.15x of the fastest explicit precision (issue 16).

``--emulate-no-bf16`` sets ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` before torch loads: oneDNN (torch's bf16
matrix products on the CPU) then uses its AVX-512 kernels without the bf16 dot-product instructions, so bf16
is converted to float32 and back as on an AVX-512 CPU without AVX512-BF16, and ``auto`` (which reads the
cap) picks 32-true. Only oneDNN's kernels are emulated; figures measured that way are labelled EMULATED and
are not a measurement of such a CPU.

Before any run, the matrix-product probe (``hardware.probe_flops``) times each explicit precision; one whose
probe rate is more than ``--max-probe-gap`` (10) times below the fastest's is not run (its step would take
far longer and the verdict is already clear: on an AVX2-only CPU bf16 products are ~100x slower than float32,
a main-job step about an hour), and the table says so with both rates.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

CONF = str(Path(__file__).resolve().parents[1] / "conf")
EXPLICIT = ("bf16-mixed", "32-true")


def measure(precision: str, args, out: Path) -> dict:
    """Mean step, rollout and update seconds over steps 2..N of one run, the precision it used and the cores
    other processes used meanwhile."""
    from _common import after_first
    from hydra import compose, initialize_config_dir

    from lit_rl.run.hardware import cpu_busy_seconds
    from lit_rl.run.train import run
    from lit_rl.tools.compare import read_scalars

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                f"trainer.precision={precision}",
                f"trainer.max_steps={args.steps}",
                "eval.num_examples=0",
                "checkpoint.every_n_steps=1000",
                "trainer.enable_progress_bar=false",
                *args.overrides,
            ],
        )
    start = cpu_busy_seconds()
    run(cfg, out)
    end = cpu_busy_seconds()
    others = ((end[0] - start[0]) - (end[1] - start[1])) / (end[2] - start[2])
    s = read_scalars(out)
    mean = lambda tag: statistics.mean(after_first(s[tag]))  # noqa: E731
    return {
        "used": cfg.trainer.precision,
        "step_s": mean("time/step_s"),
        "rollout_s": mean("time/rollout_s"),
        "update_s": mean("time/train_s"),
        "mfu": mean("perf/mfu"),
        "others": others,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="RL steps per run (the first is not counted)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (auto, bf16-mixed, 32-true); best kept")
    ap.add_argument(
        "--emulate-no-bf16",
        action="store_true",
        help="ONEDNN_MAX_CPU_ISA=AVX512_CORE (bf16 matrix products emulated), before torch loads",
    )
    ap.add_argument(
        "--max-probe-gap",
        type=float,
        default=10.0,
        help="skip an explicit precision whose matmul probe is this many times slower than the fastest's",
    )
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. rollout.prompts_per_step=4")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.emulate_no_bf16:
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE"
    from lit_rl.run.hardware import set_omp_defaults

    set_omp_defaults()  # as recipes/train.py does, before torch loads OpenMP
    from _common import ensure_quiet, machine

    ensure_quiet(args.force)
    import torch

    from lit_rl.run.hardware import probe_flops, resolve_precision

    probe = {p: probe_flops(p, torch.get_num_threads()) for p in EXPLICIT}
    skipped = {p: r for p, r in probe.items() if r * args.max_probe_gap < max(probe.values())}
    auto_as = resolve_precision("auto", "cpu")[0]
    if auto_as in skipped:
        raise SystemExit(f"auto picks {auto_as}, whose matmul probe is {args.max_probe_gap}x below the fastest's")
    tmp = Path(tempfile.mkdtemp(prefix="lit_rl_precision_auto_"))
    rounds: dict[str, list[dict]] = {p: [] for p in ("auto", *EXPLICIT) if p not in skipped}
    try:
        order = list(rounds)
        for r in range(args.rounds):
            for precision in order[r % len(order) :] + order[: r % len(order)]:
                out = tmp / f"{precision}-{r}"
                rounds[precision].append(measure(precision, args, out))
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    label = " — EMULATED no-bf16 CPU (ONEDNN_MAX_CPU_ISA=AVX512_CORE)" if args.emulate_no_bf16 else ""
    print(f"\n# {machine()}")
    print(
        f"\n## the main job ({' '.join(args.overrides) or 'defaults'}), mean of steps 2-{args.steps}, best of "
        f"{args.rounds} rounds{label}"
    )
    print(
        "| trainer.precision | runs as | step s (each round) | best step s | rollout s | update s | perf/mfu "
        "| other processes, cores |\n|---|---|---|---|---|---|---|---|"
    )
    best = {}
    fastest_rate = max(probe.values())
    for name, rate in skipped.items():
        print(
            f"| {name} | not run: matmul probe {rate / 1e9:.2f} GFLOP/s against {fastest_rate / 1e9:.1f}, "
            f"{fastest_rate / rate:.0f}x slower (--max-probe-gap {args.max_probe_gap:g}) | | | | | | |"
        )
    for name, runs in rounds.items():
        b = best[name] = min(runs, key=lambda x: x["step_s"])
        steps = " / ".join(f"{x['step_s']:.2f}" for x in runs)
        others = " / ".join(f"{x['others']:.2f}" for x in runs)
        print(
            f"| {name} | {b['used']} | {steps} | {b['step_s']:.2f} | {b['rollout_s']:.2f} | {b['update_s']:.2f} "
            f"| {b['mfu']:.3f} | {others} |"
        )
    fastest = min((p for p in EXPLICIT if p in best), key=lambda p: best[p]["step_s"])
    ratio = best["auto"]["step_s"] / best[fastest]["step_s"]
    print(
        f"\nauto ({best['auto']['used']}) / fastest explicit ({fastest}): **{ratio:.2f}x** step time "
        f"(target <= 1.15x){label}"
    )


if __name__ == "__main__":
    main()
