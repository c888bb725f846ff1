"""Which divergence ``kl.mode=loss`` descends, per ``kl.estimator``: the exact E_π[ĝ] of the trainer's own update
(``lit_rl.expectation``: every sequence of a tabular policy enumerated, the real ``build_module`` /
``accumulate_gradients`` path) against the exact gradient of each divergence, computed here in float64 autograd.

On-policy (the first update of a batch, μ = π_θ = π_old), with d_t = log π(y_t|h_t) − log π_ref(y_t|h_t), the
loss β·k(d_t) per token has the gradient β·k'(d_t)·∇log π(y_t|h_t), whose expectation at each prefix h is
    k1: k' = 1          →  E_π[∇log π] = 0: no gradient at all;
    k2: k' = d          →  E_π[d ∇log π] = ∇ KL(π(·|h) ‖ π_ref(·|h))  (the reverse KL, the one the docs name);
    k3: k' = 1 − e^{−d} →  −E_π[(π_ref/π) ∇log π] = −E_{π_ref}[∇log π] = ∇ KL(π_ref(·|h) ‖ π(·|h))  (forward KL).
Each position's term is weighted by the probability π gives its prefix h_t, held fixed (the loss does not
differentiate which prefixes are reached): per token, the loss descends Σ_t E_{h_t∼π}[D(·|h_t)], which for
responses longer than one token is not the gradient of the sequence-level KL(π ‖ π_ref) (that one also moves
the prefixes: the kl.mode=reward path with k1 is its REINFORCE estimator). docs/configuration.md names these
divergences per estimator; the last test holds the page to what is asserted here.
"""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config

from lit_rl.expectation import TabularPolicy, all_sequences, expected_gradient, noisy_table, prefix_rows
from lit_rl.objectives import k3_knee
from lit_rl.run.train import build_module

ROOT = Path(__file__).resolve().parents[1]
BETA = 0.5
ZERO = lambda rb: torch.zeros(len(rb))  # noqa: E731  (no policy-gradient term: only the KL's gradient is left)

#: kl.estimator -> the divergence its on-policy gradient descends, as docs/configuration.md names it (None: none)
DESCENDS = {"k1": None, "k2": "KL(π ‖ π_ref)", "k3": "KL(π_ref ‖ π)"}


def kl_module(policy, estimator):
    """GRPO with the KL as a loss term (kl.beta = BETA) built from the Hydra config around a tabular policy."""
    cfg = compose_config(
        "model=tiny",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={policy.length}",
        "rollout.micro_batch_size=4096",
        "logprob_chunk_tokens=4096",
        "algo=grpo",
        f"kl.beta={BETA}",
        f"kl.estimator={estimator}",
        "kl.mode=loss",
    )
    return build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))


def setup(vocab, length, sigma=1.0):
    """A tabular policy (N(0, 1) logits, seed 0) and a reference that differs from it by N(0, σ²) logit noise."""
    policy = TabularPolicy(vocab, length, seed=0)
    ref_table = noisy_table(policy.table(), sigma, seed=1)
    return policy, ref_table


def trainer_expected_gradient(policy, ref_table, estimator):
    """Exact E_π[ĝ] of the trainer's update with zero advantages: the KL term's expected gradient, float64 [S, V].
    One batch per sequence (G = 1), weighted by its probability (the KL term is not scaled by the advantages, so
    the harness's one-batch shortcut does not apply)."""
    module = kl_module(policy, estimator)
    with torch.no_grad():
        module.ref_policy.lm_head.weight.copy_(ref_table.T.float())
    return expected_gradient(
        module, policy, policy.table(), lambda s: torch.ones(len(s)), advantages=ZERO, per_batch=True
    ).mean


def reach_probabilities(table, length):
    """float64 [S]: the probability π gives each prefix row (the empty prefix 1), from the sequences' tokens."""
    vocab = table.shape[1]
    seqs = all_sequences(vocab, length)
    rows = prefix_rows(seqs, vocab)
    logp = torch.log_softmax(table.double(), -1)[rows, seqs]  # [N, L]
    reach = torch.zeros(table.shape[0], dtype=torch.float64)
    for t in range(length):
        reach[rows[:, t]] = logp[:, :t].sum(-1).exp()
    return reach


