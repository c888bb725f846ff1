"""The embedded engine continues a multi-turn episode's KV cache across turns (issue 36): inside
``TorchEngine.kv_continuation()`` a later prompt that extends a finished row's context prefills only the ids after
it, and under batch-invariant kernels the tokens and log-probs are those of a fresh engine's full prefill, bit for
bit. The collector's own test (continued vs re-prefilled episodes) is in test_multiturn.py."""

import pytest
import torch
from helpers import chat_prompts

from lit_rl.kernels import kernel_mode
from lit_rl.rollout.kv_continuation import KeptCaches, KeptKV
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.rollout.types import SamplingConfig

QUESTIONS = ["What is 1 + 2?", "What is 7 + 5? Think step by step.", "Hi", "Add 3 and 9, then explain."]
HALF_VOCAB = list(range(0, 49152, 2))  # every even id stops a row: turns of different lengths


def engine_of(tiny, continue_kv=True):
    model, tok = tiny
    engine = TorchEngine(model, tok.pad_token_id, HALF_VOCAB)
    engine.continue_kv = continue_kv
    return engine


def next_prompts(prompts, out, extra):
    """Each row's prompt + its sampled ids + ``extra[i]`` (an environment's ids, of different lengths)."""
    return [p + out.response_ids[i][out.response_mask[i]].tolist() + extra[i] for i, p in enumerate(prompts)]


def test_kept_caches_match_the_longest_kept_prefix_of_the_same_weights():
    kv = [(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))]
    kept = KeptCaches()
    kept.keep(KeptKV((1, 2), kv, 0))
    kept.keep(KeptKV((1, 2, 3, 4), kv, 0))
    kept.keep(KeptKV((1, 2, 3, 4, 5), kv, 1))
    assert kept.match((1, 2, 3, 4, 5, 6), 0).context == (1, 2, 3, 4)  # the longest of version 0
    assert kept.match((1, 2, 3, 4, 5, 6), 1).context == (1, 2, 3, 4, 5)
    assert kept.match((1, 2, 3, 4), 0).context == (1, 2)  # a proper prefix: one id at least is left to prefill
    assert kept.match((9, 2, 3, 4, 5), 0) is None
    kept.used([kept.entries[(1, 2)], None], prefilled=7)
    assert sorted(kept.entries) == [(1, 2, 3, 4), (1, 2, 3, 4, 5)]
    assert (kept.rows_continued, kept.prefilled) == (1, 7)


def test_continued_turn_equals_a_fresh_full_prefill_bit_for_bit_under_batch_invariant(tiny):
    """Three calls in one session: rows of different lengths (groups of two), environment ids of different
    lengths, a new long prompt joining the third call beside continued rows, a group's shared first prefill."""
    model, tok = tiny
    params = SamplingConfig(max_new_tokens=6, temperature=1.0, logprobs_top_k=2)
    first = [p for p in chat_prompts(tok, QUESTIONS[:3]) for _ in range(2)]
    extra = [[5, 7, 9] * (1 + i % 3) for i in range(len(first))]
    engine, fresh = engine_of(tiny), engine_of(tiny, continue_kv=False)
    with kernel_mode("batch_invariant", model):
        with engine.kv_continuation() as kept:
            a1 = engine.generate(first, params, seeds=list(range(6)))
            assert len(kept) == 6 and kept.rows_continued == 0
            second = next_prompts(first, a1, extra)
            a2 = engine.generate(second, params, seeds=list(range(10, 16)))
            assert kept.rows_continued == 6
            third = next_prompts(second, a2, extra)[:4] + chat_prompts(tok, QUESTIONS[3:]) * 2
            a3 = engine.generate(third, params, seeds=list(range(20, 26)))
            assert kept.rows_continued == 10  # the two new prompts prefilled whole, beside the continued rows
        assert engine.kept is None  # the session's KV is dropped with it
        b1 = fresh.generate(first, params, seeds=list(range(6)))
        b2 = fresh.generate(second, params, seeds=list(range(10, 16)))
        b3 = fresh.generate(third, params, seeds=list(range(20, 26)))
    for a, b in ((a1, b1), (a2, b2), (a3, b3)):
        assert a.response_mask.sum() > 6
        for name in ("response_ids", "response_mask", "rollout_logprobs", "topk_ids", "topk_logprobs"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.finish_reason == b.finish_reason


def test_continued_turn_under_torch_kernels_is_within_rounding_of_a_full_prefill(tiny):
    model, tok = tiny
    params = SamplingConfig(max_new_tokens=6, temperature=1.0)
    first = chat_prompts(tok, QUESTIONS)
    engine = engine_of(tiny)
    with engine.kv_continuation() as kept:
        a1 = engine.generate(first, params, seeds=[1, 2, 3, 4])
        second = next_prompts(first, a1, [[11, 13]] * 4)
        a2 = engine.generate(second, params, seeds=[5, 6, 7, 8])
        assert kept.rows_continued == 4
    b2 = engine.generate(second, params, seeds=[5, 6, 7, 8])  # outside the session: a full prefill
    assert torch.equal(a2.response_ids, b2.response_ids)
    diff = (a2.rollout_logprobs - b2.rollout_logprobs).abs()[a2.response_mask]
    assert diff.max().item() < 1e-5


def test_nothing_is_continued_across_a_weight_change_or_with_continuation_off(tiny):
    model, tok = tiny
    params = SamplingConfig(max_new_tokens=4, temperature=1.0)
    first = chat_prompts(tok, QUESTIONS[:2])
    engine = engine_of(tiny)
    with engine.kv_continuation() as kept:
        out = engine.generate(first, params, seeds=[1, 2])
        engine.sync_weights(1)  # newer weights: the kept KV is not theirs
        engine.generate(next_prompts(first, out, [[3], [3]]), params, seeds=[3, 4])
        assert kept.rows_continued == 0
        with engine.kv_continuation() as inner:  # a nested session shares the open one's store
            assert inner is kept
        assert engine.kept is kept
    off = engine_of(tiny, continue_kv=False)
    with off.kv_continuation() as kept:
        assert kept is None and off.kept is None


@pytest.mark.parametrize("rows", [1, 3])
def test_rows_finishing_together_or_apart_keep_exactly_their_context(tiny, rows):
    """The KV kept for a row covers its prompt and every sampled token but the last, at the row's own positions
    (left padding and the finished rows dropped before it are not part of it)."""
    model, tok = tiny
    engine = engine_of(tiny)
    prompts = chat_prompts(tok, QUESTIONS[:rows])
    with engine.kv_continuation() as kept:
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=5, temperature=1.0), seeds=list(range(rows)))
        assert len(kept) == rows
        for i, p in enumerate(prompts):
            ids = out.response_ids[i][out.response_mask[i]].tolist()
            entry = kept.entries[tuple(p + ids[:-1])]
            assert entry.layers[0][0].shape[1] == len(p) + len(ids) - 1
            assert len(entry.layers) == model.config.num_hidden_layers


