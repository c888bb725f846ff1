"""The probe's top-k rows (lit_rl.tools.topk_probe): `probe.sc_top_ks` measures SC at several heads on the same
rollouts, each row exactly what a run with `correction.sc.top_k=K` gives; the per-token statistics equal values
derived by hand; the paired fraction and the field's checks."""

import math

import pytest
import torch
from helpers import probe_config

from lit_rl.config import ConfigError
from lit_rl.tools.probe import run_probe
from lit_rl.tools.topk_probe import centring_errors, paired_fraction, t_interval, token_summary

V_TINY = 49152  # the tiny model has SmolLM2's tokenizer


def cfg(*overrides):
    return probe_config(
        "probe.batches=3",
        "probe.reference_batches=3",
        "probe.corrections=[none,sc]",
        "probe.modes=[conditional]",
        "trainer.precision=32-true",
        "probe.settings=[{name: s1, engine: {logit_noise: 1.0}}]",
        *overrides,
    )


def test_centring_errors_on_a_hand_made_distribution():
    """V = 4, μ = (0.5, 0.3, 0.15, 0.05) (the engine's order), π = (0.4, 0.4, 0.1, 0.1); ‖μ − π‖² = 0.025.
    k = 1: ρ = 0.5 / 0.6, μ̂'s tail (1/3, 1/12, 1/12) against (0.3, 0.15, 0.05): error² = 6/900.
    k = 2: ρ = 0.2 / 0.2 = 1, tail (0.1, 0.1) against (0.15, 0.05): error² = 0.005. k = 4 (and more): 0."""
    mu = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    pi = torch.tensor([[0.4, 0.4, 0.1, 0.1]], dtype=torch.float64)
    out = centring_errors(pi.log(), mu.log(), [1, 2, 4, 9])
    assert float(out["gap"]) == pytest.approx(math.sqrt(0.025), abs=1e-12)
    kl = 0.5 * math.log(5 / 4) + 0.3 * math.log(3 / 4) + 0.15 * math.log(1.5) + 0.05 * math.log(0.5)
    assert float(out["kl"]) == pytest.approx(kl, abs=1e-12)
    for k, mass, err2 in ((1, 0.5, 6 / 900), (2, 0.8, 0.005), (4, 1.0, 0.0)):
        assert float(out[f"mass@{k}"]) == pytest.approx(mass, abs=1e-12)
        assert float(out[f"abs_err@{k}"]) == pytest.approx(math.sqrt(err2), abs=1e-12)
        assert float(out[f"rel_err@{k}"]) == pytest.approx(math.sqrt(err2 / 0.025), abs=1e-12)
    assert float(out["rel_err@4"]) == 0.0 and float(out["mass@4"]) == pytest.approx(1.0)  # k = 9 > V: cut to V
    # on-policy (μ = π): no centring vector, so the relative error is undefined; the absolute one is 0 at ρ = 1
    same = centring_errors(pi.log(), pi.log(), [2])
    assert float(same["gap"]) == 0.0 and math.isnan(float(same["rel_err@2"])) and float(same["abs_err@2"]) < 1e-15
    s = token_summary([out, out], [1, 2])
    assert s["tokens"] == 2 and s["1"]["mass"] == pytest.approx([0.5] * 3) and s["kl"] == pytest.approx(kl)
    with pytest.raises(ValueError, match=r"\[n, V\]"):
        centring_errors(pi.log()[0], mu.log()[0], [1])