def per_position_gradient(table, ref_table, length, divergence):
    """∇_θ of β/L · Σ_h P_π(h) · D(π(·|h), π_ref(·|h)), the prefixes' probabilities P_π(h) held fixed, float64 [S, V]
    (β/L: GRPO's seq_mean_token_mean of one sequence of L tokens)."""
    theta = table.double().clone().requires_grad_(True)
    logp, logq = torch.log_softmax(theta, -1), torch.log_softmax(ref_table.double(), -1)
    if divergence == "KL(π ‖ π_ref)":
        per_row = (logp.exp() * (logp - logq)).sum(-1)
    else:  # KL(π_ref ‖ π)
        per_row = (logq.exp() * (logq - logp)).sum(-1)
    objective = BETA / length * (reach_probabilities(table, length) * per_row).sum()
    (grad,) = torch.autograd.grad(objective, theta)
    return grad


def sequence_kl_gradient(table, ref_table, length):
    """∇_θ of β/L · KL(π ‖ π_ref) over whole sequences (the prefixes' probabilities differentiated too)."""
    theta = table.double().clone().requires_grad_(True)
    seqs = all_sequences(table.shape[1], length)
    rows = prefix_rows(seqs, table.shape[1])
    logp = torch.log_softmax(theta, -1)[rows, seqs].sum(-1)
    logq = torch.log_softmax(ref_table.double(), -1)[rows, seqs].sum(-1)
    (grad,) = torch.autograd.grad(BETA / length * (logp.exp() * (logp - logq)).sum(), theta)
    return grad


def assert_equal_to_float32(actual, expected):
    """Equal up to the trainer's float32 path: 2e-6 of the gradients' size."""
    scale = float(expected.abs().max())
    assert float((actual - expected).abs().max()) <= 2e-6 * max(scale, 1e-3), (actual, expected)


@pytest.mark.parametrize("vocab, length", [(3, 1), (3, 2)])
@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_the_kl_loss_descends_the_divergence_the_docs_name_for_its_estimator(estimator, vocab, length):
    policy, ref_table = setup(vocab, length)
    # the k3 bound (its tangent beyond pi_ref / pi = 13.61) does not bind on these tables: k3 exact
    ratio = (torch.log_softmax(ref_table, -1) - torch.log_softmax(policy.table(), -1)).max()
    assert float(ratio) < k3_knee()
    grad = trainer_expected_gradient(policy, ref_table, estimator)
    named = per_position_gradient(policy.table(), ref_table, length, DESCENDS[estimator])
    assert float(named.abs().max()) > 0.01  # the reference is far enough for the test to mean something
    assert_equal_to_float32(grad, named)
    # ... and not the other divergence's: the two differ by more than 10% of their size on these tables
    other = next(d for d in DESCENDS.values() if d not in (None, DESCENDS[estimator]))
    other_grad = per_position_gradient(policy.table(), ref_table, length, other)
    assert float((grad - other_grad).abs().max()) > 0.1 * float(named.abs().max())


@pytest.mark.parametrize("vocab, length", [(3, 1), (3, 2)])
def test_k1_as_a_loss_has_no_gradient_in_expectation(vocab, length):
    # E_pi[beta * grad log pi(y)] = beta * grad sum_y pi(y) = 0 at every prefix, whatever the reference
    policy, ref_table = setup(vocab, length)
    grad = trainer_expected_gradient(policy, ref_table, "k1")
    reverse = per_position_gradient(policy.table(), ref_table, length, DESCENDS["k2"])
    assert float(grad.abs().max()) <= 2e-6 * float(reverse.abs().max())


def test_beyond_one_token_the_per_token_kl_is_not_the_sequence_kl_gradient():
    # two tokens: the sequence-level KL also moves which prefixes are reached (sum_{s >= t} d_s weighs grad log
    # pi(y_t)); the per-token loss (k2 included) leaves that term out. Its size here: > 10% of the gradient
    policy, ref_table = setup(3, 2)
    k2 = trainer_expected_gradient(policy, ref_table, "k2")
    whole = sequence_kl_gradient(policy.table(), ref_table, 2)
    assert float((k2 - whole).abs().max()) > 0.1 * float(whole.abs().max())
    # the first token's row holds it: the last position's rows agree (no later tokens to move)
    last = slice(1, 4)  # prefixes of length 1 (rows 1-3 of S = 4)
    assert_equal_to_float32(k2[last], whole[last])


def test_the_docs_name_each_estimators_divergence():
    # docs/configuration.md's kl.estimator row says, per estimator, what the tests above assert
    row = next(
        line
        for line in (ROOT / "docs" / "configuration.md").read_text().splitlines()
        if line.startswith("| `kl.estimator`")
    )
    meaning = row.strip("|").split(" | ")[2]
    for estimator, divergence in DESCENDS.items():
        said = re.search(rf"`{estimator}`[^;]*", meaning)
        assert said, f"{estimator} is not described in {meaning!r}"
        if divergence is None:
            assert "no gradient" in said.group(0), said.group(0)
        else:
            assert divergence in said.group(0), said.group(0)
