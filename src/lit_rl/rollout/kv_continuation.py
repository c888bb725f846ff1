"""The embedded engine continues a multi-turn episode's KV cache from one turn to the next (issue 36).

Inside ``TorchEngine.kv_continuation()`` (the multi-turn collector opens it around one collection), a row that
finishes a ``generate`` call leaves the KV of its context behind (``KeptCaches.keep_finished``): its prompt and
every token it sampled but the last, which was never fed to the model. The next call's prompt of that episode is
that context followed by the last sampled token and the environment's ids; ``KeptCaches.match`` finds the kept
context it extends (the longest one, content-addressed: an episode's next prompt extends its own context, and two
equal contexts hold equal KV), and ``continued_prefill`` prefills only what the kept KV does not hold, on top of
it, then the decode goes on as after any prefill. The kept KV is dropped when the collection ends.

The layout keeps every row's keys one contiguous run from its first real token (what the batch-invariant attention
requires, and what a fresh prefill gives): the call prefills S = max over rows of (context - kept) ids, and each
row feeds the last S ids of its context, so a row with fewer new ids re-computes a few of its kept ones (the same
KV, from the same context) instead of leaving a padding hole between its kept keys and its new ones. Under
``kernels=batch_invariant`` a position's keys, values and logits depend only on its own sequence's ids, so the
continued decode gives the tokens and log-probs of a full re-prefill bit for bit; under torch's kernels the two
differ by the prefill-vs-decode rounding a re-prefill has too.

The same continuation serves an in-flight swap with ``kv_on_update=recompute`` (``shared_prompt_prefill``): the
rows' distinct prompts are prefilled once with the new weights and kept for the call, and each row's sampled tokens
are prefilled on top of its prompt's keys and values.

Hybrid models (Gated DeltaNet layers) are not continued: their conv and recurrent states summarise the context at
its end and cannot re-compute a tail, so ``TorchEngine.kv_continuation`` keeps nothing for them and every turn
re-prefills its episode (as engines without the session, e.g. vLLM, do).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..logprobs import position_ids_from_mask


@dataclass
class KeptKV:
    """One row's kept cache: ``context`` (the ids whose KV it holds, in order), ``layers`` (per attention layer
    (keys, values), each [kv_heads, len(context), head_dim] in the cache's dtype) and ``version`` (the weights'
    version that wrote every position)."""

    context: tuple[int, ...]
    layers: list[tuple[Tensor, Tensor]]
    version: int


class KeptCaches:
    """The KV caches kept between the ``generate`` calls of one multi-turn collection, keyed by their context.

    ``rows_continued`` counts the rows that continued a kept cache, ``prefilled`` the ids prefilled by those calls
    (context ids not already in a kept cache, plus the ones re-computed to keep the layout contiguous)."""

    def __init__(self):
        self.entries: dict[tuple[int, ...], KeptKV] = {}
        self.rows_continued = 0
        self.prefilled = 0

    def __len__(self) -> int:
        return len(self.entries)

    def keep(self, kept: KeptKV) -> None:
        """Keep ``kept`` (replacing an entry of the same context: its KV is the same)."""
        self.entries[kept.context] = kept

    def match(self, context: tuple[int, ...], version: int) -> KeptKV | None:
        """The kept cache of the longest context that is a proper prefix of ``context`` (at least one id left to
        prefill) and was written by weights ``version``; None when there is none."""
        for length in sorted({len(c) for c in self.entries if len(c) < len(context)}, reverse=True):
            kept = self.entries.get(context[:length])
            if kept is not None and kept.version == version:
                return kept
        return None

    def used(self, used: list[KeptKV | None], prefilled: int) -> None:
        """Drop the entries ``used`` by a call's rows (None: a row that continued none; the rows keep newer ones
        when they finish) and count them and the call's ``prefilled`` ids (padding included)."""
        self.rows_continued += sum(k is not None for k in used)
        self.prefilled += int(prefilled)
        for kept in used:
            if kept is not None:
                self.entries.pop(kept.context, None)

    def keep_finished(self, loop, finished: Tensor) -> None:
        """Keep the KV of the live rows of ``loop`` (a ``DecodeLoop`` right after ``sample``, its ``pos`` counting
        the token just sampled) that ``finished`` ([B] bool over ``loop.active``): prompt + tokens but the last.
        Nothing is kept when the weights changed since the cache was prefilled (``kv_on_update=keep`` would leave
        positions of two versions)."""
        if loop.cache is None or loop.cache_version != loop.engine.version:
            return
        for j in finished.nonzero().squeeze(-1).tolist():
            row = int(loop.active[j])
            context = tuple(loop.prompts[row]) + tuple(loop.tokens[row, : int(loop.pos[row]) - 1].tolist())
            real = loop.attention_mask[j].bool()
            layers = [(layer.keys[j][:, real], layer.values[j][:, real]) for layer in loop.cache.layers]  # copies
            if layers and layers[0][0].shape[1] != len(context):
                raise RuntimeError(f"kept {layers[0][0].shape[1]} KV positions for a context of {len(context)} ids")
            self.keep(KeptKV(context, layers, loop.cache_version))


