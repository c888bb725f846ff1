"""GDPO in expectation (issue 40): ``advantage.multi_reward=normalize_then_sum`` against sum-then-normalise, by
exact enumeration of every group on a tabular policy (``lit_rl.expectation``), through the trainer's own update.

Two reward functions of different scales on one-token responses (V = 3): r1 = [0, 1, 1], r2 = [0, 1, 4], weights
[1, 1]. They never order two tokens oppositely: where they do, a group's normalised rewards can cancel, and GDPO's
whitening over that group then turns the eps-sized residual into O(1) advantages (pinned in the last test), a
property of one-group steps that would swamp any comparison here. The advantages are
``objectives.gdpo_advantages`` (GDPO) and ``objectives.group_advantages`` of the weighted sum (GRPO's), computed
per enumerated group (one group per batch, so GDPO's whitening over the step is over the
group); the gradient is the trainer's (``build_batch``, ``start_update``, ``accumulate_gradients``). The harness
replaces the algorithm's advantages with these (``expected_gradient``'s ``advantages``), as the module has no
data module there to name the rewards; tests/test_gdpo.py runs the algorithm's own wiring.

What holds, exactly (population std, eps 1e-6):
- both expected gradients equal an independent float64 enumeration, and they differ;
- GDPO with one reward weighted 0 is GRPO on the other (to the eps terms);
- GDPO with ``advantage.alpha=0`` (each reward only centred) is sum-then-normalise with alpha = 1;
- G = 2: each is the exact gradient of a pairwise win rate against the current policy, −∇_θ E_{y~π_θ, y'~sg π}
  [U(y, y')], with U the sign of the weighted reward difference (sum) or of the weighted sum of each reward's sign
  (GDPO); with these co-monotone rewards the two votes coincide, so both follow the same win rate at G = 2 and
  differ from G = 3 on, where each reward's own group std enters.
"""

import itertools
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config

from lit_rl import objectives as obj
from lit_rl.expectation import TabularPolicy, expected_gradient
from lit_rl.run.train import build_module

R1 = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
R2 = torch.tensor([0.0, 1.0, 4.0], dtype=torch.float64)
EPS = 1e-6


def parts_of(rb):
    """float32 [N, 2]: each row's r1 and r2 (its one response token)."""
    y = rb.response_ids[:, 0]
    return torch.stack([R1[y], R2[y]], -1).float()


def gdpo(weights, alpha=1.0):
    return lambda rb: obj.gdpo_advantages(parts_of(rb), weights, rb.group_ids, alpha, EPS)[0]


def summed(weights, alpha=1.0):
    w = torch.tensor(weights)
    return lambda rb: obj.group_advantages(parts_of(rb) @ w, rb.group_ids, alpha=alpha, eps=EPS)


def expected(policy, group_size, advantages):
    cfg = compose_config(
        "model=tiny",
        "trainer.precision=32-true",
        "sampling.max_new_tokens=1",
        "rollout.micro_batch_size=64",
        "algo=grpo",
        f"rollout.group_size={group_size}",
    )
    module = build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))
    total = lambda seqs: torch.zeros(len(seqs))  # noqa: E731  (replaced by ``advantages``)
    return expected_gradient(module, policy, policy.table(), total, group_size, advantages=advantages, per_batch=True)


def whiten(x, alpha=1.0):
    """(x − mean x) / (population std x + eps)^alpha, float64."""
    return (x - x.mean()) / (x.std(unbiased=False) + EPS) ** alpha


def enumerated(policy, group_size, advantage_of):
    """Independent E_π[ĝ] (float64, no trainer): −(1/G) Σ_groups π(group) Σ_i A_i (e_{y_i} − π), the gradient of GRPO's
    loss w.r.t. the one logit row at ratio 1 (one-token responses: T_i = 1)."""
    pi = torch.softmax(policy.table()[0], -1)
    eye = torch.eye(policy.vocab_size, dtype=torch.float64)
    out = torch.zeros_like(pi)
    for group in itertools.product(range(policy.vocab_size), repeat=group_size):
        y = torch.tensor(group)
        a = advantage_of(y)
        out -= pi[y].prod() / group_size * sum(a[i] * (eye[group[i]] - pi) for i in range(group_size))
    return out[None]


def gdpo_reference(y, weights=(1.0, 1.0), alpha=1.0):
    return whiten(weights[0] * whiten(R1[y], alpha) + weights[1] * whiten(R2[y], alpha))


def sum_reference(y, weights=(1.0, 1.0), alpha=1.0):
    return whiten(weights[0] * R1[y] + weights[1] * R2[y], alpha)


@pytest.fixture(scope="module")
def policy():
    return TabularPolicy(3, 1, seed=11)


