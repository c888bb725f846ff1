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
