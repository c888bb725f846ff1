"""The values of the config fields that name a choice, where their owners import torch: defined here, torch-free.

``config.validate`` checks every such field before torch (or Lightning) is imported, so a bad value fails in
a fraction of a second. The lists belong to the modules that implement them, and each re-exports its own
(``from lit_rl.objectives import KL_KINDS`` and ``from lit_rl.algorithms import ALGORITHMS`` work as before);
they are written here because those modules cannot be imported without torch. ``tasks.TASKS`` and
``rollout.engines.ENGINES`` are not here: the task package is torch-free, and the engine names the config
accepts are ``ENGINE_CHOICES`` (tests/test_registries.py checks it against ``ENGINES``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Registry
from .schema import (
    AlgoConfig,
    CispoConfig,
    DapoConfig,
    DrGrpoConfig,
    GspoConfig,
    PpoConfig,
    ReinforceConfig,
    ReinforcePpConfig,
    SapoConfig,
)

# -- algorithms (lit_rl.algorithms) ------------------------------------------------------------------------------
#: ``algo.name`` -> (its class, imported on lookup; its config dataclass): the one list of algorithms. A new
#: algorithm is a module in ``lit_rl/algorithms/`` with its class, one line here and its ``conf/algo/<name>.yaml``
#: (the tests check that the lists agree)
_ALGORITHMS: dict[str, tuple[str, type[AlgoConfig]]] = {
    "reinforce": ("lit_rl.algorithms.reinforce:Reinforce", ReinforceConfig),
    "ppo": ("lit_rl.algorithms.ppo:PPO", PpoConfig),
    "grpo": ("lit_rl.algorithms.grpo:GRPO", AlgoConfig),
    "dapo": ("lit_rl.algorithms.dapo:DAPO", DapoConfig),
    "dr_grpo": ("lit_rl.algorithms.dr_grpo:DrGRPO", DrGrpoConfig),
    "gspo": ("lit_rl.algorithms.gspo:GSPO", GspoConfig),
    "cispo": ("lit_rl.algorithms.cispo:CISPO", CispoConfig),
    "reinforce_pp": ("lit_rl.algorithms.reinforce_pp:ReinforcePP", ReinforcePpConfig),
    "sapo": ("lit_rl.algorithms.sapo:SAPO", SapoConfig),
}
#: ``algo.name`` -> the algorithm's class (``algorithms.base.Algorithm``), imported on the first lookup
ALGORITHMS: Registry = Registry("algo", lazy={name: target for name, (target, _) in _ALGORITHMS.items()})
#: ``algo.name`` -> its config dataclass (``Algorithm.algo_config``): its defaults and what ``config.validate``
#: asks of it (``ppo_clip``, ``uses_clip``, ``group_normalised``, ``kl_in_reward``, ``group_baseline``)
ALGO_CONFIGS: Registry[type[AlgoConfig]] = Registry("algo", {name: cls for name, (_, cls) in _ALGORITHMS.items()})

# -- objectives (lit_rl.objectives) ------------------------------------------------------------------------------
#: ``loss.reduction``
REDUCTION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
#: ``algo.baseline`` of reinforce
BASELINES = ReinforceConfig.baselines
#: ``advantage.std``: the std's denominator n (population, lit_rl's default) or n − 1 (sample: TRL, verl)
STD_KINDS = ("population", "sample")
#: ``advantage.scale``: whose std divides the centred reward (TRL's ``scale_rewards``)
SCALES = ("group", "batch", "none")
#: ``advantage.multi_reward``: how several ``reward.functions`` become one advantage (``objectives.gdpo_advantages``)
MULTI_REWARD = ("sum", "normalize_then_sum")
#: ``kl.estimator``
KL_KINDS = ("k1", "k2", "k3")
#: ``kl.mode``: the KL to the reference as a loss term (GRPO's) or folded into the per-token reward (classic RLHF)
KL_MODES = ("loss", "reward")

# -- corrections (lit_rl.corrections) ----------------------------------------------------------------------------
#: ``correction`` -> the parts it turns on (``tis``, ``mis``, ``sc``, ``opsm``, ``rs``, ``m2po``): the one list of
#: corrections; each has its ``conf/correction/<name>.yaml``, which sets exactly these ``<part>.enabled`` flags
#: (checked by the tests)
CORRECTIONS: Registry[frozenset] = Registry(
    "correction",
    {
        "none": frozenset(),
        "tis": frozenset({"tis"}),
        "mis": frozenset({"mis"}),
        "sc": frozenset({"sc"}),
        "sc+tis": frozenset({"sc", "tis"}),
        "sc+mis": frozenset({"sc", "mis"}),
        "opsm": frozenset({"opsm"}),
        "sc+opsm": frozenset({"sc", "opsm"}),
        "tis+opsm": frozenset({"tis", "opsm"}),
        "rs": frozenset({"rs"}),
        "tis+rs": frozenset({"tis", "rs"}),
        "sc+rs": frozenset({"sc", "rs"}),
        "m2po": frozenset({"m2po"}),
        "sc+m2po": frozenset({"sc", "m2po"}),
        "decoupled": frozenset({"mis"}),
    },
)

# -- kernels (lit_rl.kernels) ------------------------------------------------------------------------------------
#: ``kernels`` -> what the mode does (``kernels.kernel_mode`` builds it); each has its ``conf/kernels/<name>.yaml``
KERNELS: Registry[str] = Registry(
    "kernels",
    {
        "default": "torch's and transformers' own kernels",
        "batch_invariant": "lit_rl's CPU kernels: rollout log-probs equal the trainer's bit for bit",
    },
)
#: ``kernels.fp32_gemm`` values (``kernels.fp32_gemm.resolve``)
FP32_GEMM_CHOICES = ("auto", "aten", "onednn")
#: ``kernels.linear_attention`` values (``kernels.linear_attention.resolve_linear_attention``)
LINEAR_ATTENTION_CHOICES = ("auto", "chunked", "recurrent")
#: ``kernels.attention_backward`` values (``kernels.attention_backward.resolve``)
ATTENTION_BACKWARD_CHOICES = ("auto", "flash", "explicit")
#: ``engine.packed_linear`` values (``kernels.packed_linear.resolve``)
PACKED_LINEAR_CHOICES = ("auto", True, False)

# -- rollout (lit_rl.rollout) ------------------------------------------------------------------------------------
#: ``engine.name``: the engines of ``rollout.engines.ENGINES``, and ``auto``, a choice made at start-up
#: (``rollout.engines.resolve_auto``)
ENGINE_CHOICES = ("torch", "vllm", "auto")


@dataclass(frozen=True)
class RolloutMode:
    """What ``config.validate`` knows of a rollout mode before torch loads (the mode's ``RolloutSource`` is
    ``rollout.sources``'; ``rollout.sources.register_source`` adds both).

    description: what the mode samples with; reads: the ``rollout`` fields only this mode reads (a non-default
    value is refused under the other modes); multi_rank: it runs on several data-parallel ranks (``trainer=ddp``);
    sharded: it also runs with the weights sharded over the ranks (``trainer=fsdp``); background: its engine may
    sample beside the trainer (a producer thread or process), so an engine whose ``generate`` joins the training
    world's collectives (vLLM under data parallelism) cannot serve it on several ranks; stale: its rows may come
    from older weights; multi_turn: it serves multi-turn episodes (a task with an environment:
    ``rollout.multiturn``).
    """

    description: str
    reads: tuple[str, ...] = ()
    multi_rank: bool = False
    sharded: bool = False
    background: bool = False
    #: its rows may come from weights older than those trained (``correction.bypass`` is refused)
    stale: bool = False
    multi_turn: bool = False

    def refusal_on_ranks(self, ranks: int, strategy: str, engine: str, named: str) -> str | None:
        """Why this mode cannot run on ``ranks`` data-parallel ranks (``named``: as the config names them) under
        ``trainer.strategy`` with ``engine.name`` (``config.check_world_size`` reports it), or None when it can."""
        if ranks == 1:
            return None
        if not self.multi_rank:
            modes = " or ".join(f"rollout.mode={m}" for m in ROLLOUT_MODES.names_where(lambda m: m.multi_rank))
            return f"runs on one device in this version, not on {named}: use {modes} there"
        if strategy == "fsdp" and not self.sharded:
            modes = " or ".join(f"rollout.mode={m}" for m in ROLLOUT_MODES.names_where(lambda m: m.sharded))
            return (
                f"does not run with trainer.strategy=fsdp on {named} (its older weights are swapped into, or copied "
                f"from, an unsharded module): use trainer=ddp, or {modes} with fsdp"
            )
        if self.background and engine == "vllm":
            return (
                f"does not run with engine=vllm on {named}: each rank's vLLM engine joins the training world's "
                "collectives, which a producer beside the trainer would enter out of step with the update "
                "(rollout.mode=lagged samples in the trainer's thread); use engine=torch"
            )
        return None


#: ``rollout.mode`` -> what it samples with and what the config checks ask of it (the one list of rollout modes)
ROLLOUT_MODES: Registry[RolloutMode] = Registry(
    "rollout.mode",
    {
        "sync": RolloutMode("the weights about to be trained", multi_rank=True, sharded=True, multi_turn=True),
        "lagged": RolloutMode(
            "the weights of exactly rollout.lag RL steps ago", reads=("lag",), multi_rank=True, stale=True
        ),
        "async": RolloutMode(
            "the newest weights a producer (thread or process) has, at most rollout.max_staleness RL steps old",
            multi_rank=True,
            background=True,
            stale=True,
        ),
    },
)
#: ``rollout.producer`` -> where an async run's engine samples (``rollout.sources.StaleSource``)
PRODUCERS: Registry[str] = Registry(
    "rollout.producer",
    {
        "auto": "process where it can run (engine=torch without LoRA, on the CPU), else thread",
        "thread": "a thread of the trainer's process, sharing its cores",
        "process": "a process of its own on its own cores, fed by a shared weight store",
    },
)
#: ``rollout.weight_update`` -> when an async engine takes a newer version
WEIGHT_UPDATES: Registry[str] = Registry(
    "rollout.weight_update",
    {
        "between_batches": "before each batch: a sequence is written by one version",
        "in_flight": "between decode steps too: a sequence may span versions, each token recording its own",
    },
)
#: ``rollout.kv_on_update`` -> what an in-flight update does with the cache the older weights wrote
KV_ON_UPDATE: Registry[str] = Registry(
    "rollout.kv_on_update",
    {
        "recompute": "re-prefill every live sequence with the new weights (exact: a fresh engine's log-probs)",
        "keep": "continue with the cache the older weights wrote (the documents' KV kept; a gap, measured)",
    },
)
#: ``rollout.on_stale`` -> what happens to a batch older than ``rollout.max_staleness``
ON_STALE: Registry[str] = Registry(
    "rollout.on_stale",
    {
        "block": "the producer waits so that no batch gets too old",
        "drop": "too-old batches are dropped and counted",
    },
)
