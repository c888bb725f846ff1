"""The sampled tail's noise tool (``lit_rl.tools.tail_noise``): mean 0 over the draws, the second moment the
trainer's own sampled-tail gradient has around full score centring's, and the ratio's jackknife."""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config

from lit_rl.expectation import TabularPolicy, noisy_table, rollouts_from, scored_from, tail_draws
from lit_rl.run.train import build_module
from lit_rl.tools.tail_noise import noise_ratio, tail_noise_backward, tail_noise_weights


def test_tail_noise_weights_average_to_zero_with_the_multinomial_variance():
    g = torch.Generator().manual_seed(0)
    mu = torch.softmax(torch.randn(2, 8, generator=g, dtype=torch.float64), -1).sort(-1, descending=True).values
    k, m = 3, 4
    qs = torch.stack([tail_noise_weights(mu.log(), k, m, g) for _ in range(20000)])
    assert (qs[..., :k] == 0).all()
    mass = 1 - mu[:, :k].sum(-1, keepdim=True)
    p = mu[:, k:] / mass  # μ_tail
    torch.testing.assert_close(qs.mean(0)[:, k:], torch.zeros_like(p), rtol=0, atol=0.01)
    # n_v ~ Binomial(m, p_v): Var(q_v) = mass² p_v (1 − p_v) / m
    torch.testing.assert_close(qs.var(0)[:, k:], mass**2 * p * (1 - p) / m, rtol=0.1, atol=1e-4)
    assert (tail_noise_weights(mu.log(), 8, m, g) == 0).all()  # the whole vocabulary as head: no tail
    with pytest.raises(ValueError, match="tail_samples must be >= 1"):
        tail_noise_weights(mu.log(), k, 0, g)


def test_noise_ratio_and_its_jackknife():
    ratio, se = noise_ratio([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])
    assert ratio == 1.0
    # leave-one-out ratios 5/4, 4/4, 3/4: SE = √(2/3 · (1/16 + 0 + 1/16))
    assert se == pytest.approx(math.sqrt(1 / 12))
    with pytest.raises(ValueError, match=">= 3 paired batches"):
        noise_ratio([1.0, 2.0], [1.0, 1.0])


def module_for(policy, *overrides):
    cfg = compose_config(
        "model=tiny",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={policy.length}",
        "algo=reinforce",
        "algo.baseline=none",
        "correction=sc",
        f"correction.sc.top_k={policy.vocab_size}",
        *overrides,
    )
    return build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))


def gradient(module, policy, rb, backward=None):
    module.start_update(rb)
    rb.advantages = torch.ones(len(rb))
    policy.zero_grad(set_to_none=True)
    module.accumulate_gradients(rb) if backward is None else backward(rb)
    return policy.gradient()


def test_the_tools_noise_is_the_sampled_tails_deviation_from_full_centring():
    # V = 4, L = 2, one sequence, a head of k = 2 and m = 1: E_draws‖ξ‖² from the tool (Monte Carlo) equals the
    # exact Σ_draws p(draw) ‖g_sampled(draw) − g_full‖², both gradients through the trainer's real path
    policy = TabularPolicy(4, 2, seed=5)
    mu = noisy_table(policy.table(), 0.6, seed=6)
    seq = torch.tensor([[2, 1]])
    full_module = module_for(policy, "correction.sc.mode=exact")
    sampled_module = module_for(policy, "correction.sc.tail=sampled", "correction.sc.tail_samples=1")

    def batch(head_size, tail_ids=None):
        return full_module.build_batch(scored_from(rollouts_from(seq, mu, head_size, tail_ids), torch.ones(1), 1))

    g_full = gradient(full_module, policy, batch(4))
    ids, logp = tail_draws(seq[0], mu, 2, 1)
    exact = 0.0
    for draw, lp in zip(ids, logp.tolist()):
        g = gradient(sampled_module, policy, batch(2, draw[None]))
        exact += math.exp(lp) * float(((g - g_full) ** 2).sum())
    assert exact > 1e-4  # the draws move the gradient
    gen = torch.Generator().manual_seed(1)
    noise = [
        gradient(full_module, policy, batch(4), lambda rb: tail_noise_backward(full_module, rb, 2, 1, gen))
        for _ in range(1500)
    ]
    stacked = torch.stack(noise)
    assert float(stacked.mean(0).abs().max()) < 0.1 * math.sqrt(exact)  # 0 in expectation (SE <= 0.026)
    assert float((stacked**2).sum((1, 2)).mean()) == pytest.approx(exact, rel=0.1)
