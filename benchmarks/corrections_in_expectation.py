"""Each correction's drift, bias, variance and MSE, computed exactly on an enumerable policy.

    python benchmarks/corrections_in_expectation.py                 # the table in docs/corrections.md (about a minute)
    python benchmarks/corrections_in_expectation.py --vocab 4 --length 2 --batch 16

Not a timing benchmark: every number is an exact expectation over all V^L sequences of a tabular policy
(``lit_rl.expectation``), through the trainer's own update path (REINFORCE without a baseline, so nothing
but the correction stands between the sampler's mismatch and the gradient). The sampler μ is the policy's
logit table plus Gaussian logit noise scaled so that the mean KL(π ‖ μ) per prefix is each of ``--kls``;
the engine records the full vocabulary as its head (k = V), so score centering is exact.

Per correction and KL:
- drift: ‖E_μ[ĝ]‖ under a constant reward (A = 1 on every token), where the true gradient is 0; relative
  to ‖g‖, the norm of the on-policy gradient under the random reward below;
- bias: ‖E_μ[ĝ] − g‖ / ‖g‖ under a random reward (uniform in [0, 1) per sequence, fixed), where g = E_π[ĝ]
  is the on-policy gradient of the uncorrected estimator;
- var: E‖ĝ − E ĝ‖² / ‖g‖² of a batch of ``--batch`` sequences (N = 64: the single-sequence variance / 64);
- mse: bias² + var (relative, same batch);
- clip / drop: the fraction of tokens (under μ) whose weight the TIS cap truncates / MIS drops.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import machine  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from lit_rl.expectation import TabularPolicy, all_sequences, expected_gradient, prefix_rows, sampler_at_kl  # noqa: E402
from lit_rl.run.train import build_module  # noqa: E402

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
CORRECTIONS = {  # row label -> overrides
    "none": ["correction=none"],
    "tis": ["correction=tis"],
    "tis (sequence)": ["correction=tis", "correction.tis.level=sequence"],
    "mis": ["correction=mis"],
    "mis (mask only)": ["correction=mis", "correction.mis.weighted=false"],
    "sc": ["correction=sc"],
    "sc+tis": ["correction=sc+tis"],
    "sc+tis (sequence)": ["correction=sc+tis", "correction.tis.level=sequence"],
    "sc+mis": ["correction=sc+mis"],
    "sc+mis (mask only)": ["correction=sc+mis", "correction.mis.weighted=false"],
}


def module(policy, overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "model=tiny",
                "trainer.precision=32-true",
                "algo=reinforce",
                "algo.baseline=none",
                f"sampling.max_new_tokens={policy.length}",
                f"correction.sc.top_k={policy.vocab_size}",
                *overrides,
            ],
        )
    return build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))


def token_fractions(policy, mu, cap, band):
    """(fraction of tokens with π/μ > cap, fraction outside the band), both under μ."""
    seqs = all_sequences(policy.vocab_size, policy.length)
    logpi, logmu = torch.log_softmax(policy.table(), -1), torch.log_softmax(mu, -1)
    rows = prefix_rows(seqs, policy.vocab_size)
    w = (logpi - logmu)[rows, seqs].exp()  # [N, L]
    p = (logmu[rows, seqs].sum(-1)).exp()[:, None].expand_as(w) / policy.length
    return float((p * (w > cap)).sum()), float((p * ((w < band[0]) | (w > band[1]))).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=6)
    parser.add_argument("--length", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="sequences per batch of the estimator (its variance)")
    parser.add_argument("--kls", default="0.001,0.01,0.1,0.5")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# {machine()}")
    policy = TabularPolicy(args.vocab, args.length, seed=args.seed)
    seqs = all_sequences(args.vocab, args.length)
    rewards = torch.rand(len(seqs), generator=torch.Generator().manual_seed(args.seed + 1))
    lookup = {tuple(s.tolist()): float(r) for s, r in zip(seqs, rewards)}
    reward = lambda batch: torch.tensor([lookup[tuple(s.tolist())] for s in batch])  # noqa: E731
    ones = lambda rb: torch.ones(len(rb))  # noqa: E731
    head = args.vocab
    modules = {label: module(policy, ov) for label, ov in CORRECTIONS.items()}
    g = expected_gradient(modules["none"], policy, policy.table(), reward, head_size=head).mean
    g_norm = float(g.norm())
    print(
        f"# tabular policy V={args.vocab}, L={args.length} ({len(seqs)} sequences), REINFORCE without baseline, "
        f"head k=V, TIS cap 2, MIS band [0.5, 2]; |g| = {g_norm:.4g} (on-policy, random reward); "
        f"variance of a batch of N={args.batch}"
    )
    print("| KL(π‖μ) | correction | drift / \\|g\\| | bias / \\|g\\| | var / \\|g\\|² | mse / \\|g\\|² | clip | drop |")
    print("|---|---|---|---|---|---|---|---|")
    for kl in (float(x) for x in args.kls.split(",")):
        mu, sigma = sampler_at_kl(policy.table(), kl, seed=args.seed + 2)
        clip, drop = token_fractions(policy, mu, 2.0, (0.5, 2.0))
        for label, m in modules.items():
            drift = float(expected_gradient(m, policy, mu, reward, head_size=head, advantages=ones).mean.norm())
            mom = expected_gradient(m, policy, mu, reward, head_size=head, per_batch=True)
            bias = float((mom.mean - g).norm()) / g_norm
            var = mom.variance / args.batch / g_norm**2
            print(
                f"| {kl:g} | {label} | {drift / g_norm:.4f} | {bias:.4f} | {var:.4f} | {bias**2 + var:.4f} | "
                f"{clip if 'tis' in label else math.nan:.4f} | {drop if 'mis' in label else math.nan:.4f} |".replace(
                    "nan", "–"
                )
            )
    print(f"# logit noise σ per KL found by bisection (seed {args.seed + 2}); clip/drop: token-level fractions")


if __name__ == "__main__":
    main()
