"""One GRPO step in lit_rl and in TRL's GRPOTrainer on identical work, measured in one run.

    pip install -e .[bench]            # TRL, pinned (trl==1.16.0); only this benchmark needs it
    python benchmarks/vs_trl.py        # SmolLM2-135M, 8 prompts x G=8, 64 new tokens, float32

Same model (SmolLM2-135M-Instruct, the same local weights), the same 8 arithmetic prompts per step through
the same chat template and reward, G = 8, at most 64 new tokens, temperature 1 with no top-k/top-p, float32,
micro-batches of 16 completions (TRL: per_device_train_batch_size=16 x gradient_accumulation_steps=4 = one
generation of 64 completions, one optimizer step), one update per batch, no KL (beta = 0), no gradient
checkpointing, 2 threads. Each system runs in its own process (peak RSS is per process, model load
included) for two steps; the second step is timed (the first warms up). lit_rl's step is the real recipe
(``lit_rl.run.train.run``: Lightning loop, engine, verifier, update) and its ``time/*`` scalars; TRL's is
``trainer.train()`` with a callback timing the optimizer step and a wrapper timing generation + scoring.
Completion lengths differ (each system draws its own samples), so seconds per 1000 generated tokens are
printed beside seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

PROMPTS, G, NEW_TOKENS, MICRO = 8, 8, 64, 16


def recipe_cfg(prompts: int = PROMPTS, g: int = G, new_tokens: int = NEW_TOKENS):
    """The lit_rl config of this comparison (the recipe's defaults with the shared settings above)."""
    from hydra import compose, initialize_config_dir

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with initialize_config_dir(config_dir=os.path.join(root, "conf"), version_base="1.3"):
        return compose(
            config_name="train",
            overrides=[
                "trainer.precision=32-true",
                "trainer.max_steps=2",
                "trainer.enable_progress_bar=false",
                "threads=2",
                f"rollout.prompts_per_step={prompts}",
                f"rollout.group_size={g}",
                f"rollout.micro_batch_size={MICRO}",
                f"sampling.max_new_tokens={new_tokens}",
                "eval.num_examples=0",
                "checkpoint.every_n_steps=1000",
                "kl.beta=0",
                "model.gradient_checkpointing=false",
            ],
        )


def lit_rl_step(out: str, prompts: int = PROMPTS, g: int = G, new_tokens: int = NEW_TOKENS) -> dict:
    """Two steps of the recipe; the second step's rollout, update and whole-step seconds, generated tokens."""
    from lit_rl.run.train import run
    from lit_rl.tools.compare import read_scalars

    cfg = recipe_cfg(prompts, g, new_tokens)
    run(cfg, out)
    s = read_scalars(out)
    last = {
        tag: s[tag][-1][1] for tag in ("time/rollout_s", "time/train_s", "time/step_s", "rollout/response_length_mean")
    }
    return {
        "rollout_s": last["time/rollout_s"],
        "update_s": last["time/train_s"],
        "step_s": last["time/step_s"],
        "tokens": last["rollout/response_length_mean"] * prompts * g,
    }


def trl_step(out: str, prompts: int = PROMPTS, g: int = G, new_tokens: int = NEW_TOKENS) -> dict:
    """Two steps of TRL's GRPOTrainer on the recipe's model, prompts and reward; the second step's figures."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_rl.models import load_policy
    from lit_rl.rollout.datamodule import RolloutDataModule
    from lit_rl.run.train import build_task_from_cfg
    from lit_rl.schema import train_config

    torch.set_num_threads(2)
    cfg = recipe_cfg(prompts, g, new_tokens)
    policy, tok = load_policy(train_config(cfg).model)
    task = build_task_from_cfg(cfg)
    dm = RolloutDataModule(task, tok, prompts, g, seed=cfg.seed, eval_examples=0)
    examples = dm.prompts_for(0) + dm.prompts_for(1)  # exactly the prompts lit_rl trains on in its two steps
    ds = Dataset.from_list([{"prompt": task.messages(ex), "idx": i} for i, ex in enumerate(examples)])

    def reward(prompts, completions, idx, **kwargs):
        return [
            task.reward(c[0]["content"] if isinstance(c, list) else c, examples[i]) for c, i in zip(completions, idx)
        ]

    args = GRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=min(MICRO, prompts * g),
        gradient_accumulation_steps=max(1, prompts * g // MICRO),
        num_generations=g,
        max_completion_length=new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        learning_rate=2e-6,
        lr_scheduler_type="constant",
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        shuffle_dataset=False,
        disable_dropout=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = GRPOTrainer(model=policy, reward_funcs=[reward], args=args, train_dataset=ds, processing_class=tok)
    times: dict[str, list[float]] = {"step": [], "rollout": [], "tokens": []}
    original = trainer._generate_and_score_completions

    def timed(inputs):
        t = time.perf_counter()
        result = original(inputs)
        times["rollout"].append(time.perf_counter() - t)
        times["tokens"].append(float(result["completion_mask"].sum()))
        return result

    trainer._generate_and_score_completions = timed

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times["step"].append(time.perf_counter() - self.t)

    trainer.add_callback(StepTimer())
    trainer.train()
    step, rollout = times["step"][-1], times["rollout"][-1]
    return {"rollout_s": rollout, "update_s": step - rollout, "step_s": step, "tokens": times["tokens"][-1]}


def child(which: str, *shape: int) -> None:
    """Run one system in this process and print its figures (with peak RSS) as one RESULT line."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        result = (lit_rl_step if which == "lit_rl" else trl_step)(os.path.join(tmp, "run"), *shape)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print("RESULT " + json.dumps(result))


def measure(which: str, *shape: int) -> dict:
    """``child(which, *shape)`` in a fresh process, so peak RSS is this system's alone."""
    env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    res = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", which, *map(str, shape)],
        capture_output=True,
        text=True,
        env=env,
    )
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if res.returncode != 0 or line is None:
        sys.exit(f"{which} failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=["lit_rl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("shape", nargs="*", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    if args.child:
        return child(args.child, *args.shape)
    from _common import ensure_quiet, machine

    ensure_quiet(args.force)
    import trl

    rows = {"lit_rl": measure("lit_rl"), f"TRL {trl.__version__} GRPOTrainer": measure("trl")}
    print(f"# {machine()}")
    print(
        f"\n## one GRPO step, SmolLM2-135M-Instruct, {PROMPTS} prompts x G={G} x <= {NEW_TOKENS} new tokens, "
        f"float32, micro-batch {MICRO}, second step of two"
    )
    print("| system | rollout s | update s | step s | generated tokens | s per 1k tokens | peak RSS GB |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['rollout_s']:.1f} | {r['update_s']:.1f} | {r['step_s']:.1f} | {r['tokens']:.0f} | "
            f"{1000 * r['step_s'] / r['tokens']:.2f} | {r['peak_rss_gb']:.2f} |"
        )
    a, b = rows.values()
    print(
        f"\nlit_rl / TRL: step time {a['step_s'] / b['step_s']:.2f}x, "
        f"per generated token {(a['step_s'] / a['tokens']) / (b['step_s'] / b['tokens']):.2f}x, "
        f"rollout {a['rollout_s'] / b['rollout_s']:.2f}x, update {a['update_s'] / b['update_s']:.2f}x, "
        f"peak RSS {a['peak_rss_gb'] / b['peak_rss_gb']:.2f}x   (targets: step <= 0.5x, RSS < 1x)"
    )


if __name__ == "__main__":
    main()