def test_a_shared_prompt_prefill_gives_each_row_the_cache_of_its_whole_context(tiny):
    """``shared_prompt_prefill`` of 7 rows (two prompts, tails of 0, 1, 2 and 3 ids, two rows with one context) feeds
    each prompt once and each distinct tail once: 4 + 3 + (1 + 3 + 2 + 2) = 15 ids. Under ``kernels=batch_invariant``
    every row's next-token logits and its keys and values equal a full prefill of its context, bit for bit, and one
    cached decode step on top gives the same logits as on the full prefill's cache. A prompt length outside the
    context is named."""
    from lit_rl.logprobs import position_ids_from_mask
    from lit_rl.rollout.kv_continuation import shared_prompt_prefill

    model, tok = tiny
    x, y = (5, 9, 14, 3), (7, 2, 11)
    contexts = [x, x + (4,), x + (8, 1, 6), y + (2, 2), y + (3, 5), x + (8, 1, 6), y]
    lengths = [len(x), len(x), len(x), len(y), len(y), len(x), len(y)]
    with kernel_mode("batch_invariant", model):
        engine = TorchEngine(model, tok.pad_token_id, [], own_copy=True)
        model.eval()
        with torch.no_grad():
            logits, cache, mask, last, fed = shared_prompt_prefill(engine, contexts, lengths, steps=4)
            loop = engine_loop(engine, contexts)
            full_logits, full_cache, full_mask, full_pos = loop._prefill_rows(list(range(len(contexts))), False)
            step = torch.tensor([[17]] * len(contexts))

            def decode(c, m, p):
                m = torch.cat([m, m.new_ones(m.shape[0], 1)], 1)
                out = engine.model(input_ids=step, attention_mask=m, position_ids=p[:, -1:] + 1, cache=c,
                                   use_cache=True, logits_to_keep=1)  # fmt: skip
                return out.logits[:, -1]

            after, full_after = decode(cache, mask, last), decode(full_cache, full_mask, full_pos)
    assert fed["tokens"] == len(x) + len(y) + 1 + 3 + 2 + 2 == 15
    assert torch.equal(last[:, 0], torch.tensor([len(c) - 1 for c in contexts]))
    assert torch.equal(logits, full_logits) and torch.equal(after, full_after)
    for layer, full in zip(cache.layers, full_cache.layers):  # right-aligned: the context, then the decoded step
        for row, c in enumerate(contexts):
            span = slice(-(len(c) + 1), None)
            assert torch.equal(layer.keys[row][:, span], full.keys[row][:, span])
            assert torch.equal(layer.values[row][:, span], full.values[row][:, span])
    assert torch.equal(position_ids_from_mask(mask)[:, -1], last[:, 0])
    with pytest.raises(ValueError, match="prompt length must be within"):
        shared_prompt_prefill(engine, [x], [0], steps=4)


