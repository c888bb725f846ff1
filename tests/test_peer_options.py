"""What the peers (verl, TRL, OpenRLHF) offer that users switch on, as lit_rl options (issue 22).

Each option has a value test from a hand-derived input; where verl or TRL implement the same convention, a
test vector computed here with the formula they use (written from their documented formula, not their code).
The identities in expectation (on-policy: a correction does not change E[ĝ]; constant reward: centred
estimators do not drift) are in tests/test_corrections_expectation.py, which runs every registered algorithm.
"""

import math

import pytest
import torch
from helpers import compose_config

from lit_rl import objectives as obj
from lit_rl.config import ConfigError, validate


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
