"""The corrections atlas: each correction's drift, bias, variance and ESS, on an enumerable policy.

    python benchmarks/corrections_in_expectation.py                 # the table in docs/corrections.md (minutes)
    python benchmarks/corrections_in_expectation.py --vocab 4 --length 2 --mc-batches 20

Not a timing benchmark: every number but the batch-level rules' is an exact expectation over all V^L
sequences of a tabular policy (``lit_rl.expectation``), through the trainer's own update path (REINFORCE without
a baseline, so nothing but the correction stands between the sampler's mismatch and the gradient; ``bypass``
runs GRPO's clipped ratio with μ as π_old, the same advantages and reduction). The sampler μ is the policy's
logit table plus Gaussian logit noise scaled so that the mean KL(π ‖ μ) per prefix is each of ``--kls``; the
engine records the full vocabulary as its head (k = V), so score centering is exact. M2PO's bound and TIS's
batch normalisation are statistics of the whole batch: their rows are Monte Carlo over ``--mc-batches``
batches of ``--batch`` sequences, with the standard error printed.

Per correction and KL (defaults of conf/correction: TIS cap 2, MIS band [0.5, 2], OPSM δ = 1e-4, the rejection
rules' thresholds, M2PO τ = 0.04, the decoupled objective's cap 5):
- drift+ / drift−: ‖E_μ[ĝ]‖ under a constant advantage A = +1 / A = −1 on every sequence, where the true gradient
  is 0; relative to ‖g‖, the norm of the on-policy gradient under the real reward below;
- bias: ‖E_μ[ĝ] − g‖ / ‖g‖ under a real reward (uniform in [−0.5, 0.5) per sequence, fixed; both signs, so OPSM
  acts), g = E_π[ĝ] the on-policy gradient of the uncorrected estimator;
- var: E‖ĝ − E ĝ‖² / ‖g‖² of a batch of ``--batch`` sequences (N = 64: the single-sequence variance / 64);
- ESS: (E_μ w)² / E_μ w² of the weight w each sampled token's term is multiplied by (1 for none and sc; a
  mask's kept fraction; the correction's weights times its masks), under the real reward's advantages, exact
  over every token; M2PO's bound for it taken over the enumerated sequences.
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

from lit_rl.corrections import correction_weights, weight_function  # noqa: E402
from lit_rl.expectation import (  # noqa: E402
    TabularPolicy,
    all_sequences,
    expected_gradient,
    monte_carlo_gradient,
    sampler_at_kl,
    sequence_logprobs,
)
from lit_rl.rejection import MaskInputs, apply_sequence_masks, m2po_bound, sequence_masks  # noqa: E402
from lit_rl.run.train import build_module  # noqa: E402

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
RS = "correction=rs"
CORRECTIONS = {  # row label -> overrides
    "none": ["correction=none"],
    "tis": ["correction=tis"],
    "tis (sequence)": ["correction=tis", "correction.tis.level=sequence"],
    "mis": ["correction=mis"],
    "mis (mask only)": ["correction=mis", "correction.mis.weighted=false"],
    "mis (geometric)": ["correction=mis", "correction.mis.level=geometric"],
    "sc": ["correction=sc"],
    "sc+tis": ["correction=sc+tis"],
    "sc+tis (sequence)": ["correction=sc+tis", "correction.tis.level=sequence"],
    "sc+mis": ["correction=sc+mis"],
    "sc+mis (mask only)": ["correction=sc+mis", "correction.mis.weighted=false"],
    "opsm": ["correction=opsm"],
    "sc+opsm": ["correction=sc+opsm"],
    "tis+opsm": ["correction=tis+opsm"],
    "rs token_k1": [RS, "correction.rs.rule=token_k1"],
    "rs seq_sum_k1": [RS, "correction.rs.rule=seq_sum_k1"],
    "rs seq_mean_k3": [RS, "correction.rs.rule=seq_mean_k3"],
    "rs seq_max_k2": [RS, "correction.rs.rule=seq_max_k2"],
    "rs outlier_veto": [RS, "correction.rs.rule=outlier_veto"],
    "tis+rs (seq_mean_k3)": ["correction=tis+rs"],
    "sc+rs (token_k1)": ["correction=sc+rs", "correction.rs.rule=token_k1"],
    "tis (batch-normalised)": ["correction=tis", "correction.tis.batch_normalize=true"],
    "sc+tis (batch-normalised)": ["correction=sc+tis", "correction.tis.batch_normalize=true"],
    "m2po": ["correction=m2po"],
    "sc+m2po": ["correction=sc+m2po"],
    "bypass (grpo clip 0.2)": ["algo=grpo", "loss.reduction=seq_mean_token_sum", "correction.bypass=true"],
    # AReaL's decoupled objective: weight π_prox/μ masked above 5 (at the first update π_prox = π_old = π, so
    # correction.proximal=loglinear gives the same numbers: it differs only on later optimizer steps)
    "decoupled (cap 5)": ["correction=decoupled"],
    # score centering with a top-2 head: the documents' rescaled tail, and the sampled tail (one draw per position
    # from the sampler's own tail, enumerated with its probability: exact in expectation)
    "sc top-2 (rescaled tail)": ["correction=sc"],
    "sc top-2 (sampled tail m=1)": ["correction=sc", "correction.sc.tail=sampled", "correction.sc.tail_samples=1"],
}
#: rows whose engine head is not the whole vocabulary: label -> (k, m tail samples)
HEADS = {"sc top-2 (rescaled tail)": (2, 0), "sc top-2 (sampled tail m=1)": (2, 1)}
#: rows whose rule reads the whole batch: Monte Carlo
BATCH_LEVEL = ("tis (batch-normalised)", "sc+tis (batch-normalised)", "m2po", "sc+m2po")


def module(policy, overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "model=tiny",
                "trainer.precision=32-true",
                *(
                    ["algo=reinforce", "algo.baseline=none"]
                    if not any(o.startswith("algo=") for o in overrides)
                    else []
                ),
                f"sampling.max_new_tokens={policy.length}",
                f"correction.sc.top_k={policy.vocab_size}",
                *overrides,
            ],
        )
    return build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))


def effective_sample_size(m, policy, mu, rewards) -> float:
    """(E_μ w)² / E_μ w² over every token of every sequence, w = the correction's weight times its masks at the
    first optimizer step (π_old = π), the advantages = ``rewards`` [V^L]; lit_rl's own functions compute w."""
    seqs = all_sequences(policy.vocab_size, policy.length)
    logpi, logmu = sequence_logprobs(policy.table(), seqs).float(), sequence_logprobs(mu, seqs).float()
    mask = torch.ones_like(logpi, dtype=torch.bool)
    if getattr(m.correction, "bypass", False):
        return math.nan
    w = correction_weights(logpi, logmu, mask, weight_function(m.correction))[0].double()
    keep, _ = apply_sequence_masks(sequence_masks(m.correction), MaskInputs(logmu, logpi, logpi, rewards, mask))
    w = w * keep
    if m.correction.m2po.enabled:
        c = float(m2po_bound(logpi, logmu, mask, float(m.correction.m2po.threshold)))
        w = w * ((logpi - logmu).abs() <= c)
    p = logmu.double().sum(-1).exp()[:, None].expand_as(w)
    first, second = float((p * w).sum()), float((p * w * w).sum())
    return first * first / (policy.length * second) if second > 0 else 0.0