def continued_prefill(engine, contexts: list[tuple[int, ...]], kept: list[KeptKV | None], steps: int):
    """Prefill the rows' ``contexts`` on top of their ``kept`` caches (None: the row prefills its whole context;
    at least one is not None), in a new cache with room for ``steps`` more positions.

    Every row feeds the last S ids of its context (S = max over rows of its ids not in its kept cache), left-padded
    to S when the context is shorter; its kept keys and values of the ids before them are placed right before the
    new ones, the positions left of them padding. Returns (last-position logits [B, V], the cache, attention mask
    [B, P + S] int64, the new ids' position ids [B, S] int64), P the longest kept part used."""
    device = next(engine.model.parameters()).device
    held = [len(k.context) if k is not None else 0 for k in kept]
    width = max(len(c) - h for c, h in zip(contexts, held))
    start = [max(len(c) - width, 0) for c in contexts]  # ids before the prefilled ones: all in the kept cache
    past = max(start)
    b = len(contexts)
    ids = torch.full((b, width), engine.pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, past + width), dtype=torch.long)
    for j, (c, s) in enumerate(zip(contexts, start)):
        ids[j, width - (len(c) - s) :] = torch.tensor(c[s:], dtype=torch.long)
        mask[j, past - s : past] = 1
        mask[j, past + width - (len(c) - s) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    position_ids = position_ids_from_mask(mask)[:, past:]
    cache = engine._new_cache(past + width + steps)
    if past:
        sample = next(k for k in kept if k is not None).layers
        for index, (k0, v0) in enumerate(sample):
            keys = k0.new_zeros(b, k0.shape[0], past, k0.shape[-1])
            values = v0.new_zeros(b, v0.shape[0], past, v0.shape[-1])
            for j, s in enumerate(start):
                if s:
                    keys[j, :, past - s :], values[j, :, past - s :] = (t[:, :s] for t in kept[j].layers[index])
            cache.update(keys, values, index)
    out = engine.model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1
    )
    return out.logits[:, -1], cache, mask, position_ids


#: ``common_prefix_prefill`` is used where it spares at least this share of a whole prefill's positions and at least
#: ``PREFIX_MIN_POSITIONS`` of them: its extra forward (the shared ids as one row) costs about what a few hundred
#: positions of a batched prefill do (8 prompts x 51 ids sharing 27, 189 spared: no faster on a 2-core AMD EPYC; 64
#: prompts, 1,701 spared: 0.75 s against 1.3 s, benchmarks/README.md)
PREFIX_MIN_SAVING = 0.25
PREFIX_MIN_POSITIONS = 256


