"""The probe's conditional mode (lit_rl.tools.conditional): per-prefix conditional expectations of each correction's
drift under a constant advantage, averaged over prefixes, equal lit_rl.expectation's exact E_μ[ĝ] of the trainer's
own update; the top-k residual is 0 with k = V; TIS's conditional term is −Σ_v (π_v − C μ_v)_+ ∇log π_v."""

from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config

from lit_rl.corrections import WeightFunction
from lit_rl.expectation import (
    TabularPolicy,
    all_sequences,
    expected_gradient,
    noisy_table,
    rollouts_from,
    scored_from,
    sequence_logprobs,
)
from lit_rl.run.train import build_module
from lit_rl.tools.conditional import conditional_backward, conditional_weights

ONES = lambda rb: torch.ones(len(rb))  # noqa: E731

# (correction, overrides): caps and bands that bind at the sampler below, and ones that do not
CASES = [
    ("none", []),
    ("tis", ["correction.tis.cap=2"]),
    ("tis", ["correction.tis.cap=1.05"]),
    ("mis", ["correction.mis.low=0.8", "correction.mis.high=1.25"]),
    ("mis", ["correction.mis.low=0.8", "correction.mis.high=1.25", "correction.mis.weighted=false"]),
    ("sc", []),
    ("sc+tis", ["correction.tis.cap=1.05"]),
    ("sc+mis", ["correction.mis.low=0.8", "correction.mis.high=1.25"]),
]


def module_for(policy, correction, *overrides, algo="reinforce"):
    algo_overrides = ["algo=reinforce", "algo.baseline=none"] if algo == "reinforce" else [f"algo={algo}"]
    cfg = compose_config(
        "model=tiny",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={policy.length}",
        "rollout.micro_batch_size=4096",
        "logprob_chunk_tokens=4096",
        *algo_overrides,
        f"correction={correction}",
        f"correction.sc.top_k={policy.vocab_size}",
        *overrides,
    )
    return build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))


def conditional_expectation(module, policy, mu, head_size=None):
    """Σ_sequences μ(s) · (the conditional mode's gradient on the one-row batch s): every prefix weighted exactly."""
    seqs = all_sequences(policy.vocab_size, policy.length)
    probs = sequence_logprobs(mu, seqs).sum(-1).exp()
    out = torch.zeros_like(policy.table())
    for s, p in zip(seqs, probs.tolist()):
        batch = s[None]
        rb = module.build_batch(scored_from(rollouts_from(batch, mu, policy.vocab_size), torch.ones(1), 1))
        module.start_update(rb)
        rb.advantages = torch.ones(1)
        policy.zero_grad(set_to_none=True)
        conditional_backward(module, rb, head_size)
        out += p * policy.gradient()
    return out


@pytest.fixture(scope="module")
def setup():
    policy = TabularPolicy(4, 2, seed=5)
    mu = noisy_table(policy.table(), 0.6, seed=6)
    none = expected_gradient(module_for(policy, "none"), policy, mu, ONES, head_size=4, advantages=ONES).mean
    return policy, mu, float(none.abs().max())


@pytest.mark.parametrize("correction,overrides", CASES, ids=[f"{c}-{'-'.join(o)}" for c, o in CASES])
def test_conditional_mode_equals_the_exact_expectation(setup, correction, overrides):
    policy, mu, scale = setup
    module = module_for(policy, correction, *overrides)
    exact = expected_gradient(module, policy, mu, ONES, head_size=policy.vocab_size, advantages=ONES).mean
    cond = conditional_expectation(module, policy, mu)
    assert scale > 1e-2  # the sampler drifts the uncorrected update
    assert float((cond - exact).abs().max()) <= 1e-6 * scale, float((cond - exact).abs().max())
    if correction.startswith("sc"):
        assert float(cond.abs().max()) <= 1e-6 * scale
    if overrides == ["correction.tis.cap=1.05"] and correction == "tis":
        assert float(cond.abs().max()) > 1e-3 * scale  # the cap binds: TIS leaks, and the mode sees it


def test_top_k_residual_is_the_real_paths_and_zero_with_the_whole_vocabulary(setup):
    policy, mu, _ = setup
    module = module_for(policy, "sc")
    for k in (1, 2):
        exact = expected_gradient(module, policy, mu, ONES, head_size=k, advantages=ONES).mean
        # the conditional mode reads the full record and takes its first k entries as the head
        cond = conditional_expectation(module, policy, mu, head_size=k)
        assert float(exact.abs().max()) > 1e-4  # a residual to compare
        assert float((cond - exact).abs().max()) <= 1e-6 * float(exact.abs().max()) + 1e-9
    full = conditional_expectation(module, policy, mu, head_size=4)
    assert float(full.abs().max()) == 0.0  # q is 0 identically with k = V: exactly no residual


