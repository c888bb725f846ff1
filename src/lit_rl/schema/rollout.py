"""What samples the rollouts and how: ``engine`` (one schema per option), ``kernels``, ``rollout`` and ``sampling``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .base import Number, Problems, int_rule, is_int, rule


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
    #: parameter names (the last part of the dotted name) an engine's own copy keeps in float32 whatever its
    #: dtype; null = the family's defaults (Gated DeltaNet's decay and gate parameters A_log, dt_bias, which
    #: transformers uses in float32; none for attention models); [] rounds them too (the A_log trap); a name
    #: that matches no parameter is refused when the engine is built; embedded engine only
    keep_float32: Optional[list] = None
    #: the engine's sampling seed; set to ``seed`` at start-up
    seed: int = 0
    #: mismatch dial sigma >= 0 (0 = off): the embedded engine samples from softmax((logits + sigma*eps)/T'),
    #: eps ~ N(0, I) seeded per (seed, step, sequence, position); rollout log-probs and top-k are the noisy
    #: distribution's. Embedded engine only (vLLM: > 0 is refused at start-up)
    logit_noise: Number = 0.0
    #: mismatch dial delta: the sampler samples (and reports log-probs) at T' = T + delta (> 0), the trainer
    #: scores at T; both engines
    temperature_offset: Number = 0.0
    #: auto | true | false: under bf16 autocast on the CPU, the embedded engine's decode-step products from weights
    #: held in oneDNN's packed layout, where they give the same bits as F.linear on the model's shapes (checked at
    #: the first rollout, ``kernels.packed_linear.resolve``) and, for auto, are measured faster; true skips the
    #: timing, never the bit check; never under kernels=batch_invariant. Embedded engine only (vLLM ignores it)
    packed_linear: Any = "auto"
    #: auto | true | false: the embedded engine's decode-step attention on the CPU through lit_rl's kernel
    #: (``kernels.decode_attention``: built for the machine at the first rollout, needs a C++ compiler); auto where
    #: it is measured faster than torch's SDPA on the model's heads, per dtype; true without the timing; never under
    #: kernels=batch_invariant. Embedded engine only (vLLM ignores it)
    decode_attention: Any = "auto"
    #: auto | true | false: the embedded engine's plain sampling steps (no logit noise, top-k, top-p or recorded
    #: top-k / tail) draw each row's token and log-prob in one call of lit_rl's kernel (``kernels.sampling``: the
    #: same distribution and uniforms as torch's calls, other last bits); auto where it builds; never under
    #: kernels=batch_invariant. Embedded engine only (vLLM ignores it)
    fused_sampler: Any = "auto"

    def problems(self, run) -> Problems:
        """The mismatch dial's values it refuses (``schema.base``: ``config.validate`` raises ConfigError for the
        first): ``logit_noise`` finite, >= 0 and the embedded engine's only; ``temperature_offset`` finite, with
        ``run.sampling.temperature`` + offset > 0. The option's own fields (vLLM's) need CUDA to be checked
        (``config.check_vllm_engine``)."""
        sigma, delta = self.logit_noise, self.temperature_offset
        packed = self.packed_linear
        built = (("decode_attention", self.decode_attention), ("fused_sampler", self.fused_sampler))
        for name, value in (("packed_linear", packed), *built):
            allowed = value == "auto" or isinstance(value, bool)
            yield from rule(allowed, f"engine.{name}", value, "choose auto, true or false")
        for name, value in built:  # the kernels are built at the first rollout: their toolchain checked now
            if value is True:
                from ..kernels.decode_attention import toolchain_missing

                missing = toolchain_missing()
                yield from rule(not missing, f"engine.{name}", True, f"needs its C++ build: {missing}; use auto")
        yield from rule(
            math.isfinite(sigma) and sigma >= 0, "engine.logit_noise", sigma, "must be finite and >= 0 (0 = off)"
        )
        yield from rule(math.isfinite(delta), "engine.temperature_offset", delta, "must be a finite number (0 = off)")
        temperature = run.sampling.temperature
        yield from rule(
            not delta or temperature + delta > 0,
            "engine.temperature_offset",
            delta,
            f"must keep the sampler's temperature positive: sampling.temperature={temperature} + {delta} <= 0",
        )
        yield from rule(
            not (sigma > 0 and self.name == "vllm"),
            "engine.logit_noise",
            sigma,
            "is wired for the embedded engine only (engine=torch): vLLM samples inside its own engine core, and "
            "noise whose draws show in its processed log-probs would need a vLLM logits processor, not built "
            "in this version; engine.temperature_offset works with vLLM",
        )


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
    #: vLLM's prefix caching: auto (on for a multi-turn task, whose later turns repeat their episode's ids; off
    #: otherwise) | true | false; the cache is emptied at every weight sync (no KV of older weights is reused)
    prefix_caching: Any = "auto"


@dataclass
class KernelsConfig:
    """``kernels``: default | batch_invariant (``kernels.KERNELS``)."""

    name: str = "default"
    #: float32 matrix products on the CPU: auto (oneDNN where measured faster than torch's BLAS on the model's
    #: shapes, ``kernels.fp32_gemm.resolve``) | aten (torch's own) | onednn; kernels=batch_invariant: aten
    fp32_gemm: str = "auto"
    #: Gated DeltaNet layers (Qwen3.5, Qwen3-Next): auto (recurrent under batch_invariant, else chunked) | chunked
    #: (transformers' split: chunked full forwards, recurrent decode) | recurrent (the recurrent algorithm on every
    #: forward, the chunked one's backward: ``kernels.linear_attention``)
    linear_attention: str = "auto"
    #: the trainer's attention backward on the CPU under kernels=default: auto (explicit where measured faster, by
    #: Lq x Lk: ``kernels.attention_backward``) | flash (torch's) | explicit (a float32 explicit-softmax backward,
    #: lit_rl's compiled kernel where built); the forward, and so the log-probs, are unchanged; kernels=batch_invariant:
    #: flash
    attention_backward: str = "auto"


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
    #: async: where the engine runs: auto (process where it can: engine=torch without LoRA, on the CPU; else
    #: thread) | thread (a thread of the trainer's process) | process (a process of its own, on its own cores,
    #: reading versions from a shared weight store)
    producer: str = "auto"
    #: async, producer=process: torch threads of the rollout process; null = half the trainer's (at least 1)
    producer_threads: Optional[int] = None
    #: async, producer=process: torch threads left to the trainer; null = the trainer's minus producer_threads (>= 1)
    trainer_threads: Optional[int] = None
    #: async: the longest wait for the producer's next batch (s); a dead rollout process is an error at once
    producer_timeout_s: Number = 600.0
    #: async: between_batches (a newer version is loaded before each batch) | in_flight (also between decode
    #: steps: one sequence may span versions; engine=vllm between vLLM's engine steps)
    weight_update: str = "between_batches"
    #: async, in_flight: recompute (re-prefill the live sequences with the new weights: exact) | keep (continue
    #: with the cache the older weights wrote)
    kv_on_update: str = "recompute"
    #: async, in_flight: sequences unfinished when a step's batch is due continue in the next batch, and the freed
    #: decode slots take new prompts' groups (a group enters a batch once all its G rows are done)
    partial: bool = False
    #: multi-turn tasks: model turns per episode (each at most sampling.max_new_tokens)
    max_turns: int = 4
    #: multi-turn tasks: tokens of a whole episode (prompt, model turns, environment); longer ones are cut
    max_total_tokens: int = 1024
    #: multi-turn tasks: tool calls served per model turn (the rest get an error observation)
    max_tool_calls: int = 4
    #: multi-turn tasks: characters of a tool's output kept (the rest cut and marked)
    max_tool_output_chars: int = 2000
    #: multi-turn tasks: last (the last turn's reward, else the verifier's on it) | sum (every turn's
    #: reward feeds the advantage: ``rollout.multiturn.EPISODE_REWARDS``)
    episode_reward: str = "last"

    def problems(self, run) -> Problems:
        """The stale-rollout fields' values it refuses (``schema.base``: ``config.validate`` raises ConfigError
        for the first): mode, lag, max_staleness, on_stale, buffer_size and the two switches. The batch sizes are
        checked beside the algorithm's group rule and the world size (``config.check_rollout``)."""
        from ..choices import ON_STALE, ROLLOUT_MODES  # here, not at the top: choices imports the schema

        mode = self.mode
        yield from rule(mode in ROLLOUT_MODES, "rollout.mode", mode, f"choose one of {list(ROLLOUT_MODES)}")
        yield from int_rule(self.lag, "rollout.lag", 0, " (RL steps between the sampling and the trained weights)")
        yield from int_rule(self.max_staleness, "rollout.max_staleness", 0, " (RL steps a consumed rollout may lag)")
        yield from rule(self.on_stale in ON_STALE, "rollout.on_stale", self.on_stale, f"choose one of {list(ON_STALE)}")
        size = self.buffer_size
        yield from rule(
            size is None or (is_int(size) and size >= 1),
            "rollout.buffer_size",
            size,
            "must be null (= max(1, rollout.max_staleness)) or an integer >= 1",
        )
        yield from self.producer_problems(run)
        yield from self.update_problems(run)
        yield from rule(
            self.episode_reward in ("last", "sum"), "rollout.episode_reward", self.episode_reward, "choose last or sum"
        )
        for key in ("max_turns", "max_total_tokens", "max_tool_calls", "max_tool_output_chars"):
            yield from int_rule(getattr(self, key), f"rollout.{key}", 1, " (multi-turn episodes)")
        for key in ("behaviour_logprobs", "save_history"):
            value = getattr(self, key)
            yield from rule(isinstance(value, bool), f"rollout.{key}", value, "must be true or false")
        readers = ROLLOUT_MODES.names_where(lambda spec: "lag" in spec.reads)
        yield from rule(
            not self.lag or mode in readers,
            "rollout.lag",
            self.lag,
            f"is read by {' | '.join(f'rollout.mode={m}' for m in readers)} only (rollout.mode={mode}); add "
            f"rollout.mode={readers[0]}",
        )

    def producer_problems(self, run) -> Problems:
        """``producer`` among ``choices.PRODUCERS``, other than ``auto`` only with ``mode=async`` (the one mode
        that reads it), and ``process`` where it can run: the embedded engine
        (``engine=vllm`` samples in its own engine core) and no LoRA adapter (the rollout process loads plain
        weights); the thread counts integers >= 1 or null; ``producer_timeout_s`` a number of seconds > 0."""
        from ..choices import PRODUCERS

        yield from rule(
            self.producer in PRODUCERS, "rollout.producer", self.producer, f"choose one of {list(PRODUCERS)}"
        )
        yield from rule(  # as weight_update=in_flight: a sync or lagged run would drop it silently
            self.producer == "auto" or self.mode == "async",
            "rollout.producer",
            self.producer,
            f"is read by rollout.mode=async only (rollout.mode={self.mode}); add rollout.mode=async",
        )
        if self.producer == "process":
            engine = run.engine.name
            yield from rule(
                engine != "vllm",
                "rollout.producer",
                "process",
                f"runs the embedded engine (engine=torch), not engine={engine}: vLLM samples in its own engine "
                "core already; use rollout.producer=thread",
            )
            lora = run.model.get("lora") if hasattr(run.model, "get") else getattr(run.model, "lora", None)
            r = getattr(lora, "r", 0) if lora is not None else 0
            yield from rule(
                not r,
                "rollout.producer",
                "process",
                f"loads plain weights into the rollout process, not a LoRA adapter (model.lora.r={r}); use "
                "rollout.producer=thread",
            )
        for key in ("producer_threads", "trainer_threads"):
            value = getattr(self, key)
            yield from rule(
                value is None or run.kernels.name != "batch_invariant",
                f"rollout.{key}",
                value,
                "must stay null under kernels=batch_invariant: the engine's products must run at the trainer's thread "
                "count for their bits to match; set the run's threads (threads=1 gives 1 + 1 with the process)",
            )
            yield from rule(
                value is None or (is_int(value) and value >= 1),
                f"rollout.{key}",
                value,
                "must be null or an integer >= 1",
            )
        timeout = self.producer_timeout_s
        yield from rule(
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0,
            "rollout.producer_timeout_s",
            timeout,
            "must be a number of seconds > 0",
        )

    def update_problems(self, run) -> Problems:
        """``weight_update`` and ``kv_on_update`` among their choices; ``in_flight`` read by ``async`` only, with
        ``engine=vllm`` only in process (its step loop pauses the engine core between steps) and without
        ``partial`` (carried in the embedded engine's decode loop only). Only with ``async`` and
        ``in_flight``: ``kv_on_update=keep`` (what a swap between decode steps does with the cache; without such
        swaps it was dropped silently), ``loss.drop_older_tokens`` (no sequence spans versions without them) and
        ``partial`` (a bool; the carried tokens keep their versions: only an engine that records versions per token
        can carry them)."""
        from ..choices import KV_ON_UPDATE, WEIGHT_UPDATES

        update = self.weight_update
        yield from rule(
            update in WEIGHT_UPDATES, "rollout.weight_update", update, f"choose one of {list(WEIGHT_UPDATES)}"
        )
        kv = self.kv_on_update
        yield from rule(kv in KV_ON_UPDATE, "rollout.kv_on_update", kv, f"choose one of {list(KV_ON_UPDATE)}")
        if update == "in_flight":
            yield from rule(
                self.mode == "async",
                "rollout.weight_update",
                update,
                f"is read by rollout.mode=async only (rollout.mode={self.mode}); add rollout.mode=async",
            )
            yield from rule(  # the in-flight step loop needs the engine core stepping in this process
                run.engine.name == "torch" or getattr(run.engine, "in_process", True) is not False,
                "rollout.weight_update",
                update,
                "needs vLLM's engine core in this process (engine.in_process=false steps it in a process of its "
                "own, with no pause between two steps for the update and its weight label); set "
                "engine.in_process=true (the default)",
            )
            yield from rule(
                self.partial is not True or run.engine.name != "vllm",
                "rollout.partial",
                self.partial,
                "carries unfinished sequences in the embedded engine's decode loop only: engine=vllm takes "
                "updates in flight but not partial rollouts; use engine=torch, or rollout.partial=false",
            )
            yield from rule(  # a sync must empty vLLM's prefix cache, which vLLM refuses while requests run
                getattr(run.engine, "prefix_caching", "auto") is not True,
                "engine.prefix_caching",
                True,
                "cannot be emptied at an in-flight weight update (vLLM empties its prefix cache only with no request "
                "running, and blocks the old weights wrote must not be reused); set engine.prefix_caching=auto or "
                "false",
            )
        yield from rule(  # as partial: a between_batches or sync run never swaps mid-sequence, so keep is dropped
            kv != "keep" or (self.mode == "async" and update == "in_flight"),
            "rollout.kv_on_update",
            kv,
            "is read by rollout.mode=async with rollout.weight_update=in_flight only (what an update between decode "
            f"steps does with the cache; rollout.mode={self.mode}, rollout.weight_update={update}); add "
            "rollout.mode=async rollout.weight_update=in_flight",
        )
        drop = getattr(getattr(run, "loss", None), "drop_older_tokens", False)
        yield from rule(  # only an in-flight swap writes a sequence with two versions: elsewhere it drops nothing
            drop is not True or (self.mode == "async" and update == "in_flight"),
            "loss.drop_older_tokens",
            drop,
            "leaves out the tokens written before an in-flight weight update, which only rollout.mode=async with "
            f"rollout.weight_update=in_flight makes (rollout.mode={self.mode}, rollout.weight_update={update}); add "
            "rollout.mode=async rollout.weight_update=in_flight",
        )
        yield from rule(isinstance(self.partial, bool), "rollout.partial", self.partial, "must be true or false")
        yield from rule(
            self.partial is not True or (self.mode == "async" and update == "in_flight"),
            "rollout.partial",
            self.partial,
            "carries unfinished sequences into the next batch of rollout.mode=async with "
            f"rollout.weight_update=in_flight only (rollout.mode={self.mode}, rollout.weight_update={update}); add "
            "rollout.mode=async rollout.weight_update=in_flight",
        )


