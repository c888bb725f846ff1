"""Step time of sync versus async rollouts on the same work, measured side by side in one run.

    python benchmarks/async_speedup.py              # SmolLM2-135M, 2 prompts x G=8 x 64 new tokens, 6 steps
    python benchmarks/async_speedup.py --model tiny --steps 2 --force   # a quick check that every setting runs
    python benchmarks/async_speedup.py --keep runs/async   # each setting's run folder kept: its per-step tags

The recipe itself (``lit_rl.run.train.run``, GRPO on the default task, bf16-mixed, no eval) runs the same steps
(same prompts, same seeds) in each setting, one after the other in this process:

* ``sync, 1 thread``: generate, then train (``rollout.mode=sync``, ``threads=1``): one core works at a time;
* ``async, thread producer, 1+1``: a producer thread generates step s+1 while the trainer trains step s
  (``rollout.mode=async rollout.max_staleness=1 rollout.producer=thread``), each with one torch thread: rollout
  and training on separate cores, as the documents' 1.84x had them on separate GPUs;
  ``rollout.behaviour_logprobs=false`` so the update does the same work as sync;
* ``async, process producer, 1+1``: the same with the engine in a process of its own
  (``rollout.producer=process``: one thread there, one in the trainer), weights through the shared-memory store;
* ``async, process, in flight``: the process producer taking newer weights between decode steps
  (``rollout.weight_update=in_flight rollout.kv_on_update=recompute``);
* ``async, process, scoring stale rows``: the default ``behaviour_logprobs=true`` (stale tokens also scored with
  their own weights for the r_num / r_stale split: one more forward pass);
* ``sync, 2 threads``: the sync step with both cores inside each matmul, the other way to use them.

Step time = ``time/step_s`` (for async: waiting for the buffer + the update), the mean over the steps
after the first (the first has nothing to overlap with; with the process producer it also holds the process's
start). The sampled completions differ between sync and async after step 0 (async samples with one-step-old
weights), so generated token counts are printed too, with RL steps per minute, trained tokens per second, the
mean and max staleness and, for async, the trainer's and the producer's idle fractions
(``time/trainer_wait_frac``, ``time/producer_idle_frac``).

``--layout skewed``: the long tail. Every step's batch holds one prompt asking for a long answer (counting to 300)
and ``--prompts`` - 1 asking for one number (``task=dataset`` over a file of exactly ``--prompts`` rows written here,
so each step sees each prompt once, in a seeded order): with a model that stops on its own the short groups finish
in a few tokens and the decode batch runs on with the long group's G rows only, the time partial rollouts (refilling
the batch with the next step's prompts) exist to use. This layout adds one setting:

* ``async, process, in flight + partial``: the in-flight setting with ``rollout.partial=true``: a step's batch is
  due once P groups are complete, the long group's rows carry over into the next batch (their tokens keep their
  versions) and the freed decode slots take the next prompts' groups, so the decode batch stays at P x G rows.
  Its ``rollout/partial_fraction`` (the share of trained rows started by an earlier batch) is printed, and its
  RL steps per minute against the between-batches async (``async, process producer, 1+1``) and against
  ``sync, 2 threads``, the two ratios the long tail is judged by, each beside the ratio of trained tokens per
  second. Over a window of a few steps the two differ: partial batches are due with whichever groups finish first,
  so while long groups are still in flight at the window's end the window trained more short groups than the
  prompts drawn, and fewer tokens per step; in a long run every drawn group is trained once, so the steps' mix is
  the prompts' and the two ratios meet. Both are biased over a short window (work carried in from the first,
  excluded step, or still in flight at the end), so read them with the tokens per step beside them.
  ``--max-staleness`` (every async setting's bound) sets how many batches a long answer may span: with 1, a group
  started with the previous step's weights is due in its own batch, which waits for it.

The tiny model never stops early (random weights), so with ``--model tiny`` the layout only checks that it runs.

    python benchmarks/async_speedup.py --layout skewed --prompts 8 --new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import after_first, ensure_quiet, machine  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from lit_rl.run.train import run  # noqa: E402
from lit_rl.tools.compare import read_scalars  # noqa: E402

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def measure(overrides: list[str], out: Path) -> dict[str, float]:
    """Run the recipe with ``overrides`` into ``out``; its ``summary``."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    run(cfg, out)
    return summary(read_scalars(out))


