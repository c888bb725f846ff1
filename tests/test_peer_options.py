"""What the peers (verl, TRL, OpenRLHF) offer that users switch on, as lit_rl options (issue 22).

Each option has a value test from a hand-derived input; where verl or TRL implement the same convention, a
test vector computed here with the formula they use (written from their documented formula, not their code).
The identities in expectation (on-policy: a correction does not change E[ĝ]; constant reward: centred
estimators do not drift) are in tests/test_corrections_expectation.py, which runs every registered algorithm.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from faulty_tasks import LeadingSpaceTask
from helpers import compose_config
from test_algorithms import cfg_for as algo_cfg
from test_algorithms import fit

from lit_rl import objectives as obj
from lit_rl.config import ConfigError, validate
from lit_rl.corrections import WeightFunction, correction_weights
from lit_rl.expectation import (
    TabularPolicy,
    all_sequences,
    batch_gradient,
    rollouts_from,
    scored_from,
    sequence_logprobs,
)
from lit_rl.logprobs import response_logprobs
from lit_rl.run.train import build_module


def cfg_for(*overrides):
    return compose_config("model=tiny", *overrides)


# ----------------------------------------------------------------------------------------------
# 1. Dual-clip PPO (Ye et al. 2020; verl clip_ratio_c) and TRL's two-sided delta
# ----------------------------------------------------------------------------------------------


def one_token(ratio: float):
    """A one-token batch with log(π_θ/π_old) = log ratio; returns (logprobs with grad, old_logprobs)."""
    lp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    return lp, torch.zeros(1, 1, dtype=torch.float64)


@pytest.mark.parametrize("c, loss_value, grad_value", [(None, 4.0, 4.0), (3.0, 3.0, 0.0)])
def test_dual_clip_issue_vector(c, loss_value, grad_value):
    # A = -1, r = 4, eps = 0.2, c = 3: loss min(max(4, 1.2), 3) = 3, no gradient; without: 4 and -A*r = 4
    lp, old = one_token(4.0)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    loss, low, high = obj.ppo_clip_loss(lp, old, adv, 0.2, 0.2, clip_ratio_c=c)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert float(loss.detach()) == pytest.approx(loss_value)
    assert float(grad) == pytest.approx(grad_value)
    assert not low.any() and not high.any()  # neither ordinary clip binds at r = 4 with A < 0
    assert bool(obj.dual_clip_binds(lp.detach() - old, adv, 0.2, c, None).all()) == (c is not None)
    # the coefficient score centering uses is autograd's gradient
    coef = obj.ppo_clip_coef((lp.detach() - old)[..., None], adv, 0.2, 0.2, clip_ratio_c=c)
    assert float(coef) == pytest.approx(grad_value)


def verl_dual_clip(ratio, adv, eps, c):
    """verl's documented dual clip: pg1 = -A r, pg2 = -A clip(r), clip1 = max(pg1, pg2), pg3 = -A c,
    clip2 = min(pg3, clip1); loss = clip2 where A < 0 else clip1."""
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)
    clip1 = torch.maximum(pg1, pg2)
    return torch.where(adv < 0, torch.minimum(-adv * c, clip1), clip1)


def trl_delta(ratio, adv, eps_low, eps_high, delta):
    """TRL's two-sided GRPO loss: coef_1 = min(r, delta), coef_2 = clip(r); loss = -min(coef_1 A, coef_2 A)."""
    return -torch.minimum(ratio.clamp(max=delta) * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def test_dual_clip_and_delta_match_the_peers_formulas_and_autograd():
    g = torch.Generator().manual_seed(0)
    log_r = (torch.randn(6, 50, generator=g, dtype=torch.float64) * 0.8).requires_grad_()
    adv = torch.randn(6, 50, generator=g, dtype=torch.float64)
    ratio = log_r.detach().exp()
    old = torch.zeros_like(log_r)
    for kw, ref in (
        (dict(clip_ratio_c=3.0), verl_dual_clip(ratio, adv, 0.2, 3.0)),
        (dict(delta=1.5), trl_delta(ratio, adv, 0.2, 0.28, 1.5)),
        (dict(delta=1.1), trl_delta(ratio, adv, 0.2, 0.28, 1.1)),  # delta inside the clip range
    ):
        eps_high = 0.2 if "clip_ratio_c" in kw else 0.28
        loss, _, _ = obj.ppo_clip_loss(log_r, old, adv, 0.2, eps_high, **kw)
        torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=1e-12)
        (grad,) = torch.autograd.grad(loss.sum(), log_r)
        coef = obj.ppo_clip_coef(log_r.detach()[..., None], adv, 0.2, eps_high, **kw)[..., 0]
        torch.testing.assert_close(coef, grad, rtol=0, atol=1e-12)
    # delta > 1 + eps_high is the dual clip with c = delta
    a, _, _ = obj.ppo_clip_loss(log_r, old, adv, 0.2, 0.28, delta=1.5)
    b, _, _ = obj.ppo_clip_loss(log_r, old, adv, 0.2, 0.28, clip_ratio_c=1.5)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.clip_ratio_c=0.9"], r"algo.clip_ratio_c=0.9 is not allowed: null \(off\) or a number > 1"),
        (["algo=cispo", "algo.clip_ratio_c=3"], r"algo.clip_ratio_c=3 is not allowed: cispo's objective has no PPO"),
        (["algo=gspo", "algo.delta=2"], r"algo.delta=2 is not allowed: gspo's objective has no PPO clip"),
        (["algo.clip_ratio_c=3", "algo.delta=2"], r"are both set"),
    ],
)
def test_dual_clip_refused_where_it_means_nothing(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(*overrides))