def test_paired_fraction_and_interval():
    """D = 0.1 C batch by batch: the fraction is 0.1 with no spread; with a zero-mean part added to D the
    noise-corrected fraction is still close, and the jackknife gives it a positive SE."""
    g = torch.Generator().manual_seed(0)
    c = torch.randn(6, 50, generator=g, dtype=torch.float64) * 0.1 + torch.ones(50)
    f, se = paired_fraction(0.1 * c, c)
    assert f == pytest.approx(0.1, abs=1e-12) and se == pytest.approx(0.0, abs=1e-12)
    zero, zse = paired_fraction(torch.zeros_like(c), c)
    assert zero == 0.0 and zse == 0.0
    lo, hi = t_interval(0.1, 0.01, 6)  # t_{0.975, 5} = 2.5706
    assert hi == pytest.approx(0.1 + 0.025706, abs=1e-5) and lo == pytest.approx(0.1 - 0.025706, abs=1e-5)
    assert math.isnan(paired_fraction(c, torch.zeros_like(c))[0])  # no drift to compare with


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["probe.sc_top_ks=[0,8]"], r"probe.sc_top_ks=\[0, 8\] is not allowed: a non-empty list of distinct"),
        (["probe.sc_top_ks=[8,8]"], r"probe.sc_top_ks=\[8, 8\] is not allowed: a non-empty list of distinct"),
        (["probe.sc_top_ks=[]"], r"probe.sc_top_ks=\[\] is not allowed"),
        (["probe.sc_top_ks=[8]", "probe.modes=[constant]"], r"probe.sc_top_ks=\[8\] is not allowed: needs `none`"),
        (["probe.sc_top_ks=[8]", "probe.corrections=[sc]"], r"probe.sc_top_ks=\[8\] is not allowed: needs `none`"),
        (["probe.sc_top_ks=[8]", "correction.sc.mode=exact"], r"needs correction.sc.mode=topk"),
        # refused by the conditional mode's check (tools.conditional.SAMPLED_TAIL) or, without a centred
        # correction, by check_top_ks: both ask for the rescaled tail
        (["correction.sc.tail=sampled"], r"correction.sc.tail='sampled' is not allowed: rescaled"),
    ],
)
def test_bad_top_ks_are_refused_before_the_model_loads(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_probe(cfg(*overrides), tmp_path / "p")
    assert not (tmp_path / "p").exists()


@pytest.mark.slow  # ~1 min on 2 cores: two probes recording all 49 152 log-probs per token
def test_each_top_k_row_is_the_run_with_that_head(tmp_path):
    """On the same rollouts (same seed), the list form's row sc@k=8 equals, sketch for sketch, the `sc` row of a
    run with correction.sc.top_k=8; k = V leaves exactly 0; sc@k=128 is the run's own `sc` (top_k 128)."""
    run_probe(cfg("probe.sc_top_ks=[8,128,49152]"), tmp_path / "list")
    run_probe(cfg("correction.sc.top_k=8"), tmp_path / "one")
    listed = torch.load(tmp_path / "list" / "sketches.pt")["settings"]["s1"]
    single = torch.load(tmp_path / "one" / "sketches.pt")["settings"]["s1"]
    assert set(listed) == {"none", "sc", "sc@k=8", "sc@k=128", "sc@k=49152"}
    for a, b in zip(listed["sc@k=8"]["conditional"], single["sc"]["conditional"]):
        assert float(a.norm()) > 0 and torch.equal(a, b)
    for a, b in zip(listed["none"]["conditional"], single["none"]["conditional"]):
        assert torch.equal(a, b)  # the same rollouts
    for a, b in zip(listed["sc@k=128"]["conditional"], listed["sc"]["conditional"]):
        assert torch.equal(a, b)
    assert all(float(x.abs().max()) == 0.0 for x in listed[f"sc@k={V_TINY}"]["conditional"])
    import json

    rows = json.loads((tmp_path / "list" / "probe.json").read_text())["top_k"]
    by = {(r["setting"], r["k"]): r for r in rows}
    full = by[("s1", V_TINY)]
    assert full["norm_frac"] == 0.0 and full["along_u"] == 0.0 and full["matches"]
    assert full["tokens"]["mass"] == pytest.approx([1.0] * 3) and full["tokens"]["rel_err"] == [0.0] * 3
    assert 0 < by[("s1", 8)]["tokens"]["mass"][0] < by[("s1", 128)]["tokens"]["mass"][0] < 1
    assert by[("s1", 8)]["kl"] > 0.1 and by[("(on-policy reference)", 8)]["kl"] < 1e-6
    assert by[("s1", 8)]["n_tokens"] > 0 and by[("s1", 8)]["batches"] == 3
    assert "sc@k=8" in (tmp_path / "list" / "probe.md").read_text() and (tmp_path / "list" / "topk.png").exists()
