"""The gradient-bias probe (lit_rl.tools.probe, recipes/probe_gradients.py): its sketch, its statistics against
known values, and a small run on the tiny model through the real update path."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import CONF, ROOT, probe_config
from hydra.errors import ConfigCompositionException

from lit_rl.config import ConfigError
from lit_rl.tools.probe import GradientSketch, correction_config, jackknife, reference_summary, run_probe


def test_sketch_keeps_inner_products_and_exact_norms():
    params = [torch.nn.Parameter(torch.zeros(300_000)), torch.nn.Parameter(torch.zeros(7, 11_111))]
    sketch = GradientSketch(params, dim=1 << 14, seed=3)
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(p.shape, generator=gen) for p in params]
    b = [0.6 * x + 0.8 * torch.randn(x.shape, generator=gen) for x in a]  # cosine 0.6 with a
    sa, na = sketch.of(a)
    sb, nb = sketch.of(b)

    def exact(u, v):
        return float(sum((x.double() * y.double()).sum() for x, y in zip(u, v)))

    assert na == pytest.approx(exact(a, a), rel=1e-9) and nb == pytest.approx(exact(b, b), rel=1e-9)
    # relative error of a norm ~ sqrt(2 / D) = 1.1% at D = 2^14: 4 of those as the bound
    assert float(sa.double() @ sa.double()) == pytest.approx(na, rel=0.045)
    cos = float(sa.double() @ sb.double()) / math.sqrt(
        float(sa.double() @ sa.double()) * float(sb.double() @ sb.double())
    )
    assert cos == pytest.approx(exact(a, b) / math.sqrt(na * nb), abs=0.03)
    # linear: the sketch of a sum is the sum of the sketches; the same map every call
    sab, _ = sketch.of([x + y for x, y in zip(a, b)])
    torch.testing.assert_close(sab, sa + sb, rtol=1e-4, atol=1e-3)
    # None gradients count as zeros
    s0, n0 = sketch.of([None, None])
    assert n0 == 0 and float(s0.abs().max()) == 0


def test_statistics_recover_a_known_bias_drift_and_variance():
    """Gaussian 'gradients' with known mean and covariance: g = e_0 (norm 1); the cell's mean is g + b with
    |b| = 0.5 orthogonal to g; per-batch noise of variance trace 2 (D = 200 coordinates of variance 0.01)."""
    d, gen = 200, torch.Generator().manual_seed(1)
    g = torch.zeros(d, dtype=torch.float64)
    g[0] = 1.0
    bias = torch.zeros(d, dtype=torch.float64)
    bias[1] = 0.5

    def noise(n):
        return 0.1 * torch.randn(n, d, generator=gen, dtype=torch.float64)

    x, y = g + bias + noise(400), g + noise(400)
    est, se = jackknife(x, y)
    assert est["bias_rel"] == pytest.approx(0.5, abs=3 * se["bias_rel"]) and se["bias_rel"] < 0.03
    assert est["bias2_rel"] == pytest.approx(0.25, abs=3 * se["bias2_rel"])
    assert est["cosine"] == pytest.approx(1 / math.sqrt(1.25), abs=3 * se["cosine"])
    assert est["var_rel"] == pytest.approx(2.0, abs=3 * se["var_rel"])
    assert est["mse_rel"] == pytest.approx(2.25, abs=3 * se["mse_rel"])
    # no bias: the noise-corrected squared bias is 0 within its standard error (the plain |x - y|^2 is not)
    x0 = g + noise(400)
    est0, se0 = jackknife(x0, y)
    assert abs(est0["bias2_rel"]) < 3 * se0["bias2_rel"]
    assert float((x0.mean(0) - y.mean(0)).pow(2).sum()) > 5 * se0["bias2_rel"]
    ref = reference_summary(y)
    assert ref["norm"] == pytest.approx(1.0, abs=0.03) and ref["se_rel"] == pytest.approx(math.sqrt(2 / 400), rel=0.1)


def test_correction_config_switches_components_and_keeps_fields():
    base = {
        "name": "none",
        "tis": {"enabled": False, "cap": 1.5, "level": "token"},
        "mis": {"enabled": False, "low": 0.4, "high": 3.0},
        "sc": {"enabled": False, "top_k": 32},
    }
    c = correction_config(base, "sc+tis")
    assert c["name"] == "sc+tis" and c["tis"] == {"enabled": True, "cap": 1.5, "level": "token"}
    assert c["sc"] == {"enabled": True, "top_k": 32} and c["mis"]["enabled"] is False
    assert not any(correction_config(base, "none")[k]["enabled"] for k in ("tis", "mis", "sc"))


def test_probe_on_the_tiny_model(tmp_path, monkeypatch):
    """The whole recipe on the tiny model through the real update path: an on-policy control setting, where
    on the same rollouts every correction's gradient equals the uncorrected one (TIS weights are 1, the SC
    term is 0), and a logit-noise setting (the tiny model's pi is nearly uniform: sigma = 1 gives KL ~ 0.5),
    where TIS clips and SC moves the gradient. (The random tiny model never answers right, so every RLOO
    advantage is 0 and the real-reward gradient is 0: only the constant-reward (A = 1) gradients carry
    signal here, and the relative columns are NaN; the statistics are checked on known Gaussians above, and
    the real model's bias and drift are in the README.)"""
    from lit_rl.tools import probe

    seen = {}
    original = probe.run_cells

    def spy(*args, **kwargs):
        cells = original(*args, **kwargs)
        seen[kwargs.get("label", args[-1] if args else "")] = cells
        return cells

    monkeypatch.setattr(probe, "run_cells", spy)
    rows = run_probe(
        probe_config(
            "probe.corrections=[none,tis,sc]",
            "probe.batches=3",
            "probe.reference_batches=3",
            "probe.modes=[reward,constant]",
            "trainer.precision=32-true",
            "probe.settings=[{name: on, engine: {}}, {name: s1, engine: {logit_noise: 1.0}}]",
        ),
        tmp_path / "p",
    )
    assert [(r["setting"], r["correction"]) for r in rows if not r["correction"].startswith("(")] == [
        ("on", "none"),
        ("on", "tis"),
        ("on", "sc"),
        ("s1", "none"),
        ("s1", "tis"),
        ("s1", "sc"),
    ]
    rows = [r for r in rows if not r["correction"].startswith("(")]
    by = {(r["setting"], r["correction"]): r for r in rows}
    on, noisy = seen["on"], seen["s1"]
    for name in ("tis", "sc"):
        for mode in ("reward", "constant"):
            for a, b in zip(on[name].sketches[mode], on["none"].sketches[mode]):
                assert float((a - b).norm()) <= 1e-4 * float(b.norm()) + 1e-12, (name, mode)
        diff = max(
            float((a - b).norm() / b.norm())
            for a, b in zip(noisy[name].sketches["constant"], noisy["none"].sketches["constant"])
        )
        assert diff > 1e-3, name
    assert by[("on", "none")]["kl"] < 1e-6
    assert 0.3 < by[("s1", "none")]["kl"] < 0.7 and 0.3 < by[("s1", "none")]["kl_reverse"] < 0.7
    assert by[("s1", "tis")]["tis_clipfrac"] > 0.01
    for r in rows:
        assert r["batches"] == 3 and r["g2"] == 0 and math.isnan(r["bias_rel"])  # every advantage 0 (above)
        assert math.isfinite(r["drift2"]) and math.isfinite(r["drift2_se"]) and r["drift2_se"] > 0
    saved = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert saved["reference"]["batches"] == 3
    text = (tmp_path / "p" / "probe.md").read_text()
    assert "| s1 |" in text and "Reference (on-policy" in text
    assert (tmp_path / "p" / "probe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="already holds a probe"):
        run_probe(probe_config("probe.corrections=[none]"), tmp_path / "p")


@pytest.mark.slow  # ~45 s on 2 cores: the engine records all 49 152 log-probs per token
def test_conditional_mode_on_the_tiny_model(tmp_path, monkeypatch):
    """The conditional mode through the recipe: the engine records all V log-probs, each module keeps its own head
    for the other modes, and the per-prefix drift is 0 on-policy (Σ_v π_v ∇log π_v = 0 at every prefix), clearly
    nonzero for `none` under logit noise, smaller for TIS (its cap's leak), and smaller still for SC's top-128
    residual on the tiny model's near-uniform 49 152-token distribution. The exact values are pinned on tabular
    policies (tests/test_conditional_probe.py)."""
    from lit_rl.tools import probe

    seen = {}
    original = probe.run_cells

    def spy(*args, **kwargs):
        cells = original(*args, **kwargs)
        seen[kwargs.get("label", args[-1] if args else "")] = cells
        return cells

    monkeypatch.setattr(probe, "run_cells", spy)
    rows = run_probe(
        probe_config(
            "probe.corrections=[none,tis,sc]",
            "probe.batches=3",
            "probe.reference_batches=3",
            "probe.modes=[constant,conditional]",
            "trainer.precision=32-true",
            "probe.settings=[{name: on, engine: {}}, {name: s1, engine: {logit_noise: 1.0}}]",
        ),
        tmp_path / "p",
    )
    on, noisy = seen["on"], seen["s1"]

    def norm(cells, name):
        return max(float(x.norm()) for x in cells[name].sketches["conditional"])

    drift = norm(noisy, "none")
    assert drift > 0
    for name in ("none", "tis", "sc"):
        assert norm(on, name) <= 1e-4 * drift, name
    # TIS leaks where its cap binds; SC leaves the tail its top-128 head misses (most of a near-uniform
    # 49 152-token distribution, so on this random model that residual is not small)
    assert 1e-3 * drift < norm(noisy, "tis") < drift and 1e-3 * drift < norm(noisy, "sc") < drift
    by = {(r["setting"], r["correction"]): r for r in rows}
    assert 0 < by[("s1", "tis")]["cond_drift_proj"] < by[("s1", "none")]["cond_drift_proj"]
    assert math.isfinite(by[("s1", "sc")]["cond_drift2"]) and by[("s1", "sc")]["cond_drift2_se"] >= 0
    # the constant mode still sums SC over the module's own head (128), not the recorded vocabulary
    c = noisy["sc"].sketches["constant"][0]
    assert float(c.norm()) > 0 and "cond. drift along u" in (tmp_path / "p" / "probe.md").read_text()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["probe.corrections=[none,foo]"], r"probe.corrections=\['none', 'foo'\] is not allowed"),
        (["probe.batches=2"], r"probe.batches=2 is not allowed: must be an integer >= 3"),
        (["probe.modes=[drift]"], r"probe.modes=\['drift'\] is not allowed"),
        (["probe.modes=[conditional]", "probe.corrections=[none,opsm]"], r"token-level corrections only"),
        (
            ["probe.modes=[conditional]", "probe.corrections=[none,sc]", "correction.sc.tail=sampled"],
            r"correction.sc.tail='sampled' is not allowed: rescaled: the conditional mode computes the rescaled",
        ),
        (["probe.settings=[{name: a, engine: {logit_noise: -1}}]"], r"engine.logit_noise=-1 is not allowed"),
        (["probe.settings=[{name: a, sampler: /nonexistent/policy_step8}]"], r"settings\[0\].sampler=.*a model folder"),
    ],
)
def test_probe_bad_config(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_probe(probe_config(*overrides), tmp_path / "p")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["probe.settings=[{name: a, engine: {noise: 1}}]"], "noise"),
        (["probe.batchez=3"], "batchez"),
    ],
)
def test_probe_unknown_key_is_refused_at_compose(overrides, key):
    with pytest.raises(ConfigCompositionException, match=key):
        probe_config(*overrides)


def test_a_typo_in_the_probe_file_fails_naming_the_key(tmp_path):
    """The probe's config has the train config's typo protection (schema.ProbeRunConfig): a key with no field,
    written in conf/probe.yaml itself, fails at compose time naming the file and the key."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    text = (conf / "probe.yaml").read_text().replace("  sketch_seed: 0", "  sketch_sed: 0")
    (conf / "probe.yaml").write_text(text)
    with pytest.raises(ConfigCompositionException) as err:
        probe_config(conf_dir=conf)
    assert "In 'probe'" in str(err.value) and "Key 'sketch_sed' not in" in str(err.value), str(err.value)


def test_the_recipe_refuses_a_bad_value_before_loading_the_model(tmp_path):
    """recipes/probe_gradients.py as a user runs it (Hydra, conf/probe.yaml and the resolvers its train.yaml
    base uses): a bad probe value exits 2 with the message, and nothing is written to the run folder."""
    out = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "recipes", "probe_gradients.py"),
            "model=tiny",
            "probe.batches=2",
            f"hydra.run.dir={out}",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    assert "lit_rl: error: probe.batches=2 is not allowed: must be an integer >= 3" in res.stderr
    assert not (out / "probe.md").exists()
