"""The embedded engine: log-probs equal the trainer's, seeded and batch-independent sampling."""

import pytest
import torch
from helpers import chat_prompts

from lit_rl.logprobs import process_logits, response_logprobs, support_mask
from lit_rl.rollout.torch_engine import TorchEngine, sample_rows, sample_tail
from lit_rl.rollout.types import SamplingConfig, left_pad

QUESTIONS = ["What is 1 + 2?", "What is 7 + 5? Think step by step.", "Hi", "Add 3 and 9, then explain."]


def make_engine(model, tok, **options):
    return TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], **options)


def trainer_logprobs(model, tok, r, temperature=1.0):
    pi, pm = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        scores = response_logprobs(model, pi, pm, r.response_ids, r.response_mask, temperature=temperature)
    return scores.logprobs


def test_rollout_logprobs_equal_trainer_forward_float32(tiny):
    model, tok = tiny
    prompts = chat_prompts(tok, QUESTIONS) * 2  # different prompt lengths -> left padding
    for temperature in (1.0, 0.7):
        r = make_engine(model, tok).generate(
            prompts, SamplingConfig(temperature=temperature, max_new_tokens=24), seeds=list(range(len(prompts)))
        )
        assert r.response_mask.sum() > 0
        lp = trainer_logprobs(model, tok, r, temperature)
        diff = (lp - r.rollout_logprobs).abs()[r.response_mask]
        assert diff.max().item() < 1e-5, diff.max().item()
        assert (r.rollout_logprobs[~r.response_mask] == 0).all()


def test_same_seed_same_rollouts_and_batch_independent(tiny):
    model, tok = tiny
    eng = make_engine(model, tok)
    prompts = chat_prompts(tok, QUESTIONS)
    params = SamplingConfig(max_new_tokens=16)
    a = eng.generate(prompts, params, seeds=[11, 12, 13, 14])
    b = eng.generate(prompts, params, seeds=[11, 12, 13, 14])
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    alone = eng.generate(prompts[1:2], params, seeds=[12])
    width = alone.response_ids.shape[1]
    assert torch.equal(alone.response_ids[0], a.response_ids[1, :width])
    c = eng.generate(prompts, params, seeds=[21, 22, 23, 24])
    assert not torch.equal(a.response_ids, c.response_ids)


def test_finish_reasons_and_stop_token(tiny):
    model, tok = tiny
    # Make the stop token certain: the engine must stop after exactly one token, reason "stop".
    eng = TorchEngine(model, tok.pad_token_id, stop_token_ids=list(range(len(tok))))
    r = eng.generate(chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=8), seeds=[0, 1])
    assert r.finish_reason == ["stop", "stop"]
    assert r.response_length.tolist() == [1, 1]
    r = make_engine(model, tok).generate(
        chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=5), seeds=[0, 1]
    )
    # the random tiny model essentially never emits <|im_end|> in 5 tokens
    assert r.finish_reason == ["length", "length"] and r.response_length.tolist() == [5, 5]


def test_topk_record_and_truncated_sampling(tiny):
    model, tok = tiny
    params = SamplingConfig(max_new_tokens=12, top_k=5, logprobs_top_k=8)
    r = make_engine(model, tok).generate(chat_prompts(tok, QUESTIONS), params, seeds=[1, 2, 3, 4])
    m = r.response_mask
    assert r.topk_ids.shape == (*m.shape, 8)
    # the distribution sampled from is the top-5 one: 5 finite entries, normalised, holding the sampled token
    finite = torch.isfinite(r.topk_logprobs)
    assert (finite.sum(-1)[m] == 5).all()
    mass = torch.where(finite, r.topk_logprobs.exp(), torch.zeros(())).sum(-1)
    assert torch.allclose(mass[m], torch.ones(()), atol=1e-5)
    hit = (r.topk_ids == r.response_ids.unsqueeze(-1)) & finite
    assert hit.any(-1)[m].all()


def test_process_logits_top_p_keeps_smallest_prefix():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = process_logits(logits, 1.0, top_p=0.8)
    assert torch.isfinite(lp).tolist() == [[True, True, False, False]]
    assert torch.allclose(lp.exp()[0, :2], torch.tensor([0.625, 0.375]))