@pytest.mark.parametrize("algo", ["ppo", "grpo", "dapo", "dr_grpo"])
def test_dual_clip_accepted_for_the_ppo_clip_family(algo):
    validate(cfg_for(f"algo={algo}", "algo.clip_ratio_c=3"))


def test_dual_clip_fraction_is_its_own_metric():
    # r = 4 (A < 0: dual clip binds), r = 0.5 (A < 0: the ordinary lower clip), r = 1.2 (A < 0, delta 1.1: the
    # clipped branch r still wins, no clip), r = 1.05 (A > 0, delta 1.02: the cap binds below 1 + eps)
    log_r = torch.tensor([[4.0, 0.5, 1.2, 1.05]]).log()
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0]])
    assert obj.dual_clip_binds(log_r, adv, 0.2, 3.0, None).tolist() == [[True, False, False, False]]
    assert obj.dual_clip_binds(log_r, adv, 0.2, None, 1.02).tolist() == [[True, False, False, True]]


# ----------------------------------------------------------------------------------------------
# 2. Advantage conventions: advantage.std (population | sample), advantage.scale (group | batch | none)
# ----------------------------------------------------------------------------------------------


def test_std_conventions_on_the_issue_example():
    rewards, groups = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0])
    population = obj.group_advantages(rewards, groups, eps=1e-6)
    assert population.tolist() == pytest.approx([0.999998, -0.999998], abs=1e-6)  # 0.5 / (0.5 + 1e-6)
    sample = obj.group_advantages(rewards, groups, eps=1e-6, std="sample")
    assert sample.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)], rel=1e-12)
    # verl's GRPO outcome advantage: (r - mean) / (torch.std(r) + 1e-6), torch.std being the sample std
    verl = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    torch.testing.assert_close(sample, verl, rtol=1e-12, atol=0)
    assert verl.tolist() == pytest.approx([0.70711, -0.70711], abs=5e-6)
    # TRL's GRPOTrainer: (r - mean) / (std + 1e-4), std the sample std; its eps is advantage.eps here
    trl = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    assert trl.tolist() == pytest.approx([0.70700, -0.70700], abs=1e-5)  # 0.707007: the issue quotes 0.70700
    torch.testing.assert_close(obj.group_advantages(rewards, groups, eps=1e-4, std="sample"), trl, rtol=1e-12, atol=0)


