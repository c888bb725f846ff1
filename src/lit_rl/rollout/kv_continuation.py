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

Hybrid models (Gated DeltaNet layers) are not continued: their conv and recurrent states summarise the context at
its end and cannot re-compute a tail, so ``TorchEngine.kv_continuation`` keeps nothing for them and every turn
re-prefills its episode (as engines without the session, e.g. vLLM, do).
"""

from __future__ import annotations

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
