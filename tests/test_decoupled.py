"""AReaL's decoupled PPO objective (issue 38): ``correction=decoupled`` and ``correction.proximal=loglinear``.

The ratio's denominator is the proximal policy π_prox (π_old, the trainer at the version the update cycle started
from); the sampler μ enters as the weight π_prox/μ, kept up to the cap 5 and masked above it (AReaL's token mask).
``correction.proximal=loglinear`` skips the π_old pass and interpolates log π_prox between log μ and log π_θ by
weight version (``corrections.loglinear_proximal_logprobs``). Hand values on three tokens; in the tabular harness
(``lit_rl.expectation``) the objective's expected gradient with μ ≠ π_prox = π is the on-policy one while the cap
does not bind (one-token responses: token-level weights correct each token, not its prefix) and its bias once it
binds is pinned to a formula; the log-linear π_prox equals the exact π_old at both ends of the interpolation.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config
from test_bypass import BITWISE, TEXT_REWARD, bit_identity

from lit_rl import objectives as obj
from lit_rl.config import ConfigError, validate
from lit_rl.corrections import (
    PROXIMAL_METHODS,
    corrected_policy_loss,
    loglinear_alpha,
    loglinear_proximal_head,
    loglinear_proximal_logprobs,
    weight_function,
)
from lit_rl.expectation import TabularPolicy, expected_gradient, sampler_at_kl
from lit_rl.run.train import build_module, run
from lit_rl.schema import CorrectionConfig

MASK3 = torch.ones(1, 3, dtype=torch.bool)


# ----------------------------------------------------------------------------------------------
# The log-linear proximal policy: hand values and its exact ends
# ----------------------------------------------------------------------------------------------


def test_loglinear_proximal_hand_values():
    """μ = [−1, −2, −3], π_θ = [−1.5, −2.5, −3.5], tokens sampled at versions [3, 4, 5], the cycle started at
    v_prox = 5 and the weights are at v_θ = 7: α = [(5−3)/(7−3), (5−4)/(7−4), (5−5)/(7−5)] = [1/2, 1/3, 0], so
    log π_prox = [−1 − 0.5/2, −2 − 0.5/3, −3] = [−1.25, −2.1667, −3]."""
    mu, current = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -2.5, -3.5]])
    versions = torch.tensor([[3, 4, 5]])
    got = loglinear_proximal_logprobs(mu, current, versions, 5, 7, MASK3)
    torch.testing.assert_close(got, torch.tensor([[-1.25, -2.0 - 0.5 / 3, -3.0]]))
    # AReaL's count (one version per training step, v_prox = v_θ − 1): a token two steps old has α = 1/2
    areal = loglinear_proximal_logprobs(mu[:, :1], current[:, :1], torch.tensor([[5]]), 6, 7, MASK3[:, :1])
    torch.testing.assert_close(areal, torch.tensor([[-1.25]]))


def test_loglinear_proximal_is_exact_at_both_ends():
    """v_θ = v_prox (the cycle's first update): π_θ itself, bit for bit, fresh and stale tokens alike. A token the
    proximal version sampled (v_b = v_prox < v_θ): log μ itself."""
    mu, current = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -2.5, -3.5]])
    versions = torch.tensor([[0, 2, 4]])
    assert torch.equal(loglinear_proximal_logprobs(mu, current, versions, 4, 4, MASK3), current)
    fresh = loglinear_proximal_logprobs(mu, current, torch.full((1, 3), 4), 4, 6, MASK3)
    assert torch.equal(fresh, mu)
    padded = loglinear_proximal_logprobs(mu, current, versions, 4, 6, torch.tensor([[True, True, False]]))
    assert padded[0, 2] == current[0, 2]  # padding: the current value, never an interpolation


def test_loglinear_proximal_at_the_head_ids():
    """Score centering's π_prox at the engine's head: (1 − α) log μ_v + α log π_θ,v with the position's α; μ_v = 0
    (log −inf) stays −inf while α < 1."""
    mu = torch.tensor([[[-1.0, -2.0, -math.inf]]])
    current = torch.tensor([[[-1.5, -2.5, -3.0]]])
    half = loglinear_proximal_head(mu, current, torch.tensor([[0.5]]))
    torch.testing.assert_close(half, torch.tensor([[[-1.25, -2.25, -math.inf]]]))
    assert torch.equal(loglinear_proximal_head(mu, current, torch.tensor([[1.0]])), current)
    assert torch.equal(loglinear_proximal_head(mu, current, torch.tensor([[0.0]])), mu)
    assert torch.equal(loglinear_alpha(torch.tensor([[3, 4, 5]]), 5, 5), torch.ones(1, 3, dtype=torch.float64))


def test_loglinear_proximal_refuses_bad_input():
    mu = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="current_version=3 is older than proximal_version=4"):
        loglinear_proximal_logprobs(mu, mu, torch.zeros(1, 3, dtype=torch.long), 4, 3, MASK3)
    with pytest.raises(ValueError, match="token_versions and mask must have the same shape"):
        loglinear_proximal_logprobs(mu, mu, torch.zeros(1, 2, dtype=torch.long), 4, 5, MASK3)


# ----------------------------------------------------------------------------------------------
# The decoupled objective on three tokens
# ----------------------------------------------------------------------------------------------


def test_decoupled_objective_three_token_hand_values():
    """μ = [0.2, 0.5, 0.1], π_prox = [0.3, 0.5, 0.6], π_θ = [0.39, 0.45, 0.6], A = +1, clip 0.2. Behaviour weights
    π_prox/μ = [1.5, 1, 6]: the third is above the cap 5 and masked (AReaL's token mask, kept weight otherwise).
    Ratios π_θ/π_prox = [1.3, 0.9, 1]: PPO's per-token loss −min(r, clip(r)) = [−1.2, −0.9, −1], times the weights
    [−1.8, −0.9, 0]. Gradient w.r.t. log π_θ: the first is clipped (0), the second −A · r · w = −0.9, the third
    masked (0)."""
    mu = torch.tensor([[0.2, 0.5, 0.1]]).log()
    prox = torch.tensor([[0.3, 0.5, 0.6]]).log()
    logprobs = torch.tensor([[0.39, 0.45, 0.6]]).log().requires_grad_(True)
    advantages = torch.ones(1)
    rule = weight_function(compose_config("model=tiny", "correction=decoupled").correction)
    assert rule.mis_band == (0.0, 5.0) and rule.mis_weighted and rule.tis_cap is None
    pg, _, _ = obj.ppo_clip_loss(logprobs, prox, advantages, 0.2, 0.2)
    loss, metrics = corrected_policy_loss(pg, prox, mu, MASK3, rule)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.8, -0.9, 0.0]]))
    assert float(metrics["mis_maskfrac"]) == pytest.approx(1 / 3)
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.9, 0.0]]))


# ----------------------------------------------------------------------------------------------
# The config: allowed with stale rollout modes, refused where the skipped pass is needed
# ----------------------------------------------------------------------------------------------


def test_proximal_methods_agree_and_loglinear_is_allowed_with_stale_modes():
    assert CorrectionConfig.proximal_methods == PROXIMAL_METHODS
    decoupled = ("model=tiny", "correction=decoupled", "correction.proximal=loglinear")
    for mode in ("sync", "lagged", "async"):
        validate(compose_config(*decoupled, f"rollout.mode={mode}"))


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (["correction.proximal=exact"], "choose one of ['trainer', 'loglinear']"),
        (["correction.proximal=loglinear", "correction.bypass=true"], "correction.bypass=true"),
        (["correction.proximal=loglinear", "correction=m2po"], "m2po (its bound reads pi_old of the whole batch)"),
        (["correction.proximal=loglinear", "correction=tis", "correction.tis.batch_normalize=true"], "tis.batch_norm"),
    ],
)
def test_loglinear_is_refused_where_the_skipped_pass_is_needed(overrides, reason):
    with pytest.raises(ConfigError, match="correction.proximal") as err:
        validate(compose_config("model=tiny", *overrides))
    assert reason in str(err.value)


# ----------------------------------------------------------------------------------------------
# In expectation (tabular harness, the trainer's own update path)
# ----------------------------------------------------------------------------------------------

#: a real reward of each one-token response (both signs)
REWARD = torch.tensor([0.3, -0.2, 0.5, 0.1, -0.4], dtype=torch.float64)


def module_for(policy, algo, *overrides):
    base = [
        "model=tiny",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={policy.length}",
        "rollout.micro_batch_size=4096",
        "logprob_chunk_tokens=4096",
        f"algo={algo}",
        f"correction.sc.top_k={policy.vocab_size}",
    ]
    if algo == "reinforce":
        base.append("algo.baseline=none")
    cfg = compose_config(*base, *overrides)
    return build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))


def reward_of(seqs):
    return REWARD[seqs[:, 0]].float()


def gradient(policy, algo, sampler, *overrides, before=None, advantages=None):
    """E_μ[ĝ] of one-token responses (the engine's head: the whole vocabulary), the real reward as the advantage
    (REINFORCE's own; GRPO's group of one would centre it to 0) unless ``advantages``."""
    module = module_for(policy, algo, *overrides)
    if advantages is None and algo != "reinforce":
        advantages = lambda rb: rb.rewards.clone()  # noqa: E731
    head = policy.vocab_size
    return expected_gradient(
        module, policy, sampler, reward_of, head_size=head, advantages=advantages, before=before
    ).mean


@pytest.fixture(scope="module")
def one_token():
    """V = 5, L = 1; a sampler at KL(π‖μ) = 0.05, whose weights π/μ stay below the cap 5."""
    policy = TabularPolicy(5, 1, seed=7)
    mu, _ = sampler_at_kl(policy.table(), 0.05, seed=8)
    weights = (torch.log_softmax(policy.table(), -1) - torch.log_softmax(mu, -1)).exp()
    assert 1.1 < float(weights.max()) < 5.0 and float(weights.min()) < 0.9  # a real gap, the cap not binding
    return policy, mu, weights[0]


@pytest.mark.parametrize("algo", ["reinforce", "grpo"])
def test_decoupled_expected_gradient_is_the_on_policy_one_while_the_cap_does_not_bind(one_token, algo):
    policy, mu, _ = one_token
    on_policy = gradient(policy, algo, policy.table(), "correction=none")
    uncorrected = gradient(policy, algo, mu, "correction=none")
    decoupled = gradient(policy, algo, mu, "correction=decoupled")
    scale = float(on_policy.abs().max())
    assert float((uncorrected - on_policy).abs().max()) > 1e-2 * scale  # the gap biases the plain update
    assert float((decoupled - on_policy).abs().max()) <= 1e-6 * scale  # exact IS: π_prox/μ undoes it


def test_decoupled_bias_when_the_cap_binds_is_pinned(one_token):
    """Cap 1.1: the tokens with π/μ > 1.1 leave the loss, so E_μ[ĝ] − g = Σ_{y: π_y/μ_y > cap} π_y A_y (e_y − π)
    (the dropped tokens' share of the on-policy gradient g = −Σ_y π_y A_y (e_y − π), REINFORCE's loss −A log π)."""
    policy, mu, weights = one_token
    cap = 1.1
    assert int((weights > cap).sum()) >= 1
    on_policy = gradient(policy, "reinforce", policy.table(), "correction=none")
    capped = gradient(policy, "reinforce", mu, "correction=decoupled", f"correction.mis.high={cap}")
    pi = torch.softmax(policy.table()[0], -1)
    eye = torch.eye(policy.vocab_size, dtype=torch.float64)
    bias = sum(pi[y] * REWARD[y] * (eye[y] - pi) for y in range(policy.vocab_size) if weights[y] > cap)
    scale = float(on_policy.abs().max())
    assert float(bias.abs().max()) > 1e-2 * scale
    torch.testing.assert_close(capped - on_policy, bias[None], atol=1e-6 * scale, rtol=0)


def test_loglinear_proximal_equals_the_exact_pi_old_at_both_ends_of_the_interpolation(one_token):
    """Through the trainer's path, stale rows (sampled 3 versions before the cycle): on the cycle's first update
    (v_θ = v_prox, α = 1) the log-linear π_prox is π_θ = π_old and the gradient is the trainer's (to float32
    rounding: the snapshot is its own forward; bit for bit under batch-invariant kernels, the slow test below). Rows
    the proximal version sampled itself, the weights one update later (v_θ = v_prox + 1, α = 0, here with the
    weights unchanged so that π_old = π_θ): log μ, which is π_old up to float32 rounding for the on-policy sampler."""
    policy, mu, _ = one_token
    overrides = ("correction=decoupled", "algo.ppo_epochs=2")

    def stale(rb):
        rb.token_versions = torch.full_like(rb.token_versions, -3)

    exact = gradient(policy, "grpo", mu, *overrides, before=stale)
    first = gradient(policy, "grpo", mu, *overrides, "correction.proximal=loglinear", before=stale)
    torch.testing.assert_close(first, exact, atol=1e-6 * float(exact.abs().max()), rtol=0)  # the snapshot's pass

    module = module_for(policy, "grpo", *overrides, "correction.proximal=loglinear")

    def proximal_sampled_them(rb):  # the cycle started one version ago and these rows are its own
        module.proximal_version = -1
        rb.token_versions = torch.full_like(rb.token_versions, -1)

    as_reward = lambda rb: rb.rewards.clone()  # noqa: E731
    pi = policy.table()
    on_policy = gradient(policy, "grpo", pi, *overrides)
    interpolated = expected_gradient(
        module, policy, pi, reward_of, head_size=policy.vocab_size, advantages=as_reward, before=proximal_sampled_them
    )
    scale = float(on_policy.abs().max())
    torch.testing.assert_close(interpolated.mean, on_policy, atol=1e-6 * scale, rtol=0)


def test_score_centering_under_the_loglinear_proximal_policy(one_token):
    """``correction=sc`` with ``correction.proximal=loglinear``: on the cycle's first update (stale rows, α = 1) the
    trainer's gradient; at the α = 0 end (rows the proximal version sampled, π_prox = μ at the sampled token and at
    the head ids alike) a constant advantage does not drift under the noisy sampler, GRPO's clip included, while
    the uncentred update does."""
    policy, mu, _ = one_token
    extra = ("algo.ppo_epochs=2",)

    def stale(rb):
        rb.token_versions = torch.full_like(rb.token_versions, -3)

    exact = gradient(policy, "grpo", mu, "correction=sc", *extra, before=stale)
    first = gradient(policy, "grpo", mu, "correction=sc", "correction.proximal=loglinear", *extra, before=stale)
    torch.testing.assert_close(first, exact, atol=1e-6 * float(exact.abs().max()), rtol=0)

    ones = lambda rb: torch.ones(len(rb))  # noqa: E731
    drifts = {}
    for correction in ("none", "sc"):
        module = module_for(policy, "grpo", f"correction={correction}", "correction.proximal=loglinear", *extra)

        def proximal_sampled_them(rb, module=module):
            module.proximal_version = -1
            rb.token_versions = torch.full_like(rb.token_versions, -1)

        drifts[correction] = expected_gradient(
            module, policy, mu, reward_of, head_size=policy.vocab_size, advantages=ones, before=proximal_sampled_them
        ).mean
    scale = float(drifts["none"].abs().max())
    assert scale > 1e-2
    torch.testing.assert_close(drifts["sc"], torch.zeros_like(drifts["sc"]), atol=1e-6 * scale, rtol=0)


# ----------------------------------------------------------------------------------------------
# The recipe (slow)
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # two runs of the recipe
def test_loglinear_under_batch_invariant_kernels_is_bitwise_the_snapshot(tmp_path):
    """Sync rows under ``kernels=batch_invariant``, 2 epochs × 2 minibatches: the first update's π_prox is π_θ
    itself and the later ones' is μ, equal to π_old bit for bit, so every logged value and the final weights
    equal the run with the π_old pass, which loglinear skips (``time/old_logprob_s`` 0)."""
    from safetensors.torch import load_file

    (tmp_path / "reward.py").write_text(TEXT_REWARD)
    reward = f"reward.functions=[{tmp_path}/reward.py:by_text]"
    for name, proximal in (("trainer", "trainer"), ("loglinear", "loglinear")):
        cfg = compose_config(*BITWISE, reward, "correction=decoupled", f"correction.proximal={proximal}")
        run(cfg, tmp_path / name)
    exact, approx = (bit_identity.read_scalars(tmp_path / name) for name in ("trainer", "loglinear"))
    c = bit_identity.compare_scalars(exact, approx)
    assert c.identical, c.first
    assert c.tags > 20 and c.steps == 1
    assert [v for _, v in approx["time/old_logprob_s"]] == [0.0]
    assert all(v > 0 for _, v in exact["time/old_logprob_s"])
    w1, w2 = (load_file(str(tmp_path / name / "policy" / "model.safetensors")) for name in ("trainer", "loglinear"))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


@pytest.mark.slow  # one run of the recipe
def test_decoupled_with_loglinear_trains_lagged_rows_without_the_pi_old_pass(tmp_path):
    """``rollout.mode=lagged`` (rows one RL step = 4 versions old), where bypass is refused: 3 steps of 2 × 2
    updates with no π_old pass, finite losses, and the behaviour weights measured (``train/mis_maskfrac``)."""
    (tmp_path / "reward.py").write_text(TEXT_REWARD)
    overrides = [o for o in BITWISE if not o.startswith(("kernels", "trainer.max_steps"))]
    cfg = compose_config(
        *overrides,
        f"reward.functions=[{tmp_path}/reward.py:by_text]",
        "trainer.max_steps=3",
        "rollout.mode=lagged",
        "rollout.lag=1",
        "correction=decoupled",
        "correction.proximal=loglinear",
    )
    run(cfg, tmp_path / "run")
    s = bit_identity.read_scalars(tmp_path / "run")
    assert len(s["train/loss"]) == 3 and all(math.isfinite(v) for _, v in s["train/loss"])
    assert [v for _, v in s["time/old_logprob_s"]] == [0.0, 0.0, 0.0]
    assert [v > 0 for _, v in s["rollout/staleness_max"]] == [False, True, True]
    assert all(0 <= v <= 1 for _, v in s["train/mis_maskfrac"])
