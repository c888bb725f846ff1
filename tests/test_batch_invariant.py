"""Batch-invariant kernels (``kernels=batch_invariant``): each kernel's f(x[:m]) == f(x)[:m], and the engine's
rollout_logprobs == the trainer's old_logprobs bit for bit (torch.equal, never allclose)."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, compose_config
from torch.utils._python_dispatch import TorchDispatchMode

from lit_rl.config import ConfigError, validate
from lit_rl.kernels import KERNELS, BatchInvariantMode, kernel_mode
from lit_rl.kernels import batch_invariant as bi
from lit_rl.logprobs import position_ids_from_mask, response_logprobs
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.rollout.types import SamplingConfig, left_pad
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars

MS = list(range(1, 34)) + [47, 64, 100, 255, 256, 257, 500]
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def autocast(precision):
    """The trainer's precision: float32 (32-true) or bf16 autocast (bf16-mixed, float32 weights)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16")


# -- property tests: f(x[:m]) == f(x)[:m] for each kernel -----------------------------------------------
# Every test of this file runs at the suite's thread count (helpers.THREADS, torch's default here), set by
# conftest before each test; the tests marked with ``threads`` run at several counts.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (64, 32)])
def test_mm_rows_do_not_depend_on_how_many_rows_share_the_call(dtype, k, n):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(600, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    full, full_b = bi.mm(x, w.t()), bi.addmm(bias, x, w.t())
    for m in MS:
        assert torch.equal(bi.mm(x[:m].clone(), w.t()), full[:m]), m
        assert torch.equal(bi.addmm(bias, x[:m].clone(), w.t()), full_b[:m]), m
        s = (600 - m) // 2  # a block from the middle, not only prefixes
        assert torch.equal(bi.mm(x[s : s + m].clone(), w.t()), full[s : s + m]), m
    assert torch.allclose(full.float(), (x.float() @ w.float().t()), rtol=2e-2, atol=2e-1)


def test_linear_under_the_mode_is_batch_invariant_in_float32_where_the_default_is_not():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 576, generator=g), torch.randn(1536, 576, generator=g)
    default_full = F.linear(x, w)
    assert any(not torch.equal(F.linear(x[:m].clone(), w), default_full[:m]) for m in (1, 2, 3, 5, 7, 9))
    with BatchInvariantMode():
        full = F.linear(x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full_bf16 = F.linear(x, w)
        for m in MS[:40]:
            assert torch.equal(F.linear(x[:m].clone(), w), full[:m]), m
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(F.linear(x[:m].clone(), w), full_bf16[:m]), m
    assert torch.equal(F.linear(x, w), default_full)  # disabled: the native kernel again


class _Ops(TorchDispatchMode):
    """The aten ops a region dispatches (names only)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_linear_that_torch_computes_with_bmm_gets_the_trainer_s_bits(dtype):
    """The bug behind ``rollout.mode=async``'s nonzero gap on an AVX2-only EPYC: the engine's own (frozen) copy
    scored a prefill's last position, a strided [B, 1, K] slice, and ``torch.matmul`` computed that linear
    layer as ``aten::bmm`` against the expanded weight (it folds rows into one ``aten::mm`` only when the
    weight requires grad or the fold is a view), outside the mode's kernels. Under the mode both routes give
    the rows' bits of one ``mm`` of all rows: the trainable layer (mm), the frozen one (bmm), any batch."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 49, 64, generator=g).to(dtype)
    trainable = torch.nn.Linear(64, 4000, bias=False).to(dtype)
    frozen = torch.nn.Linear(64, 4000, bias=False).to(dtype).requires_grad_(False)
    with torch.no_grad():
        frozen.weight.copy_(trainable.weight)
    last = hidden[:, -1:, :]  # [3, 1, 64], strides (3136, 64, 1): not foldable into [3, 64] as a view
    with BatchInvariantMode(), torch.no_grad():
        with _Ops() as ops:
            got = frozen(last)
        assert "aten.bmm.default" in ops.names  # the route this test is about (torch's matmul rule)
        with _Ops() as ops:
            want = trainable(last)
        assert "aten.mm.default" in ops.names
        assert torch.equal(got, want)
        assert torch.equal(frozen(hidden[1:2, -1:, :]), want[1:2])  # alone: the same bits
        rows = hidden.reshape(-1, 64)[[48, 97, 146]]  # the same three rows, contiguous, among 64 rows of a call
        assert torch.equal(bi.mm(rows, frozen.weight.t()), want[:, 0])
        batched = torch.randn(3, 4, 5, generator=g).to(dtype)  # a real batch keeps the native kernel
        other = torch.randn(3, 5, 6, generator=g).to(dtype)
        native = torch.ops.aten.bmm.out(batched, other, out=batched.new_empty(3, 4, 6))
        assert torch.equal(torch.bmm(batched, other), native)
        # the attention kernel's own products stay native even as a batch of one (one sequence, one key head,
        # one block of queries): computed as they are among other sequences
        q, k = torch.randn(1, 1, 3, 32, generator=g).to(dtype), torch.randn(1, 1, 3, 32, generator=g).to(dtype)
        blocked = []
        original = bi._blocked_product
        bi._blocked_product = lambda *args, **kw: blocked.append(1) or original(*args, **kw)
        try:
            with _Ops() as ops:
                bi.attention(None, q, k, k.clone(), None, scaling=0.125)
        finally:
            bi._blocked_product = original
        assert "aten.bmm.default" in ops.names and not blocked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_log_softmax_per_row(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 576, generator=g) * 3).to(dtype)
    weight = torch.rand(576, generator=g)
    logits = (torch.randn(300, 4096, generator=g) * 4).to(dtype)
    norm, lsm = bi.rms_norm(x, weight, 1e-5), bi.log_softmax(logits, -1)
    for m in MS[:38]:
        assert torch.equal(bi.rms_norm(x[:m].clone(), weight, 1e-5), norm[:m]), m
        assert torch.equal(bi.log_softmax(logits[:m].clone(), -1), lsm[:m]), m
    # the same numbers as transformers' RMSNorm and torch's log-softmax
    h = x.float()
    ref = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(norm, ref)
    assert torch.allclose(lsm.float(), F.log_softmax(logits.float(), -1), atol=1e-5 if dtype == torch.float32 else 0.2)