def test_batch_scale_is_trls_scale_rewards_batch():
    # two groups: [1, 0, 0, 0] and [1, 1, 0, 1]; centred by the group mean, divided by the std of all 8 rewards
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25], dtype=torch.float64)
    trl = centred / (rewards.std() + 1e-4)  # TRL: rewards.std() over the batch, sample std
    got = obj.group_advantages(rewards, groups, eps=1e-4, std="sample", scale="batch")
    torch.testing.assert_close(got, trl, rtol=1e-12, atol=0)
    # by hand: mean 0.5, sum of squared deviations 8 * 0.25 = 2, sample std sqrt(2/7)
    assert float(got[0]) == pytest.approx(0.75 / (math.sqrt(2 / 7) + 1e-4), rel=1e-12)
    population = obj.group_advantages(rewards, groups, eps=1e-6, scale="batch")
    assert float(population[0]) == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-12)
    # scale=none: the mean-only advantage, as alpha = 0 (TRL scale_rewards="none", Dr.GRPO)
    torch.testing.assert_close(obj.group_advantages(rewards, groups, alpha=0.0, scale="none"), centred)
    torch.testing.assert_close(obj.group_advantages(rewards, groups, alpha=0.0), centred)
    # the moments form (several data-parallel ranks) gives the same std
    half = [obj.masked_sum(x, torch.ones(4, dtype=torch.bool)) for x in (rewards[:4], rewards[4:])]
    sq = [float((x**2).sum()) for x in (rewards[:4], rewards[4:])]
    assert float(obj.std_from_moments(8, sum(half), sum(sq), "sample")) == pytest.approx(math.sqrt(2 / 7))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["advantage.std=unbiased"], r"advantage.std='unbiased' is not allowed: choose one of \['population'"),
        (["advantage.scale=global"], r"advantage.scale='global' is not allowed: choose one of \['group'"),
        (["advantage.scale=none"], r"advantage.scale='none' is not allowed: none means no std division, i.e. adv"),
        (["algo=ppo", "advantage.std=sample"], r"advantage.std='sample' is not allowed: ppo has its own advantage"),
        (["algo=reinforce", "advantage.scale=batch"], r"advantage.scale='batch' is not allowed: reinforce has its"),
        # a new user's case: accepted and silently ignored before (REINFORCE++ whitens over the batch)
        (["algo=reinforce_pp", "advantage.alpha=0.3"], r"advantage.alpha=0.3 is not allowed: reinforce_pp has its"),
        # the same class: a clip the algorithm never reads
        (["algo=sapo", "algo.clip.eps_high=0.28"], r"algo.clip.eps_high=0.28 is not allowed: algo=sapo does not read"),
        (["algo=reinforce", "algo.clip.eps_low=0.1"], r"algo.clip.eps_low=0.1 is not allowed: algo=reinforce does not"),
    ],
)
def test_contradictory_advantage_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(*overrides))


def test_advantage_settings_accepted():
    validate(cfg_for("advantage.scale=none", "advantage.alpha=0"))
    validate(cfg_for("algo=dr_grpo", "advantage.scale=none"))  # dr_grpo sets alpha 0
    validate(cfg_for("advantage.std=sample", "advantage.scale=batch", "advantage.eps=1e-4"))


# ----------------------------------------------------------------------------------------------
# 3. TIS lower bound (TRL clip_min), geometric-mean MIS (verl's geometric rejection)
# ----------------------------------------------------------------------------------------------


def test_tis_lower_bound_is_trls_clip_min():
    # weights pi_old / mu = 0.3, 1.0, 3.0: TRL's token_truncate with clip_min 0.5, clip_max 2 gives
    # clamp(w, 0.5, 2) = 0.5, 1, 2; without the lower bound 0.3, 1, 2
    w = torch.tensor([[0.3, 1.0, 3.0]])
    old, rollout, mask = w.log(), torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool)
    for low, expected_w in ((0.5, [0.5, 1.0, 2.0]), (None, [0.3, 1.0, 2.0])):
        rule = WeightFunction(tis_cap=2.0, tis_low=low)
        weights, *_, metrics = correction_weights(old, rollout, mask, rule)
        assert weights.tolist()[0] == pytest.approx(expected_w)
        assert weights.tolist()[0] == pytest.approx(w.clamp(min=low, max=2.0).tolist()[0])  # TRL's formula
        assert float(metrics["tis_clipfrac"]) == pytest.approx(1 / 3)
        assert ("tis_clipfrac_low" in metrics) == (low is not None)
    with pytest.raises(ValueError, match="TIS lower bound"):
        WeightFunction(tis_cap=2.0, tis_low=1.5)


