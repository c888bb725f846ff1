"""lit_rl's sampling kernel (``kernels.sampling``, ``engine.fused_sampler``): each row's next token by inverse CDF
of softmax(logits / T) and its log-prob in one call. Its draws are the distribution's (every token's share of a
grid of uniforms is its probability), its log-probs are float64 ``log_softmax``'s within a few ulp (closer than
torch's float32 one), its token is the float64 inverse CDF's, and the engine uses it only where it may (plain
sampling, not under batch-invariant kernels)."""

import pytest
import torch
from helpers import chat_prompts

from lit_rl.kernels import decode_attention, kernel_mode, sampling
from lit_rl.logprobs import process_logits
from lit_rl.rollout.torch_engine import TorchEngine, row_uniforms, sample_rows
from lit_rl.rollout.types import SamplingConfig

# skipped only without a C++ toolchain: a build that fails where one is present fails these tests (sample raises)
pytestmark = pytest.mark.skipif(bool(decode_attention.toolchain_missing()), reason="no C++ toolchain")

NEG_INF = float("-inf")


def reference_ids(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float):
    """The float64 inverse CDF of softmax(float32(logits) / T): (ids, each target's distance to the nearest CDF step
    relative to the total)."""
    x = logits.float() / temperature if temperature != 1.0 else logits.float()
    p = torch.softmax(x.double(), -1)
    cdf = p.cumsum(-1)
    target = uniforms.double() * cdf[:, -1]
    ids = torch.searchsorted(cdf, target[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    gap = (cdf - target[:, None]).abs().min(-1).values / cdf[:, -1]
    return ids, gap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab", [1000, 49157])  # a multiple of neither the vector width nor the 256-entry block
def test_token_is_the_inverse_cdf_and_its_logprob_is_log_softmax(dtype, temperature, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(48, vocab, generator=gen) * 3).to(dtype)
    uniforms = torch.rand(48, generator=gen)
    ids, logprobs = sampling.sample(logits, uniforms, temperature)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32 and ids.shape == logprobs.shape == (48,)
    want, gap = reference_ids(logits, uniforms, temperature)
    clear = gap > 1e-5  # a target within rounding of a step may fall on either side
    assert int(clear.sum()) >= 40 and torch.equal(ids[clear], want[clear])
    x = logits.float() / temperature if temperature != 1.0 else logits.float()
    truth = torch.log_softmax(x.double(), -1).gather(-1, ids[:, None]).squeeze(-1)
    assert (logprobs.double() - truth).abs().max() <= 2e-6  # a few ulp of log-probs down to about -20
    torch_float32 = process_logits(logits, temperature).gather(-1, ids[:, None]).squeeze(-1)
    assert (torch_float32.double() - truth).abs().max() <= 1e-5  # torch's own log_softmax: no closer


def test_every_token_takes_its_probability_of_a_grid_of_uniforms():
    """The exact expectation over u: N uniforms (k + 1/2) / N through the kernel give token v a share within 1/N of
    softmax's p_v; a token of probability 0 (logit −inf) is never drawn."""
    logits = torch.tensor([NEG_INF, 2.0, -1.0, 0.5, NEG_INF, 3.0, -4.0, NEG_INF])
    n = 4096
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()
    for temperature in (1.0, 1.7):
        ids, logprobs = sampling.sample(logits.expand(n, -1), uniforms, temperature)
        share = torch.bincount(ids, minlength=8).double() / n
        p = torch.softmax(logits.double() / temperature, -1)
        assert (share - p).abs().max() <= 1.0 / n + 1e-9
        assert share[[0, 4, 7]].sum() == 0
        assert torch.allclose(logprobs.double(), p.log()[ids], atol=2e-6)


def test_the_ends_of_u_draw_the_first_and_last_tokens_with_probability():
    logits = torch.tensor([[NEG_INF, NEG_INF, 1.0, 0.0, 2.0, NEG_INF]] * 2)
    ids, logprobs = sampling.sample(logits, torch.tensor([0.0, 1.0 - 2**-24]), 1.0)
    assert ids.tolist() == [2, 4]
    assert torch.isfinite(logprobs).all()


def test_same_uniforms_as_torchs_sampler_same_tokens():
    """``row_uniforms`` gives both samplers the same draws: they pick the same tokens unless a draw falls within
    rounding of a boundary (none does on these peaked rows)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4096, generator=gen) * 6
    seeds = range(64)
    ref = sample_rows(process_logits(logits, 1.0), [torch.Generator().manual_seed(s) for s in seeds])
    ids, _ = sampling.sample(logits, row_uniforms([torch.Generator().manual_seed(s) for s in seeds]), 1.0)
    assert torch.equal(ids, ref)


@pytest.mark.parametrize("vocab", [3, 40])  # +inf in the scalar tail (fewer entries than a vector) or a vector
def test_a_row_with_nan_inf_or_no_finite_logit_is_refused_by_row(vocab):
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(3, vocab)
        logits[1, vocab - 2] = bad
        with pytest.raises(ValueError, match=r"logits row 1 has a NaN or \+inf, or no finite entry"):
            sampling.sample(logits, torch.full((3,), 0.5), 1.0)
    logits = torch.zeros(3, vocab)
    logits[1] = NEG_INF
    with pytest.raises(ValueError, match="logits row 1 .* no finite entry"):
        sampling.sample(logits, torch.zeros(3), 1.0)
    big = torch.zeros(2, vocab, dtype=torch.bfloat16)
    big[0, 1] = 3e38  # finite in bf16, +inf once divided by T = 0.5
    with pytest.raises(ValueError, match="logits row 0"):
        sampling.sample(big, torch.zeros(2), 0.5)
    strided = torch.randn(4, 2 * vocab)[:, ::2]  # not one entry after another: copied, the same draw
    assert torch.equal(sampling.sample(strided, torch.full((4,), 0.3), 1.0)[0],
                       sampling.sample(strided.contiguous(), torch.full((4,), 0.3), 1.0)[0])  # fmt: skip
    with pytest.raises(RuntimeError, match="uniforms must be float32"):
        sampling.sample(torch.zeros(3, 40), torch.zeros(2), 1.0)


def rollouts(engine, prompts, fused, **sampling_options):
    engine.fused_sampler = fused
    params = SamplingConfig(temperature=1.0, max_new_tokens=8, **sampling_options)
    return engine.generate(prompts, params, seeds=list(range(len(prompts))))


def test_engine_samples_through_the_kernel_with_torchs_draws(tiny, capsys):
    model, tok = tiny
    prompts = chat_prompts(tok, ["What is 1 + 2?", "Hi", "Add 3 and 9."]) * 2
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id])
    calls = []
    real = sampling.sample
    try:
        sampling.sample = lambda *a: calls.append(1) or real(*a)
        on, off = rollouts(engine, prompts, "auto"), rollouts(engine, prompts, False)
        assert len(calls) == 8  # one call a decode step, all 6 rows at once
        assert "engine.fused_sampler=auto: on" in capsys.readouterr().out
        calls.clear()
        rollouts(engine, prompts, "auto", logprobs_top_k=2)  # needs every log-prob: torch's calls
        rollouts(engine, prompts, "auto", top_p=0.9)
        rollouts(engine, prompts, "auto", top_p=0.9)
        with kernel_mode("batch_invariant", model):
            rollouts(engine, prompts, True)
        assert calls == []
        out = capsys.readouterr().out
        assert out.count("torch's sampling calls for rollouts with top-p (they need every log-prob)") == 1
        assert "torch's sampling calls for rollouts with recorded top-k log-probs or tail samples" in out
    finally:
        sampling.sample = real
    assert torch.equal(on.response_ids, off.response_ids)
    assert torch.allclose(on.rollout_logprobs, off.rollout_logprobs, rtol=2e-6, atol=1e-6)


def test_engine_refuses_another_fused_sampler_value(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="engine.fused_sampler must be auto, true or false, got 'yes'"):
        TorchEngine(model, tok.pad_token_id, [], fused_sampler="yes")


def test_nan_logits_in_a_rollout_fall_back_to_torchs_calls_on_the_same_draws(tiny):
    """A NaN logit (a diverged model) does not stop the rollout: that step runs torch's calls with the uniforms the
    kernel was given, as a run without the kernel would (its NaN log-prob then makes a non-finite loss, whose update
    is skipped and counted)."""
    model, tok = tiny
    prompts = chat_prompts(tok, ["What is 1 + 2?", "Hi"])
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id])
    handle = model.lm_head.register_forward_hook(lambda m, i, out: out.index_fill(-1, torch.tensor([7]), float("nan")))
    try:
        on, off = rollouts(engine, prompts, "auto"), rollouts(engine, prompts, False)
    finally:
        handle.remove()
    assert torch.equal(on.response_ids, off.response_ids)
    assert torch.isnan(on.rollout_logprobs[on.response_mask]).all()