def _attention_inputs(lengths, lq_total, h=9, kvh=3, d=64, seed=0):
    """Left-padded q/k/v for sequences of ``lengths`` real tokens in a window of ``lq_total`` positions."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    real = torch.randn(b, h + 2 * kvh, max(lengths), d, generator=g)
    q = torch.zeros(b, h, lq_total, d)
    k = torch.zeros(b, kvh, lq_total, d)
    v = torch.zeros(b, kvh, lq_total, d)
    mask2d = torch.zeros(b, lq_total, dtype=torch.long)
    for i, n in enumerate(lengths):
        q[i, :, -n:] = real[i, :h, :n]
        k[i, :, -n:] = real[i, h : h + kvh, :n]
        v[i, :, -n:] = real[i, h + kvh :, :n]
        mask2d[i, -n:] = 1
    return q, k, v, mask2d


def _causal_padded_mask(mask2d, lq):
    """[B, 1, Lq, Lk] bool: query i (the last lq of Lk positions) sees real keys up to itself."""
    lk = mask2d.shape[1]
    qpos = torch.arange(lk - lq, lk)[:, None]
    return (torch.arange(lk)[None, :] <= qpos)[None, None] & mask2d.bool()[:, None, None, :]


def test_attention_decode_equals_prefill_whatever_the_padding_or_batch():
    """A query's output depends on its own sequence's real keys only: decode (1 query) == prefill row, for
    any amount of left padding, any batch it shares, and any key count beyond a block."""
    lengths = [5, 70, 1, 33, 130, 64]
    q, k, v, mask2d = _attention_inputs(lengths, 140)
    full, _ = bi.attention(None, q, k, v, _causal_padded_mask(mask2d, 140), scaling=0.125)
    for i, n in enumerate(lengths):
        for extra_pad in (0, 3, 77):
            qi, ki, vi, mi = _attention_inputs([n], n + extra_pad)
            qi[0, :, -n:], ki[0, :, -n:], vi[0, :, -n:] = q[i, :, -n:], k[i, :, -n:], v[i, :, -n:]
            alone, _ = bi.attention(None, qi, ki, vi, _causal_padded_mask(mi, n + extra_pad), scaling=0.125)
            assert torch.equal(alone[0, -n:], full[i, -n:]), (n, extra_pad)
            for t in (0, n // 2, n - 1):  # decode: the query at real position t against the cache so far
                lk = extra_pad + t + 1
                dec, _ = bi.attention(
                    None,
                    qi[:, :, lk - 1 : lk],
                    ki[:, :, :lk],
                    vi[:, :, :lk],
                    _causal_padded_mask(mi[:, :lk], 1),
                    scaling=0.125,
                )
                assert torch.equal(dec[0, 0], full[i, 140 - n + t]), (n, extra_pad, t)
    # batch prefixes: f(x[:m]) == f(x)[:m]
    for m in range(1, len(lengths) + 1):
        part, _ = bi.attention(None, q[:m], k[:m], v[:m], _causal_padded_mask(mask2d[:m], 140), scaling=0.125)
        assert torch.equal(part, full[:m])
    # and it is attention: close to torch's SDPA on the real rows
    rep = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=_causal_padded_mask(mask2d, 140), scale=0.125
    ).transpose(1, 2)
    for i, n in enumerate(lengths):
        assert torch.allclose(full[i, -n:], rep[i, -n:], atol=1e-5)


def test_attention_refuses_masks_it_cannot_align():
    q, k, v, mask2d = _attention_inputs([6, 6], 6)
    mask = _causal_padded_mask(mask2d, 6).clone()
    mask[..., 0] = False  # a hole: sliding-window-like, not causal-with-padding
    mask[..., -1, 0] = True
    with pytest.raises(ValueError, match="contiguous range"):
        bi.attention(None, q, k, v, mask, scaling=0.125)


# -- the mode installs and uninstalls cleanly ---------------------------------------------------------------
def test_mode_installs_and_removes_everything(tiny):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    model, _ = tiny
    norm_cls = type(model.model.norm)
    before_forward, before_impl = norm_cls.forward, model.config._attn_implementation
    with kernel_mode("batch_invariant", model) as mode:
        assert mode.enabled and model.config._attn_implementation == "batch_invariant"
        assert "batch_invariant" in AttentionInterface._global_mapping
        assert "batch_invariant" in AttentionMaskInterface._global_mapping
        assert norm_cls.forward is not before_forward
        with pytest.raises(RuntimeError, match="already enabled"):
            BatchInvariantMode(model).enable()
    assert model.config._attn_implementation == before_impl and norm_cls.forward is before_forward
    assert "batch_invariant" not in AttentionInterface._global_mapping
    assert "batch_invariant" not in AttentionMaskInterface._global_mapping
    with kernel_mode("default", model):
        assert model.config._attn_implementation == before_impl
    with pytest.raises(ValueError, match="kernels='fast'"):
        kernel_mode("fast", model)
    assert set(KERNELS) == {"default", "batch_invariant"}


def test_unknown_kernels_value_is_named_before_any_model_loads():
    cfg = compose_config("kernels.name=fast")
    gpu = compose_config("kernels=batch_invariant", "trainer=gpu")
    assert compose_config().kernels.name == "default"
    with pytest.raises(
        ConfigError, match=r"kernels='fast' is not allowed: choose one of \['default', 'batch_invariant'\]"
    ):
        validate(cfg)
    with pytest.raises(ConfigError, match="CPU only"):
        validate(gpu)


# -- engine rollout_logprobs == trainer old_logprobs ------------------------------------------------------
def prompts_of(n, seed=0, vocab=2000):
    """n prompts of 2..40 tokens; every third one repeated (a GRPO group: prefilled once, cache copied)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 41, (n,), generator=g).tolist()
    out = [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths]
    return [out[i - 1] if i % 3 == 2 else p for i, p in enumerate(out)]