def test_geometric_mis_keeps_each_kept_tokens_own_weight():
    # row 0: w = 1.5, 2.5 -> geometric mean sqrt(3.75) = 1.94 inside [0.5, 2]: both kept, each with its own w
    # (token-level MIS would drop the 2.5); row 1: w = 2.5, 2.5 -> 2.5 outside: both dropped
    w = torch.tensor([[1.5, 2.5], [2.5, 2.5]])
    old, rollout, mask = w.log(), torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool)
    weighted = WeightFunction(mis_band=(0.5, 2.0), mis_level="geometric")
    weights, _, _, scale, metrics = correction_weights(old, rollout, mask, weighted)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 2.5], [0.0, 0.0]]))
    assert float(metrics["mis_maskfrac"]) == 0.5
    torch.testing.assert_close(scale, torch.full((2, 2), 0.5))
    # verl's geometric rejection: exp(mean_t log w_t) outside [low, high] drops the sequence; mask only
    geo = w.log().mean(-1).exp()
    keep = ((geo >= 0.5) & (geo <= 2.0))[:, None].expand_as(w)
    mask_only, *_ = correction_weights(
        old, rollout, mask, WeightFunction(mis_band=(0.5, 2.0), mis_level="geometric", mis_weighted=False)
    )
    torch.testing.assert_close(mask_only, keep.float())
    # padding does not enter the mean: row [1.5, pad] with a huge padded value is kept at w = 1.5
    pad_mask = torch.tensor([[True, False]])
    weights, *_ = correction_weights(torch.tensor([[math.log(1.5), 50.0]]), torch.zeros(1, 2), pad_mask, weighted)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.0]]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["correction=tis", "correction.tis.low=1.5"], r"correction.tis.low=1.5 is not allowed: null \(no lower"),
        (["correction=tis", "correction.tis.low=0"], r"correction.tis.low=0 is not allowed"),
        (["correction=tis", "correction.tis.level=geometric"], r"correction.tis.level='geometric' is not allowed"),
        (["correction=mis", "correction.mis.level=geo"], r"correction.mis.level='geo' is not allowed: choose 'token'"),
    ],
)
def test_correction_options_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(*overrides))


# ----------------------------------------------------------------------------------------------
# 4. Entropy bonus: loss.entropy_coef
# ----------------------------------------------------------------------------------------------


def test_entropy_has_the_samplers_distribution_and_its_gradient():
    # one prefix, V = 4: logits z, temperature 0.5, top-k 2 -> the sampler's p = softmax(z[top2] / 0.5)
    z = torch.tensor([[1.0, 0.2, -0.5, 0.7]], dtype=torch.float64)
    policy = TabularPolicy(4, 1, z)
    one = torch.ones(1, 1, dtype=torch.bool)
    scores = response_logprobs(
        policy, torch.zeros(1, 1, dtype=torch.long), one, torch.tensor([[0]]), one, 0.5, top_k=2, entropy_grad=True
    )
    theta = policy.lm_head.weight  # [V, S] = z^T
    (grad,) = torch.autograd.grad(scores.entropy.sum(), theta)
    zz = z.T.clone().requires_grad_()
    p = torch.softmax(zz[[0, 3], 0] / 0.5, -1)
    h = -(p * p.log()).sum()
    (ref_grad,) = torch.autograd.grad(h, zz)
    assert float(scores.entropy.detach()) == pytest.approx(float(h.detach()), rel=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    assert float(grad[1, 0]) == 0.0 and float(grad[2, 0]) == 0.0  # outside the support: no gradient, no NaN
    # without entropy_grad it stays a detached diagnostic
    plain = response_logprobs(policy, torch.zeros(1, 1, dtype=torch.long), one, torch.tensor([[0]]), one, 0.5, top_k=2)
    assert not plain.entropy.requires_grad


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean"])
def test_entropy_bonus_is_reduced_like_the_loss(reduction):
    # the module's gradient with the bonus minus without = -coef * grad of reduce_loss(H, mask, reduction)
    policy = TabularPolicy(3, 2, seed=1)
    seqs = all_sequences(3, 2)[:5]
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    coef = 0.3

    def gradient(entropy_coef):
        cfg = compose_config(
            "model=tiny",
            "trainer.precision=32-true",
            "sampling.max_new_tokens=2",
            f"loss.reduction={reduction}",
            f"loss.entropy_coef={entropy_coef}",
        )
        module = build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=2))
        rollouts = rollouts_from(seqs, policy.table())
        rollouts.response_mask = mask.clone()
        rb = module.build_batch(scored_from(rollouts, torch.tensor([1.0, 0, 1, 0, 1]), 5))
        return batch_gradient(module, policy, rb)

    diff = gradient(coef) - gradient(0.0)
    one = torch.ones(5, 1, dtype=torch.bool)
    scores = response_logprobs(policy, torch.zeros(5, 1, dtype=torch.long), one, seqs, mask, entropy_grad=True)
    policy.zero_grad(set_to_none=True)
    (-coef * obj.reduce_loss(scores.entropy, mask, reduction)).backward()
    torch.testing.assert_close(diff, policy.gradient(), rtol=1e-5, atol=1e-7)
    assert diff.abs().max() > 1e-3


