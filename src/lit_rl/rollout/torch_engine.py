"""The embedded rollout engine: KV-cached batched sampling with the trainer's own ``nn.Module``.

Because the engine calls the very module the optimizer updates (no copy, no weight sync), its gap to the
trainer comes only from kernels (prefill/decode and batch-shape dependent reductions), never from stale
or mis-synced weights.

Per step the engine projects only the last position's hidden state to logits, samples each sequence with
its own seeded generator (so a prompt's tokens do not depend on which other prompts share the batch), and
drops finished sequences from the batch and the cache, so short answers stop costing compute. A prompt
that appears G times (a GRPO group) is prefilled once and its KV cache copied to the G rows.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from ..kernels import BatchInvariantMode, attention_kv_dtype, single_query
from ..kernels import decode_attention as decode_kernel
from ..kernels import sampling as sampling_kernel
from ..models import merged_weights, peft_model
from .decode_loop import DecodeLoop, PartialRollouts
from .kv_cache import ReservedLayer, reserved_cache
from .kv_continuation import KeptCaches
from .llama_decode import DecodeParity
from .state_cache import float32_names, hybrid_cache, is_hybrid
from .types import InFlightSwaps, Rollouts, SamplingConfig
from .weight_casts import WeightCasts


@dataclass
class GenerationStats:
    """Timing of the last ``generate`` call: seconds and generated tokens (valid ones only); in-flight weight
    updates: how many swaps it made between decode steps and the seconds they paused decoding (loading, and with
    ``kv_on_update=recompute`` the re-prefill)."""

    seconds: float = 0.0
    tokens: int = 0
    swaps: int = 0
    swap_seconds: float = 0.0
    partial: dict[str, float] | None = None  # rollout.partial: ``PartialRollouts.totals`` after the call
    recompute: dict[str, int] | None = None  # the engine's ``recompute_totals`` after the call

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class GenerationCancelled(RuntimeError):
    """``TorchEngine.cancel`` was set while ``generate`` ran; its partial output is discarded."""


def int8_roundtrip(weight: Tensor) -> Tensor:
    """Symmetric per-row int8 quantise/de-quantise of a [out, in] matrix (same shape and dtype back)."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return ((w / scale).round().clamp(-127, 127) * scale).to(weight.dtype)


def noise_seed(sequence_seed: int) -> int:
    """The seed of a sequence's logit-noise stream: a 63-bit function of its sampling seed only, apart from the
    sampling stream (so turning the noise on does not change the uniforms that pick the tokens)."""
    return hash((int(sequence_seed), 0x6E6F697365)) & (2**63 - 1)


def tail_seed(sequence_seed: int) -> int:
    """The seed of a sequence's tail-sample stream (score centering's sampled tail, ``sample_tail``): a 63-bit
    function of its sampling seed only, apart from the sampling and noise streams, so recording tail samples changes
    neither the sampled tokens nor the noise."""
    return hash((int(sequence_seed), 0x7461696C)) & (2**63 - 1)


def sample_tail(logp: Tensor, head_ids: Tensor, m: int, generators: list[torch.Generator]) -> tuple[Tensor, Tensor]:
    """Draw ``m`` tokens per row i.i.d. (with replacement) from the row's tail: ``logp`` [B, V] (float32 log-probs of
    the sampling distribution μ) with the ``head_ids`` [B, k] int64 removed and renormalised, μ_tail(v) =
    μ_v / (1 − Σ_H μ) for v ∉ H. Row r uses ``generators[r]`` only (``m`` uniforms per call), by inverse CDF.

    Returns (ids [B, m] int64, log μ of those ids [B, m] float32, the UNconditional log-probs). A row whose tail
    has no mass (its support inside the head) gets its first head id with log-prob −inf: score centering skips it.
    Raises ValueError for ``m`` < 1 or a generator count other than B.
    """
    if m < 1:
        raise ValueError(f"tail samples m must be >= 1, got {m}")
    if len(generators) != logp.shape[0]:
        raise ValueError(f"got {logp.shape[0]} rows but {len(generators)} tail generators")
    tail = logp.float().scatter(-1, head_ids, float("-inf"))
    cdf = tail.exp().cumsum(-1)  # [B, V]
    total = cdf[:, -1:]
    u = torch.stack([torch.rand(m, generator=g, device=logp.device) for g in generators])  # [B, m]
    idx = torch.searchsorted(cdf, u * total).clamp(max=logp.shape[-1] - 1)
    lp = tail.gather(-1, idx)
    bad = torch.isinf(lp) & (total > 0)  # a float tie at a flat CDF step: the nearest tail token above, else below
    for r, j in bad.nonzero().tolist():
        support = torch.isfinite(tail[r]).nonzero().squeeze(-1)
        idx[r, j] = support[torch.searchsorted(support, idx[r, j]).clamp(max=support.numel() - 1)]
    empty = (total <= 0).expand_as(idx)
    idx = torch.where(empty, head_ids[:, :1].expand_as(idx) if head_ids.shape[-1] else idx, idx)
    return idx, torch.where(empty, torch.full_like(lp, float("-inf")), tail.gather(-1, idx))


