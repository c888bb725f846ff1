"""Staleness exactly, on a tabular policy: each correction's bias against the on-policy gradient as the lag k grows.

    python recipes/tabular_staleness.py --out docs/results/tabular_staleness                       # A = R (seconds)
    python recipes/tabular_staleness.py --algo grpo --group-size 2 --out docs/results/tabular_staleness/grpo_g2
    python recipes/tabular_staleness.py --vocab 3 --length 2 --algo grpo --group-size 4 --out /tmp/g4

Trains a tabular policy (V tokens, responses of L) for ``--steps`` exact on-policy updates, keeps every θ, then at
θ_s computes E_{μ = π_{s−k}}[ĝ_c] exactly for every lag k and correction c (``lit_rl.tools.tabular_staleness``).
``--algo reinforce`` (default): REINFORCE without a baseline, so A = R exactly; ``--algo grpo``: group-centred and
std-normalised advantages over groups of ``--group-size``, every group enumerated (V^(L·G) of them).
Writes staleness.md (the table and the verdict), staleness.json (every number) and staleness.png (bias and
progress ratio against k) under ``--out``. The logic is in lit_rl.tools.tabular_staleness.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
import time
from types import SimpleNamespace

from lit_rl.run.hardware import set_omp_defaults  # imports no torch

set_omp_defaults()

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from lit_rl.expectation import TabularPolicy, all_sequences, sequence_logprobs  # noqa: E402
from lit_rl.run.hardware import describe_machine  # noqa: E402
from lit_rl.run.train import build_module  # noqa: E402
from lit_rl.tools.tabular_staleness import staleness_curves, tolerated_lag, train_tables  # noqa: E402

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def module_for(policy: TabularPolicy, algo: str, correction: str):
    """The run's own module (``build_module`` of conf/train.yaml) for ``algo`` and ``correction``, around
    ``policy``: float32, the full vocabulary as score centering's head, the correction group's defaults (TIS cap 2,
    MIS band [0.5, 2], token level). ``correction`` may end in ``/seq``: its TIS and MIS at the sequence level."""
    correction, _, level = correction.partition("/")
    levels = ["correction.tis.level=sequence", "correction.mis.level=sequence"] if level == "seq" else []
    algo_overrides = ["algo=reinforce", "algo.baseline=none"] if algo == "reinforce" else [f"algo={algo}"]
    if algo == "dapo":
        algo_overrides.append("algo.overlong.enabled=false")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "model=tiny",
                "trainer.precision=32-true",
                f"sampling.max_new_tokens={policy.length}",
                "rollout.micro_batch_size=1000000",
                "logprob_chunk_tokens=1000000",
                *algo_overrides,
                f"correction={correction}",
                f"correction.sc.top_k={policy.vocab_size}",
                *levels,
            ],
        )
    return build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))


def first_equals_last(seqs: torch.Tensor) -> torch.Tensor:
    """The verifiable reward: 1 when the response's first and last tokens agree, else 0."""
    return (seqs[:, 0] == seqs[:, -1]).float()


def expected_reward(table: torch.Tensor, length: int) -> float:
    """E_π[R] of the policy with logit table ``table`` [S, V], exact."""
    seqs = all_sequences(table.shape[1], length)
    return float((sequence_logprobs(table, seqs).sum(-1).exp() * first_equals_last(seqs).double()).sum())


def plot(points, path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.0), dpi=110)
    FigureCanvasAgg(fig)
    names = list(dict.fromkeys(p.correction for p in points))
    for j, (key, label) in enumerate((("bias", "bias ‖E ĝ − g‖ / ‖g‖"), ("progress", "progress ⟨E ĝ, g⟩ / ‖g‖²"))):
        ax = fig.add_subplot(1, 2, j + 1)
        for name in names:
            pts = sorted((p.lag, getattr(p, key)) for p in points if p.correction == name)
            ax.plot([max(k, 0.5) for k, _ in pts], [v for _, v in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("lag k (steps; k = 0 drawn at 0.5)")
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
        if j == 0:
            ax.legend(fontsize="small")
    fig.suptitle(textwrap.fill(title, 150), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=4)
    parser.add_argument("--length", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.02, help="Adam learning rate of the training updates")
    parser.add_argument("--lags", default="0,1,2,4,8,16")
    parser.add_argument("--algo", default="reinforce", help="reinforce (A = R, no baseline) or a group algorithm")
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument(
        "--corrections", default="none,tis,mis,sc,sc+tis,tis/seq", help="names; NAME/seq: TIS and MIS per sequence"
    )
    parser.add_argument("--threshold", type=float, default=0.1, help="verdict: tolerated while bias/‖g‖ <= this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    policy = TabularPolicy(args.vocab, args.length, seed=args.seed)
    names = [c for c in args.corrections.split(",") if c]
    modules = {c: module_for(policy, args.algo, c) for c in dict.fromkeys(["none", *names])}
    tables = train_tables(modules["none"], policy, first_equals_last, args.steps, args.lr, args.group_size)
    lags = [int(k) for k in args.lags.split(",")]
    g, points = staleness_curves(modules, policy, tables, first_equals_last, lags, args.group_size)
    wall = time.perf_counter() - t0
    setting = (
        f"tabular policy V={args.vocab}, L={args.length}, algo={args.algo}, G={args.group_size}, reward "
        f"1[y_1 = y_L], {args.steps} exact Adam steps at lr {args.lr} (seed {args.seed}); E[R] "
        f"{expected_reward(tables[0], args.length):.3f} at θ_0, {expected_reward(tables[-1], args.length):.3f} at θ_s; "
        f"‖g‖ = {float(g.norm()):.4g}"
    )
    lines = [
        f"# Tabular staleness: {setting}",
        "",
        f"Exact expectations (no sampling noise); {wall:.1f} s wall ({describe_machine()}).",
        "",
        "| correction | k | KL(μ‖π_s)/token | bias / ‖g‖ | progress | cosine |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {p.correction} | {p.lag} | {p.kl:.4g} | {p.bias:.4f} | {p.progress:.4f} | {p.cosine:.4f} |" for p in points
    ]
    rule = f"the largest k with bias / ‖g‖ <= {args.threshold} at every lag up to it"
    lines += ["", f"Verdict (tolerated lag: {rule}):", ""]
    for c in dict.fromkeys(p.correction for p in points):
        lines.append(f"- {c}: {tolerated_lag(points, c, args.threshold)}")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "staleness.md"), "w") as f:
        f.write(text)
    rows = [{k: v for k, v in vars(p).items() if k != "gradient"} for p in points]
    with open(os.path.join(args.out, "staleness.json"), "w") as f:
        json.dump(
            {"setting": setting, "args": vars(args), "g_norm": float(g.norm()), "rows": rows, "wall_s": wall},
            f,
            indent=2,
        )
    plot(points, os.path.join(args.out, "staleness.png"), setting)
    print(text, flush=True)


if __name__ == "__main__":
    main()