def common_prefix(contexts: list[tuple[int, ...]]) -> int:
    """How many leading ids every one of ``contexts`` (two or more) shares and ``common_prefix_prefill`` would feed
    once: the longest common prefix, less one id of the shortest context (each row feeds at least its last id, whose
    logits it needs), or 0 when that spares under ``PREFIX_MIN_SAVING`` of a whole left-padded prefill's positions
    (B x the longest context) or fewer than ``PREFIX_MIN_POSITIONS``."""
    if len(contexts) < 2:
        return 0
    n = min(len(os.path.commonprefix(contexts)), min(len(c) for c in contexts) - 1)
    longest = max(len(c) for c in contexts)
    saved = len(contexts) * longest - (n + len(contexts) * (longest - n))
    worth = saved >= max(PREFIX_MIN_SAVING * len(contexts) * longest, PREFIX_MIN_POSITIONS)
    return n if n > 0 and worth else 0


def common_prefix_prefill(engine, contexts: list[tuple[int, ...]], prefix: int, steps: int):
    """A new cache of ``contexts`` (distinct rows whose first ``prefix`` ids are the same, ``common_prefix``): the
    shared ids prefilled once as one row, then every row's rest on top of their keys and values
    (``continued_prefill``, one call; a row shorter than the longest re-feeds a few shared ids so its keys stay one
    run). The first rollout of a batch of distinct prompts under one chat template (a system prompt, the template's
    opening) feeds the template once, not once per row: 27 + 64 x 24 ids instead of 64 x 51 for SmolLM2's arithmetic
    prompts. Under ``kernels=batch_invariant`` the keys, values and logits are those of a whole prefill bit for bit
    (``shared_prompt_prefill``'s argument); under torch's kernels they differ by the rounding of other shapes.
    Attention-only models.

    Returns (last-position logits [B, V], the cache with room for ``steps`` more positions, attention mask
    [B, L] int64, the fed ids' position ids [B, S] int64, {"tokens": real ids fed, "positions": ids fed with
    padding})."""
    device = next(engine.model.parameters()).device
    ids = torch.tensor([contexts[0][:prefix]], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    cache = engine._new_cache(prefix)
    engine.model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), cache=cache, use_cache=True,
        logits_to_keep=1,
    )  # fmt: skip
    layers = [(layer.keys[0][:, :prefix], layer.values[0][:, :prefix]) for layer in cache.layers]
    kept = KeptKV(tuple(contexts[0][:prefix]), layers, engine.version)
    logits, cache, mask, position_ids = continued_prefill(engine, contexts, [kept] * len(contexts), steps)
    width = position_ids.shape[1]  # each row fed its last min(len, width) ids
    fed = {"tokens": prefix + sum(min(len(c), width) for c in contexts), "positions": prefix + position_ids.numel()}
    return logits, cache, mask, position_ids, fed


