"""On-policy distillation (issue 40): the per-token reverse KL to a frozen teacher in the advantage or as its own
loss term; its hand values and its expectation on a tabular policy, through the trainer's real update path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.config import compose_config

from lit_rl import objectives as obj
from lit_rl.expectation import (
    TabularPolicy,
    all_sequences,
    expected_gradient,
    num_prefixes,
    prefix_index,
    sequence_logprobs,
)
from lit_rl.run.train import build_module


def test_advantage_form_hand_values():
    """Student [-1, -2], teacher [-1.5, -1], coef 1, A = 0 -> [-0.5, +1.0] (SPEC vector 19); A = 2 adds 2 to each
    valid token, padding stays 0; a teacher equal to the student leaves A exactly."""
    s, t, mask = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.0, 0.0]]), torch.tensor([[1, 1, 0]])
    assert obj.opd_advantages(torch.zeros(1), s, t, 1.0, mask.bool()).tolist() == [[-0.5, 1.0, 0.0]]
    assert obj.opd_advantages(torch.full((1,), 2.0), s, t, 1.0, mask.bool()).tolist() == [[1.5, 3.0, 0.0]]
    assert obj.opd_advantages(torch.full((1,), 2.0), s, s.clone(), 0.7, mask.bool()).tolist() == [[2.0, 2.0, 0.0]]
    with pytest.raises(ValueError, match="must have one shape"):
        obj.opd_advantages(torch.zeros(1), s, t[:, :2], 1.0, mask.bool())


def test_loss_form_value_and_its_own_token_count():
    """coef 0.5, log-probs [-1, -2 | pad]: the loss is 0.5 * sum(gap * logp) / 2 valid tokens and train/opd_kl the mean
    gap; the gradient per token is coef * gap / count."""
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    teacher, mask = torch.tensor([[-1.5, -1.0, -9.0]]), torch.tensor([[True, True, False]])
    loss, kl = obj.opd_loss(logp, teacher, 0.5, mask)
    assert loss.item() == pytest.approx(0.5 * (0.5 * -1.0 + -1.0 * -2.0) / 2) and kl.item() == pytest.approx(-0.25)
    loss.backward()
    assert logp.grad.tolist() == [[0.5 * 0.5 / 2, 0.5 * -1.0 / 2, 0.0]]


def local_kl_gradient(table: torch.Tensor, teacher: torch.Tensor, vocab: int, length: int) -> torch.Tensor:
    """∇ of Σ_t Σ_{h of length t} P(h) KL(π(·|h) ‖ π_teacher(·|h)), the prefix probabilities P held fixed: float64
    [S, V] by enumeration (for length 1: the gradient of KL(π ‖ π_teacher) itself)."""
    theta = table.clone().requires_grad_(True)
    logp, logq = torch.log_softmax(theta, -1), torch.log_softmax(teacher.double(), -1)
    total = theta.new_zeros(())
    for t in range(length):
        for prefix in all_sequences(vocab, t).tolist() if t else [[]]:
            row = prefix_index(prefix, vocab)
            reach = sequence_logprobs(table, torch.tensor([prefix])).sum().exp() if t else torch.tensor(1.0)
            total = total + reach.detach() * (logp[row].exp() * (logp[row] - logq[row])).sum()
    total.backward()
    return theta.grad


@pytest.mark.parametrize("vocab,length", [(3, 1), (3, 2)])
def test_on_policy_expected_gradient_of_the_distillation_term_is_the_kl_gradient(vocab, length):
    """μ = π, task reward 0, GRPO's update path with the per-token advantages of ``opd_advantages`` (coef 0.7): the
    exact expected gradient over every response equals coef / L · ∇KL(π ‖ π_teacher) (per position, prefixes fixed;
    for L = 1 the KL's own gradient), L the response length (the reduction's 1/T)."""
    policy = TabularPolicy(vocab, length, seed=3)
    teacher = torch.randn(num_prefixes(vocab, length), vocab, generator=torch.Generator().manual_seed(9)).double()
    cfg = compose_config(
        "model=tiny",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={length}",
        "rollout.micro_batch_size=4096",
        "logprob_chunk_tokens=4096",
    )
    module = build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=vocab - 1))
    coef = 0.7

    def advantages(rb):
        student = sequence_logprobs(policy.table(), rb.response_ids.cpu()).float()
        teacher_lp = sequence_logprobs(teacher, rb.response_ids.cpu()).float()
        return obj.opd_advantages(torch.zeros(len(rb)), student, teacher_lp, coef, rb.response_mask)

    got = expected_gradient(module, policy, policy.table(), lambda seqs: torch.zeros(len(seqs)), advantages=advantages)
    want = coef / length * local_kl_gradient(policy.table(), teacher, vocab, length)
    assert got.mass == pytest.approx(1.0)
    assert torch.allclose(got.mean, want, atol=1e-6), (got.mean, want)
    assert float(want.abs().max()) > 1e-2  # a gradient to compare, not two zeros
