"""The main job's first RL steps against a base commit's, side by side in one run: issue 34's step targets.

    python benchmarks/main_job_speed.py --base 752006f                   # 5 steps a side, default and BI kernels
    python benchmarks/main_job_speed.py --base 752006f --kernels default --steps 3

For each kernel mode (``--kernels``: ``default``, ``batch_invariant`` or both) the main job (``recipes/train.py``
with no arguments but ``trainer.max_steps``, ``eval.num_examples=0`` and a run folder of its own) runs twice, one
after the other, alone: with the base commit's code (a temporary ``git worktree``, ``bit_identity.base_checkout``,
removed at the end) and with the working tree's, each in a new process importing its own ``src``
(``bit_identity.child_env``). Both sides run what the main job resolves on this machine (``trainer.precision=auto``,
``threads=auto``, ``kernels.fp32_gemm=auto``...), at ``seed=0``. The script then reads both runs' TensorBoard
scalars and prints, per side, the median over steps 2..N (step 1 holds one-time warm-ups) of ``time/rollout_s``,
``time/train_s``, ``time/step_s`` and ``perf/mfu``, and the ratios working tree / base beside the issue's targets
(rollout <= 0.5x, step <= 0.7x, the update's MFU >= 0.7).

Exactness, read from the same runs:

- ``batch_invariant``: the sampled tokens and rewards must equal the base's. Their fingerprints, compared step by
  step bit for bit: ``rollout/reward_mean``, ``rollout/response_length_mean``, ``rollout/truncation_rate`` and
  ``perf/rollout_flops`` (a count of the generated tokens' work), where both sides log them. These runs use torch's
  deterministic mode (``bit_identity.BOOTSTRAP``: without it the base commit's shared-prefix gather adds into the same
  gradient rows from two threads in a varying order, so even two runs of one commit part after step 1; the working
  tree gathers with ``index_select`` since 2026-12-05, one order); their
  times are printed but are not the timing the targets read.
- ``default``: the engine-trainer gap ``train/logprob_abs_diff`` (mean over the steps) of each side, which must not
  grow.

Exits 1 when a batch-invariant fingerprint differs or a run fails, else 0 (the timing targets are printed, not
enforced: they are measurements). Refuses a busy machine unless ``--force`` (``_common.ensure_quiet``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import after_first, ensure_quiet  # noqa: E402
from bit_identity import (  # noqa: E402
    BOOTSTRAP,
    RunFailed,
    base_checkout,
    check_imports_own_code,
    child_env,
    git,
    read_scalars,
    run_logged,
    same_value,
    shift_steps,
    step_origin,
)

ROOT = Path(__file__).resolve().parents[1]
TIMES = ("time/rollout_s", "time/train_s", "time/step_s", "perf/mfu")
FINGERPRINT = ("rollout/reward_mean", "rollout/response_length_mean", "rollout/truncation_rate", "perf/rollout_flops")
GAP = "train/logprob_abs_diff"
TARGETS = {"time/rollout_s": ("<=", 0.5), "time/step_s": ("<=", 0.7)}


def run_main_job(checkout: Path, run: Path, steps: int, kernels: str, timeout: float, reuse: bool = False) -> dict:
    """``checkout``'s ``recipes/train.py``: the main job for ``steps`` RL steps in ``run`` (must not exist), under
    ``kernels`` (deterministic mode for batch_invariant). Returns its scalars (``read_scalars``). ``reuse``: a
    finished run already in ``run`` (``--keep`` of an earlier invocation) is read, not run again. Raises RunFailed
    with the log's tail."""
    if reuse and (run / "finished.json").is_file():
        print(f"  {run.name}: read from {run} (--reuse)", flush=True)
        return read_scalars(run)
    env = child_env(checkout, 1)
    del env["OMP_NUM_THREADS"]  # threads=auto, as the main job runs; an exported OMP_NUM_THREADS is kept
    env.update({k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ})
    check_imports_own_code(sys.executable, checkout, env)
    args = [str(checkout / "recipes" / "train.py"), f"trainer.max_steps={steps}", "eval.num_examples=0", "seed=0",
            f"hydra.run.dir={run}"]  # fmt: skip
    if kernels != "default":
        args.append(f"kernels={kernels}")
    argv = [sys.executable, "-c", BOOTSTRAP, *args] if kernels == "batch_invariant" else [sys.executable, *args]
    run.parent.mkdir(parents=True, exist_ok=True)
    run_logged(argv, checkout, env, run.parent / f"{run.name}.log", timeout, run.name)
    return read_scalars(run)