@pytest.mark.parametrize(
    "correction,overrides",
    [("tis", ["correction.tis.cap=1.05"]), ("mis", ["correction.mis.low=0.8", "correction.mis.high=1.25"])],
)
def test_conditional_metrics_are_the_trainers_in_expectation(setup, correction, overrides):
    """The conditional mode's KLs, clip and mask fractions (per-prefix expectations over the vocabulary) equal the
    trainer's own sampled-token metrics averaged exactly over every sequence, token-weighted."""
    policy, mu, _ = setup
    module = module_for(policy, correction, *overrides)
    seqs = all_sequences(policy.vocab_size, policy.length)
    probs = sequence_logprobs(mu, seqs).sum(-1).exp()
    cond, trainer = {}, {}
    for s, p in zip(seqs, probs.tolist()):
        rb = module.build_batch(scored_from(rollouts_from(s[None], mu, policy.vocab_size), torch.ones(1), 1))
        module.start_update(rb)
        got = {}
        conditional_backward(module, rb, metrics=got)
        policy.zero_grad(set_to_none=True)
        stats, _ = module.accumulate_gradients(rb)
        tokens = float(rb.response_mask.sum())  # each side is a token mean: weight it by the sequence's tokens
        for k, v in got.items():
            cond[k] = cond.get(k, 0.0) + p * tokens * v
            trainer[k] = trainer.get(k, 0.0) + p * tokens * float(stats.means()[k])
    fraction = "train/tis_clipfrac" if correction == "tis" else "train/mis_maskfrac"
    assert set(cond) == {"train/train_inference_kl", "train/train_inference_kl_reverse", fraction}
    assert cond[fraction] > 0.05 and cond["train/train_inference_kl"] > 1e-3  # the cap or band binds; a real gap
    for k in cond:
        assert abs(cond[k] - trainer[k]) <= 1e-6 * max(1.0, abs(trainer[k])), (k, cond[k], trainer[k])


def test_tis_conditional_term_is_minus_the_capped_excess():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g, dtype=torch.float64)
    logpi = torch.log_softmax(logits, -1)
    logmu = torch.log_softmax(logits + 0.8 * torch.randn(3, 6, generator=g, dtype=torch.float64), -1)
    cap = 1.2
    coef = -torch.ones_like(logpi)  # REINFORCE with A = 1: the minimised loss's coefficient
    q = conditional_weights(logpi, logmu, WeightFunction(tis_cap=cap), coef, coef[..., :1])
    pi, mu = logpi.exp(), logmu.exp()
    # the ascent direction wrt the logits: Σ_v (−q_v) (e_v − π) against −Σ_v (π_v − C μ_v)_+ (e_v − π)
    ascent = -q - (-q).sum(-1, keepdim=True) * pi
    excess = (pi - cap * mu).clamp(min=0)
    expected = -(excess - excess.sum(-1, keepdim=True) * pi)
    assert float(excess.sum()) > 0.05  # the cap binds somewhere
    torch.testing.assert_close(ascent, expected, atol=1e-12, rtol=0)


def test_bad_input_is_refused(setup):
    policy, mu, _ = setup
    module = module_for(policy, "tis", "correction.tis.level=sequence")
    rb = module.build_batch(scored_from(rollouts_from(all_sequences(4, 2)[:2], mu, 4), torch.ones(2), 1))
    module.start_update(rb)
    with pytest.raises(ValueError, match="token-level weights"):
        conditional_backward(module, rb)
    short = module.build_batch(scored_from(rollouts_from(all_sequences(4, 2)[:2], mu, 2), torch.ones(2), 1))
    with pytest.raises(ValueError, match="full distribution: top-k of 2, vocabulary 4"):
        conditional_backward(module_for(policy, "none"), short)
    with pytest.raises(ValueError, match="sequence masks"):
        conditional_backward(module_for(policy, "opsm"), rb)
    # the sampled tail: no conditional form here (its drift is 0 in expectation over its draws, by construction)
    with pytest.raises(ValueError, match="correction=sc with sc.tail=sampled: the conditional mode computes the"):
        conditional_backward(module_for(policy, "sc", "correction.sc.tail=sampled"), rb)