def test_entropy_bonus_value_and_refusal():
    loss = obj.entropy_bonus_loss(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 1.5]]), 0.1)
    torch.testing.assert_close(loss, torch.tensor([[0.95, 1.85]]))
    with pytest.raises(ConfigError, match=r"loss.entropy_coef=-0.1 is not allowed: must be a finite number >= 0"):
        validate(cfg_for("loss.entropy_coef=-0.1"))


# ----------------------------------------------------------------------------------------------
# 5. REINFORCE++ (algo=reinforce_pp), KL in the reward (kl.mode), the adaptive controller (kl.target)
# ----------------------------------------------------------------------------------------------


def pp_module(policy, *overrides):
    cfg = compose_config(
        "model=tiny",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={policy.length}",
        "algo=reinforce_pp",
        *overrides,
    )
    return build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))


def pp_batch(module, policy, seqs, rewards, group_size=2):
    rb = module.build_batch(scored_from(rollouts_from(seqs, policy.table()), rewards, group_size))
    module.start_update(rb)
    return rb


def test_kl_penalised_returns_by_hand():
    # R = 1, kl = [0.1, 0.3], beta = 0.5: G = [1 - 0.5 * 0.4, 1 - 0.5 * 0.3] = [0.8, 0.85]; padding stays 0
    g = obj.kl_penalised_returns(
        torch.tensor([1.0, 0.0]), torch.tensor([[0.1, 0.3], [0.2, 9.0]]), torch.tensor([[1, 1], [1, 0]]).bool(), 0.5
    )
    torch.testing.assert_close(g, torch.tensor([[0.8, 0.85], [-0.1, 0.0]]))


