"""The staleness probe (lit_rl.tools.staleness_probe): its read-outs against known values on Gaussians, and a stale
sampler's weights on the tiny model through the real probe."""

import math

import pytest
import torch
from helpers import probe_config

from lit_rl.config import ConfigError
from lit_rl.models import ModelConfig, load_policy, tiny_config
from lit_rl.tools.probe import run_probe
from lit_rl.tools.staleness_probe import (
    coupled_bias2,
    coupled_gap,
    coupled_progress,
    jackknife_groups,
    load_sampler_policy,
    paired_gap,
    progress,
)


def gaussian_cells(n: int, seed: int = 0):
    """g = e_0 (‖g‖ = 1); cell a has mean 0.8 g + 0.3 e_1, cell b g + 0.5 e_2, on the same batches: they share
    one noise draw per batch (variance trace 2 over D = 200) plus a small own part (trace 0.02)."""
    d, gen = 200, torch.Generator().manual_seed(seed)
    g, ea, eb = (torch.zeros(d, dtype=torch.float64) for _ in range(3))
    g[0], ea[1], eb[2] = 1.0, 0.3, 0.5
    shared = 0.1 * torch.randn(n, d, generator=gen, dtype=torch.float64)

    def own():
        return 0.01 * torch.randn(n, d, generator=gen, dtype=torch.float64)

    xa, xb = 0.8 * g + ea + shared + own(), g + eb + shared + own()
    y = g + 0.1 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    return xa, xb, y


def test_progress_and_paired_gap_recover_known_values():
    # by hand: progress(a) = <0.8 g + 0.3 e1, g> / |g|^2 = 0.8; progress(b) = 1;
    # T(a, b) = |-0.2 g + 0.3 e1|^2 - |0.5 e2|^2 = 0.04 + 0.09 - 0.25 = -0.12
    xa, xb, y = gaussian_cells(400)
    p, p_se = jackknife_groups(progress, xa, y)
    t, t_se = jackknife_groups(paired_gap, xa, xb, y, paired=2)
    assert 0 < p_se < 0.02 and abs(p - 0.8) < 4 * p_se
    assert 0 < t_se < 0.02 and abs(t - (-0.12)) < 4 * t_se
    assert progress(xb, y) == pytest.approx(1.0, abs=0.02)
    # unbiased: the noise floors are removed (averaged over 200 small samples of 8 batches, far from the naive
    # |mean_a - mean_y|^2 - |mean_b - mean_y|^2, whose expectation is -0.12 + (2.02 - 2.02) / 8 ... and whose
    # per-cell noise a wrong pairing would leave in)
    ts = [paired_gap(*gaussian_cells(8, seed=s)) for s in range(200)]
    ps = [progress(*gaussian_cells(8, seed=s)[::2]) for s in range(200)]
    assert sum(ts) / len(ts) == pytest.approx(-0.12, abs=0.02)
    assert sum(ps) / len(ps) == pytest.approx(0.8, abs=0.03)
    # T(a, a) = 0 exactly; a reference without signal gives nan, not a ratio of noise
    assert paired_gap(xa, xa, y) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(progress(xa, torch.zeros_like(y)))
    with pytest.raises(ValueError, match=">= 3 rows"):
        jackknife_groups(progress, xa[:2], y)


def coupled_cells(n: int, seed: int = 0):
    """On-policy batches z = g + e_b (trace 2 over D = 200) and two stale cells on the same seeds, x = z + bias + a
    small own part: cell a's bias -0.2 g + 0.3 e_1, cell b's 0.5 e_2 (as gaussian_cells); an independent reference y."""
    d, gen = 200, torch.Generator().manual_seed(seed)
    g, ea, eb = (torch.zeros(d, dtype=torch.float64) for _ in range(3))
    g[0], ea[1], eb[2] = 1.0, 0.3, 0.5
    z = g + 0.1 * torch.randn(n, d, generator=gen, dtype=torch.float64)

    def own():
        return 0.01 * torch.randn(n, d, generator=gen, dtype=torch.float64)

    xa, xb = z - 0.2 * g + ea + own(), z + eb + own()
    y = g + 0.1 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    return xa, xb, z, y


def test_coupled_read_outs_recover_known_values_with_less_noise():
    # by hand, as above: |bias_a|^2 = 0.13, |bias_b|^2 = 0.25, progress(a) = 0.8, progress(b) = 1, T(a, b) = -0.12
    xa, xb, z, y = coupled_cells(40)
    for fn, args, want in (
        (coupled_bias2, (xa, z, y), 0.13),
        (coupled_bias2, (xb, z, y), 0.25),
        (coupled_progress, (xa, z, y), 0.8),
        (coupled_progress, (xb, z, y), 1.0),
        (coupled_gap, (xa, xb, z, y), -0.12),
    ):
        v, se = jackknife_groups(fn, *args, paired=len(args) - 1)
        assert abs(v - want) < 4 * se + 1e-9, (fn.__name__, v, se)
    # the coupling: at 40 batches the coupled progress ratio's SE is far below the uncoupled one's
    _, se_coupled = jackknife_groups(coupled_progress, xa, z, y, paired=2)
    _, se_plain = jackknife_groups(progress, xa, y)
    assert se_coupled < 0.5 * se_plain  # 0.006 against 0.022 here
    # unbiased: averaged over 300 samples of 4 batches each
    reps = [coupled_cells(4, seed=s) for s in range(300)]
    assert sum(coupled_bias2(a, z, y) for a, _, z, y in reps) / 300 == pytest.approx(0.13, abs=0.005)
    assert sum(coupled_gap(a, b, z, y) for a, b, z, y in reps) / 300 == pytest.approx(-0.12, abs=0.005)