def engine_loop(engine, contexts):
    """A ``DecodeLoop`` holding ``contexts`` as bare prompts (its ``_prefill_rows`` prefills each whole)."""
    from lit_rl.rollout.decode_loop import DecodeLoop

    loop = DecodeLoop(engine, SamplingConfig(temperature=0.0, max_new_tokens=4))
    loop.add([list(c) for c in contexts], list(range(len(contexts))))
    return loop


def test_common_prefix_is_fed_once_where_it_spares_enough():
    """``common_prefix``: the shared ids less one id of the shortest context, where feeding them once spares at
    least a quarter of the whole prefill and 256 positions; else 0."""
    from lit_rl.rollout.kv_continuation import common_prefix

    shared = tuple(range(100, 190))
    four = [shared + tuple(range(10 * i, 10 * i + 10)) for i in range(4)]
    assert common_prefix(four) == 90  # spares 3 x 90 = 270 of 400
    assert common_prefix(four[:2]) == 0  # 90 of 200: under 256 positions
    assert common_prefix(four[:1]) == 0
    assert common_prefix([c[:91] for c in four] * 2) == 90  # one id of the shortest is left to feed
    short = [shared[:40] + (i,) * 60 for i in range(16)]
    assert common_prefix(short) == 40  # 15 x 40 = 600 of 1,600
    assert common_prefix([(7,) + c for c in four] + [(8,) + four[0]]) == 0  # nothing shared at the start


def test_shared_opening_prefilled_once_is_a_whole_prefill_bit_for_bit_under_batch_invariant(tiny):
    """Twelve distinct chat prompts share the template's opening: it is prefilled once and every row's rest on top
    (``common_prefix_prefill``), with the tokens and log-probs of one whole prefill, bit for bit, under batch-invariant
    kernels; greedy under torch's kernels, the same tokens and log-probs within float32 rounding."""
    from lit_rl.rollout import decode_loop

    model, tok = tiny
    questions = [f"What is {a} + {b}? Answer briefly." for a, b in zip(range(3, 15), range(40, 52))]
    prompts = chat_prompts(tok, questions)
    calls = []
    real = decode_loop.common_prefix_prefill
    decode_loop.common_prefix_prefill = lambda *a: calls.append(a[2]) or real(*a)
    engine = TorchEngine(model, tok.pad_token_id, HALF_VOCAB)
    try:
        for mode, params in (
            ("batch_invariant", SamplingConfig(max_new_tokens=6, temperature=1.0, logprobs_top_k=2)),
            ("default", SamplingConfig(max_new_tokens=6, temperature=0.0)),
        ):
            out = {}
            for sharing in (False, True):
                engine.prefix_sharing = sharing
                with kernel_mode(mode, model):
                    out[sharing] = engine.generate(prompts, params, seeds=list(range(12)))
            whole, shared = out[False], out[True]
            assert torch.equal(whole.response_ids, shared.response_ids)
            if mode == "batch_invariant":
                assert torch.equal(whole.rollout_logprobs, shared.rollout_logprobs)
                assert torch.equal(whole.topk_logprobs, shared.topk_logprobs)
            else:
                assert torch.allclose(whole.rollout_logprobs, shared.rollout_logprobs, atol=1e-5)
    finally:
        decode_loop.common_prefix_prefill = real
    assert len(calls) == 2 and calls[0] >= 20  # the template's opening, once per rollout with sharing on


def test_common_prefix_prefill_counts_the_ids_it_feeds(tiny):
    """One context of 100 ids and fifteen of 40 share their first 30: the shared ids once, then every row's last
    min(len, 70) ids (the longest's rest is 70; a 40-id row re-feeds its whole context, padded to 70): 700 real ids
    in 1,150 positions, where a whole prefill feeds the same 700 in 16 x 100 = 1,600."""
    from lit_rl.rollout.kv_continuation import common_prefix, common_prefix_prefill

    model, tok = tiny
    shared = tuple(range(200, 230))
    contexts = [shared + tuple(range(300, 370))] + [shared + tuple(range(400 + i, 410 + i)) for i in range(15)]
    assert common_prefix(contexts) == 30
    engine = TorchEngine(model, tok.pad_token_id, [])
    with torch.no_grad():
        logits, cache, mask, position_ids, fed = common_prefix_prefill(engine, contexts, 30, steps=4)
    assert fed == {"tokens": 30 + 70 + 15 * 40, "positions": 30 + 16 * 70}
    assert logits.shape == (16, model.config.vocab_size) and position_ids.shape == (16, 70)
    assert mask.sum(-1).tolist() == [len(c) for c in contexts]
    assert position_ids[:, -1].tolist() == [len(c) - 1 for c in contexts]