def test_process_logits_at_temperature_one_is_the_log_softmax_of_the_division():
    """At T = 1 the division is skipped: the bits of dividing by 1.0 (bf16 logits as the engine gets them under
    autocast, float32 ones, top-k), and the float32 input is left untouched."""
    g = torch.Generator().manual_seed(0)
    for logits in (torch.randn(3, 50, generator=g) * 4, (torch.randn(3, 50, generator=g) * 4).bfloat16()):
        before = logits.clone()
        for top_k in (0, 5):
            divided = logits.float() / 1.0
            if top_k:
                divided = divided.masked_fill(~support_mask(divided, top_k, 1.0), float("-inf"))
            assert torch.equal(process_logits(logits, 1.0, top_k), torch.log_softmax(divided, -1))
        assert torch.equal(logits, before)
    assert not torch.equal(process_logits(logits, 0.5), process_logits(logits, 1.0))


def test_sample_rows_matches_distribution():
    logp = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]])).expand(1, 4)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    draws = torch.cat([sample_rows(logp, [g]) for g in gens])
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[1] == 0  # zero-probability token never drawn
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.03)


@pytest.mark.slow
def test_smollm2_rollout_logprobs_match_trainer_float32(smollm2):
    model, tok = smollm2
    prompts = chat_prompts(tok, QUESTIONS) * 4
    r = make_engine(model, tok).generate(prompts, SamplingConfig(max_new_tokens=32), seeds=list(range(16)))
    diff = (trainer_logprobs(model, tok, r) - r.rollout_logprobs).abs()[r.response_mask]
    assert diff.max().item() < 1e-3 and diff.mean().item() < 1e-5, (diff.max().item(), diff.mean().item())


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.9), (20, 0.8)])
def test_trainer_scores_the_truncated_distribution_the_sampler_drew_from(tiny, top_k, top_p):
    """With top-k / top-p on, rollout_logprobs are log-probs of the truncated, renormalised distribution;
    the trainer scores that same object (equal within float32 noise), where scoring the full softmax
    is off by the log of the kept mass at every token."""
    model, tok = tiny
    params = SamplingConfig(max_new_tokens=16, top_k=top_k, top_p=top_p)
    r = make_engine(model, tok).generate(chat_prompts(tok, QUESTIONS), params, seeds=[5, 6, 7, 8])
    m = r.response_mask
    pi, pm = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        truncated = response_logprobs(model, pi, pm, r.response_ids, m, top_k=top_k, top_p=top_p).logprobs
        full = response_logprobs(model, pi, pm, r.response_ids, m).logprobs
    assert (truncated - r.rollout_logprobs).abs()[m].max().item() < 1e-5
    assert (full - r.rollout_logprobs).abs()[m].mean().item() > 0.05  # the untruncated score is another object
    assert (truncated >= full - 1e-6)[m].all()  # renormalising over fewer tokens only raises log-probs


def test_score_centering_on_the_recorded_truncated_support_vanishes_on_policy(tiny):
    """Same weights in sampler and trainer, top-k = 5 sampling, the engine's recorded head as H: the
    trainer's truncated pi equals mu on H, so the centring gradient sum_H mu grad log pi is ~0. Centring the
    full-softmax score on the same head instead leaves a large spurious term."""
    from lit_rl.corrections import score_centering_term

    model, tok = tiny
    params = SamplingConfig(max_new_tokens=8, top_k=5, logprobs_top_k=16)
    r = make_engine(model, tok).generate(chat_prompts(tok, QUESTIONS), params, seeds=[1, 2, 3, 4])
    m = r.response_mask
    pi, pm = left_pad(r.prompt_ids, tok.pad_token_id)
    weight = model.get_output_embeddings().weight

    def grad_norm(**trunc):
        scores = response_logprobs(model, pi, pm, r.response_ids, m, head_ids=r.topk_ids, **trunc)
        term = score_centering_term(scores.head_logprobs, r.topk_logprobs, torch.isfinite(r.topk_logprobs))
        (g_term,) = torch.autograd.grad(term[m].sum(), weight, retain_graph=True)
        (g_score,) = torch.autograd.grad(scores.logprobs[m].sum(), weight)
        return (g_term.norm() / g_score.norm()).item()

    assert grad_norm(top_k=5) < 1e-4
    assert grad_norm() > 0.05


# ----------------------------------------------------------------------------------------------
# The mismatch dial: engine.logit_noise (sigma) and engine.temperature_offset (delta)
# ----------------------------------------------------------------------------------------------


