"""Corrections right in expectation: exact E_μ[ĝ] of the trainer's own update on enumerable policies.

Every gradient here is computed by lit_rl's real update path (``build_module`` from the Hydra config, then
``build_batch`` / ``start_update`` / ``accumulate_gradients``) on a tabular policy (``lit_rl.expectation``);
the expectation over the sampler μ is an exact sum over every sequence (or every group of G = 2). Float32 on
the trainer's path: identities are asserted to 1e-6 of the gradients' scale.

The identities (SPEC "Composition", test vectors 14-16):
1. μ = π: every correction's E[ĝ] equals ``none``'s, for every algorithm (real rewards, G = 2 groups).
2. A constant advantage (A = 1 on every sequence, so group baselines cannot make the test empty), any μ:
   ``sc``, ``sc+tis`` and ``sc+mis`` (weighted and mask-only) have E[ĝ] = 0 whether or not the cap binds or
   tokens are masked; ``tis`` is 0 until the cap binds and leaks after (the leak pinned to an independent
   formula); ``none`` drifts by E_μ[s̄].
   With a head k < V, score centering's rescaled tail leaves a residual (pinned to its formula) and the sampled
   tail (``correction.sc.tail=sampled``, its draws enumerated too) none, alone and under TIS / MIS.
3. Any reward: untruncated sequence-level importance sampling is unbiased (E_μ[ĝ] = on-policy E_π[ĝ]);
   token-level IS is not, beyond the first token.
4. SPEC vector 15 (V = 2) exactly; vector 16 (MIS keeps the weight and the denominator).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config

from lit_rl.algorithms import ALGORITHMS
from lit_rl.corrections import CORRECTIONS as REGISTERED_CORRECTIONS
from lit_rl.corrections import WeightFunction, corrected_policy_loss, exact_score_centering_term, score_centering_term
from lit_rl.expectation import (
    TabularPolicy,
    all_sequences,
    expected_gradient,
    monte_carlo_gradient,
    noisy_table,
    prefix_rows,
    sampler_at_kl,
    sequence_logprobs,
)
from lit_rl.objectives import reduce_loss
from lit_rl.rejection import m2po_bound
from lit_rl.run.train import build_module

ALGOS = tuple(ALGORITHMS)  # every registered algorithm
#: the corrections that drop whole sequences (``rejection``) and their compositions
MASKED = tuple(name for name in REGISTERED_CORRECTIONS if REGISTERED_CORRECTIONS[name] & {"opsm", "rs", "m2po"})
ONES = lambda rb: torch.ones(len(rb))  # noqa: E731  (a constant advantage on every sequence)

# correction name -> extra overrides (mis_mask = mask-only MIS, verl's rejection sampling)
#: every registered correction, and MIS's mask-only form of each that has MIS
CORRECTIONS = {
    variant: overrides
    for name in REGISTERED_CORRECTIONS
    for variant, overrides in ((name, []), (f"{name}_mask", ["correction.mis.weighted=false"]))
    if variant == name or "mis" in REGISTERED_CORRECTIONS[name]
}


def module_for(policy, algo, correction="none", *overrides):
    """The algorithm's LightningModule built from the real Hydra config around a tabular policy."""
    name = correction.replace("_mask", "")
    base = [
        "model=tiny",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={policy.length}",
        "rollout.micro_batch_size=4096",
        "logprob_chunk_tokens=4096",
        f"algo={algo}",
        f"correction={name}",
        f"correction.sc.top_k={policy.vocab_size}",
        *CORRECTIONS[correction],
    ]
    if algo == "reinforce":
        base.append("algo.baseline=none")
    if algo == "dapo":
        base.append("algo.overlong.enabled=false")  # a constant length: shaping would only shift rewards
    cfg = compose_config(*base, *overrides)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1)
    return build_module(cfg, policy, tokenizer)


def expected(policy, algo, correction, sampler, overrides=(), **kwargs):
    module = module_for(policy, algo, correction, *overrides)
    kwargs.setdefault("reward", lambda seqs: torch.ones(len(seqs)))
    return expected_gradient(
        module, policy, sampler, head_size=kwargs.pop("head_size", policy.vocab_size), **kwargs
    ).mean


def close(a, b, scale, rtol=1e-6):
    """|a - b| <= rtol * scale elementwise (scale: the size of the gradients compared, float32 path)."""
    return float((a - b).abs().max()) <= rtol * max(scale, 1e-3)


# ----------------------------------------------------------------------------------------------
# SPEC vector 15: one token, V = 2, π = (0.5, 0.5), μ = (0.6, 0.4), reward 1, no baseline
# ----------------------------------------------------------------------------------------------