def engine_and_trainer_logprobs(model, tok, prompts, precision, micro_batch_sizes, new_tokens=12, seed=0):
    """(rollouts, [trainer log-probs for each micro-batch size]) for the same tokens: the engine samples; the
    trainer scores the left-padded batch (as ``RLModule.build_batch`` pads it) in shuffled micro-batches,
    the first size with autograd on (the update's forward, whose detached log-probs are old_logprobs). Sizes
    0, 2, ... score with ``update.shared_prefix`` (the repeated prompts of a micro-batch encoded once, their
    cache reused), sizes 1, 3, ... with one forward per row: both equal the engine bit for bit."""
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id])
    params = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
    with autocast(precision):
        r = engine.generate(prompts, params, seeds=[seed + i for i in range(len(prompts))])
        pids, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
        scored = []
        for j, mbs in enumerate(micro_batch_sizes):
            order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(j))
            lp = torch.zeros_like(r.rollout_logprobs)
            for s in range(0, len(prompts), mbs):
                rows = order[s : s + mbs]
                with torch.set_grad_enabled(j == 0):
                    out = response_logprobs(
                        model,
                        pids[rows],
                        pmask[rows],
                        r.response_ids[rows],
                        r.response_mask[rows],
                        chunk_tokens=64,
                        shared_prefix=j % 2 == 0,
                    ).logprobs
                lp[rows] = out.detach()
            scored.append(lp)
    return r, scored