def test_gdpo_and_sum_then_normalise_match_the_enumeration_and_differ(policy):
    got_gdpo = expected(policy, 3, gdpo([1.0, 1.0])).mean
    got_sum = expected(policy, 3, summed([1.0, 1.0])).mean
    ref_gdpo, ref_sum = enumerated(policy, 3, gdpo_reference), enumerated(policy, 3, sum_reference)
    scale = float(ref_sum.abs().max())
    torch.testing.assert_close(got_gdpo, ref_gdpo, atol=1e-6 * scale, rtol=0)
    torch.testing.assert_close(got_sum, ref_sum, atol=1e-6 * scale, rtol=0)
    # they differ by 2.3% of ‖E ĝ‖ (the enumeration: 0.0226), far above the 1e-6 the trainer's path agrees to
    assert float((ref_gdpo - ref_sum).norm()) == pytest.approx(0.0226 * float(ref_sum.norm()), rel=0.01)


def test_gdpo_with_one_reward_weighted_zero_is_grpo_on_the_other(policy):
    """S = A1 (r2's weight 0), whitened over the group: A1 / (std A1 + eps) with std A1 = s / (s + eps), i.e. A1
    up to the eps terms (relative 1e-6)."""
    got = expected(policy, 3, gdpo([1.0, 0.0])).mean
    grpo_r1 = expected(policy, 3, summed([1.0, 0.0])).mean
    torch.testing.assert_close(got, grpo_r1, atol=1e-5 * float(grpo_r1.abs().max()), rtol=0)
    assert float(grpo_r1.abs().max()) > 1e-2


def test_gdpo_without_the_group_std_is_sum_then_normalise(policy):
    """alpha = 0: A_k = r_k − mean r_k, so S = R − mean R with R = Σ w_k r_k, and the whitening makes it
    (R − mean R) / (std R + eps): GRPO's sum-then-normalise advantage, exactly."""
    for weights in ([1.0, 1.0], [1.0, 0.25]):
        got = expected(policy, 3, gdpo(weights, alpha=0.0)).mean
        ref = expected(policy, 3, summed(weights, alpha=1.0)).mean
        torch.testing.assert_close(got, ref, atol=1e-6 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("which", ["gdpo", "sum"])
def test_at_group_size_two_each_is_the_exact_gradient_of_a_pairwise_win_rate(policy, which):
    """G = 2: a group's advantages are ±(its vote) (population std of two values is half their gap), so
    E[ĝ] = −Σ_{y,y'} π(y) π(y') U(y, y') (e_y − π) = −∇_z E_{y~π_z, y'~sg π}[U(y, y')] at z = the logits:
    U(y, y') = sign(Σ_k w_k (r_k(y) − r_k(y'))) for the sum, sign(Σ_k w_k sign(r_k(y) − r_k(y'))) for GDPO (to the eps
    terms)."""
    d1, d2 = R1[:, None] - R1[None, :], R2[:, None] - R2[None, :]
    vote = torch.sign(d1.sign() + d2.sign()) if which == "gdpo" else torch.sign(d1 + d2)
    z = policy.table()[0].clone().requires_grad_(True)
    p = torch.softmax(z, -1)
    win_rate = p @ vote @ p.detach()
    (grad,) = torch.autograd.grad(-win_rate, z)
    got = expected(policy, 2, gdpo([1.0, 1.0]) if which == "gdpo" else summed([1.0, 1.0])).mean
    torch.testing.assert_close(got, grad[None], atol=1e-5 * float(grad.abs().max()), rtol=0)


def test_gdpo_whitening_of_one_group_amplifies_cancelling_rewards():
    """r1 = [1, 0], r2 = [0, 4] in one group of 2: each normalised reward is ±c_k with c_k = (|d_k|/2)/(|d_k|/2 +
    eps), so S = ±(c1 − c2) = ±1.5e-6 (the two rewards' votes tie) and the whitening (S − 0)/(|S| + eps) gives
    ±1.5/2.5 = ±0.6, not 0; summing first gives ±1 (r2's larger gap wins). Over a step of many groups std S is
    O(1) and the residual stays O(eps)."""
    parts = torch.tensor([[1.0, 0.0], [0.0, 4.0]])
    adv, per_reward = obj.gdpo_advantages(parts, [1.0, 1.0], torch.zeros(2, dtype=torch.long), 1.0, EPS)
    torch.testing.assert_close(per_reward.abs(), torch.ones(2, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv, torch.tensor([-0.6, 0.6]), atol=0.05, rtol=0)  # float32: c1 − c2 to a few %
    summed_adv = obj.group_advantages(parts.sum(-1), torch.zeros(2, dtype=torch.long), eps=EPS)
    torch.testing.assert_close(summed_adv, torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0)