def real_advantages(m):
    """The advantages of the real reward: REINFORCE's own (the reward); GRPO's (``bypass``) would centre a group of
    one to 0, so the reward itself there too."""
    return (lambda rb: rb.rewards.clone()) if getattr(m.correction, "bypass", False) else None


def row(m, label, policy, mu, reward, g, args) -> tuple[float, float, float, float, float]:
    """(drift+, drift−, bias, var) for one correction and sampler, relative to ‖g‖, and the Monte Carlo standard
    error of the first three (0 when exact)."""
    ones = lambda rb: torch.ones(len(rb))  # noqa: E731
    minus = lambda rb: -torch.ones(len(rb))  # noqa: E731
    (head, tail), g_norm, se = HEADS.get(label, (policy.vocab_size, 0)), float(g.norm()), 0.0
    if label in BATCH_LEVEL:
        kw = dict(batch_size=args.batch, num_batches=args.mc_batches, seed=args.seed + 3, head_size=head)
        plus = monte_carlo_gradient(m, policy, mu, reward, advantages=ones, **kw)
        neg = monte_carlo_gradient(m, policy, mu, reward, advantages=minus, **kw)
        real = monte_carlo_gradient(m, policy, mu, reward, **kw)
        drifts = (float(plus.mean.norm()), float(neg.mean.norm()))
        bias, var = float((real.mean - g).norm()) / g_norm, real.variance / g_norm**2
        se = max(plus.norm_stderr, neg.norm_stderr, real.norm_stderr) / g_norm
    else:
        drifts = tuple(
            float(expected_gradient(m, policy, mu, reward, head_size=head, advantages=a, tail_samples=tail).mean.norm())
            for a in (ones, minus)
        )
        adv = real_advantages(m)
        mom = expected_gradient(
            m, policy, mu, reward, head_size=head, advantages=adv, per_batch=True, tail_samples=tail
        )
        bias, var = float((mom.mean - g).norm()) / g_norm, mom.variance / args.batch / g_norm**2
    return drifts[0] / g_norm, drifts[1] / g_norm, bias, var, se


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=6)
    parser.add_argument("--length", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="sequences per batch of the estimator (its variance)")
    parser.add_argument("--kls", default="0.001,0.01,0.1,0.5")
    parser.add_argument("--mc-batches", type=int, default=100, help="Monte Carlo batches of the batch-level rules")
    parser.add_argument("--only", default="", help="comma-separated row labels (default: every row)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# {machine()}")
    policy = TabularPolicy(args.vocab, args.length, seed=args.seed)
    seqs = all_sequences(args.vocab, args.length)
    rewards = torch.rand(len(seqs), generator=torch.Generator().manual_seed(args.seed + 1)) - 0.5
    lookup = {tuple(s.tolist()): float(r) for s, r in zip(seqs, rewards)}
    reward = lambda batch: torch.tensor([lookup[tuple(s.tolist())] for s in batch])  # noqa: E731
    labels = [x for x in args.only.split(",") if x] or list(CORRECTIONS)
    modules = {label: module(policy, CORRECTIONS[label]) for label in ["none", *labels]}
    g = expected_gradient(modules["none"], policy, policy.table(), reward, head_size=args.vocab).mean
    print(
        f"# tabular policy V={args.vocab}, L={args.length} ({len(seqs)} sequences), REINFORCE without baseline, "
        f"head k=V, reward uniform in [-0.5, 0.5); |g| = {float(g.norm()):.4g} (on-policy); variance of a batch of "
        f"N={args.batch}; {', '.join(BATCH_LEVEL)}: Monte Carlo over {args.mc_batches} batches (± its SE)"
    )
    print("| KL(π‖μ) | correction | drift+ / \\|g\\| | drift− / \\|g\\| | bias / \\|g\\| | var / \\|g\\|² | ESS |")
    print("|---|---|---|---|---|---|---|")
    for kl in (float(x) for x in args.kls.split(",")):
        mu, _ = sampler_at_kl(policy.table(), kl, seed=args.seed + 2)
        for label in labels:
            m = modules[label]
            plus, minus, bias, var, se = row(m, label, policy, mu, reward, g, args)
            ess = effective_sample_size(m, policy, mu, rewards)
            pm = f" ± {se:.4f}" if se else ""
            cells = [f"{plus:.4f}{pm}", f"{minus:.4f}{pm}", f"{bias:.4f}{pm}", f"{var:.4f}", f"{ess:.4f}"]
            print(f"| {kl:g} | {label} | " + " | ".join(cells).replace("nan", "–") + " |")
    print(f"# logit noise σ per KL found by bisection (seed {args.seed + 2})")


if __name__ == "__main__":
    main()