@pytest.mark.parametrize(
    "baseline, expected",
    [
        # rewards [1, 0 | 1, 1], two tokens each, beta 0 (no reference):
        # none: token returns [1,1,0,0,1,1,1,1], mean 3/4, std sqrt(3)/4 -> 1/sqrt(3) and -sqrt(3)
        ("none", [[1 / math.sqrt(3)] * 2, [-math.sqrt(3)] * 2, [1 / math.sqrt(3)] * 2, [1 / math.sqrt(3)] * 2]),
        # group: minus the group mean -> [.5,.5,-.5,-.5,0,0,0,0], mean 0, std sqrt(1/8) -> ±sqrt(2), 0
        ("group", [[math.sqrt(2)] * 2, [-math.sqrt(2)] * 2, [0.0, 0.0], [0.0, 0.0]]),
    ],
)
def test_reinforce_pp_advantages_of_a_two_group_batch(baseline, expected):
    policy = TabularPolicy(3, 2, seed=0)
    module = pp_module(policy, f"algo.baseline={baseline}", "kl.beta=0")
    seqs = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 1]])
    rb = pp_batch(module, policy, seqs, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(rb.advantages, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_reinforce_pp_folds_the_reference_kl_into_the_returns():
    # the reference is the initial policy; the trained policy has moved: k1 = log pi_old - log pi_ref per token
    policy = TabularPolicy(3, 2, seed=0)
    module = pp_module(policy, "kl.beta=0.5")
    with torch.no_grad():
        policy.lm_head.weight.add_(
            0.7 * torch.randn(policy.lm_head.weight.shape, generator=torch.Generator().manual_seed(1))
        )
    seqs = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 1]])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rb = pp_batch(module, policy, seqs, rewards)
    ref_table = module.ref_policy.table()
    kl = (sequence_logprobs(policy.table(), seqs) - sequence_logprobs(ref_table, seqs)).float()  # k1 [4, 2]
    g = rewards[:, None] - 0.5 * torch.stack([kl[:, 0] + kl[:, 1], kl[:, 1]], -1)  # R - beta * sum_{s>=t} kl_s
    expected = (g - g.mean()) / (g.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(rb.advantages, expected, rtol=1e-4, atol=1e-5)
    assert float(kl.abs().max()) > 0.05  # the KL is not negligible
    assert module.reward_kl == pytest.approx(float(kl.sum(-1).mean()), rel=1e-5)  # the controller's KL per sequence


def test_adaptive_kl_controller_after_three_steps_by_hand():
    # Ziegler et al. 2019: beta *= 1 + clip(KL/target - 1, -0.2, 0.2) * n_steps / horizon; beta0 0.1, target 6,
    # horizon 10000, 512 sequences per step (K = 0.0512); KL 12 (e = +0.2, clipped), 3 (e = -0.2, clipped), 7 (1/6)
    by_hand = 0.1 * (1 + 0.2 * 0.0512) * (1 - 0.2 * 0.0512) * (1 + (1 / 6) * 0.0512)
    assert by_hand == pytest.approx(0.10084276, abs=1e-8)  # 0.1 * 1.01024 * 0.98976 * 1.0085333
    beta = 0.1
    for kl in (12.0, 3.0, 7.0):
        beta = obj.adaptive_kl_coef(beta, kl, 6.0, 10000, 512)
    assert beta == pytest.approx(by_hand, rel=1e-12)
    # the module's wiring: each step logs the beta it used and moves it for the next (kl.mode=loss reads the
    # update's train/ref_kl_seq; n_steps = the step's sequences)
    policy = TabularPolicy(3, 2, seed=0)
    module = pp_module(policy, "kl.beta=0.1", "kl.mode=loss", "kl.target=6", "kl.horizon=10000")
    used = [module.adapt_kl_coef({"train/ref_kl_seq": kl}, 512)["train/kl_coef"] for kl in (12.0, 3.0, 7.0)]
    assert used[0] == 0.1 and used[1] == pytest.approx(0.1 * 1.01024)
    assert module.kl_coef == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["kl.mode=reward", "kl.beta=0.1"], r"kl.mode='reward' is not allowed: grpo's advantage is one number per seq"),
        (["kl.mode=penalty"], r"kl.mode='penalty' is not allowed: choose one of \['loss', 'reward'\]"),
        (["kl.target=6"], r"kl.beta=0.0 is not allowed: must be > 0 with kl.target=6"),
        (["kl.beta=0.1", "kl.target=-1"], r"kl.target=-1 is not allowed"),
        # k1 as a loss term: its gradient beta * grad log pi(y) does not depend on pi_ref (tests/test_kl_expectation.py)
        (["kl.beta=0.1", "kl.estimator=k1"], r"kl.estimator='k1' is not allowed: with kl.mode=loss and kl.beta=0.1"),
        (["algo=reinforce_pp", "kl.beta=0.1", "kl.mode=loss"], r"kl.estimator='k1' is not allowed: .* cannot pull"),
        (["algo=reinforce_pp", "algo.baseline=rloo"], r"algo.baseline='rloo' is not allowed: choose none"),
        (["algo=reinforce_pp", "advantage.scale=batch"], r"advantage.scale='batch' is not allowed: reinforce_pp"),
    ],
)
def test_kl_and_reinforce_pp_settings_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(*overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo=reinforce_pp", "kl.beta=0.1"],  # k1 in the reward: the classic per-token penalty
        ["kl.estimator=k1", "kl.track=true"],  # k1 only logged (beta = 0)
        ["kl.estimator=k2", "kl.beta=0.1"],
        ["kl.beta=0.1"],  # the default k3
    ],
)
def test_k1_is_accepted_where_it_is_not_a_loss_term(overrides):
    validate(cfg_for(*overrides))


