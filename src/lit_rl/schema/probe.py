"""The gradient-bias probe's config (``recipes/probe_gradients.py``, ``conf/probe.yaml``): every field of a
training run, plus ``probe``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from .base import Number
from .train import TrainConfig


@dataclass
class ProbeEngineOverrides:
    """``probe.settings[i].engine``: the ``engine`` fields a mismatch setting overrides (null = the run's own)."""

    logit_noise: Optional[Number] = None
    temperature_offset: Optional[Number] = None
    dtype: Optional[str] = None
    int8_roundtrip: Optional[bool] = None


@dataclass
class ProbeSetting:
    """One mismatch setting of the probe: a name (its row label), the engine fields it sets, its sampler's weights."""

    name: str = MISSING
    engine: ProbeEngineOverrides = field(default_factory=ProbeEngineOverrides)
    #: the sampler's weights in this setting: a model folder (a run's ``policy_step{n}/``, from
    #: ``checkpoint.export_at_steps``: a stale sampler, ``lit_rl.tools.staleness_probe``); null = the policy's own
    sampler: Optional[str] = None


@dataclass
class ProbeConfig:
    """``probe``: the gradient-bias probe's own fields (``lit_rl.tools.probe``; ranges in ``probe.check_probe``)."""

    #: the corrections whose batch gradients are measured (names of ``corrections.CORRECTIONS``)
    corrections: list[str] = field(default_factory=lambda: ["none", "tis", "mis", "sc", "sc+tis", "sc+mis"])
    #: the mismatched samplers; each correction sees the same rollouts of each
    settings: list[ProbeSetting] = field(default_factory=list)
    #: rollout batches per mismatch setting (>= 3: the jackknife leaves one out)
    batches: int = 5
    #: on-policy batches for the reference gradient (correction none; >= 3)
    reference_batches: int = 5
    #: constant (every advantage 1: the drift, true value 0), conditional (that drift's per-prefix conditional
    #: expectation from the full μ(h) and π(h): no token noise; token-level corrections) and/or reward (the batch's
    #: own advantages)
    modes: list[str] = field(default_factory=lambda: ["constant"])
    #: score centering's head sizes k measured beside the rest, one row ``sc@k=K`` each (the ``sc`` correction with
    #: ``correction.sc.top_k=K``, same rollouts) and their residual against ``none``'s conditional drift
    #: (``lit_rl.tools.topk_probe``); null: none
    sc_top_ks: Optional[list[int]] = None
    #: D of the gradients' CountSketch (relative error of a squared norm ~ sqrt(2/D))
    sketch_dim: int = 131072
    sketch_seed: int = 0
    #: batch b samples with the seeds of step seed_offset + b (the reference's: 10^6 + seed_offset + b): a probe with
    #: offset B continues one of B batches with new rollouts, its sketches on the same map (sketch_dim, sketch_seed)
    seed_offset: int = 0
    #: output folder; null = the Hydra run folder
    out: Optional[str] = None


@dataclass
class ProbeRunConfig(TrainConfig):
    """The probe's whole config (``conf/probe.yaml``): every field of a training run, plus ``probe``."""

    probe: ProbeConfig = field(default_factory=ProbeConfig)