def test_logit_noise_is_reproducible_and_sigma_zero_is_no_dial(tiny):
    model, tok = tiny
    prompts = chat_prompts(tok, QUESTIONS) * 2
    params = SamplingConfig(max_new_tokens=16, logprobs_top_k=4)
    seeds = list(range(100, 108))
    plain = make_engine(model, tok).generate(prompts, params, seeds)
    zero = make_engine(model, tok, logit_noise=0.0, temperature_offset=0.0).generate(prompts, params, seeds)
    for name in ("response_ids", "rollout_logprobs", "topk_ids", "topk_logprobs"):
        assert torch.equal(getattr(plain, name), getattr(zero, name)), name
    noisy = make_engine(model, tok, logit_noise=1.0)
    a, b = noisy.generate(prompts, params, seeds), noisy.generate(prompts, params, seeds)
    for name in ("response_ids", "rollout_logprobs", "topk_ids", "topk_logprobs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.response_ids, plain.response_ids)  # the noise changes what is sampled
    # a sequence's noise depends on its own seed only, not on the batch it shares: the same tokens; the
    # log-probs equal up to the last bits (outside kernels=batch_invariant, a product's summation order may
    # depend on the batch's size: on an AVX2-only AMD EPYC it does, on an AVX512 one it did not)
    alone = noisy.generate(prompts[3:4], params, seeds[3:4])
    width = alone.response_ids.shape[1]
    assert torch.equal(alone.response_ids[0], a.response_ids[3, :width])
    torch.testing.assert_close(alone.rollout_logprobs[0], a.rollout_logprobs[3, :width], rtol=1e-5, atol=1e-5)
    # another seed, other noise
    c = noisy.generate(prompts, params, [s + 1000 for s in seeds])
    assert not torch.equal(a.response_ids, c.response_ids)
    # greedy decoding (evaluation) scores the policy, not the sampler: the dial does not apply
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    assert torch.equal(
        noisy.generate(prompts, greedy, seeds).response_ids,
        make_engine(model, tok).generate(prompts, greedy, seeds).response_ids,
    )


def test_rollout_logprobs_and_head_are_the_noisy_distribution(tiny):
    """The recorded head (k = V: the whole distribution) is normalised, holds the sampled token's
    rollout_logprob, and differs from the trainer's distribution by noise of size sigma: the centred
    log-ratio log mu_v - log pi_v over the vocabulary has standard deviation sigma (V = 49152 draws per token)."""
    model, tok = tiny
    vocab = model.get_output_embeddings().weight.shape[0]
    params = SamplingConfig(max_new_tokens=3, logprobs_top_k=vocab)
    for sigma in (0.3, 1.0):
        r = make_engine(model, tok, logit_noise=sigma).generate(chat_prompts(tok, QUESTIONS[:2]), params, [1, 2])
        m = r.response_mask
        pi, pm = left_pad(r.prompt_ids, tok.pad_token_id)
        with torch.no_grad():
            s = response_logprobs(model, pi, pm, r.response_ids, m, head_ids=r.topk_ids, with_entropy=False)
        log_mu, log_pi = r.topk_logprobs[m].double(), s.head_logprobs[m].double()  # [tokens, V]
        assert torch.allclose(log_mu.exp().sum(-1), torch.ones(()).double(), atol=1e-4)
        at_y = (r.topk_ids == r.response_ids.unsqueeze(-1))[m]
        assert torch.allclose(log_mu[at_y], r.rollout_logprobs[m].double(), atol=1e-6)
        spread = (log_mu - log_pi).std(-1)  # the normaliser shift cancels in the standard deviation
        assert torch.allclose(spread, torch.full_like(spread, sigma), rtol=0.02), (sigma, spread)


def test_realised_train_inference_kl_grows_with_sigma(tiny):
    """The k3 estimate the trainer logs (train/train_inference_kl, from the sampled tokens) and the reverse
    KL (train/train_inference_kl_reverse) rise with sigma; on the tiny model (pi nearly uniform over 49152
    tokens) both are ~ sigma^2 / 2."""
    from lit_rl.corrections import mismatch_decomposition

    model, tok = tiny
    prompts = chat_prompts(tok, QUESTIONS) * 4
    params = SamplingConfig(max_new_tokens=16)
    forward, reverse = [], []
    for sigma in (0.0, 0.25, 0.5, 1.0):
        r = make_engine(model, tok, logit_noise=sigma).generate(prompts, params, list(range(16)))
        lp = trainer_logprobs(model, tok, r)
        d = mismatch_decomposition(r.rollout_logprobs, lp, lp, r.response_mask)
        forward.append(d["train_inference_kl"].item())
        reverse.append(d["train_inference_kl_reverse"].item())
    assert forward[0] < 1e-9 and reverse[0] < 1e-9
    assert forward[1] < forward[2] < forward[3] and reverse[1] < reverse[2] < reverse[3]
    for sigma, f, b in zip((0.25, 0.5, 1.0), forward[1:], reverse[1:]):
        assert f == pytest.approx(sigma**2 / 2, rel=0.35) and b == pytest.approx(sigma**2 / 2, rel=0.35)


def test_temperature_offset_samples_at_t_plus_delta(tiny):
    model, tok = tiny
    prompts = chat_prompts(tok, QUESTIONS) * 2
    params = SamplingConfig(temperature=0.8, max_new_tokens=12, logprobs_top_k=4)
    r = make_engine(model, tok, temperature_offset=0.4).generate(prompts, params, list(range(8)))
    m = r.response_mask
    at_sampler = trainer_logprobs(model, tok, r, temperature=1.2)
    at_trainer = trainer_logprobs(model, tok, r, temperature=0.8)
    assert (at_sampler - r.rollout_logprobs).abs()[m].max().item() < 1e-5
    assert (at_trainer - r.rollout_logprobs).abs()[m].mean().item() > 1e-3
    with pytest.raises(ValueError, match="must be > 0"):
        make_engine(model, tok, temperature_offset=-0.8).generate(prompts, params, list(range(8)))


def test_the_reserved_kv_cache_samples_what_a_growing_cache_does(tiny, monkeypatch):
    """``ReservedLayer`` writes into room reserved up front instead of concatenating: the same keys and values,
    so the same tokens and log-probs (a group's prompt prefilled once, rows dropped as they finish, and a
    capacity too small for the run, which must grow)."""
    from transformers import DynamicCache

    import lit_rl.rollout.torch_engine as te

    model, tok = tiny
    stops = list(range(0, len(tok), 8))  # about one token in eight ends a row: rows finish at different steps

    def make_engine(model, tok):
        return TorchEngine(model, tok.pad_token_id, stop_token_ids=stops)

    prompts = [p for p in chat_prompts(tok, QUESTIONS) for _ in range(3)]
    params = SamplingConfig(max_new_tokens=20)
    seeds = list(range(len(prompts)))
    reserved = make_engine(model, tok).generate(prompts, params, seeds)
    original = te.reserved_cache
    monkeypatch.setattr(te, "reserved_cache", lambda capacity, dtype: original(8, dtype))  # too small: grows
    too_small = make_engine(model, tok).generate(prompts, params, seeds)
    monkeypatch.setattr(te, "reserved_cache", lambda capacity, dtype: te.DynamicCache())
    growing = make_engine(model, tok).generate(prompts, params, seeds)
    assert te.DynamicCache is DynamicCache
    assert reserved.response_mask.sum(-1).unique().numel() > 1  # rows finished at different steps
    torch.testing.assert_close(reserved.rollout_logprobs, growing.rollout_logprobs, rtol=0, atol=1e-6)
    assert torch.equal(reserved.response_ids, growing.response_ids)
    assert torch.equal(too_small.response_ids, reserved.response_ids)
    torch.testing.assert_close(too_small.rollout_logprobs, reserved.rollout_logprobs, rtol=0, atol=1e-6)


def test_a_reserved_layer_grows_past_its_capacity():
    from lit_rl.rollout.torch_engine import ReservedLayer

    layer, expected = ReservedLayer(capacity=3), []
    for step in range(5):
        k = torch.full((2, 1, 2 if step == 0 else 1, 4), float(step))
        keys, values = layer.update(k, -k)
        expected.append(k)
        assert torch.equal(keys, torch.cat(expected, dim=-2)) and torch.equal(values, -keys)
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape == (1, 1, 6, 4) and layer.get_seq_length() == 6


def test_under_autocast_the_cache_holds_what_sdpa_reads_and_samples_the_same(tiny, monkeypatch):
    """Under bf16 autocast torch's SDPA casts the float32 keys (rotary output) to bf16 at every call; the engine
    stores them in bf16 once (``kernels.attention_kv_dtype``), so tokens, log-probs and the top-k head are bit
    for bit those of a float32 cache (left-padded prompts: the masked path too). The batch-invariant attention
    reads float32 keys: its cache stays as written."""
    import lit_rl.rollout.torch_engine as te
    from lit_rl.kernels import BatchInvariantMode, attention_kv_dtype

    model, tok = tiny
    prompts = chat_prompts(tok, QUESTIONS)  # different lengths: left padding
    params = SamplingConfig(max_new_tokens=12, logprobs_top_k=3)
    seeds = list(range(len(prompts)))
    caches = []
    original = te.reserved_cache
    monkeypatch.setattr(te, "reserved_cache", lambda *a: caches.append(original(*a)) or caches[-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_kv_dtype(model) == torch.bfloat16
        stored = make_engine(model, tok).generate(prompts, params, seeds)
        layer = caches[-1].layers[0]
        assert layer._keys.dtype == layer._values.dtype == torch.bfloat16
        monkeypatch.setattr(te, "attention_kv_dtype", lambda model: None)
        as_written = make_engine(model, tok).generate(prompts, params, seeds)
        assert caches[-1].layers[0]._keys.dtype == torch.float32  # keys from float32 rotary embeddings
        with BatchInvariantMode(model):
            assert attention_kv_dtype(model) is None
    assert attention_kv_dtype(model) is None  # no autocast: float32 as written
    assert torch.equal(stored.response_ids, as_written.response_ids)
    assert torch.equal(stored.rollout_logprobs, as_written.rollout_logprobs)
    assert torch.equal(stored.topk_logprobs, as_written.topk_logprobs)


def test_single_query_attention_groups_decode_heads_and_samples_the_same(tiny, monkeypatch):
    """Unpadded bf16 decode steps run a key/value head's query heads as the rows of one SDPA problem
    (``kernels.single_query``): here the same tokens, log-probs and top-k head, bit for bit, as transformers' own
    ``sdpa``; float32 steps and the prefill are handed to transformers' ``sdpa`` (the same calls)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from lit_rl.kernels import attention_backward, single_query

    model, tok = tiny
    rep = model.config.num_attention_heads // model.config.num_key_value_heads
    assert rep > 1  # grouped-query attention
    chats = chat_prompts(tok, QUESTIONS)
    width = min(map(len, chats))
    prompts = [p[-width:] for p in chats]  # one length: no padding mask, the path transformers does not pack
    params = SamplingConfig(max_new_tokens=12, logprobs_top_k=3)
    seeds = list(range(len(prompts)))
    rows = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(query, *args, **kwargs):
        rows.append(query.shape[-2])
        return sdpa(query, *args, **kwargs)

    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            # no stop token; SDPA's path (the decode kernel off: tests/test_decode_attention.py); installs single_query
            engine = TorchEngine(model, tok.pad_token_id, [], decode_attention=False)
            engine.generate(prompts[:1], SamplingConfig(max_new_tokens=2), [0])  # the Llama step's parity check, once
            # .attention in the chain under ``sdpa`` (the trainer's attention_backward wrapper may sit above it, inert)
            served = ALL_ATTENTION_FUNCTIONS["sdpa"]
            assert served is single_query.attention or (
                served is attention_backward.attention and attention_backward._delegate is single_query.attention
            )
            with monkeypatch.context() as m:
                m.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
                grouped = engine.generate(prompts, params, seeds)
            decode_rows = rep if autocast else 1  # float32 keeps transformers' one row per head
            assert rows.count(decode_rows) == 11 * model.config.num_hidden_layers  # 12 tokens: 11 cached steps
            assert set(rows) == {decode_rows, width}  # and the prefill's positions
            rows.clear()
            monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", single_query._sdpa)
            own = engine.generate(prompts, params, seeds)
            monkeypatch.undo()
        assert grouped.response_mask.all()  # no row stopped: every step decoded every row
        assert torch.equal(grouped.response_ids, own.response_ids)
        assert torch.equal(grouped.rollout_logprobs, own.rollout_logprobs)
        assert torch.equal(grouped.topk_logprobs, own.topk_logprobs)


def test_sample_tail_draws_from_the_renormalised_tail_and_records_the_unconditional_log_probs():
    mu = torch.tensor([[0.4, 0.1, 0.2, 0.0, 0.3]])
    logp, head = mu.log(), torch.tensor([[0]])
    gens = [torch.Generator().manual_seed(i) for i in range(3000)]
    draws = [sample_tail(logp, head, 2, [g]) for g in gens]
    ids = torch.cat([d[0] for d in draws]).flatten()
    lps = torch.cat([d[1] for d in draws]).flatten()
    freq = torch.bincount(ids, minlength=5).double() / len(ids)
    assert freq[0] == 0 and freq[3] == 0  # the head and a zero-probability token are never drawn
    assert torch.allclose(freq, torch.tensor([0.0, 1 / 6, 1 / 3, 0.0, 0.5], dtype=torch.float64), atol=0.03)
    assert torch.equal(lps, mu.log()[0][ids])  # log μ_u, not the renormalised log μ_tail(u)
    # a tail with no mass (the support inside the head): the first head id, log-prob -inf
    ids, lps = sample_tail(torch.tensor([[0.5, 0.5, 0.0]]).log(), torch.tensor([[1, 0]]), 3, [gens[0]])
    assert ids.tolist() == [[1, 1, 1]] and torch.isneginf(lps).all()
    with pytest.raises(ValueError, match="tail samples m must be >= 1"):
        sample_tail(logp, head, 0, [gens[0]])


def test_tail_samples_come_from_the_tail_on_their_own_stream(tiny):
    """``sampling.logprobs_tail_samples`` (score centering's sampled tail): m ids per position after the top-k,
    outside the top-k and inside the sampler's support, with the sampler's own log-probs; the sampled tokens, their
    log-probs and the top-k are those of a run without them (another stream), and the draws are reproducible."""
    model, tok = tiny
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts, seeds = chat_prompts(tok, QUESTIONS), [11, 12, 13, 14]
    engine = make_engine(model, tok, logit_noise=0.5)
    base = SamplingConfig(max_new_tokens=6, top_k=50, logprobs_top_k=8)
    plain = engine.generate(prompts, base, seeds)
    tail = engine.generate(prompts, SamplingConfig(**{**vars(base), "logprobs_tail_samples": 3}), seeds)
    again = engine.generate(prompts, SamplingConfig(**{**vars(base), "logprobs_tail_samples": 3}), seeds)
    full = engine.generate(prompts, SamplingConfig(**{**vars(base), "logprobs_top_k": vocab}), seeds)
    for name in ("response_ids", "rollout_logprobs", "response_mask"):
        assert torch.equal(getattr(plain, name), getattr(tail, name)), name
    assert tail.topk_ids.shape[-1] == 11
    assert torch.equal(tail.topk_ids[..., :8], plain.topk_ids) and torch.equal(
        tail.topk_logprobs[..., :8], plain.topk_logprobs
    )
    assert torch.equal(tail.topk_ids, again.topk_ids) and torch.equal(tail.topk_logprobs, again.topk_logprobs)
    m = tail.response_mask
    ids, lps = tail.topk_ids[..., 8:][m], tail.topk_logprobs[..., 8:][m]  # [tokens, 3]
    head = tail.topk_ids[..., :8][m]
    assert not (ids[:, :, None] == head[:, None, :]).any()  # never a head token
    dense = torch.full((*full.topk_ids.shape[:2], vocab), float("-inf")).scatter(-1, full.topk_ids, full.topk_logprobs)
    assert torch.isfinite(lps).all()  # 50 tokens in the support, 8 in the head: the tail is never empty here
    assert torch.equal(lps, dense[m].gather(-1, ids))  # the sampler's log μ_u at the drawn ids
    assert len(set(ids.flatten().tolist())) > 10  # draws spread over the tail (42 tokens), not one id
    other = engine.generate(
        prompts, SamplingConfig(**{**vars(base), "logprobs_tail_samples": 3}), [s + 100 for s in seeds]
    )
    assert not torch.equal(other.topk_ids[..., 8:], tail.topk_ids[..., 8:])
    # the support inside the head (top_k = 5 < 8): no tail, every sample recorded with log-prob -inf
    empty = engine.generate(
        prompts, SamplingConfig(max_new_tokens=4, top_k=5, logprobs_top_k=8, logprobs_tail_samples=2), seeds
    )
    assert torch.isneginf(empty.topk_logprobs[..., 8:][empty.response_mask]).all()