def add_logit_noise(logits: Tensor, sigma: float, generators: list[torch.Generator]) -> Tensor:
    """``logits`` [B, V] plus σ·ε, ε ~ N(0, I) drawn row by row from each row's own generator (float32 [B, V]).

    The mismatch dial ``engine.logit_noise``: a sampler whose logits are off by Gaussian noise of known
    size, reproducible because row r's noise at its t-th decode step is the t-th block of V normals of
    ``generators[r]`` (seeded by ``noise_seed`` of the sequence's seed, which the data module derives from
    (seed, step, round, prompt, sample)): the same sequence seed gives the same noise at every position,
    whatever else shares the batch. For a small σ at temperature T the per-token KL between the clean and the
    noisy distribution is about Var_π[σε]/(2T²), in expectation σ²(1 − Σ_v π_v²)/(2T²) nats: less for a
    peaked π (a token the model is sure of barely moves).
    Raises ValueError for σ < 0 or a generator count other than B.
    """
    if sigma < 0:
        raise ValueError(f"logit noise sigma must be >= 0, got {sigma}")
    if len(generators) != logits.shape[0]:
        raise ValueError(f"got {logits.shape[0]} rows but {len(generators)} noise generators")
    noise = torch.stack([torch.randn(logits.shape[-1], generator=g, device=logits.device) for g in generators])
    return logits.float() + sigma * noise


def row_uniforms(generators: list[torch.Generator], device=None) -> Tensor:
    """One uniform in [0, 1) per row, row r's from ``generators[r]`` (float32 [B]): the draw ``sample_rows`` and
    ``kernels.sampling.sample`` turn into row r's next token."""
    return torch.stack([torch.rand((), generator=g, device=device) for g in generators])


def sample_rows(logp: Tensor, generators: list[torch.Generator], uniforms: Tensor | None = None) -> Tensor:
    """Draw one token per row of ``logp`` [B, V] (float32 log-probs) by inverse CDF.

    Each row uses one uniform from its own generator, so a row's token depends only on its own
    distribution and seed, not on the other rows in the batch; ``uniforms`` [B]: those already drawn
    (``row_uniforms``), then none is drawn here. Returns [B] int64.
    """
    u = row_uniforms(generators, logp.device) if uniforms is None else uniforms.to(logp.device)
    cdf = logp.exp().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    idx = idx.clamp(max=logp.shape[-1] - 1)
    # a zero-probability token can only be hit on a float tie at a flat CDF step; step back to the
    # nearest token inside the support
    bad = torch.isinf(logp.gather(-1, idx[:, None]).squeeze(-1))
    if bad.any():
        for r in bad.nonzero().squeeze(-1).tolist():
            support = torch.isfinite(logp[r]).nonzero().squeeze(-1)
            idx[r] = support[torch.searchsorted(support, idx[r]).clamp(max=support.numel() - 1)]
    return idx


