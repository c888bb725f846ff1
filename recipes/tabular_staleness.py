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

from lit_rl.choices import ALGORITHMS, CORRECTIONS  # noqa: E402
from lit_rl.config import ConfigError, validate  # noqa: E402
from lit_rl.expectation import TabularPolicy, all_sequences, sequence_logprobs  # noqa: E402
from lit_rl.run.hardware import describe_machine  # noqa: E402
from lit_rl.run.train import build_module  # noqa: E402
from lit_rl.tools.tabular_staleness import staleness_curves, tolerated_lag, train_tables  # noqa: E402

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def overrides_for(vocab: int, length: int, algo: str, correction: str) -> list[str]:
    """The overrides of conf/train.yaml for ``algo`` and ``correction`` around a tabular policy (V tokens,
    responses of L): float32, the full vocabulary as score centering's head, the correction group's defaults (TIS
    cap 2, MIS band [0.5, 2], token level). ``correction`` may end in ``/seq``: its TIS and MIS at the sequence
    level."""
    correction, _, level = correction.partition("/")
    levels = ["correction.tis.level=sequence", "correction.mis.level=sequence"] if level == "seq" else []
    algo_overrides = ["algo=reinforce", "algo.baseline=none"] if algo == "reinforce" else [f"algo={algo}"]
    if algo == "dapo":
        algo_overrides.append("algo.overlong.enabled=false")
    return [
        "model=tiny",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={length}",
        "rollout.micro_batch_size=1000000",
        "logprob_chunk_tokens=1000000",
        *algo_overrides,
        f"correction={correction}",
        f"correction.sc.top_k={vocab}",
        *levels,
    ]


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def module_for(policy: TabularPolicy, algo: str, correction: str):
    """The run's own module (``build_module`` of conf/train.yaml, ``overrides_for``) around ``policy``."""
    cfg = compose_train(overrides_for(policy.vocab_size, policy.length, algo, correction))
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any work (argparse's usage and the reason, exit 2): the algorithm and each
    correction among the registered choices (``lit_rl.choices``), ``/seq`` the only suffix, the sizes positive, every
    lag in [0, --steps], and each (algorithm, correction, --group-size) as ``config.validate`` takes it (a group
    algorithm with groups of 1 has zero advantage: the run would end, after training, on a gradient of 0). Sets
    ``args.correction_names`` and ``args.lag_list``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.algo not in ALGORITHMS:
        parser.error(f"--algo {args.algo!r}: choose one of {ALGORITHMS.choices}")
    names = [c for c in args.corrections.split(",") if c]
    for name in names:
        base, _, level = name.partition("/")
        if base not in CORRECTIONS or level not in ("", "seq"):
            parser.error(f"--corrections: {name!r}: choose among {CORRECTIONS.choices}, each optionally with /seq")
    for flag, value, low in (("vocab", args.vocab, 2), ("length", args.length, 1), ("steps", args.steps, 1)):
        if value < low:
            parser.error(f"--{flag} {value}: must be >= {low}")
    if args.group_size < 1 or not args.lr > 0:
        parser.error(f"--group-size {args.group_size} must be >= 1 and --lr {args.lr} > 0")
    try:
        lags = [int(k) for k in args.lags.split(",")]
    except ValueError:
        parser.error(f"--lags {args.lags!r}: comma-separated integers")
    bad = [k for k in lags if not 0 <= k <= args.steps]
    if bad:
        parser.error(f"--lags: {bad} outside [0, --steps {args.steps}] (a lag k reads the policy k steps back)")
    for name in dict.fromkeys(["none", *names]):
        overrides = overrides_for(args.vocab, args.length, args.algo, name)
        try:
            validate(compose_train([*overrides, f"rollout.group_size={args.group_size}"]))
        except ConfigError as err:
            parser.error(f"--algo {args.algo} --group-size {args.group_size} --corrections {name}: {err}")
    args.correction_names, args.lag_list = names, lags
    return args


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    policy = TabularPolicy(args.vocab, args.length, seed=args.seed)
    names = args.correction_names
    modules = {c: module_for(policy, args.algo, c) for c in dict.fromkeys(["none", *names])}
    tables = train_tables(modules["none"], policy, first_equals_last, args.steps, args.lr, args.group_size)
    lags = args.lag_list
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