def shared_prompt_prefill(engine, contexts: list[tuple[int, ...]], prompt_lengths: list[int], steps: int):
    """A new cache of every row's ``context`` (prompt + the tokens it sampled so far; its first ``prompt_lengths``
    ids are its prompt) under the engine's current weights, each prompt prefilled once however many rows share it
    (RL repeats every prompt G times) and each row's own tail on top of it: an in-flight swap with
    ``kv_on_update=recompute`` feeds sum over distinct prompts of P + sum over rows of t_i ids, not the G x P + sum
    t_i of a per-row re-prefill. Rows whose contexts are equal share one prefill.

    The distinct prompts are prefilled together (left-padded); each prompt's keys and values then serve as a kept
    cache (``KeptKV``) under its rows' tails, which are prefilled by ``continued_prefill`` in one call per tail
    length (no row re-computes a prompt id, and every row's keys stay one contiguous run: what the batch-invariant
    attention requires); rows without a tail take the prompt's prefill. The parts are then stacked right-aligned
    (``kv_cache.stack_rows``: keys and values copied, none recomputed). Under ``kernels=batch_invariant`` a position's
    keys, values and logits depend only on its own sequence's ids, so every row gets bit for bit the cache and
    logits of a full re-prefill of its context; under torch's kernels they differ by the rounding of other shapes.
    Attention-only models (a hybrid's recurrent states are not served here).

    Returns (last-position logits [B, V], the cache with room for ``steps`` more positions, attention mask [B, L]
    int64, each row's last position id [B, 1] int64, {"tokens": real ids fed, "positions": ids fed with padding}).
    Raises ValueError when ``contexts`` and ``prompt_lengths`` differ in length or a prompt length is not within
    1..len(context)."""
    from .kv_cache import stack_rows
    from .types import left_pad

    if len(contexts) != len(prompt_lengths):
        raise ValueError(f"got {len(contexts)} contexts but {len(prompt_lengths)} prompt lengths")
    if any(not 0 < p <= len(c) for c, p in zip(contexts, prompt_lengths)):
        raise ValueError("every prompt length must be within 1..len(context)")
    device = next(engine.model.parameters()).device
    distinct: dict[tuple[int, ...], int] = {}
    row_of = [distinct.setdefault(c, len(distinct)) for c in contexts]
    prompt_of_context: dict[tuple[int, ...], tuple[int, ...]] = {}
    for c, p in zip(contexts, prompt_lengths):
        prompt_of_context.setdefault(c, c[:p])
    prompts = list(dict.fromkeys(prompt_of_context.values()))
    prompt_index = {p: i for i, p in enumerate(prompts)}
    ids, mask = left_pad([list(p) for p in prompts], engine.pad_token_id)
    ids, mask = ids.to(device), mask.long().to(device)
    position_ids = position_ids_from_mask(mask)
    cache = engine._new_cache(ids.shape[1] + steps)
    out = engine.model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1
    )
    fed = {"tokens": int(mask.sum()), "positions": int(ids.numel())}
    kept = []
    for i, prompt in enumerate(prompts):  # copies of each prompt's real positions
        real = mask[i].bool()
        layers = [(layer.keys[i][:, real], layer.values[i][:, real]) for layer in cache.layers]
        kept.append(KeptKV(prompt, layers, engine.version))
    by_tail: dict[int, list[int]] = {}
    for j, c in enumerate(distinct):
        by_tail.setdefault(len(c) - len(prompt_of_context[c]), []).append(j)
    parts, order = [], []  # (logits, cache, mask, last position ids) per tail length; distinct contexts in order
    ctx = list(distinct)
    if 0 in by_tail:  # rows without a tail: the prompt's own prefill
        pick = torch.tensor([prompt_index[ctx[j]] for j in by_tail[0]], device=device)
        logits0 = out.logits[:, -1][pick]
        cache.batch_select_indices(pick)
        parts.append((logits0, cache, mask[pick], position_ids[pick, -1:]))
        order += by_tail.pop(0)
    for tail, members in sorted(by_tail.items()):
        part = continued_prefill(
            engine, [ctx[j] for j in members], [kept[prompt_index[prompt_of_context[ctx[j]]]] for j in members], steps
        )
        parts.append((part[0], part[1], part[2], part[3][:, -1:]))
        fed["tokens"] += tail * len(members)
        fed["positions"] += tail * len(members)
        order += members
    if len(parts) == 1:
        logits, cache, mask, last = parts[0]
    else:
        cache, mask = stack_rows(engine, [(p[1], p[2]) for p in parts], room=steps)
        logits, last = torch.cat([p[0] for p in parts]), torch.cat([p[3] for p in parts])
    place = {j: i for i, j in enumerate(order)}
    select = torch.tensor([place[j] for j in row_of], dtype=torch.long, device=device)
    if not torch.equal(select, torch.arange(len(row_of), device=device)):
        cache.batch_select_indices(select)
        logits, mask, last = logits[select], mask[select], last[select]
    return logits, cache, mask, last, fed