class TorchEngine(InFlightSwaps):
    """Samples from ``model`` (a transformers causal LM) with a KV cache.

    Args:
        model: the trainer's module (shared, not copied, by default).
        pad_token_id: id used for padding outputs.
        stop_token_ids: ids that end a sequence (the tokenizer's EOS / chat end-of-turn).
        weights_dtype: mismatch injection: sample with an own copy of the weights in this dtype (e.g.
            torch.bfloat16 while the trainer is float32), refreshed by ``sync_weights``.
        int8_roundtrip: mismatch injection: the copy's matrices go through a symmetric per-row int8
            quantise/de-quantise round trip at every sync.
        own_copy: sample with an own copy of the weights (in the trainer's dtype) even without a mismatch
            injection: stale rollouts (``rollout.mode=lagged|async``) sample with older weights than the
            trainer holds, loaded into the copy by ``sync_weights(version, weights)``.
        logit_noise: mismatch dial σ >= 0 (``engine.logit_noise``): sampling rollouts (temperature > 0) draw
            from softmax((logits + σε) / T'), ε ~ N(0, I) per token (``add_logit_noise``); 0 = off.
        temperature_offset: mismatch dial δ (``engine.temperature_offset``): sampling rollouts draw at
            T' = T + δ while the trainer scores at T; 0 = off. T + δ must stay > 0.
        keep_float32: parameter names (last part of the dotted name) an own copy keeps in float32 whatever
            ``weights_dtype`` (``engine.keep_float32``); None = the family's defaults (Gated DeltaNet's ``A_log``,
            ``dt_bias`` where the model has them), () = none. A name that matches no parameter of ``model``
            raises ValueError naming it and the model's candidates (``state_cache.float32_names``).
        packed_linear: ``engine.packed_linear``, "auto" | True | False: under bf16 autocast on the CPU, decode
            steps' products from weights held in oneDNN's packed layout where ``kernels.packed_linear.resolve``
            finds the same bits as ``F.linear`` (and, for auto, a faster product) at the first rollout; ValueError
            naming the field for another value.
        decode_attention: ``engine.decode_attention``, "auto" | True | False: decode steps' attention through
            lit_rl's CPU kernel (``kernels.decode_attention``) where ``resolve`` turns it on for the model at the
            first rollout (auto: measured faster than SDPA, per dtype); never under batch-invariant kernels;
            ValueError naming the field for another value.
        fused_sampler: ``engine.fused_sampler``, "auto" | True | False: plain sampling steps (no logit noise, top-k,
            top-p or recorded top-k / tail) draw each row's token and its log-prob in one call of lit_rl's kernel
            (``kernels.sampling``: the same distribution and uniforms, other last bits); auto where it builds, True
            raises where it does not; never under batch-invariant kernels; ValueError for another value.

    With either dial on, ``rollout_logprobs`` and the recorded top-k head are those of the distribution
    actually sampled (noisy logits, temperature T + δ, then top-k/top-p on those), as a mismatched engine's
    would be. Greedy decoding (temperature 0: evaluation) ignores both: it scores the policy, not the sampler.

    Under ``torch.autocast`` each rollout casts the linear layers' weights to the autocast dtype once and reuses the
    casts at every decode step (``weight_casts.WeightCasts``, ``casts``; the same values autocast's per-step casts
    give), under bf16 also packed for oneDNN where ``packed_linear`` says so (the same bits); a sync or any
    in-place write of a weight makes its cast again.

    ``cancel``: a ``threading.Event``, or None; once set, a ``generate`` in progress raises
    ``GenerationCancelled`` at its next decode step (a rollout producer thread is stopped this way).

    Partial rollouts (``rollout.partial``): ``generate_partial`` keeps unfinished rows for the next call and
    refills freed decode slots with queued groups (``decode_loop.PartialRollouts``).

    Multi-turn episodes: inside ``kv_continuation()`` (one collection) ``generate`` keeps each finished row's KV
    and continues it when a later prompt extends that row's context (``kv_continuation.KeptCaches``).
    ``continue_kv`` False (a comparison's baseline) keeps none: every turn re-prefills its whole episode.

    In-flight weight updates (``rollout.weight_update=in_flight``): ``between_steps``, None or a callable
    ``between_steps(step) -> bool`` called before each decode step after the first, which returns True when it
    loaded newer weights (``sync_weights``) into the engine; tokens sampled from then on record the new version
    (``Rollouts.token_versions``). ``kv_on_update``: ``keep`` continues with the cache written by the older
    weights (the documents' "KV kept"); ``recompute`` re-prefills every live sequence (prompt and the tokens
    sampled so far) with the new weights, so the next token's log-prob is the one a fresh engine holding the new
    version assigns to the same context; a prompt that rows share is prefilled once and each row's tail on top
    of it (``kv_continuation.shared_prompt_prefill``), the ids fed counted in ``recompute_totals``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        stop_token_ids: list[int],
        weights_dtype: torch.dtype | None = None,
        int8_roundtrip: bool = False,
        own_copy: bool = False,
        logit_noise: float = 0.0,
        temperature_offset: float = 0.0,
        keep_float32: tuple[str, ...] | None = None,
        packed_linear="auto",
        decode_attention="auto",
        fused_sampler="auto",
    ):
        if not logit_noise >= 0:
            raise ValueError(f"logit_noise must be >= 0, got {logit_noise}")
        self.logit_noise, self.temperature_offset = float(logit_noise), float(temperature_offset)
        self.source = model
        self.cancel = None
        self.own_copy = own_copy or weights_dtype is not None or int8_roundtrip
        self.int8_roundtrip = int8_roundtrip
        self.keep_float32 = float32_names(model, keep_float32)
        self.model = model
        self.weights_dtype = weights_dtype
        if self.own_copy:
            self._copy_model()
        self.pad_token_id = pad_token_id
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.version = 0
        self.last = GenerationStats()
        self.swap_totals = [0, 0.0]  # in-flight swaps and their seconds over every generate call so far
        self._swaps = [0, 0.0]  # those of the current generate call
        # caches rebuilt over rows with sampled tokens (a recompute swap, carried rows under newer weights), over every
        # call so far: the rebuilds, the ids they fed (each shared prompt once) and the rows' contexts' total length
        self.recompute_totals = {"prefills": 0, "prefill_tokens": 0, "context_tokens": 0}
        self.between_steps = None
        self.kv_on_update = "keep"
        self.partial, self.partial_min_version = False, None  # rollout.partial (set by the rollout source)
        self.partial_ahead_min_version = None  # rollout.partial: the look-ahead's batch's bound (set by the producer)
        self.partial_state: PartialRollouts | None = None  # the rows carried between generate_partial calls
        self.continue_kv = True
        # ``casts.enabled = False``: autocast's own per-step casts (a comparison's baseline)
        self.casts = WeightCasts(packed=packed_linear)
        # a Llama model's cached decode steps through fewer calls, the same bits (``llama_step.enabled = False``: off)
        self.llama_step = DecodeParity()
        decode_kernel.check_setting(decode_attention)
        self.decode_attention = decode_attention
        sampling_kernel.check_setting(fused_sampler)
        self.fused_sampler = fused_sampler
        # distinct prompts' shared opening (a chat template's) prefilled once (``kv_continuation.common_prefix``)
        self.prefix_sharing = True
        self.said_prefix = False  # the shared-opening prefill said once
        self._fused_why: str | None = None  # None: not asked yet; "": the kernel runs; else why not
        self._fused_said: set[str] = set()  # the sampling settings already said to keep torch's calls
        self._decode_dtypes: dict[tuple, tuple] = {}  # (threads, model) -> the dtypes the decode kernel serves
        self.kept: KeptCaches | None = None  # the KV kept inside ``kv_continuation``
        single_query.install()  # decode steps: a key/value head's query heads in one SDPA problem
        self.sync_weights(0)

    def _copy_model(self) -> None:
        self.model = copy.deepcopy(self.source).requires_grad_(False)
        wrapper = peft_model(self.model)
        if wrapper is not None:  # LoRA: the copy is the plain base architecture; syncs fill in merged weights
            self.model = wrapper.merge_and_unload()
            self.model.__dict__.pop("lit_rl_peft", None)
        if self.weights_dtype is not None:
            self.model.to(self.weights_dtype)
            for name, param in self.model.named_parameters():  # engine.keep_float32
                if name.rsplit(".", 1)[-1] in self.keep_float32:
                    param.data = param.data.float()
        if getattr(self.model, "is_activation_checkpointing", False):
            disable = (
                getattr(self.model, "activation_checkpointing_disable", None)
                or self.model.gradient_checkpointing_disable
            )
            disable()

    def take_own_copy(self) -> None:
        """Sample from a copy of the weights from now on (idempotent): for a trainer whose module is about to be
        sharded (FSDP), whose forward would be a collective every rank must join -- ranks whose completions end
        at different lengths would stall. Call before the module is wrapped; ``sync_weights(weights=...)``
        then fills the copy from the gathered full weights."""
        if not self.own_copy:
            self.own_copy = True
            self._copy_model()

    @torch.no_grad()
    def sync_weights(self, version: int, weights: dict[str, Tensor] | None = None) -> None:
        """Make the engine sample with the trainer's current weights, of version ``version``, or with
        ``weights`` (a name -> tensor dict of the trainer's state dict, e.g. an older version kept by
        ``rollout.staleness.WeightHistory``; own copy only).

        Shared module: nothing to copy (a LoRA policy samples through its adapter). Own copy: every tensor of the
        state dict (tied output embeddings included) is copied, cast to the copy's dtype, through the int8 round
        trip if configured; a LoRA policy's weights merged first, W0 + (alpha / r) B A (``models.merged_weights``).
        """
        if weights is not None and not self.own_copy:
            raise ValueError("sync_weights(weights=...) needs an engine with its own copy of the weights")
        self.version = version
        self.casts.clear()  # new weights: new casts (also for writes no version counter sees)
        if not self.own_copy:
            return
        device = next(self.source.parameters()).device
        if next(self.model.parameters()).device != device:  # follow the trainer (e.g. onto its GPU)
            self.model.to(device)
        target = self.model.state_dict()
        source = merged_weights(self.source, weights)
        for name, value in source.items():
            if self.int8_roundtrip and value.dim() == 2:
                value = int8_roundtrip(value)
            target[name].copy_(value)

    def sleep(self) -> None:
        """Nothing to release: the embedded engine holds no memory of its own between rollouts."""

    def close(self) -> None:
        """Nothing to shut down (same interface as the vLLM engine)."""

    @contextlib.contextmanager
    def kv_continuation(self):
        """A multi-turn collection's session: inside it, ``generate`` keeps the KV of every row it finishes (prompt
        + its tokens but the last) and a later prompt that extends a kept context prefills only the ids after it,
        then decodes on (``kv_continuation``); on leaving, the kept KV is dropped. Yields the ``KeptCaches`` (None
        when nothing is kept: ``continue_kv`` off, a hybrid model, whose conv and recurrent states cannot be
        continued this way); a session opened inside another shares its store (the outer one drops it)."""
        if self.kept is not None or not self.continue_kv or is_hybrid(self.model):
            yield self.kept
            return
        self.kept = KeptCaches()
        try:
            yield self.kept
        finally:
            self.kept = None

    @torch.no_grad()  # not inference_mode: callers may edit the returned tensors in place
    def generate(self, prompts: list[list[int]], params: SamplingConfig, seeds: list[int]) -> Rollouts:
        """Sample one completion per prompt.

        prompts: N token-id lists (already chat-formatted); seeds: N ints, one generator per sequence.
        Returns ``Rollouts`` (see its docstring for shapes). temperature 0 means greedy decoding.
        Raises ValueError if len(seeds) != len(prompts) or max_new_tokens <= 0.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds")
        if params.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {params.max_new_tokens}")
        return self._timed(self._generate, prompts, params, seeds)

    @torch.no_grad()
    def generate_partial(
        self, prompts: list[list[int]], params: SamplingConfig, seeds: list[int], keys: list, want: int,
        min_version: int | None = None, ahead: int = 0, ahead_min_version: int | None = None,
    ) -> tuple[Rollouts, list, Tensor]:  # fmt: skip
        """``rollout.partial``: add the groups of ``prompts`` (``keys``: one per group; a group's rows next to each
        other) to the engine's partial rollouts (``decode_loop.PartialRollouts``, kept across calls) and decode until
        ``want`` groups are complete; rows still decoding carry over to the next call. ``min_version``: held groups
        with an older token restart (None: ``partial_min_version``, which the async producer sets to the oldest
        version its next batch may train on). ``ahead``: the last ``ahead`` groups are the next batch's, queued for
        the decode slots this batch's groups free (not counted in the batch's slots; a key already seen is skipped).
        ``ahead_min_version``: the oldest version the look-ahead's own batch may train on (None:
        ``partial_ahead_min_version``, which the producer sets); a look-ahead group does not start with older weights
        unless this batch needs it (``PartialRollouts``).
        Returns (``Rollouts`` of the ``want`` groups' rows, ``carried`` set, their keys, carried [N] bool);
        ``last.tokens`` counts the returned rows' tokens, carried ones included.
        Raises ValueError for max_new_tokens <= 0 and as ``PartialRollouts.generate``."""
        if params.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {params.max_new_tokens}")
        if self.partial_state is None:
            self.partial_state = PartialRollouts()
        min_version = self.partial_min_version if min_version is None else min_version
        if ahead_min_version is None:
            ahead_min_version = self.partial_ahead_min_version
        state = self.partial_state
        return self._timed(
            state.generate, self, prompts, params, seeds, keys, want, min_version, ahead, ahead_min_version
        )

    @property
    def partial_totals(self) -> dict[str, float] | None:
        """``rollout.partial``: the carried rows' running totals (``PartialRollouts.totals``); None before any."""
        return self.partial_state.totals() if self.partial_state is not None else None

    def _timed(self, run, *args):
        """``run(*args)`` in eval mode with the weights cast once (``casts``), its time, tokens and in-flight swaps in
        ``last``."""
        start = time.perf_counter()
        model = self.model
        was_training = model.training
        model.eval()
        self._swaps = [0, 0.0]
        self.llama_step.begin()
        try:
            with self.casts.installed(model), decode_kernel.active(self._decode_kernel(model)):
                result = run(*args)
        finally:
            model.train(was_training)
        out = result[0] if isinstance(result, tuple) else result
        seconds = time.perf_counter() - start
        self.last = GenerationStats(seconds, int(out.response_mask.sum()), self._swaps[0], self._swaps[1])
        self.last.partial = self.partial_totals
        self.last.recompute = dict(self.recompute_totals)
        self.swap_totals[0] += self._swaps[0]
        self.swap_totals[1] += self._swaps[1]
        return result

    def fused_sampling(self, needs_torch: str = "") -> bool:
        """Whether this rollout's sampling steps run ``kernels.sampling.sample`` (``DecodeLoop`` asks at each step):
        never under batch-invariant kernels or with ``fused_sampler`` false; not where ``needs_torch`` names what in
        the rollout's sampling needs every log-prob (top-k, a recorded head...: printed once per reason); else where
        the kernel builds (asked once, printed). Raises RuntimeError for ``fused_sampler`` true where it cannot be
        built."""
        if self.fused_sampler is False or BatchInvariantMode._active is not None:
            return False
        if needs_torch:
            if needs_torch not in self._fused_said:
                self._fused_said.add(needs_torch)
                print(f"lit_rl: engine.fused_sampler={str(self.fused_sampler).lower()}: torch's sampling calls for "
                      f"rollouts with {needs_torch} (they need every log-prob)", flush=True)  # fmt: skip
            return False
        if self._fused_why is None:
            self._fused_why = why = sampling_kernel.available()
            if why and self.fused_sampler is True:
                raise RuntimeError(f"engine.fused_sampler=true, but lit_rl's sampling kernel is not there: {why}")
            state = f"off ({why})" if why else "on (each decode step's tokens and log-probs in one kernel call)"
            print(f"lit_rl: engine.fused_sampler={str(self.fused_sampler).lower()}: {state}", flush=True)
        return not self._fused_why

    def _decode_kernel(self, model: torch.nn.Module) -> tuple:
        """The dtypes whose decode steps run lit_rl's decode attention kernel in this rollout: none under
        batch-invariant kernels or with ``decode_attention`` false; else ``kernels.decode_attention.resolve``'s
        answer, asked once per thread count and model (it prints why)."""
        if self.decode_attention is False or BatchInvariantMode._active is not None:
            return ()
        key = (torch.get_num_threads(), id(model))
        if key not in self._decode_dtypes:
            on, why = decode_kernel.resolve(self.decode_attention, model)
            print(f"lit_rl: {why}", flush=True)
            self._decode_dtypes[key] = on
        return self._decode_dtypes[key]

    def _new_cache(self, capacity: int) -> DynamicCache:
        """An empty cache for ``capacity`` positions: KV reserved up front, in the dtype the attention reads it in
        (``kernels.attention_kv_dtype``: bf16 under autocast with SDPA), and the conv / recurrent states of Gated
        DeltaNet layers where the model has them (``state_cache.hybrid_cache``)."""
        dtype = attention_kv_dtype(self.model)
        attention = functools.partial(ReservedLayer, capacity, dtype=dtype)
        return hybrid_cache(self.model, attention) or reserved_cache(capacity, dtype)

    def _check_cancel(self) -> None:
        """Raise ``GenerationCancelled`` once ``cancel`` is set (looked at before every decode step)."""
        if self.cancel is not None and self.cancel.is_set():
            raise GenerationCancelled("generation cancelled")

    def _generate(self, prompts, params: SamplingConfig, seeds) -> Rollouts:
        loop = DecodeLoop(self, params, self.kept)
        loop.add(prompts, seeds)
        loop.run()
        return loop.rollouts()