def assert_bit_exact(model, tok, precision, n_prompts, micro_batch_sizes):
    prompts = prompts_of(n_prompts, seed=n_prompts)
    with kernel_mode("batch_invariant", model):
        r, scored = engine_and_trainer_logprobs(model, tok, prompts, precision, micro_batch_sizes)
    m = r.response_mask
    assert m.sum() > 0
    for lp in scored:
        assert torch.equal(lp[m], r.rollout_logprobs[m])


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("n_prompts,micro_batch_sizes", [(1, [1]), (7, [7, 3, 1]), (64, [16, 5, 64])])
def test_tiny_rollout_logprobs_equal_trainer_bit_for_bit(tiny, precision, n_prompts, micro_batch_sizes):
    model, tok = tiny
    assert_bit_exact(model, tok, precision, n_prompts, micro_batch_sizes)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_tiny_default_kernels_show_a_gap(tiny, precision):
    """The same comparison without the mode: a nonzero gap (so the test above can fail)."""
    model, tok = tiny
    r, (lp,) = engine_and_trainer_logprobs(model, tok, prompts_of(64, seed=64), precision, [16])
    m = r.response_mask
    assert not torch.equal(lp[m], r.rollout_logprobs[m])
    assert (lp[m] - r.rollout_logprobs[m]).abs().max() > 0


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_prompt_alone_or_among_63_others_gets_the_same_tokens_and_logprobs(tiny, precision):
    model, tok = tiny
    prompts = prompts_of(64, seed=3)
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id])
    params = SamplingConfig(max_new_tokens=12, temperature=1.0)
    with kernel_mode("batch_invariant", model), autocast(precision):
        batch = engine.generate(prompts, params, seeds=list(range(64)))
        for i in (0, 17, 63):
            alone = engine.generate([prompts[i]], params, seeds=[i])
            w = alone.response_ids.shape[1]
            assert torch.equal(alone.response_ids[0], batch.response_ids[i, :w])
            assert torch.equal(alone.rollout_logprobs[0], batch.rollout_logprobs[i, :w])