def median_after_first(series: list[tuple[int, float]]) -> float:
    """The median of a tag's values over its steps after the first (all of them when it has one step)."""
    values = after_first(series)
    return statistics.median(values) if values else float("nan")


def timing_table(sides: dict[str, dict]) -> list[str]:
    base, head = sides["base"], sides["head"]
    lines = ["| tag | base | working tree | tree / base | target |", "|---|---|---|---|---|"]
    for tag in TIMES:
        a, b = median_after_first(base.get(tag, [])), median_after_first(head.get(tag, []))
        op, target = TARGETS.get(tag, ("", None))
        verdict = "" if target is None else f"{op} {target}x: {'met' if b / a <= target else 'not met'}"
        if tag == "perf/mfu":
            verdict = f">= 0.7: {'met' if b >= 0.7 else 'not met'}"
        lines.append(f"| {tag} | {a:.3f} | {b:.3f} | {b / a:.3f}x | {verdict} |")
    return lines


def fingerprint_differences(base: dict, head: dict) -> list[str]:
    """The fingerprint tags (both sides log) whose per-step values differ, with the first differing step."""
    out = []
    for tag in FINGERPRINT:
        if tag not in base or tag not in head:
            continue
        a, b = dict(base[tag]), dict(head[tag])
        if a.keys() != b.keys():
            out.append(f"{tag}: steps {sorted(a)} against {sorted(b)}")
            continue
        odd = [s for s in sorted(a) if not same_value(a[s], b[s])]
        if odd:
            out.append(f"{tag}: step {odd[0]}: base {a[odd[0]]!r}, working tree {b[odd[0]]!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare against (e.g. 752006f)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--kernels", default="default,batch_invariant", help="comma-separated: default, batch_invariant")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    ap.add_argument("--keep", default=None, help="keep the run folders and logs here")
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    ap.add_argument("--reuse", action="store_true", help="read finished runs already under --keep instead of rerunning")
    args = ap.parse_args(argv)
    modes = [m for m in args.kernels.split(",") if m]
    bad = [m for m in modes if m not in ("default", "batch_invariant")]
    if bad or args.steps < 2:
        raise SystemExit(f"main_job_speed: --kernels {bad} not in default, batch_invariant, or --steps < 2")
    sha = git("rev-parse", "--verify", f"{args.base}^{{commit}}")
    ensure_quiet(args.force)
    work = Path(args.keep or tempfile.mkdtemp(prefix="lit_rl_main_job_speed_"))
    print(f"# base {args.base} ({sha[:12]}) against the working tree, {args.steps} steps a run, runs under {work}")
    failed = False
    with base_checkout(sha) as base_src:
        for mode in modes:
            print(f"\n## kernels={mode}", flush=True)
            sides = {}
            try:
                for side, checkout in (("base", base_src()), ("head", ROOT)):
                    run = work / f"{mode}_{side}"
                    sides[side] = run_main_job(checkout, run, args.steps, mode, args.timeout, args.reuse)
            except RunFailed as e:
                print(f"run failed: {e}")
                failed = True
                continue
            # a base that numbers its first RL step 0 is compared step for step with a tree that numbers it 1
            sides["base"] = shift_steps(sides["base"], step_origin(None) - step_origin(sha))
            note = " (deterministic mode: not the targets' timing)" if mode == "batch_invariant" else ""
            print(f"\nmedian of steps 2-{args.steps}{note}:")
            print("\n".join(timing_table(sides)))
            if mode == "batch_invariant":
                diffs = fingerprint_differences(sides["base"], sides["head"])
                shared = [t for t in FINGERPRINT if t in sides["base"] and t in sides["head"]]
                print(f"\nsampled tokens' fingerprint ({', '.join(shared)}), step by step: "
                      + ("identical" if not diffs else "DIFFERENT: " + "; ".join(diffs)))  # fmt: skip
                failed |= bool(diffs) or not shared
            else:
                gaps = {s: statistics.fmean(v for _, v in sides[s].get(GAP, [(0, float("nan"))])) for s in sides}
                print(f"\n{GAP}, mean over the steps: base {gaps['base']:.3e}, working tree {gaps['head']:.3e} "
                      f"({gaps['head'] / gaps['base']:.2f}x)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