def save_tiny(folder, shift: float = 0.0, **config):
    """The tiny model's weights (its seeded init, every parameter + ``shift`` * N(0, 1) when asked) as a folder."""
    policy, tok = load_policy(ModelConfig("tiny"))
    if config:
        from transformers import LlamaForCausalLM

        policy = LlamaForCausalLM(tiny_config(len(tok), config))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(shift * torch.randn(p.shape, generator=gen))
    policy.save_pretrained(folder)
    return folder, tok


def test_a_stale_sampler_samples_with_its_own_weights(tmp_path):
    """``probe.settings[i].sampler``: the policy's own weights as the sampler give an on-policy setting (KL 0, TIS's
    weights 1: its gradient equals none's); other weights give the staleness ratio (KL > 0)."""
    same, _ = save_tiny(tmp_path / "same")
    other, _ = save_tiny(tmp_path / "other", shift=0.05)
    rows = run_probe(
        probe_config(
            "probe.batches=3",
            "probe.reference_batches=3",
            "probe.sketch_dim=4096",
            "probe.corrections=[none,tis]",
            "probe.modes=[constant]",
            "trainer.precision=32-true",
            f"probe.settings=[{{name: same, sampler: {same}}}, {{name: stale, sampler: {other}}}]",
        ),
        tmp_path / "p",
    )
    by = {(r["setting"], r["correction"]): r for r in rows}
    assert by[("same", "none")]["kl"] < 1e-7 and by[("same", "tis")]["tis_clipfrac"] == 0
    assert by[("stale", "none")]["kl"] > 1e-3
    sketches = torch.load(tmp_path / "p" / "sketches.pt")["settings"]
    for a, b in zip(sketches["same"]["tis"]["constant"], sketches["same"]["none"]["constant"]):
        assert float((a - b).norm()) <= 1e-5 * float(b.norm())
    assert any(
        float((a - b).norm()) > 1e-4 * float(b.norm())
        for a, b in zip(sketches["stale"]["tis"]["constant"], sketches["stale"]["none"]["constant"])
    )


def test_a_sampler_of_another_shape_is_refused_by_name(tmp_path):
    policy, tok = load_policy(ModelConfig("tiny"))
    folder, _ = save_tiny(tmp_path / "wide", hidden_size=96)
    with pytest.raises(ConfigError, match=r"probe.settings\[1\].sampler=.*wide: its weights do not fit the policy's "
                       r"names and shapes \(.*: sampler \(\d+, 96\), policy \(\d+, 64\)"):  # fmt: skip
        load_sampler_policy(ModelConfig("tiny"), folder, policy, tok, "probe.settings[1].sampler")


def test_a_sampler_folder_is_checked_before_any_model_loads(tmp_path, monkeypatch):
    # a bug report: a folder of another shape, or with config.json and no weights, passed the start-up check and
    # failed after the reference batches (minutes on SmolLM2)
    import lit_rl.run.train as train_module

    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded before the sampler folder was checked")

    monkeypatch.setattr(train_module, "assemble", no_loading)
    wide, _ = save_tiny(tmp_path / "wide", hidden_size=96)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((wide / "config.json").read_text())
    for folder, message in [
        (wide, r"wide: a model of another shape than model.name_or_path=tiny \(hidden_size: sampler 96, policy 64\)"),
        (empty, r"empty: config.json but no weights \(none of model.safetensors"),
    ]:
        with pytest.raises(ConfigError, match=r"probe.settings\[0\].sampler=.*" + message):
            run_probe(probe_config(f"probe.settings=[{{name: a, sampler: {folder}}}]"), tmp_path / "p")
        assert not (tmp_path / "p").exists()


def test_seed_offset_continues_a_probe_with_new_rollouts(tmp_path):
    """``probe.seed_offset=1`` with 3 batches draws exactly batches 1-3 of a 4-batch probe (settings and reference):
    a later probe adds batches to an earlier one, its sketches on the same map."""

    def probe(out, *extra):
        run_probe(
            probe_config(
                "algo.baseline=none",
                "task.constant_reward=1",
                "rollout.group_size=2",
                "sampling.max_new_tokens=4",
                "probe.sketch_dim=1024",
                "probe.corrections=[none]",
                "probe.modes=[reward]",
                "trainer.precision=32-true",
                "probe.settings=[{name: s, engine: {logit_noise: 1.0}}]",
                *extra,
            ),
            tmp_path / out,
        )
        return torch.load(tmp_path / out / "sketches.pt")

    whole = probe("whole", "probe.batches=4", "probe.reference_batches=4")
    later = probe("later", "probe.batches=3", "probe.reference_batches=3", "probe.seed_offset=1")
    for a, b in zip(later["settings"]["s"]["none"]["reward"], whole["settings"]["s"]["none"]["reward"][1:]):
        assert torch.equal(a, b)
    for a, b in zip(later["reference"]["reward"], whole["reference"]["reward"][1:]):
        assert torch.equal(a, b)
    assert not torch.equal(whole["reference"]["reward"][0], whole["reference"]["reward"][1])