def summary(s: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """One setting's means over its steps after the first (``_common.after_first``) from its scalars (``read_scalars``);
    0 for a tag the setting does not log."""
    after = lambda tag: after_first(s.get(tag, [])) or [0.0]  # noqa: E731
    return {
        "step": statistics.mean(after("time/step_s")),
        "rollout": statistics.mean(after("time/rollout_s")),
        "train": statistics.mean(after("time/train_s")),
        "tokens": statistics.mean(v * t for v, t in zip(after("perf/rollout_tokens_per_s"), after("time/generate_s"))),
        "staleness": statistics.mean(after("rollout/staleness_mean")),
        "staleness_max": max(after("rollout/staleness_max")),
        "trainer_wait": statistics.mean(after("time/trainer_wait_frac")),  # 0: sync
        "producer_idle": statistics.mean(after("time/producer_idle_frac")),
        "partial": statistics.mean(after("rollout/partial_fraction")),  # 0: partial rollouts off
        "generate": statistics.mean(after("time/generate_s")),
        "step_series": after("time/step_s"),  # per step, for ``ratio_interval``
        "token_series": [
            v * t
            for v, t in zip(
                after_first(s.get("perf/rollout_tokens_per_s", [])), after_first(s.get("time/generate_s", []))
            )
        ],
        **{  # partial rollouts: what each batch prefilled, decoded and threw away (0: off)
            name: statistics.mean(after(tag)) for name, tag in PARTIAL_TAGS.items()
        },
    }


def ratio_interval(a: dict, b: dict, measure: str, confidence: float = 0.95) -> tuple[float, float, float]:
    """``a``'s rate over ``b``'s (two ``summary`` results) and a percentile bootstrap interval over their steps
    (``scipy.stats.bootstrap``, each setting's steps resampled apart, seeded). ``measure``: ``steps`` (RL steps per
    minute: b's mean step over a's) or ``tokens`` (trained tokens per second: each side's tokens over its seconds,
    summed over the steps); the interval is NaN with fewer than two steps a side. Raises ValueError when a
    setting's token counts do not match its steps. The steps are resampled as if independent, which a partial
    run's are not (a carried group ties neighbouring steps): a rough guide to the spread, not an exact interval."""
    from scipy.stats import bootstrap

    for r in (a, b):
        if len(r["token_series"]) != len(r["step_series"]):
            raise ValueError(f"{len(r['token_series'])} token counts for {len(r['step_series'])} steps")

    def rate(r, idx):
        t = [r["step_series"][i] for i in idx]
        return len(t) / sum(t) if measure == "steps" else sum(r["token_series"][i] for i in idx) / sum(t)

    def stat(ia, ib):
        return rate(a, ia.astype(int)) / rate(b, ib.astype(int))

    ia, ib = np.arange(len(a["step_series"])), np.arange(len(b["step_series"]))
    if min(len(ia), len(ib)) < 2:  # one timed step a side (--steps 2): no spread to resample
        return stat(ia, ib), float("nan"), float("nan")
    res = bootstrap(
        (ia, ib), stat, vectorized=False, paired=False, n_resamples=2000, method="percentile",
        confidence_level=confidence, rng=np.random.default_rng(0),
    )  # fmt: skip
    return stat(ia, ib), float(res.confidence_interval.low), float(res.confidence_interval.high)


#: the per-batch partial-rollout counters printed for the partial settings (``PartialRollouts.totals``) and the
#: recompute's prefill work
PARTIAL_TAGS = {
    "joined rows": "rollout/partial_joined_rows",
    "prefill positions": "rollout/partial_prefill_positions",
    "prefill s": "time/partial_prefill_s",
    "decode rows": "rollout/partial_decode_rows",
    "decode s": "time/partial_decode_s",
    "held back": "rollout/partial_held_back",
    "restarts": "rollout/partial_restarts",
    "discarded tokens": "rollout/partial_discarded_tokens",
    "recompute ids": "rollout/recompute_prefill_tokens",  # a rebuild's ids (shared prompts once) ...
    "context ids": "rollout/recompute_context_tokens",  # ... and what re-prefilling each row whole would feed
}


LONG_PROMPT = "Write every whole number from 1 to 300, in order, separated by commas."
SHORT_PROMPT = "What is {a} + {b}? Reply with the number only."


def setting_folder(name: str) -> str:
    """A setting's run folder name under ``--keep``: its printed name in lower case, runs of other characters as "-"
    ("async, process producer, 1+1" -> "async-process-producer-1-1")."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def skewed_task(prompts: int, where: Path) -> list[str]:
    """Overrides of a ``task=dataset`` run over a file of ``prompts`` rows written to ``where``: one asking for a long
    answer, ``prompts`` - 1 asking for one number (their sums as answers; the long one's answer is its last number)."""
    if prompts < 2:
        raise ValueError(f"--layout skewed needs --prompts >= 2 (one long, the others short), got {prompts}")
    rows = [{"prompt": LONG_PROMPT, "answer": "300"}]
    for i in range(prompts - 1):
        rows.append({"prompt": SHORT_PROMPT.format(a=i + 2, b=2 * i + 3), "answer": str(3 * i + 5)})
    where.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["task=dataset", f"task.path={where}", "task.prompt_field=prompt", "task.answer_field=answer"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="rollout.max_staleness of every async setting (RL steps; partial rollouts carry a long answer over "
        "more than one batch only with >= 2)",
    )
    ap.add_argument("--model", default="smollm2-135m", help="the model group (smollm2-135m, tiny)")
    ap.add_argument(
        "--layout",
        choices=["uniform", "skewed"],
        default="uniform",
        help="uniform: the default task's prompts; skewed: one long-answer prompt per step, the others short",
    )
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    ap.add_argument(
        "--skip-two-threads",
        action="store_true",
        help="leave out 'sync, 2 threads' (under CPU contention two spinning threads can be 10-50x slower)",
    )
    ap.add_argument(
        "--only",
        default=None,
        help="semicolon-separated settings to run (their names as printed, e.g. 'async, process producer, 1+1'); "
        "'sync, 1 thread' always runs (the ratios' base) unless --no-sync-base",
    )
    ap.add_argument(
        "--keep",
        default=None,
        help="keep each setting's run folder (its TensorBoard scalars, config and logs) under this folder, one per "
        "setting named after it; refused if one of them exists already",
    )
    ap.add_argument(
        "--no-sync-base",
        action="store_true",
        help="with --only: leave out 'sync, 1 thread' (then only the partial settings' ratios are printed)",
    )
    args = ap.parse_args()
    if args.layout == "skewed" and args.prompts < 2:
        ap.error("--layout skewed needs --prompts >= 2 (one long-answer prompt, the others short)")
    ensure_quiet(args.force)
    work = [
        f"model={args.model}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"rollout.micro_batch_size={args.prompts * args.group_size}",
        f"sampling.max_new_tokens={args.new_tokens}",
        f"trainer.max_steps={args.steps}",
        f"checkpoint.every_n_steps={args.steps}",
        "eval.num_examples=0",
        "trainer.enable_progress_bar=false",
    ]
    one_each = [
        "rollout.mode=async",
        f"rollout.max_staleness={args.max_staleness}",
        "threads=1",
    ]  # 1 + 1 threads in every async setting
    settings = {
        "sync, 1 thread": ["rollout.mode=sync", "threads=1"],
        "async, thread producer, 1+1": [*one_each, "rollout.producer=thread", "rollout.behaviour_logprobs=false"],
        "async, process producer, 1+1": [*one_each, "rollout.producer=process", "rollout.behaviour_logprobs=false"],
        "async, process, in flight": [
            *one_each,
            "rollout.producer=process",
            "rollout.behaviour_logprobs=false",
            "rollout.weight_update=in_flight",
            "rollout.kv_on_update=recompute",
        ],
        "async, process, scoring stale rows": [*one_each, "rollout.producer=process"],
        "sync, 2 threads": ["rollout.mode=sync", "threads=2"],
    }
    if args.layout == "skewed":  # the long tail: the long group's rows carry over, the freed slots refilled
        settings["async, process, in flight + partial"] = [
            *settings["async, process, in flight"],
            "rollout.partial=true",
        ]
        settings["async, process, in flight (keep) + partial"] = [  # no re-prefill of the live rows at a swap
            *settings["async, process, in flight + partial"],
            "rollout.kv_on_update=keep",
        ]
    if args.skip_two_threads:
        del settings["sync, 2 threads"]
    if args.only:
        wanted = {name.strip() for name in args.only.split(";")}
        wanted |= set() if args.no_sync_base else {"sync, 1 thread"}
        unknown = wanted - set(settings)
        if unknown:
            ap.error(f"--only: unknown settings {sorted(unknown)}; choose among {list(settings)}")
        settings = {name: extra for name, extra in settings.items() if name in wanted}
    keep = Path(args.keep) if args.keep else None
    if keep is not None:  # nothing kept before is overwritten: refused before any run
        taken = [str(keep / n) for n in [*map(setting_folder, settings), "skewed.jsonl"] if (keep / n).exists()]
        if taken:
            ap.error(
                f"--keep: {', '.join(taken)} already exist(s); a kept run is never overwritten: choose another folder"
            )
        keep.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="async_speedup-"))
    where = keep if keep is not None else tmp
    task = skewed_task(args.prompts, where / "skewed.jsonl") if args.layout == "skewed" else []
    results = {}
    try:
        for name, extra in settings.items():
            out = where / setting_folder(name)
            results[name] = measure([*task, *work, *extra], out)
            if keep is None:
                shutil.rmtree(out, ignore_errors=True)
            else:
                print(f"# {name}: run folder kept in {out}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n# {machine()}")
    print(
        f"\n## {args.model}, {args.layout} layout: {args.prompts} prompts x G={args.group_size} x <= {args.new_tokens} "
        f"new tokens, GRPO, bf16-mixed, async max_staleness={args.max_staleness}, mean of steps 2-{args.steps}"
    )
    print(
        "| setting | step s | RL steps / min | rollout (or wait) s | update s | generated tokens / step "
        "| trained tokens / s | staleness mean / max | trainer wait / producer idle | partial fraction |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        print(
            f"| {name} | {r['step']:.2f} | {60 / r['step']:.2f} | {r['rollout']:.2f} | {r['train']:.2f} "
            f"| {r['tokens']:.0f} | {r['tokens'] / r['step']:.1f} | {r['staleness']:.2f} / {r['staleness_max']:.0f} "
            f"| {r['trainer_wait']:.2f} / {r['producer_idle']:.2f} | {r['partial']:.2f} |"
        )
    partial_rows = [name for name in results if "partial" in name]
    if partial_rows:  # where a partial batch's producer time goes (means per batch over the same steps)
        print("\n| setting | generate s | " + " | ".join(PARTIAL_TAGS) + " |")
        print("|---" * (len(PARTIAL_TAGS) + 2) + "|")
        for name in partial_rows:
            r = results[name]
            cells = " | ".join(f"{r[k]:.2f}" if k.endswith(" s") else f"{r[k]:.0f}" for k in PARTIAL_TAGS)
            print(f"| {name} | {r['generate']:.2f} | {cells} |")
    base = results["sync, 1 thread"]["step"] if "sync, 1 thread" in results else None
    print()
    for name, r in results.items():
        if name != "sync, 1 thread" and base is not None:
            print(f"{name} vs sync, 1 thread: step time {r['step'] / base:.3f}x (speed-up {base / r['step']:.2f}x)")
    for label in ("async, process, in flight + partial", "async, process, in flight (keep) + partial"):
        partial = results.get(label)
        for name in ("async, process producer, 1+1", "sync, 2 threads"):
            if partial is not None and name in results:  # RL steps per minute, the partial setting's over the other's
                steps = ratio_interval(partial, results[name], "steps")
                tokens = ratio_interval(partial, results[name], "tokens")
                print(
                    f"{label} vs {name}: RL steps / min {steps[0]:.2f}x (95% bootstrap over steps {steps[1]:.2f}-"
                    f"{steps[2]:.2f}), trained tokens / s {tokens[0]:.2f}x ({tokens[1]:.2f}-{tokens[2]:.2f})"
                )


if __name__ == "__main__":
    main()
