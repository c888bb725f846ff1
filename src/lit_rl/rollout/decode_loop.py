"""The embedded engine's decode loop (``TorchEngine.generate``), as an object: the rows, their KV cache and outputs.

``DecodeLoop`` holds one batched decode: every row's prompt, seeded generator(s) and outputs so far (tokens,
log-probs, the top-k head, the version that sampled each token), the rows live in the decode batch (``active``),
and the cache of those live rows. One decode step is ``forward`` (a prefill of the live rows' contexts when they
(re)join, else one cached step) → ``sample`` → ``advance`` (finished rows leave the batch and the cache). A
``generate`` call runs it once over its prompts; ``PartialRollouts`` keeps one alive across calls
(``rollout.partial``): unfinished rows carry over to the next call and freed decode slots take new groups.

Every position a row writes is its own (``pos``: tokens sampled so far), so rows that joined at different decode
steps (a refill, a carry-over) share one batch. New rows join beside live ones (``add(beside=True)``, a refill):
their prompts are prefilled alone and their KV placed beside the live rows' (``kv_cache.merge_rows``), no live
position recomputed. A row rejoins through a prefill of its context (prompt + its tokens so far) with the engine's
current weights only when its cache is gone or stale: the first prefill, a ``kv_on_update=recompute`` swap, a hybrid
model (its recurrent states cannot take rows beside them).
With ``kept`` (``kv_continuation.KeptCaches``: a multi-turn collection's session) a finished row leaves its KV
there, and a row whose context extends a kept one prefills only the ids the kept KV does not hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kernels import sampling as sampling_kernel
from ..logprobs import position_ids_from_mask, process_logits
from .kv_cache import keep_rows, merge_rows
from .kv_continuation import (
    KeptCaches,
    common_prefix,
    common_prefix_prefill,
    continued_prefill,
    shared_prompt_prefill,
)
from .llama_decode import decode_logits
from .state_cache import is_hybrid
from .types import Rollouts, SamplingConfig, left_pad


class DecodeLoop:
    """One batched decode with ``engine`` (a ``TorchEngine``) under sampling settings ``params``; ``kept``: the
    caches a multi-turn collection keeps between calls (``TorchEngine.kv_continuation``), None to keep none.

    Raises ValueError when temperature + the engine's temperature offset is not > 0 for a sampling run.
    """

    def __init__(self, engine, params: SamplingConfig, kept: KeptCaches | None = None):
        self.engine, self.params, self.kept = engine, params, kept
        self.steps, self.k = params.max_new_tokens, params.logprobs_top_k
        self.m = int(getattr(params, "logprobs_tail_samples", 0))  # tail samples recorded after the top-k
        self.width = self.k + self.m  # the recorded entries per position
        self.device = next(engine.model.parameters()).device
        self.sampling = params.temperature > 0
        self.noisy = self.sampling and engine.logit_noise > 0
        self.temperature = params.temperature + engine.temperature_offset if self.sampling else 0.0
        if self.sampling and not self.temperature > 0:
            raise ValueError(
                f"temperature {params.temperature} + temperature_offset {engine.temperature_offset} must be > 0"
            )
        # plain sampling (nothing that needs every log-prob) through ``kernels.sampling`` where the engine turns it on
        needs = (("logit noise", self.noisy), ("top-k", params.top_k), ("top-p", params.top_p < 1.0),
                 ("recorded top-k log-probs or tail samples", self.width))  # fmt: skip
        self.needs_torch = " and ".join(name for name, on in needs if on)  # what needs every log-prob, if anything
        self.fed_tokens = 0  # real ids (no padding) the last ``_prefill_rows`` fed
        self.stop = torch.tensor(engine.stop_token_ids, device=self.device)
        # per row (N rows, S = max_new_tokens columns)
        self.prompts: list[list[int]] = []
        self.seeds: list[int] = []
        self.generators: list[torch.Generator] = []
        self.noise_gens: list[torch.Generator] = []
        self.tail_gens: list[torch.Generator] = []  # the tail samples' own streams (``torch_engine.tail_seed``)
        self.tokens = torch.zeros((0, self.steps), dtype=torch.long)
        self.logprobs = torch.zeros((0, self.steps), dtype=torch.float32)
        self.mask = torch.zeros((0, self.steps), dtype=torch.bool)
        self.versions = torch.zeros((0, self.steps), dtype=torch.long)
        self.topk_ids = torch.zeros((0, self.steps, self.width), dtype=torch.long) if self.width else None
        self.topk_lp = torch.zeros((0, self.steps, self.width), dtype=torch.float32) if self.width else None
        self.stopped = torch.zeros(0, dtype=torch.bool)
        self.pos = torch.zeros(0, dtype=torch.long)  # tokens sampled so far
        # the decode batch: live rows (indices into the rows), their cache and inputs
        self.active = torch.zeros(0, dtype=torch.long)
        self.cache = self.input_ids = self.attention_mask = self.position_ids = None
        self.cache_version = engine.version  # the weights that prefilled the cache
        self.rejoin = True  # the next forward prefills the live rows' contexts (new rows, a carry-over)
        self.joining = 0  # the last rows of ``active``: added beside the live rows, their prompts not prefilled yet
        # running totals: positions fed through prefills (padding included) and their seconds; rows decoded by
        # cached steps (one position each) and their seconds
        # and rows that joined beside live ones (``add(beside=True)``)
        self.counts = {"prefill_positions": 0, "prefill_s": 0.0, "decode_rows": 0, "decode_s": 0.0, "joined_rows": 0}

    # -- rows ----------------------------------------------------------------------------------------------
    def add(self, prompts: list[list[int]], seeds: list[int], beside: bool = False) -> Tensor:
        """Add rows (one per prompt, its generators seeded from ``seeds``) and make them live from the next
        ``forward``, which prefills every live row's context; with ``beside`` (a refill) and live rows whose cache
        can take rows beside it (an attention-only model, no rejoin pending), the next ``forward`` prefills the new
        rows' prompts alone and places their KV beside the live rows' (``kv_cache.merge_rows``) while those take
        one cached step. Returns the new rows' indices [len(prompts)]."""
        from .torch_engine import noise_seed, tail_seed

        n0, n = len(self.prompts), len(prompts)
        self.prompts += [list(p) for p in prompts]
        self.seeds += [int(s) for s in seeds]
        self.generators += [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        if self.noisy:
            self.noise_gens += [torch.Generator(device=self.device).manual_seed(noise_seed(s)) for s in seeds]
        if self.m:
            self.tail_gens += [torch.Generator(device=self.device).manual_seed(tail_seed(s)) for s in seeds]
        pad = self.engine.pad_token_id
        self.tokens = torch.cat([self.tokens, torch.full((n, self.steps), pad, dtype=torch.long)])
        self.logprobs = torch.cat([self.logprobs, torch.zeros((n, self.steps), dtype=torch.float32)])
        self.mask = torch.cat([self.mask, torch.zeros((n, self.steps), dtype=torch.bool)])
        self.versions = torch.cat([self.versions, torch.full((n, self.steps), self.engine.version, dtype=torch.long)])
        if self.width:
            self.topk_ids = torch.cat([self.topk_ids, torch.zeros((n, self.steps, self.width), dtype=torch.long)])
            self.topk_lp = torch.cat([self.topk_lp, torch.zeros((n, self.steps, self.width), dtype=torch.float32)])
        self.stopped = torch.cat([self.stopped, torch.zeros(n, dtype=torch.bool)])
        self.pos = torch.cat([self.pos, torch.zeros(n, dtype=torch.long)])
        rows = torch.arange(n0, n0 + n)
        self.active = torch.cat([self.active, rows])
        if beside and not self.rejoin and self.cache is not None and not is_hybrid(self.engine.model):
            self.joining += n
            self.counts["joined_rows"] += n
        else:
            self.rejoin, self.joining = True, 0
        return rows

    def keep_rows(self, keep: Tensor) -> None:
        """Keep only rows ``keep`` (sorted indices [M]); the others are forgotten. Live rows among the forgotten
        ones leave the batch and the cache (the others keep their cache rows; with a prefill pending, all rejoin)."""
        n = len(self.prompts)
        new_index = torch.full((n,), -1, dtype=torch.long)
        new_index[keep] = torch.arange(keep.numel())
        live = new_index[self.active]
        gone = live < 0
        if bool(gone.any()):
            if self.rejoin or self.joining or self.cache is None:
                self.rejoin, self.joining = True, 0
            else:  # the remaining live rows keep their cache rows
                stay = (~gone).nonzero().squeeze(-1)
                self._select(stay)
        self.active = live[live >= 0]
        rows = keep.tolist()
        self.prompts = [self.prompts[r] for r in rows]
        self.seeds = [self.seeds[r] for r in rows]
        self.generators = [self.generators[r] for r in rows]
        if self.noisy:
            self.noise_gens = [self.noise_gens[r] for r in rows]
        if self.m:
            self.tail_gens = [self.tail_gens[r] for r in rows]
        for name in ("tokens", "logprobs", "mask", "versions", "topk_ids", "topk_lp", "stopped", "pos"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[keep])

    # -- one decode step -------------------------------------------------------------------------------------
    def forward(self, step: int, swapped: bool | None = None) -> Tensor:
        """The live rows' next-token logits [B, V] at call-local decode step ``step``: a prefill of their contexts
        when they (re)join or after an in-flight swap with ``kv_on_update=recompute``, else one cached step.
        ``swapped``: whether the caller already took newer weights before this step (None: ask the engine now)."""
        engine = self.engine
        swapped = engine._swapped(step) if swapped is None else swapped
        t0, spent = time.perf_counter(), "prefill_s"
        if self.rejoin:
            logits = self._prefill(dedupe=True)
            self.rejoin = False
        elif swapped and engine.kv_on_update == "recompute":
            logits = self._prefill(dedupe=True)
            engine._swaps[1] += time.perf_counter() - t0  # the swap's pause: loading, then this re-prefill
        else:
            logits = self._cached_step()
            if self.joining:  # a refill: the joining rows' prompts prefilled alone, their KV placed beside
                t1 = time.perf_counter()
                self.counts["decode_s"] += t1 - t0
                logits = torch.cat([logits, self._join()])
                t0 = t1
            else:
                spent = "decode_s"
        self.joining = 0
        self.counts[spent] += time.perf_counter() - t0
        self.versions[self.active, self.pos[self.active]] = engine.version
        return logits

    def _cached_step(self) -> Tensor:
        """One cached decode step of the rows the cache holds (``input_ids`` [B, 1]); their logits [B, V]."""
        self.counts["decode_rows"] += int(self.input_ids.shape[0])
        engine = self.engine
        if engine.llama_step.ok(engine, engine.model):  # the same bits through fewer calls (``llama_decode``)
            return decode_logits(
                engine.model, engine.casts, self.input_ids, self.attention_mask, self.position_ids, self.cache
            )
        out = self.engine.model(
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            position_ids=self.position_ids,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )  # fills ``cache`` in place
        return out.logits[:, -1]

    def _join(self) -> Tensor:
        """Prefill the ``joining`` rows' prompts alone (each distinct prompt once) and merge their KV beside the live
        rows' (``kv_cache.merge_rows``: no live position is recomputed). Returns the joining rows' logits [J, V]."""
        rows = self.active[-self.joining :].tolist()
        logits, cache, mask, position_ids = self._prefill_rows(rows, dedupe=True)
        self.cache, self.attention_mask = merge_rows(
            self.engine, self.cache, self.attention_mask, cache, mask, room=self.steps
        )
        self.position_ids = torch.cat([self.position_ids[:, -1:], position_ids[:, -1:]])
        return logits

    def _select(self, keep: Tensor) -> None:
        """Keep the cache rows ``keep`` (indices into ``active``, int64 [M]) and their inputs."""
        if keep.numel() == 0:
            self.cache = None
            return
        keep_dev = keep.to(self.device)
        self.cache.batch_select_indices(keep_dev)
        self.attention_mask, self.position_ids = self.attention_mask[keep_dev], self.position_ids[keep_dev]
        if self.input_ids is not None:
            self.input_ids = self.input_ids[keep_dev]

    def _prefill(self, dedupe: bool) -> Tensor:
        """A new cache of every live row's context (prompt + tokens so far) under the engine's current weights;
        with ``dedupe`` each distinct context is prefilled once and its cache copied to the rows that share it (RL
        repeats every prompt G times); rows whose context extends a ``kept`` cache continue it instead
        (``kv_continuation.continued_prefill``). A rebuild of rows with tokens already sampled (a
        ``kv_on_update=recompute`` swap, carried rows under newer weights) prefills each prompt once and every row's
        own tail on top of it (``kv_continuation.shared_prompt_prefill``) where rows share a prompt, and counts the
        ids it feeds in the engine's ``recompute_totals``. Returns the last position's logits [B, V]."""
        rows = self.active.tolist()
        contexts = [tuple(self.prompts[r]) + tuple(self.tokens[r, : int(self.pos[r])].tolist()) for r in rows]
        self.cache_version = self.engine.version
        kept = [self.kept.match(c, self.engine.version) for c in contexts] if dedupe and self.kept else []
        if any(k is not None for k in kept):
            out = continued_prefill(self.engine, contexts, kept, self.steps)
            logits, self.cache, self.attention_mask, self.position_ids = out
            self.counts["prefill_positions"] += self.position_ids.numel()
            self.kept.used(kept, prefilled=self.position_ids.numel())
            return logits
        rebuild = any(int(self.pos[r]) for r in rows)  # rows with sampled tokens: their cache is rebuilt
        if rebuild and self._shares_prompts(rows, contexts):
            out = shared_prompt_prefill(self.engine, contexts, [len(self.prompts[r]) for r in rows], self.steps)
            logits, self.cache, self.attention_mask, self.position_ids, fed = out
            self.counts["prefill_positions"] += fed["positions"]
        else:
            logits, self.cache, self.attention_mask, self.position_ids = self._prefill_rows(rows, dedupe, contexts)
            fed = {"tokens": self.fed_tokens}
        if rebuild:
            totals = self.engine.recompute_totals
            totals["prefills"] += 1
            totals["prefill_tokens"] += fed["tokens"]
            totals["context_tokens"] += sum(len(c) for c in contexts)
        return logits

    def _shares_prompts(self, rows: list[int], contexts: list[tuple[int, ...]]) -> bool:
        """True when a prompt is shared by rows of different contexts (so prefilling it once saves work) and the
        model is attention-only (a hybrid's recurrent states re-prefill whole contexts)."""
        prompts = {tuple(self.prompts[r]) for r in rows}
        return len(prompts) < len(set(contexts)) and not is_hybrid(self.engine.model)

    def _prefill_rows(self, rows: list[int], dedupe: bool, contexts=None):
        """A new cache of rows ``rows``' contexts (prompt + tokens so far; ``contexts`` when already built), each
        distinct one prefilled once with ``dedupe``. Returns (last-position logits [R, V], the cache, attention mask
        [R, L] int64, position ids [R, L] int64)."""
        if contexts is None:
            contexts = [tuple(self.prompts[r]) + tuple(self.tokens[r, : int(self.pos[r])].tolist()) for r in rows]
        distinct: dict[tuple[int, ...], int] = {}
        if dedupe:
            row_of = torch.tensor([distinct.setdefault(c, len(distinct)) for c in contexts], dtype=torch.long)
            contexts = list(distinct)
        prefix = common_prefix(contexts) if self.engine.prefix_sharing and not is_hybrid(self.engine.model) else 0
        if prefix:  # a chat template's shared opening fed once (``kv_continuation.common_prefix_prefill``)
            if not self.engine.said_prefix:
                self.engine.said_prefix = True
                print(f"lit_rl: prefilling the {prefix} ids that {len(contexts)} distinct prompts open with once, "
                      "each prompt's rest on top (said once)", flush=True)  # fmt: skip
            logits, cache, mask, position_ids, fed = common_prefix_prefill(self.engine, contexts, prefix, self.steps)
            self.counts["prefill_positions"] += fed["positions"]
            self.fed_tokens = fed["tokens"]
        else:
            ids, mask = left_pad([list(c) for c in contexts], self.engine.pad_token_id)
            ids, mask = ids.to(self.device), mask.long().to(self.device)
            position_ids = position_ids_from_mask(mask)
            self.counts["prefill_positions"] += ids.numel()
            self.fed_tokens = int(mask.sum())
            # hybrid models (linear-attention layers) hold conv + recurrent states beside the reserved KV
            cache = self.engine._new_cache(max(len(self.prompts[r]) for r in rows) + self.steps)
            out = self.engine.model(
                input_ids=ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True,
                logits_to_keep=1,
            )  # fmt: skip
            logits = out.logits[:, -1]
        if dedupe and len(distinct) < len(rows):
            cache.batch_select_indices(row_of.to(self.device))
            logits, mask, position_ids = logits[row_of], mask[row_of], position_ids[row_of]
        return logits, cache, mask, position_ids

    def sample(self, logits: Tensor) -> Tensor:
        """Sample each live row's next token from ``logits`` [B, V] (its own generator; greedy at temperature 0)
        and record it, its log-prob and the top-k head at the row's position. Returns the tokens [B] int64."""
        active, params = self.active, self.params
        gens = [self.generators[int(row)] for row in active] if self.sampling else []
        next_tok = uniforms = None
        if self.sampling and sampling_kernel.serves(logits) and self.engine.fused_sampling(self.needs_torch):
            from .torch_engine import row_uniforms

            uniforms = row_uniforms(gens)
            try:
                next_tok, chosen = sampling_kernel.sample(logits, uniforms, self.temperature)
            except ValueError:  # a NaN or +inf logit: torch's calls on the same uniforms, as without the kernel
                next_tok = None  # (a NaN log-prob then makes a non-finite loss, whose update is skipped and counted)
        if next_tok is None:
            if self.sampling:
                if self.noisy:
                    from .torch_engine import add_logit_noise

                    noise = [self.noise_gens[int(row)] for row in active]
                    logits = add_logit_noise(logits, self.engine.logit_noise, noise)
                logp = process_logits(logits, self.temperature, params.top_k, params.top_p)
                from .torch_engine import sample_rows

                next_tok = sample_rows(logp, gens, uniforms)
            else:
                logp = process_logits(logits, 1.0)
                next_tok = logp.argmax(-1)
            chosen = logp.gather(-1, next_tok[:, None]).squeeze(-1)
        cols = self.pos[active]
        self.tokens[active, cols] = next_tok.cpu()
        self.logprobs[active, cols] = chosen.cpu()
        self.mask[active, cols] = True
        if self.k:
            top = torch.topk(logp, self.k, dim=-1)
            self.topk_ids[active, cols, : self.k] = top.indices.cpu()
            self.topk_lp[active, cols, : self.k] = top.values.cpu()
        if self.m:  # score centering's sampled tail: m draws from μ without its top-k, on their own streams
            from .torch_engine import sample_tail

            head = top.indices if self.k else logp.new_zeros((logp.shape[0], 0), dtype=torch.long)
            ids, lp = sample_tail(logp, head, self.m, [self.tail_gens[int(row)] for row in active])
            self.topk_ids[active, cols, self.k :] = ids.cpu()
            self.topk_lp[active, cols, self.k :] = lp.cpu()
        return next_tok

    def advance(self, next_tok: Tensor) -> Tensor:
        """After ``sample``: rows that sampled a stop token or hit ``max_new_tokens`` leave the batch and the
        cache; the others take ``next_tok`` as their next input. Returns the rows that finished [F] int64."""
        active = self.active
        done = torch.isin(next_tok, self.stop)
        self.stopped[active[done.cpu()]] = True
        self.pos[active] += 1
        finished = done.cpu() | (self.pos[active] >= self.steps)
        if self.kept is not None:
            self.kept.keep_finished(self, finished)
        if bool(finished.all()):
            self.active, self.cache = active[:0], None
            return active[finished]
        keep = keep_rows(finished)  # kept rows from the top fill the holes: the fewest KV rows move
        if keep.numel() < active.numel():  # drop finished rows from the batch and the KV cache
            keep_dev = keep.to(next_tok.device)
            self.cache.batch_select_indices(keep_dev)
            self.attention_mask = self.attention_mask[keep_dev]
            self.position_ids = self.position_ids[keep_dev]
            next_tok = next_tok[keep_dev]
            self.active = active[keep]
        self.input_ids = next_tok[:, None]
        ones = self.attention_mask.new_ones(self.attention_mask.shape[0], 1)
        self.attention_mask = torch.cat([self.attention_mask, ones], 1)
        self.position_ids = self.position_ids[:, -1:] + 1
        return active[finished]

    def run(self) -> None:
        """Decode until every live row has finished (``TorchEngine.cancel`` is looked at before each step)."""
        for step in range(self.steps if self.active.numel() else 0):
            self.engine._check_cancel()
            self.advance(self.sample(self.forward(step)))
            if self.active.numel() == 0:
                break

    # -- the output ----------------------------------------------------------------------------------------
    def rollouts(self, rows: Tensor | None = None) -> Rollouts:
        """``Rollouts`` of rows ``rows`` (all, in order, when None), T = their longest response."""
        rows = torch.arange(len(self.prompts)) if rows is None else rows
        mask = self.mask[rows]
        width = int(mask.sum(-1).max()) if rows.numel() else 0
        versions = self.versions[rows]
        return Rollouts(
            prompt_ids=[list(self.prompts[r]) for r in rows.tolist()],
            response_ids=self.tokens[rows, :width],
            response_mask=mask[:, :width],
            rollout_logprobs=self.logprobs[rows, :width],
            finish_reason=["stop" if s else "length" for s in self.stopped[rows].tolist()],
            policy_version=versions[:, 0].clone(),  # the oldest token's: versions only grow
            topk_ids=self.topk_ids[rows, :width] if self.width else None,
            topk_logprobs=self.topk_lp[rows, :width] if self.width else None,
            token_versions=torch.where(mask[:, :width], versions[:, :width], versions[:, :1]),
        )


@dataclass(eq=False)  # a group is itself: compared by identity
class _Group:
    """A group of ``PartialRollouts``: the rows of one prompt's G samples, their caller's key, and the call that
    started them (``born``; -1 while waiting for decode slots)."""

    key: object
    prompts: list[list[int]]
    seeds: list[int]
    rows: list[int] = field(default_factory=list)  # indices into the loop's rows once admitted
    born: int = -1
    bound: int | None = None  # the oldest version the batch it was drawn for may train on (None: unknown)
    committed: bool = False  # admitted with weights too old for a later batch: this call's batch takes it
    waited: bool = False  # held back once for newer weights (counted once)


class PartialRollouts:
    """``rollout.partial``: one ``DecodeLoop`` kept alive across ``generate`` calls, filled group by group.

    A call adds its groups (G rows of one prompt each) to a queue and decodes until ``want`` groups are complete,
    every one of their rows finished: a group is trained whole (GRPO's baseline needs all G rows), so it enters a
    batch only once its last row is done. Between decode steps, decode slots freed by finished rows take the next
    queued group whole as soon as G slots are free, so the decode batch stays at a batch's row count (``slots``:
    the most rows one call has brought, P x G in a run) while a long sequence runs on.

    The rows still decoding when the batch is due, and complete groups beyond ``want``, stay for the next call:
    their tokens keep the versions and log-probs that sampled them, their generators their state, and the live ones
    their KV: the next call decodes them on from their cache, unless the engine holds newer weights than wrote it and
    ``kv_on_update=recompute`` (then they are re-prefilled with them, as at a swap). A held group whose oldest token
    the next batch may not train on (older than ``ahead_min_version``) is committed to this batch, which waits for
    it: it is trained in the last batch its tokens allow, not carried into one that would restart it. A held group
    with a token older than ``min_version`` (a caller that gave no ``ahead_min_version``, or more due groups than a
    batch wants) is restarted from its first token (same seeds), so no trained token is older than the caller's
    bound (``restarts`` counts them).

    A look-ahead group (one drawn for a later batch, whose bound ``ahead_min_version`` is newer than this call's
    ``min_version``) is not started with weights older than that bound: it could then be trained only if it completed
    inside this call, which cannot be known when it starts (its length is sampled), and were it carried it would be
    restarted and its tokens thrown away. It waits in the queue (``held_back`` counts such groups) until an in-flight
    swap brings weights its own batch may train on, or until this call's batch cannot be completed without it: it is
    then started and committed to this batch (the batch waits for it and takes it first), so it is never carried.

    ``decode_rows``: the live rows of each decode step of the last call (the refill is visible there).
    """

    def __init__(self):
        self.loop: DecodeLoop | None = None
        self.queue: list[_Group] = []  # waiting for decode slots, in arrival order
        self.held: list[_Group] = []  # admitted, in admission order
        self.complete: list[_Group] = []  # every row finished, in completion order
        self.calls = 0
        self.restarts = 0
        self.slots = 0  # the decode batch's rows: the most rows one call has brought
        self.discarded_tokens = 0  # tokens of restarted groups, sampled and thrown away
        self.held_back = 0  # look-ahead groups that waited for weights their own batch may train on
        self.min_version: int | None = None  # this call's bound
        self.ahead_min_version: int | None = None  # the next call's bound (this call's look-ahead's)
        self.seen: set = set()  # every key ever added: a look-ahead group offered again by its own batch is skipped
        self.decode_rows: list[int] = []

    def generate(
        self, engine, prompts, params: SamplingConfig, seeds, keys: list, want: int, min_version=None, ahead: int = 0,
        ahead_min_version=None,
    ):  # fmt: skip
        """Add the groups of ``prompts`` (len(keys) groups of equal size, each group's rows next to each other,
        ``seeds`` one per row, ``keys`` one opaque key per group; a key added by an earlier call is skipped) and
        decode until ``want`` held groups are complete and every committed one (in the last batch its tokens allow,
        ``_commit_due``; taken first) is. The last ``ahead`` groups are a look-ahead (the next batch's
        groups: they wait in the queue for slots freed early and do not widen the decode batch, which stays at the
        most rows the other groups of one call have brought); ``ahead_min_version``: the oldest version their own
        batch may train on (None: not known, they start whenever slots are free). Returns (``Rollouts`` of those
        groups' rows, group after group, their keys [want], carried [N] bool: the row was started by an earlier
        call). Raises ValueError for sizes that do not add up, a ``want`` larger than the groups held, or sampling
        settings other than the first call's."""
        if not keys or len(prompts) % len(keys) or len(seeds) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts, {len(seeds)} seeds and {len(keys)} group keys: need "
                             "one seed per prompt and the same number of prompts in every group")  # fmt: skip
        if self.loop is None:
            self.loop = DecodeLoop(engine, params)
        elif params != self.loop.params:
            raise ValueError("rollout.partial: the sampling settings must stay those of the first batch")
        size = len(prompts) // len(keys)
        self._restart_older_than(min_version)
        self.min_version, self.ahead_min_version = min_version, ahead_min_version
        queued = {g.key: g for g in self.queue}
        for i, key in enumerate(keys):
            bound = ahead_min_version if i >= len(keys) - ahead else min_version
            if key not in self.seen:
                self.seen.add(key)
                rows = slice(i * size, (i + 1) * size)
                self.queue.append(_Group(key, prompts[rows], seeds[rows], bound=bound))
            elif key in queued and i < len(keys) - ahead:  # a look-ahead group offered by its own batch
                queued[key].bound = min_version
        if want > len(self.held) + len(self.queue):
            raise ValueError(f"want {want} groups but only {len(self.held) + len(self.queue)} are held")
        self._commit_due(self.held, want)  # carried groups in their last batch
        self.slots = max(self.slots, (len(keys) - ahead) * size)
        loop, slots = self.loop, self.slots
        if loop.active.numel() and engine.kv_on_update == "recompute" and loop.cache_version != engine.version:
            loop.rejoin = True  # newer weights since the carried rows' cache was written: recomputed, as at a swap
        self.decode_rows = []
        step = 0
        while len(self.complete) < want or any(g.committed and g not in self.complete for g in self.held):
            engine._check_cancel()
            swapped = engine._swapped(step)  # before admitting: a group started now samples with the newest weights
            self._admit(slots, want)
            if not loop.active.numel():
                raise RuntimeError(
                    f"partial rollouts: no row to decode with {len(self.complete)} of {want} groups done"
                )
            self.decode_rows.append(int(loop.active.numel()))
            loop.advance(loop.sample(loop.forward(step, swapped)))
            self._mark_complete()
            step += 1
        return self._take(want)

    def totals(self) -> dict[str, float]:
        """Running totals over every call: ``restarts`` (groups restarted as too old) and ``discarded_tokens``
        (their tokens), ``held_back`` (look-ahead groups that waited for newer weights), the decode loop's
        ``prefill_positions`` (ids fed through prefills, padding included), ``prefill_s``, ``decode_rows`` (rows
        advanced by cached steps), ``decode_s`` (seconds) and ``joined_rows``
        (rows whose prompts were prefilled alone beside live rows: a refill)."""
        loop_counts = self.loop.counts if self.loop is not None else {}
        own = {"restarts": self.restarts, "discarded_tokens": self.discarded_tokens, "held_back": self.held_back}
        return {k: float(v) for k, v in {**own, **loop_counts}.items()}

    def _admit(self, slots: int, want: int) -> bool:
        """Move queued groups into the decode batch, whole and in order, while it has room for them; a look-ahead
        group whose own batch may not train on the engine's weights waits (the groups behind it may go), unless
        this call's ``want`` groups cannot be completed without it (then it is committed to this batch). A group that
        would be due in this batch (the engine's weights older than the next batch's bound) waits too once the batch
        has its ``want`` committed groups: started, it could only be restarted. True when one moved."""
        loop = self.loop
        moved = False
        for group in list(self.queue):
            if loop.active.numel() + len(group.prompts) > slots:
                break
            if self._waits(group):
                if not self._needed(want):
                    self.held_back += not group.waited
                    group.waited = True
                    continue
                group.committed = True
            elif self._due_now() and self._room(want) <= 0 and not self._needed(want):
                continue  # due in this batch, which has its groups: started now it could only be restarted
            self.queue.remove(group)
            group.rows, group.born = loop.add(group.prompts, group.seeds, beside=True).tolist(), self.calls
            self.held.append(group)
            self._commit_due([group], want)  # started with weights the next batch may not train on
            moved = True
        return moved

    def _due_now(self) -> bool:
        """True when a group started now would be due in this call's batch: the engine's weights are older than the
        next batch's bound (``ahead_min_version``)."""
        bound = self.ahead_min_version
        return bound is not None and self.loop.engine.version < bound

    def _room(self, want: int) -> int:
        """How many more groups this call's batch can take committed (``want`` less those committed already)."""
        return want - sum(g.committed for g in self.held)

    def _written(self, group: _Group) -> Tensor:
        """The versions of ``group``'s sampled tokens (int64, flat; empty before its first token)."""
        rows = torch.tensor(group.rows, dtype=torch.long)
        return self.loop.versions[rows][self.loop.mask[rows]]

    def _oldest(self, group: _Group) -> int:
        """The version of ``group``'s oldest token (the engine's, for a group admitted but not yet sampled)."""
        written = self._written(group)
        return int(written.min()) if written.numel() else int(self.loop.engine.version)

    def _commit_due(self, groups: list[_Group], want: int) -> None:
        """Commit to this call's batch the ``groups`` (held) whose oldest token the next batch may not train on
        (older than ``ahead_min_version``): carried on, they would be restarted at the next call and their tokens
        thrown away, and a long answer that never fits the bound would be restarted at every call and never trained
        (measured: a 4 x G = 2 long-tail run restarted long groups in 5 of its last 9 batches, 226-925 sampled
        tokens thrown away each time). The batch waits for them instead, as between-batches rollouts wait for every
        group. Oldest first, at most ``want`` committed groups in all; beyond that a group may still be restarted."""
        if self.ahead_min_version is None:
            return
        room = self._room(want)
        due = sorted(
            (g for g in groups if not g.committed and self._oldest(g) < self.ahead_min_version), key=self._oldest
        )
        for group in due[: max(0, room)]:
            group.committed = True

    def _waits(self, group: _Group) -> bool:
        """True for a group drawn for a later batch than this call's whose bound the engine's weights are older
        than: started now, it could only be trained if it completed inside this call."""
        bound, now = group.bound, self.min_version
        return bound is not None and now is not None and bound > now and self.loop.engine.version < bound

    def _needed(self, want: int) -> bool:
        """True when fewer than ``want`` groups could complete this call without the waiting ones: the complete, the
        admitted and the queued groups that do not wait."""
        return len(self.held) + sum(not self._waits(g) for g in self.queue) < want  # the complete ones are held

    def _finished(self, group: _Group) -> bool:
        rows = torch.tensor(group.rows, dtype=torch.long)
        return bool((self.loop.stopped[rows] | (self.loop.pos[rows] >= self.loop.steps)).all())

    def _mark_complete(self) -> None:
        for group in self.held:
            if group not in self.complete and self._finished(group):
                self.complete.append(group)

    def _take(self, want: int):
        order = [g for g in self.complete if g.committed] + [g for g in self.complete if not g.committed]
        groups = order[:want]
        self.complete = [g for g in self.complete if g not in groups]
        rows = torch.tensor([r for g in groups for r in g.rows], dtype=torch.long)
        out = self.loop.rollouts(rows)
        carried = torch.tensor([g.born < self.calls for g in groups for _ in g.rows], dtype=torch.bool)
        out.carried = carried
        self._forget(groups)
        self.calls += 1
        return out, [g.key for g in groups], carried

    def _forget(self, groups: list[_Group]) -> None:
        """Drop ``groups``' rows from the loop (their indices shift: every held group's are renumbered)."""
        gone = {r for g in groups for r in g.rows}
        self.held = [g for g in self.held if g not in groups]
        self.complete = [g for g in self.complete if g not in groups]
        keep = torch.tensor([r for r in range(len(self.loop.prompts)) if r not in gone], dtype=torch.long)
        new_index = {int(r): i for i, r in enumerate(keep.tolist())}
        self.loop.keep_rows(keep)
        for g in self.held:
            g.rows = [new_index[r] for r in g.rows]

    def _restart_older_than(self, min_version) -> None:
        """Held groups with a token sampled before ``min_version`` go back to the queue's front, unstarted."""
        if min_version is None or self.loop is None:
            return
        stale = []
        for g in self.held:
            written = self._written(g)
            if written.numel() and int(written.min()) < min_version:
                stale.append(g)
                self.discarded_tokens += written.numel()
        if stale:
            self._forget(stale)
            for g in stale:
                g.rows, g.born, g.committed = [], -1, False
            self.queue = stale + self.queue
            self.restarts += len(stale)