def test_mode_keeps_the_model_s_numbers_up_to_rounding(tiny):
    model, tok = tiny
    ids, mask = left_pad(prompts_of(5, seed=9), tok.pad_token_id)
    mask = mask.long()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        with kernel_mode("batch_invariant", model):
            got = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    real = mask.bool()
    assert torch.allclose(got[real], ref[real], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("n_prompts,micro_batch_sizes", [(1, [1]), (7, [7, 2]), (64, [16, 5])])
def test_smollm2_rollout_logprobs_equal_trainer_bit_for_bit(smollm2, precision, n_prompts, micro_batch_sizes):
    model, tok = smollm2
    assert_bit_exact(model, tok, precision, n_prompts, micro_batch_sizes)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_smollm2_default_kernels_show_a_gap(smollm2, precision):
    model, tok = smollm2
    r, (lp,) = engine_and_trainer_logprobs(model, tok, prompts_of(7, seed=7), precision, [7])
    m = r.response_mask
    assert (lp[m] - r.rollout_logprobs[m]).abs().max() > 0


# -- the recipe: 10 steps with kernels=batch_invariant log a zero gap at every step ---------------------
def test_ten_step_run_logs_a_zero_gap_at_every_step(tmp_path):
    overrides = [
        "model=tiny",
        "kernels=batch_invariant",
        "trainer.enable_progress_bar=false",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.micro_batch_size=3",
        "sampling.max_new_tokens=8",
        "eval.num_examples=0",
        "checkpoint.every_n_steps=10",
        "trainer.max_steps=10",
        "algo=reinforce",
        "algo.baseline=none",
        "task.constant_reward=1",
        "optim.lr=1e-3",
    ]  # bf16-mixed (the default precision); updates that move the weights
    cfg = compose_config(*overrides)
    run(cfg, tmp_path / "bi")
    s = read_scalars(tmp_path / "bi")
    gaps = [v for _, v in s["train/logprob_abs_diff"]]
    assert len(gaps) == 10 and all(v == 0.0 for v in gaps), gaps
    assert len({v for _, v in s["train/grad_norm"]}) > 1  # the weights moved between steps
    assert "batch_invariant" not in __import__("transformers").AttentionInterface._global_mapping


# slow, not in the default suite: on an Intel Xeon (AVX-512, AMX; MKL's Intel path natively) run as the first test of
# a process it failed 1 in 3 runs on 2026-12-03, always with train/r_num_abs 5.04e-5 at step 0 and 0 after: the
# first-use race inside MKL's Intel path described above (the producer thread's first attention products). A
# default suite that fails by chance would block every landing; scripts/test.sh -m slow runs it.
@pytest.mark.slow
def test_async_rollouts_keep_a_zero_gap_with_the_producer_at_the_trainer_s_thread_count(tmp_path):
    """``rollout.mode=async``: the rollout producer thread generates while the trainer updates, both under the
    mode and at one thread count (the producer copies the trainer's; ``_check_threads`` would raise at a
    product run at another). The rollouts are stale (older weights), yet the gap between the engine's
    logprobs and the trainer's under the same weights (``train/r_num_abs``) is exactly 0 at every step."""
    overrides = [
        "model=tiny",
        "kernels=batch_invariant",
        "trainer.enable_progress_bar=false",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "sampling.max_new_tokens=8",
        "eval.num_examples=0",
        "checkpoint.every_n_steps=10",
        "trainer.max_steps=4",
        "algo=reinforce",
        "algo.baseline=none",
        "task.constant_reward=1",
        "optim.lr=1e-3",
        "rollout.mode=async",
        "rollout.max_staleness=1",
    ]
    run(compose_config(*overrides), tmp_path / "async")
    s = read_scalars(tmp_path / "async")
    r_num = [v for _, v in s["train/r_num_abs"]]
    assert len(r_num) == 4 and all(v == 0.0 for v in r_num), r_num
    assert max(v for _, v in s["rollout/staleness_max"]) > 0  # the producer ran ahead of the trainer
    assert "batch_invariant" not in __import__("transformers").AttentionInterface._global_mapping


# -- other CPUs' kernel paths: the report came from an Intel Xeon without AVX512-BF16 --------------------------
INTEL_CPU_SHIM = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
PATH_TESTS = "mm_rows or linear_under or attention_decode or rms_norm"


def intel_mkl_preload(folder):
    """A preload library telling MKL it runs on an Intel CPU, or None without a C compiler. MKL takes its
    AVX-512 GEMM paths on Intel CPUs only; torch's wheel links MKL into libtorch_cpu.so and calls this check
    through the PLT, so the preload reaches MKL's Intel path on an AMD CPU (on an Intel CPU it changes
    nothing)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    (folder / "intel_cpu.c").write_text(INTEL_CPU_SHIM)
    lib = folder / "libintel_cpu.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(folder / "intel_cpu.c")], check=True)
    return lib


# slow, not in the default suite: under this emulation early attention calls of a process sometimes give other
# values (2 of 9 test runs earlier; 1 of 97 processes with the preload and 0 of 14 without it on 2026-11-30; with
# MKL_DYNAMIC=FALSE too). The caught case differed by up to 5e-4 in two value products of one sequence, far above
# rounding: a first-use race inside MKL's Intel path, not a shape effect (docs/kernels.md). A default suite that
# fails by chance would block every landing; scripts/test.sh -m slow runs it.
@pytest.mark.slow
@pytest.mark.parametrize("threads", [2, 3])
def test_kernels_hold_on_the_cpu_paths_of_an_intel_xeon_without_avx512_bf16(tmp_path, threads):
    """The kernel property tests above, in a child process on the paths the report's CPU takes: MKL's Intel
    path (preloaded, see ``intel_mkl_preload``) and oneDNN's bf16 kernels capped at AVX512_CORE (no AVX512-BF16:
    bf16 products emulated in float32). There, with the first version's kernels (one padded call below 16
    rows, one native call above), 2 threads gave other bits for 64-128-row float32 products with K=1536 (MKL
    split the sum over K between the threads) and for bf16 products of odd row counts, and the attention
    differed between a batch and a sequence alone."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE", LIT_RL_TEST_THREADS=str(threads))
    lib = intel_mkl_preload(tmp_path)
    if lib is not None:
        env["LD_PRELOAD"] = f"{lib} {env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(lib)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", PATH_TESTS],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-4000:]
    assert " passed" in res.stdout and " failed" not in res.stdout