V15 = [
    ("none", [], (-0.1, 0.1)),
    ("tis", ["correction.tis.cap=2"], (0.0, 0.0)),
    ("sc", [], (0.0, 0.0)),
    ("sc+tis", ["correction.tis.cap=2"], (0.0, 0.0)),  # (+0.1, -0.1) when the centred score was multiplied by w_y
    ("sc+mis", ["correction.mis.low=0.5", "correction.mis.high=2"], (0.0, 0.0)),
    ("tis", ["correction.tis.cap=1.1"], (-0.03, 0.03)),  # the cap binds: TIS leaks the drift back
    ("sc+tis", ["correction.tis.cap=1.1"], (0.0, 0.0)),
    ("mis", ["correction.mis.low=0.9", "correction.mis.high=1.5"], (0.25, -0.25)),  # token 0 (w = 5/6) masked
    ("mis_mask", ["correction.mis.low=0.9", "correction.mis.high=1.5"], (0.2, -0.2)),
    ("sc+mis", ["correction.mis.low=0.9", "correction.mis.high=1.5"], (0.0, 0.0)),
    ("sc+mis_mask", ["correction.mis.low=0.9", "correction.mis.high=1.5"], (0.0, 0.0)),
]


@pytest.mark.parametrize("correction,overrides,value", V15, ids=[f"{c}-{'-'.join(o)}" for c, o, _ in V15])
def test_vector_15_two_token_vocabulary(correction, overrides, value):
    policy = TabularPolicy(2, 1, torch.zeros(1, 2, dtype=torch.float64))
    mu = torch.tensor([[0.6, 0.4]], dtype=torch.float64).log()
    grad = expected(policy, "reinforce", correction, mu, overrides)
    torch.testing.assert_close(grad, torch.tensor([value], dtype=torch.float64), atol=1e-7, rtol=0)