@pytest.mark.parametrize(
    "algo, overrides",
    [
        ("reinforce_pp", ["algo.baseline=group"]),
        ("ppo", ["kl.mode=reward", "kl.beta=0.05", "algo.ppo_epochs=1", "algo.num_minibatches=1"]),
    ],
)
def test_two_step_run_with_the_kl_in_the_reward_and_an_adaptive_beta(algo, overrides):
    # 2 RL steps of the tiny model: beta of step 2 is the controller's update of step 1's, from the KL per
    # sequence step 1 measured and its 16 sequences (a horizon of 16 makes the factor 1 + e)
    cfg = algo_cfg(algo, *overrides, "kl.target=0.5", "kl.horizon=16", "optim.lr=3e-2")
    steps, module = fit(cfg, LeadingSpaceTask(), steps=2)
    assert len(steps) == 2 * module.updates_per_step
    first, second = steps[0], steps[-1]
    beta0 = float(cfg.kl.beta)
    assert first["train/kl_coef"] == pytest.approx(beta0)
    kl = first["train/ref_kl_seq"]
    assert second["train/kl_coef"] == pytest.approx(obj.adaptive_kl_coef(beta0, kl, 0.5, 16, 16), rel=1e-6)
    assert second["train/ref_kl_seq"] > 0  # the policy moved away from the reference
    assert second["train/kl_coef"] != beta0
    assert math.isfinite(second["train/loss"])


# ----------------------------------------------------------------------------------------------
# 6. SAPO: the soft gate sigma(tau (r - 1)) * 4 / tau (arXiv 2511.20347; TRL and verl implement it)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ratio, adv, loss_value, grad_value",
    [
        (1.0, 1.0, -2.0, -1.0),  # on-policy: f(1) = 2 / tau_pos, the gradient REINFORCE's -A
        (math.e, 1.0, -4 * (1 / (1 + math.exp(-(math.e - 1)))), -1.402203349698022),  # PPO's clip: 0
        (0.5, -1.0, 1.4159383303033666, 0.4670699116426963),  # A < 0: tau_neg = 1.05
    ],
)
def test_sapo_gate_values(ratio, adv, loss_value, grad_value):
    lp, old = one_token(ratio)
    a = torch.tensor([adv], dtype=torch.float64)
    loss = obj.sapo_loss(lp, old, a, 1.0, 1.05)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert float(loss.detach()) == pytest.approx(loss_value, rel=1e-12)
    assert float(grad) == pytest.approx(grad_value, rel=1e-12)
    coef = obj.sapo_coef((lp.detach() - old)[..., None], a, 1.0, 1.05)
    assert float(coef) == pytest.approx(grad_value, rel=1e-12)
    # the documented formula (TRL, verl, ms-swift): loss = -sigmoid(tau (r - 1)) * 4 / tau * A
    tau = 1.0 if adv > 0 else 1.05
    assert float(loss.detach()) == pytest.approx(-(1 / (1 + math.exp(-tau * (ratio - 1)))) * 4 / tau * adv, rel=1e-12)


def test_sapo_refuses_the_clip_options_and_bad_temperatures():
    with pytest.raises(ConfigError, match=r"algo.clip_ratio_c=3 is not allowed: sapo's objective has no PPO clip"):
        validate(cfg_for("algo=sapo", "algo.clip_ratio_c=3"))
    with pytest.raises(ConfigError, match=r"algo.sapo.tau_neg=0 is not allowed: must be a number > 0"):
        validate(cfg_for("algo=sapo", "algo.sapo.tau_neg=0"))
    cfg = cfg_for("algo=sapo")
    validate(cfg)
    assert (cfg.algo.sapo.tau_pos, cfg.algo.sapo.tau_neg) == (1.0, 1.05)  # the paper's defaults
