"""What samples the rollouts and how: ``engine`` (one schema per option), ``kernels``, ``rollout`` and ``sampling``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .base import Number


@dataclass
class EngineConfig:
    """``engine=torch``: the embedded engine (``rollout.engines.ENGINES``); the base of every engine's fields."""

    #: torch | vllm | auto (``rollout.engines.ENGINE_CHOICES``)
    name: str = "torch"
    #: torch: null = share the trainer's module, else sample with an own copy in this dtype (float32 |
    #: bfloat16); vllm: null = bfloat16 under a bf16 trainer precision, else model.dtype
    dtype: Optional[str] = None
    #: mismatch injection: matrices through an int8 round trip at each sync
    int8_roundtrip: bool = False
    #: the engine's sampling seed; set to ``seed`` at start-up
    seed: int = 0
    #: mismatch dial sigma >= 0 (0 = off): the embedded engine samples from softmax((logits + sigma*eps)/T'),
    #: eps ~ N(0, I) seeded per (seed, step, sequence, position); rollout log-probs and top-k are the noisy
    #: distribution's. Embedded engine only (vLLM: > 0 is refused at start-up)
    logit_noise: Number = 0.0
    #: mismatch dial delta: the sampler samples (and reports log-probs) at T' = T + delta (> 0), the trainer
    #: scores at T; both engines
    temperature_offset: Number = 0.0


@dataclass
class VLLMEngineConfig(EngineConfig):
    """``engine=vllm`` (and ``auto``, which may become it): the colocated vLLM engine."""

    name: str = "vllm"
    #: GPU memory fraction for weights + KV cache (on CPU vLLM reads it as a RAM fraction)
    gpu_memory_utilization: Number = 0.3
    #: KV-cache GiB; null = 1 on CPU, from gpu_memory_utilization on GPUs
    kv_cache_gb: Optional[Number] = None
    #: > 1 needs in_process=false (weights then travel through a file)
    tensor_parallel_size: int = 1
    #: prompt + response tokens per sequence; null = the model's context length
    max_model_len: Optional[int] = None
    #: free the engine's GPU memory during the update: auto (on with CUDA) | true | false
    sleep_mode: Any = "auto"
    #: CUDA-graph capture for decoding: auto (on with CUDA) | true | false
    cuda_graphs: Any = "auto"
    #: engine core in the training process: weights handed over by reference
    in_process: bool = True


@dataclass
class KernelsConfig:
    """``kernels``: default | batch_invariant (``kernels.KERNELS``)."""

    name: str = "default"
    #: float32 matrix products on the CPU: auto (oneDNN where measured faster than torch's BLAS on the model's
    #: shapes, ``kernels.fp32_gemm.resolve``) | aten (torch's own) | onednn; kernels=batch_invariant: aten
    fp32_gemm: str = "auto"


@dataclass
class RolloutConfig:
    """``rollout``: how many rollouts a step takes and with which weights (``rollout.staleness``)."""

    #: P prompts per RL step
    prompts_per_step: int = 8
    #: G completions per prompt
    group_size: int = 8
    #: sequences per forward/backward of the update (does not change the result)
    micro_batch_size: int = 16
    #: sync | lagged | async (``rollout.staleness.ROLLOUT_MODES``)
    mode: str = "sync"
    #: lagged: RL steps between the sampling weights and the trained ones
    lag: int = 0
    #: async: no consumed rollout is more than this many RL steps old
    max_staleness: int = 1
    #: async: block | drop (``rollout.staleness.ON_STALE``)
    on_stale: str = "block"
    #: async: RL steps of rollouts buffered; null = max(1, max_staleness)
    buffer_size: Optional[int] = None
    #: lagged/async: score stale rows with their own weights, so r_num and r_stale split exactly
    behaviour_logprobs: bool = True
    #: lagged: keep the lag's weight history in checkpoints (exact resume)
    save_history: bool = True


@dataclass
class SamplingConfig:
    """``sampling``: the training rollouts (``rollout.types.SamplingParams``); the trainer scores at the same
    temperature."""

    temperature: Number = 1.0
    #: 0 = off
    top_k: int = 0
    #: 1.0 = off
    top_p: Number = 1.0
    #: L_max, the generation cap (max_response_length)
    max_new_tokens: int = 64
    #: top-k log-probs the engine records per token (score centering raises it to its head)
    logprobs_top_k: int = 0