def test_vector_16_mis_keeps_the_weight_and_the_denominator():
    # one row, two tokens: w = 1.5 inside [0.5, 2] and w = 2.5 outside; A = +1, ratio 1 (loss -A log pi)
    logprobs = torch.tensor([[math.log(0.3), math.log(0.5)]], requires_grad=True)
    rollout = torch.tensor([[math.log(0.2), math.log(0.2)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    for weighted, kept_loss in ((True, -1.5), (False, -1.0)):
        rule = WeightFunction(mis_band=(0.5, 2.0), mis_weighted=weighted)
        # per-token loss with the log-prob's value replaced by 1 (ratio 1): -A * 1 = -1 before the weight
        loss, metrics = corrected_policy_loss(-torch.ones(1, 2), logprobs.detach(), rollout, mask, rule)
        torch.testing.assert_close(loss, torch.tensor([[kept_loss, 0.0]]))
        assert float(metrics["mis_maskfrac"]) == 0.5
        # the dropped token still counts in the step's denominator: token_mean over 2 tokens
        assert float(reduce_loss(loss, mask, "token_mean")) == pytest.approx(kept_loss / 2)


# ----------------------------------------------------------------------------------------------
# 1. On-policy: no correction changes the expected gradient (real rewards, groups of G = 2)
# ----------------------------------------------------------------------------------------------


def reward_first_equals_last(seqs):
    """A task with signal: 1 when the response's first and last tokens agree."""
    return (seqs[:, 0] == seqs[:, -1]).float()


@pytest.mark.parametrize("algo", ALGOS)
def test_on_policy_every_correction_equals_none(algo):
    policy = TabularPolicy(3, 2, seed=1)
    pi = policy.table()
    kw = dict(reward=reward_first_equals_last, group_size=2)
    reference = expected(policy, algo, "none", pi, **kw)
    assert reference.abs().max() > 1e-3  # the groups carry a gradient
    scale = float(reference.abs().max())
    for correction in CORRECTIONS:
        if correction in MASKED and algo not in ("grpo", "ppo"):
            continue  # masks read only the log-ratios and the advantages' sign: one sequence-, one token-advantage algo
        levels = ("token", "sequence") if correction in ("tis", "mis", "mis_mask", "sc+tis", "sc+mis") else ("token",)
        for level in levels:
            overrides = [f"correction.tis.level={level}", f"correction.mis.level={level}"]
            grad = expected(policy, algo, correction, pi, overrides, **kw)
            assert close(grad, reference, scale), (correction, level, float((grad - reference).abs().max()))


# ----------------------------------------------------------------------------------------------
# 2. A constant advantage: the centred corrections do not drift, whatever the cap or band
# ----------------------------------------------------------------------------------------------


def reference_drift(policy, sampler, rule, centred, reduction_weight, advantage=1.0, keep=None):
    """Independent formula for REINFORCE with a constant A (1 unless ``advantage``; no autograd, no trainer):
    E_μ[ĝ] wrt the table = Σ_s μ(s) k(s) Σ_t red · A · [-w_t(s) (e_{y_t} - π_t) + centred · Σ_v μ_v w_t(s; v)
    (e_v - π_t)], where w_t(s; v) is the correction's weight with v in place of y_t (token level: f(π_v/μ_v);
    sequence level: f(W_s r_v / r_{y_t})) and k(s) = ``keep[s]`` the sequence mask (1 without one) over
    ``all_sequences``."""
    vocab = policy.vocab_size
    seqs = all_sequences(vocab, policy.length)
    logpi, logmu = torch.log_softmax(policy.table(), -1), torch.log_softmax(sampler, -1)
    rows = prefix_rows(seqs, vocab)
    seq_logmu = sequence_logprobs(sampler, seqs).sum(-1)
    log_r = (logpi - logmu)[rows, seqs]  # [N, L]
    out = torch.zeros_like(logpi)
    eye = torch.eye(vocab, dtype=torch.float64)

    def f(log_r_tis, log_r_mis, log_r_token):
        return rule.log_weight(log_r_tis, log_r_mis, log_r_token).exp()

    for i, s in enumerate(seqs):
        p_s = math.exp(float(seq_logmu[i])) * advantage * (1.0 if keep is None else float(keep[i]))
        for t in range(policy.length):
            h = int(rows[i, t])
            pi_h, mu_h = logpi[h].exp(), logmu[h].exp()
            rest = float(log_r[i].sum() - log_r[i, t])  # the other tokens' log-ratios
            lr_v = logpi[h] - logmu[h]  # [V]
            level = {"token": lr_v, "sequence": lr_v + rest, "geometric": (lr_v + rest) / policy.length}
            w_v = f(level[rule.tis_level], level[rule.mis_level], lr_v)
            y = int(s[t])
            g = -w_v[y] * (eye[y] - pi_h)
            if centred:
                g = g + (mu_h[:, None] * w_v[:, None] * (eye - pi_h)).sum(0)
            out[h] += p_s * reduction_weight * g
    return out


def rule_for(correction, level="token", cap=2.0, band=(0.5, 2.0), tis_low=None, mis_level=None):
    parts = REGISTERED_CORRECTIONS[correction.removesuffix("_mask")]  # ``decoupled`` is MIS by another name
    return WeightFunction(
        tis_cap=cap if "tis" in parts else None,
        tis_low=tis_low if "tis" in parts else None,
        tis_level=level,
        mis_band=band if "mis" in parts else None,
        mis_level=mis_level or level,
        mis_weighted=not correction.endswith("_mask"),
    )


SETTINGS = {  # name -> (overrides, the matching WeightFunction keywords)
    "loose": (
        ["correction.tis.cap=1e6", "correction.mis.low=1e-6", "correction.mis.high=1e6"],
        dict(cap=1e6, band=(1e-6, 1e6)),
    ),
    "binding": (
        ["correction.tis.cap=1.05", "correction.mis.low=0.9", "correction.mis.high=1.1"],
        dict(cap=1.05, band=(0.9, 1.1)),
    ),
}


@pytest.fixture(scope="module")
def drift_setup():
    """V = 4, L = 2; a sampler with logit noise (KL(π‖μ) = 0.1 per prefix) and a stale one (an older θ)."""
    policy = TabularPolicy(4, 2, seed=2)
    noisy, _ = sampler_at_kl(policy.table(), 0.1, seed=3)
    stale = policy.table() - 0.5 * torch.randn(
        policy.table().shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    return policy, {"noise": noisy, "stale": stale}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("sampler", ["noise", "stale"])
def test_constant_reward_reinforce_matches_the_formula(drift_setup, sampler, setting, level):
    policy, samplers = drift_setup
    mu = samplers[sampler]
    overrides, rule_kw = SETTINGS[setting]
    overrides = [*overrides, f"correction.tis.level={level}", f"correction.mis.level={level}"]
    none = expected(policy, "reinforce", "none", mu, overrides)
    assert none.abs().max() > 1e-2  # the mismatch drifts an uncorrected REINFORCE
    for correction in CORRECTIONS:
        if REGISTERED_CORRECTIONS.get(correction, frozenset()) & {"rs", "m2po"}:
            continue  # they mask under any reward: pinned in test_sequence_masks_match_the_formula and below
        grad = expected(policy, "reinforce", correction, mu, overrides)
        rule = rule_for(correction, level, **rule_kw)
        ref = reference_drift(policy, mu, rule, correction.startswith("sc"), reduction_weight=1.0)
        assert close(grad, ref, float(none.abs().max())), (correction, float((grad - ref).abs().max()))
        if correction.startswith("sc") and level == "token":
            assert close(grad, torch.zeros_like(grad), float(none.abs().max())), correction
    tis = expected(policy, "reinforce", "tis", mu, overrides)
    if setting == "binding":
        assert tis.abs().max() > 1e-3  # the cap binds: TIS leaks the drift back (the value: the formula above)
    elif level == "token":
        assert close(tis, torch.zeros_like(tis), float(none.abs().max()))  # the cap does not bind: no drift


@pytest.mark.parametrize("algo", ALGOS)
def test_constant_advantage_centred_corrections_do_not_drift(drift_setup, algo):
    policy, samplers = drift_setup
    for mu in samplers.values():
        for setting, (overrides, _) in SETTINGS.items():
            none = expected(policy, algo, "none", mu, overrides, advantages=ONES)
            assert none.abs().max() > 1e-2
            for correction in ("sc", "sc+tis", "sc+mis", "sc+mis_mask"):
                grad = expected(policy, algo, correction, mu, overrides, advantages=ONES)
                assert close(grad, torch.zeros_like(grad), float(none.abs().max())), (setting, correction)


def test_sequence_level_centring_leaks_only_when_the_cap_binds(drift_setup):
    # Sequence-level weights depend on the tokens after t, which depend on y_t: a head token's weight can
    # only be estimated by substitution (W r_v / r_y), exact while f is linear (an untruncated ratio) and
    # leaking once the cap binds. The leak is pinned by the formula in
    # test_constant_reward_reinforce_matches_the_formula; here: zero when loose, nonzero when binding.
    policy, samplers = drift_setup
    mu = samplers["noise"]
    loose = ["correction.tis.level=sequence", "correction.tis.cap=1e6"]
    binding = ["correction.tis.level=sequence", "correction.tis.cap=1.05"]
    none = expected(policy, "reinforce", "none", mu)
    scale = float(none.abs().max())
    assert close(expected(policy, "reinforce", "sc+tis", mu, loose), torch.zeros_like(none), scale)
    assert close(expected(policy, "reinforce", "tis", mu, loose), torch.zeros_like(none), scale)
    assert expected(policy, "reinforce", "sc+tis", mu, binding).abs().max() > 1e-4


def test_later_optimizer_steps_stay_centred_with_the_full_head(drift_setup):
    # Several optimizer steps per batch: π_θ has moved from π_old, the ratio and the clip act, and the
    # snapshot keeps π_old at the head ids. For token-level objectives the coefficient of a head token is
    # known exactly (its own ratio), so SC+TIS stays drift-free; the uncorrected update drifts.
    policy, samplers = drift_setup
    mu = samplers["noise"]
    move = 0.3 * torch.randn(policy.lm_head.weight.shape, generator=torch.Generator().manual_seed(5))
    theta_old = policy.lm_head.weight.detach().clone()

    def move_away(rb):
        with torch.no_grad():
            policy.lm_head.weight.copy_(theta_old + move)

    try:
        for algo in ("grpo", "dapo", "cispo", "ppo"):
            extra = ["algo.ppo_epochs=2", "correction.tis.cap=1.05"]
            none = expected(policy, algo, "none", mu, extra, advantages=ONES, before=move_away)
            policy.lm_head.weight.data.copy_(theta_old)
            assert none.abs().max() > 1e-2
            for correction in ("sc", "sc+tis", "sc+mis"):
                grad = expected(policy, algo, correction, mu, extra, advantages=ONES, before=move_away)
                policy.lm_head.weight.data.copy_(theta_old)
                assert close(grad, torch.zeros_like(grad), float(none.abs().max())), (algo, correction)
    finally:
        policy.lm_head.weight.data.copy_(theta_old)


# ----------------------------------------------------------------------------------------------
# 2b. The engine's head: exact with k = V or a proportional tail, a residual otherwise
# ----------------------------------------------------------------------------------------------


def test_top_k_head_with_a_proportional_tail_is_exact_and_otherwise_leaves_a_residual():
    policy = TabularPolicy(6, 1, seed=6)
    pi = policy.table()
    # a sampler that differs from pi only on its top-2 tokens: off the head mu_v = rho * pi_v exactly
    proportional = pi.clone()
    top2 = torch.log_softmax(pi, -1).topk(2, -1).indices
    proportional.scatter_add_(-1, top2, torch.tensor([[0.4, -0.3]], dtype=torch.float64))
    noisy = noisy_table(pi, 0.5, seed=7)
    assert (torch.log_softmax(proportional, -1).topk(2, -1).indices.sort().values == top2.sort().values).all()
    for mu, exact in ((proportional, True), (noisy, False)):
        none = expected(policy, "reinforce", "none", mu, head_size=2)
        sc = expected(policy, "reinforce", "sc", mu, head_size=2)
        full = expected(policy, "reinforce", "sc", mu, head_size=6)
        scale = float(none.abs().max())
        assert close(full, torch.zeros_like(full), scale)
        if exact:
            assert close(sc, torch.zeros_like(sc), scale)
        else:  # the tail's own mismatch is not seen by a top-2 head: a residual, smaller than no correction
            assert 1e-4 < float(sc.abs().max()) < 0.5 * scale


# ----------------------------------------------------------------------------------------------
# 2c. The sampled tail (correction.sc.tail=sampled): exact in expectation for any head
# ----------------------------------------------------------------------------------------------

SAMPLED = ["correction.sc.tail=sampled"]


def rescaled_residual(policy, sampler, head_size):
    """Independent formula for REINFORCE, A = 1, score centering with the top-k head and the rescaled tail:
    E_μ[ĝ] wrt the table = Σ_s μ(s) Σ_t [−(e_{y_t} − π_t) + (μ̂_t − π_t)], μ̂ = μ on the head, ρ π off it,
    ρ = (1 − Σ_H μ) / (1 − Σ_H π) (the rescaled tail; no autograd, no trainer)."""
    vocab = policy.vocab_size
    seqs = all_sequences(vocab, policy.length)
    logpi, logmu = torch.log_softmax(policy.table(), -1), torch.log_softmax(sampler, -1)
    rows = prefix_rows(seqs, vocab)
    seq_mu = sequence_logprobs(sampler, seqs).sum(-1).exp()
    out = torch.zeros_like(logpi)
    eye = torch.eye(vocab, dtype=torch.float64)
    for i, s in enumerate(seqs):
        for t in range(policy.length):
            h = int(rows[i, t])
            pi, mu = logpi[h].exp(), logmu[h].exp()
            head = mu.topk(head_size).indices
            in_head = torch.zeros(vocab, dtype=torch.bool)
            in_head[head] = True
            rho = (1 - mu[in_head].sum()) / (1 - pi[in_head].sum())
            mu_hat = torch.where(in_head, mu, rho * pi)
            out[h] += float(seq_mu[i]) * (-(eye[int(s[t])] - pi) + (mu_hat - pi))
    return out


@pytest.mark.parametrize("sampler", ["noise", "stale"])
def test_sampled_tail_has_no_drift_where_the_rescaled_tail_leaves_one(drift_setup, sampler):
    # V = 4, L = 2, a head of k = 2 < V: the rescaled tail leaves the residual its formula gives (the sampler's
    # tail is not proportional to π's); the sampled tail (m draws from μ's own tail at every position,
    # enumerated with their probabilities) has E[ĝ] = 0 to float32 rounding, for m = 1 and m = 2
    policy, samplers = drift_setup
    mu = samplers[sampler]
    none = expected(policy, "reinforce", "none", mu, head_size=2)
    scale = float(none.abs().max())
    rescaled = expected(policy, "reinforce", "sc", mu, head_size=2)
    ref = rescaled_residual(policy, mu, 2)
    assert float(ref.abs().max()) > 1e-2 * scale  # the formula's residual is not 0: the test can fail
    assert close(rescaled, ref, scale), float((rescaled - ref).abs().max())
    for m in (1, 2):
        overrides = [*SAMPLED, f"correction.sc.tail_samples={m}"]
        sampled = expected(policy, "reinforce", "sc", mu, overrides, head_size=2, tail_samples=m)
        # 1e-5: the draws multiply the rows (256 at m = 2) summed in float32; the rescaled residual is 1e3x that
        assert close(sampled, torch.zeros_like(sampled), scale, rtol=1e-5), (m, float(sampled.abs().max()))


@pytest.mark.parametrize("algo", ["reinforce", "grpo", "ppo"])
def test_sampled_tail_composes_with_tis_and_mis_without_drift(drift_setup, algo):
    # sc+tis / sc+mis with the cap or the band binding: the tail samples carry their own weight f(π_old/μ_u)
    # (their μ_u recorded), so the centring stays under the sample's weights with a head of k = 1 and the tail
    # sampled; the rescaled tail leaves a residual there
    policy, samplers = drift_setup
    mu = samplers["noise"]
    overrides, _ = SETTINGS["binding"]
    none = expected(policy, algo, "none", mu, overrides, advantages=ONES, head_size=1)
    scale = float(none.abs().max())
    for correction in ("sc", "sc+tis", "sc+mis", "sc+mis_mask"):
        rescaled = expected(policy, algo, correction, mu, overrides, advantages=ONES, head_size=1)
        assert float(rescaled.abs().max()) > 1e-4, correction
        sampled = expected(
            policy, algo, correction, mu, [*overrides, *SAMPLED, "correction.sc.tail_samples=1"],
            advantages=ONES, head_size=1, tail_samples=1,
        )  # fmt: skip
        assert close(sampled, torch.zeros_like(sampled), scale, rtol=1e-5), (correction, float(sampled.abs().max()))


def test_sampled_tail_keeps_the_on_policy_identity():
    # μ = π, real rewards, groups of 2: the sampled tail's centring is 0 in expectation, so E[ĝ] is none's
    policy = TabularPolicy(3, 2, seed=8)
    pi = policy.table()
    kw = dict(reward=reward_first_equals_last, group_size=2)
    reference = expected(policy, "grpo", "none", pi, **kw)
    assert reference.abs().max() > 1e-3
    grad = expected(
        policy, "grpo", "sc", pi, [*SAMPLED, "correction.sc.tail_samples=1"], head_size=1, tail_samples=1, **kw
    )
    assert close(grad, reference, float(reference.abs().max()))


# ----------------------------------------------------------------------------------------------
# 3. Any reward: untruncated sequence-level IS is unbiased; the SC term is s̄
# ----------------------------------------------------------------------------------------------


def random_reward(seqs):
    g = torch.Generator().manual_seed(int((seqs * torch.arange(1, seqs.shape[1] + 1)).sum()) % 1000)
    return torch.rand(len(seqs), generator=g)


@pytest.mark.parametrize("algo", ALGOS)
def test_untruncated_sequence_importance_sampling_is_unbiased(algo):
    policy = TabularPolicy(3, 2, seed=8)
    mu, _ = sampler_at_kl(policy.table(), 0.2, seed=9)
    draws = torch.rand(9, generator=torch.Generator().manual_seed(10))
    table_reward = {tuple(s.tolist()): float(r) for s, r in zip(all_sequences(3, 2), draws)}
    reward = lambda seqs: torch.tensor([table_reward[tuple(s.tolist())] for s in seqs])  # noqa: E731
    fixed = lambda rb: rb.rewards.clone() if algo != "ppo" else rb.rewards[:, None].expand_as(rb.response_mask).clone()  # noqa: E731
    on_policy = expected(policy, algo, "none", policy.table(), reward=reward, advantages=fixed)
    seq_is = expected(
        policy,
        algo,
        "tis",
        mu,
        ["correction.tis.level=sequence", "correction.tis.cap=1e9"],
        reward=reward,
        advantages=fixed,
    )
    token_is = expected(policy, algo, "tis", mu, ["correction.tis.cap=1e9"], reward=reward, advantages=fixed)
    off_policy = expected(policy, algo, "none", mu, reward=reward, advantages=fixed)
    scale = float(on_policy.abs().max())
    assert close(seq_is, on_policy, scale, rtol=1e-5)  # float32 weights of products of ratios
    assert not close(off_policy, on_policy, scale, rtol=1e-2)
    # token-level IS corrects each token's own distribution, not the prefix it was sampled under
    assert not close(token_is, on_policy, scale, rtol=1e-3)


def test_centring_term_with_the_full_head_is_the_enumerated_expected_score():
    g = torch.Generator().manual_seed(11)
    vocab = 7
    logits = torch.randn(2, 3, vocab, generator=g, dtype=torch.float64).requires_grad_()
    mu = torch.log_softmax(logits.detach() + 0.7 * torch.randn(2, 3, vocab, generator=g, dtype=torch.float64), -1)
    head_ids = torch.arange(vocab).expand(2, 3, vocab)
    logpi = torch.log_softmax(logits, -1)
    term = score_centering_term(logpi.gather(-1, head_ids), mu.gather(-1, head_ids))
    (grad_topk,) = torch.autograd.grad(term.sum(), logits)
    (grad_exact,) = torch.autograd.grad(exact_score_centering_term(logits, mu).sum(), logits)
    # Σ_v μ_v ∇_z log π_v = Σ_v μ_v (e_v − π), enumerated
    pi = logpi.detach().exp()
    enumerated = sum(mu.exp()[..., v : v + 1] * (torch.eye(vocab, dtype=torch.float64)[v] - pi) for v in range(vocab))
    torch.testing.assert_close(grad_topk, enumerated)
    torch.testing.assert_close(grad_exact, enumerated)


# ----------------------------------------------------------------------------------------------
# 5. The peers' options (issue 22) join the harness: on-policy identity, and no drift when centred
# ----------------------------------------------------------------------------------------------

#: (algorithm, overrides) of each objective option: it must keep both identities
PEER_OBJECTIVE_OPTIONS = [
    ("grpo", ["algo.clip_ratio_c=1.05"]),
    ("ppo", ["algo.clip_ratio_c=1.05"]),
    ("dapo", ["algo.delta=1.05"]),
    ("sapo", []),  # its soft gate acts wherever the ratio is not 1: the score coefficient 4 r σ (1 − σ) at each token
    ("reinforce_pp", ["algo.clip_ratio_c=1.05"]),
]
#: the options that change the advantages (or the corrections' weights) join the on-policy identity
PEER_OPTIONS = [
    *PEER_OBJECTIVE_OPTIONS,
    ("grpo", ["advantage.std=sample", "advantage.scale=batch"]),
    ("dr_grpo", ["advantage.scale=none"]),
    ("grpo", ["loss.entropy_coef=0.1"]),
    ("grpo", ["correction.tis.low=0.5", "correction.mis.level=geometric"]),
    ("cispo", ["correction.tis.low=0.5", "correction.mis.level=geometric"]),
    ("grpo", ["correction.tis.batch_normalize=true"]),  # Z = 1 on-policy
]


@pytest.mark.parametrize("algo,options", PEER_OPTIONS, ids=[f"{a}-{'-'.join(o)}" for a, o in PEER_OPTIONS])
def test_peer_options_keep_the_on_policy_identity(algo, options):
    # on-policy (μ = π): every correction's E[ĝ] equals none's
    policy = TabularPolicy(3, 2, seed=1)
    kw = dict(reward=reward_first_equals_last, group_size=2)
    reference = expected(policy, algo, "none", policy.table(), options, **kw)
    assert reference.abs().max() > 1e-3
    for correction in ("tis", "mis", "mis_mask", "sc+tis", "sc+mis"):
        grad = expected(policy, algo, correction, policy.table(), options, **kw)
        assert close(grad, reference, float(reference.abs().max())), (correction, options)


@pytest.mark.parametrize(
    "algo,options", PEER_OBJECTIVE_OPTIONS, ids=[f"{a}-{'-'.join(o)}" for a, o in PEER_OBJECTIVE_OPTIONS]
)
def test_peer_objective_options_do_not_drift_when_centred(drift_setup, algo, options):
    # a constant advantage ±1 after θ moved away from π_old (the option binds): the centred corrections do not drift
    policy, samplers = drift_setup
    mu = samplers["noise"]
    move = 0.3 * torch.randn(policy.lm_head.weight.shape, generator=torch.Generator().manual_seed(5))
    theta_old = policy.lm_head.weight.detach().clone()

    def move_away(rb):
        with torch.no_grad():
            policy.lm_head.weight.copy_(theta_old + move)

    base = ["algo.ppo_epochs=2", "correction.tis.cap=1.05"]
    minus_ones = lambda rb: -torch.ones(len(rb))  # noqa: E731  (A < 0: where the dual clip acts)
    try:
        for adv in (ONES, minus_ones):
            none = expected(policy, algo, "none", mu, [*base, *options], advantages=adv, before=move_away)
            policy.lm_head.weight.data.copy_(theta_old)
            without = expected(policy, algo, "none", mu, base, advantages=adv, before=move_away)
            policy.lm_head.weight.data.copy_(theta_old)
            binds = not close(none, without, float(without.abs().max()), rtol=1e-3)
            for correction in ("sc", "sc+tis", "sc+mis"):
                grad = expected(policy, algo, correction, mu, [*base, *options], advantages=adv, before=move_away)
                policy.lm_head.weight.data.copy_(theta_old)
                assert close(grad, torch.zeros_like(grad), float(none.abs().max())), (correction, options)
        assert binds or not options  # the option changed the update (A = -1)
    finally:
        policy.lm_head.weight.data.copy_(theta_old)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("sampler", ["noise", "stale"])
def test_tis_lower_bound_and_geometric_mis_match_the_formula(drift_setup, sampler, setting):
    # TRL's TIS lower bound (token level: the centred forms stay drift-free even where it binds) and verl's
    # geometric MIS (kept tokens keep their own w_t), pinned to the independent formula in every case
    policy, samplers = drift_setup
    mu = samplers[sampler]
    overrides, rule_kw = SETTINGS[setting]
    low = 0.95 if setting == "binding" else 1e-6
    overrides = [*overrides, f"correction.tis.low={low}", "correction.mis.level=geometric"]
    none = expected(policy, "reinforce", "none", mu, overrides)
    for correction in ("tis", "sc+tis", "mis", "mis_mask", "sc+mis", "sc+mis_mask"):
        grad = expected(policy, "reinforce", correction, mu, overrides)
        rule = rule_for(correction, "token", tis_low=low, mis_level="geometric", **rule_kw)
        ref = reference_drift(policy, mu, rule, correction.startswith("sc"), reduction_weight=1.0)
        assert close(grad, ref, float(none.abs().max())), (correction, float((grad - ref).abs().max()))
        if correction == "sc+tis" or (correction.startswith("sc") and setting == "loose"):
            assert close(grad, torch.zeros_like(grad), float(none.abs().max())), correction
    if setting == "binding":  # the lower bound binds: TIS with it differs from TIS without
        without = expected(policy, "reinforce", "tis", mu, SETTINGS[setting][0])
        assert not close(expected(policy, "reinforce", "tis", mu, overrides), without, float(none.abs().max()), 1e-3)


# ----------------------------------------------------------------------------------------------
# 6. Sequence masks (issue 38): OPSM and the rejection family under a constant reward of either sign
# ----------------------------------------------------------------------------------------------


def sequence_log_ratios(policy, sampler):
    """float64 [V^L, L]: log π − log μ of every token of every sequence (π = the policy, the first step's π_old)."""
    seqs = all_sequences(policy.vocab_size, policy.length)
    return sequence_logprobs(policy.table(), seqs) - sequence_logprobs(sampler, seqs)


#: correction -> (overrides, k(s) of the log-ratios d [V^L, L] = log π_old − log μ and the constant advantage A)
SEQUENCE_MASK_CASES = {
    "opsm": (["correction.opsm.delta=0.05"], lambda d, a: ~((a < 0) & ((-d).mean(-1) > 0.05))),
    "rs": (
        ["correction.rs.rule=seq_mean_k3", "correction.rs.threshold=0.1"],
        lambda d, a: (d.expm1() - d).mean(-1) <= 0.1,
    ),
    "rs-veto": (
        ["correction.rs.rule=outlier_veto", "correction.rs.veto_band=[0.5,2.0]"],
        lambda d, a: ((d >= math.log(0.5)) & (d <= math.log(2.0))).all(-1),
    ),
}


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_sequence_masks_match_the_formula(drift_setup, advantage):
    # OPSM never drops a sequence with A > 0: opsm equals none and sc+opsm equals sc (0). With A = -1 it drops the
    # sequences the current policy has left (mean log mu/pi > delta), a choice that depends on the whole
    # sequence: the drift of opsm and of sc+opsm is the formula's with k(s), and sc+opsm's is not 0
    policy, samplers = drift_setup
    mu = samplers["noise"]
    constant = (lambda rb: torch.ones(len(rb))) if advantage > 0 else (lambda rb: -torch.ones(len(rb)))  # noqa: E731
    d = sequence_log_ratios(policy, mu)
    none = expected(policy, "reinforce", "none", mu, advantages=constant)
    scale = float(none.abs().max())
    for case, (overrides, keep_of) in SEQUENCE_MASK_CASES.items():
        keep = keep_of(d, advantage)
        for centred in (False, True):
            correction = ("sc+" if centred else "") + case.split("-")[0]
            grad = expected(policy, "reinforce", correction, mu, overrides, advantages=constant)
            ref = reference_drift(policy, mu, WeightFunction(), centred, 1.0, advantage=advantage, keep=keep)
            assert close(grad, ref, scale), (case, centred, float((grad - ref).abs().max()))
            if case == "opsm" and advantage > 0:  # never masks: none's drift, and sc's (0)
                assert bool(keep.all()) and close(grad, torch.zeros_like(grad) if centred else none, scale)
            elif centred:  # a mask of the whole sequence: the centring of the kept ones no longer averages to 0
                assert 0 < float(keep.double().mean()) < 1 and float(grad.abs().max()) > 1e-3 * scale, case


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_token_rules_centred_do_not_drift(drift_setup, advantage):
    # the rejection family's token rule (token_k1 = mask-only MIS with the band e^{±tau}) is a per-token weight:
    # sc+rs centres under it and does not drift, alone or with TIS's cap binding (tis+rs has no centring)
    policy, samplers = drift_setup
    constant = (lambda rb: torch.ones(len(rb))) if advantage > 0 else (lambda rb: -torch.ones(len(rb)))  # noqa: E731
    overrides = ["correction.rs.rule=token_k1", "correction.rs.threshold=0.1"]
    for mu in samplers.values():
        rs = expected(policy, "reinforce", "rs", mu, overrides, advantages=constant)
        band = WeightFunction(mis_band=(math.exp(-0.1), math.exp(0.1)), mis_weighted=False)
        ref = reference_drift(policy, mu, band, False, 1.0, advantage=advantage)
        assert close(rs, ref, float(rs.abs().max())) and float(rs.abs().max()) > 1e-3
        grad = expected(policy, "reinforce", "sc+rs", mu, overrides, advantages=constant)
        assert close(grad, torch.zeros_like(grad), float(rs.abs().max()))


def test_m2po_is_a_token_band_sc_centres_under_and_its_batch_bound_by_monte_carlo(drift_setup):
    # Exact, for the bound of the enumerated batch (every sequence once): m2po is mask-only MIS with the band
    # e^{±c}, pinned to the formula, and sc+m2po does not drift. Over real batches of N = 64 the bound depends on
    # the batch: Monte Carlo (100 batches, seeded) with its standard error. sc+m2po stays within 4 SE of 0 while
    # m2po's drift is many SE away from it
    policy, samplers = drift_setup
    mu = samplers["noise"]
    seqs = all_sequences(policy.vocab_size, policy.length)
    d = sequence_log_ratios(policy, mu)
    threshold = 0.5 * float((d**2).mean())  # binds: about half the second moment must go
    overrides = [f"correction.m2po.threshold={threshold}"]
    c = float(m2po_bound(d, torch.zeros_like(d), torch.ones_like(d, dtype=torch.bool), threshold))
    assert 0 < c < float(d.abs().max())
    band = WeightFunction(mis_band=(math.exp(-c), math.exp(c)), mis_weighted=False)
    ones = lambda s: torch.ones(len(s))  # noqa: E731
    m2po = expected(policy, "reinforce", "m2po", mu, overrides, reward=ones)
    scale = float(m2po.abs().max())
    assert close(m2po, reference_drift(policy, mu, band, False, 1.0), scale) and scale > 1e-2
    assert close(expected(policy, "reinforce", "sc+m2po", mu, overrides, reward=ones), torch.zeros_like(m2po), scale)
    assert len(seqs) == 16
    for correction, drifts in (("m2po", True), ("sc+m2po", False)):
        module = module_for(policy, "reinforce", correction, *overrides)
        mc = monte_carlo_gradient(module, policy, mu, ones, 64, 100, seed=12, head_size=policy.vocab_size)
        z = float((mc.mean.abs() / mc.stderr.clamp(min=1e-12)).max())
        assert (z > 6) if drifts else (z < 4), (correction, z, mc.norm_stderr)  # measured: 29.1 and 2.13


def test_tis_batch_normalisation_stays_centred_for_every_batch(drift_setup):
    # Z divides both corrected terms: sc+tis stays drift-free for the enumerated batch's Z, exactly, and over
    # batches of 64 (each its own Z) within 4 standard errors of 0 (Monte Carlo, 60 batches)
    policy, samplers = drift_setup
    mu = samplers["noise"]
    overrides = ["correction.tis.batch_normalize=true", "correction.tis.cap=1.05"]
    ones = lambda s: torch.ones(len(s))  # noqa: E731
    tis = expected(policy, "reinforce", "tis", mu, overrides, reward=ones)
    scale = float(tis.abs().max())
    assert scale > 1e-2  # the cap binds: normalised TIS still drifts
    assert close(expected(policy, "reinforce", "sc+tis", mu, overrides, reward=ones), torch.zeros_like(tis), scale)
    module = module_for(policy, "reinforce", "sc+tis", *overrides)
    mc = monte_carlo_gradient(module, policy, mu, ones, 64, 60, seed=13, head_size=policy.vocab_size)
    assert float((mc.mean.abs() / mc.stderr.clamp(min=1e-12)).max()) < 4