@dataclass
class SamplingConfig:
    """``sampling``: how the engine samples the training rollouts (the trainer scores at the same temperature);
    the module's evaluation uses one too (``eval.temperature``, no truncation, no top-k log-probs). Engines take
    it as it is (``RolloutEngine.generate``)."""

    #: > 0 samples from softmax(logits / temperature); 0 is greedy (evaluation only)
    temperature: Number = 1.0
    #: keep the k most likely tokens; 0 = off
    top_k: int = 0
    #: nucleus mass; 1.0 = off
    top_p: Number = 1.0
    #: L_max, the generation cap (max_response_length)
    max_new_tokens: int = 64
    #: top-k log-probs of the sampling distribution the engine records per token (score centering raises it to its
    #: head H)
    logprobs_top_k: int = 0
    #: tail tokens the engine draws per position from its distribution with the top-k removed (renormalised),
    #: recorded with their log-probs after the top-k (score centering sets it: correction.sc.tail_samples with
    #: tail=sampled, else 0; the embedded engine only)
    logprobs_tail_samples: int = 0

    def problems(self, run) -> Problems:
        """The sampler's values it refuses (``schema.base``: ``config.validate`` raises ConfigError for the first)."""
        yield from rule(self.max_new_tokens > 0, "sampling.max_new_tokens", self.max_new_tokens, "must be > 0")
        yield from rule(
            self.temperature > 0,
            "sampling.temperature",
            self.temperature,
            "must be > 0 for training rollouts (the trainer scores at this temperature)",
        )
        yield from rule(0.0 < self.top_p <= 1.0, "sampling.top_p", self.top_p, "must lie in (0, 1]")
        yield from rule(self.top_k >= 0, "sampling.top_k", self.top_k, "must be >= 0 (0 = off)")
        yield from rule(self.logprobs_top_k >= 0, "sampling.logprobs_top_k", self.logprobs_top_k, "must be >= 0")
        tail = self.logprobs_tail_samples
        yield from rule(tail >= 0, "sampling.logprobs_tail_samples", tail, "must be >= 0")
