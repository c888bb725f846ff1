"""Batch-invariant CPU kernels: a token's numbers do not depend on which rows share its forward pass.

Why: the rollout engine decodes one token per sequence among whichever sequences are still running, the
trainer scores whole sequences in micro-batches of its own choosing. Floating-point addition is not
associative (SPEC.md test vector 12), and a kernel whose reduction order depends on the shape of the call
gives the same token a slightly different log-prob in each. With the kernels below, every reduction that
produces a token's log-prob runs in an order fixed by that token's own sequence, so the engine's
``rollout_logprobs`` equal the trainer's ``old_logprobs`` bit for bit before the first update
(``tests/test_batch_invariant.py``). Sources: Thinking Machines, "Defeating Nondeterminism in LLM
Inference" (2025) and its ``batch_invariant_ops`` (GEMM with a fixed tiling, RMSNorm and log-softmax per
row, attention with a fixed split over keys); the seeds in ``../shared/seeds/`` (the slides' table of
batch-variant ops, the article's "bitwise consistency" section on vLLM's batch-invariant mode).

What each kernel fixes (measured with torch 2.13, MKL and oneDNN, SmolLM2-135M shapes):

* **matrix products** (``aten::mm``, ``aten::addmm`` and ``aten::bmm`` of a batch against one broadcast
  matrix, how ``torch.matmul`` computes a frozen linear layer whose input it cannot fold: ``bmm``) for the
  CPU dispatch key: every float product of a forward pass runs as native calls of one shape per weight
  matrix, [``GEMM_ROWS``, K] x [K, N] (rows in blocks, the last one zero-padded), at one thread count for
  the whole run. A BLAS library chooses its
  kernel, its split of the work over threads and whether it splits the sum over K from the call's shape
  and the thread count, so the same row can get other bits in a call of another size: on this AMD EPYC
  (MKL's AMD path, AVX512-BF16) products of 1-11 rows differed from larger ones; on the path of an Intel
  Xeon without AVX512-BF16 (reproduced here by telling MKL it runs on an Intel CPU and capping oneDNN at
  AVX512_CORE) 2 threads split the sum over K=1536 for 64-128-row products, and bf16 products of odd row
  counts took other tail kernels. With one shape and one thread count a run's calls are all computed the
  same way, whatever the CPU. The thread count is recorded when the mode is enabled and a product at
  another count raises (``_check_threads``); the start-up message says so.
* **RMSNorm**: each row's mean of squares is a float32 reduction over that row alone (never split across
  rows or threads; a single row is computed inside a block of two). Installed on the model's norm classes,
  so a fused kernel that a transformers version may swap in never replaces it. Two formulas are covered:
  Llama's (``weight * normed``, cast first: Llama, Qwen2/3 and their q/k norms, Mistral, Phi-3) and Gemma's
  (``(1 + weight) * normed`` in float32, cast last: Gemma, Gemma-2, Gemma-3). Each norm class of a model is
  matched to its formula by running its own ``forward`` on a probe input (``norm_kernels``); a norm class that
  matches neither (a LayerNorm, a new formula) is refused when the mode is enabled, naming the class, rather
  than left on a batch-variant kernel.
* **log-softmax** (``aten::_log_softmax``, CPU): a contiguous [rows, V] layout, reduced per row (a lone row
  padded to two), whatever view the caller passes.
* **attention** (``attention`` + ``attention_mask``, registered in transformers' ``AttentionInterface`` and
  ``AttentionMaskInterface`` as ``"batch_invariant"``): one function for the trainer's full-sequence
  forward, the engine's prefill and its one-token decode. Keys and values are re-laid out so that each
  sequence's first real token sits at index 0 (left padding removed), cut into blocks of ``KEY_BLOCK``
  keys; the query rows of a key head are cut into blocks of ``QUERY_ROWS``, so every score product is
  one float32 [QUERY_ROWS, d] x [d, KEY_BLOCK] matrix of a batched call and every value product one
  [QUERY_ROWS, KEY_BLOCK] x [KEY_BLOCK, d]; softmax uses the exact row maximum, and the value sums are
  accumulated block after block in key order. A query's numbers are therefore a function of its own sequence's real
  keys only: the amount of left padding, the keys after it (masked to exact zeros) and the other queries
  of the call cannot change them. Gemma-2's attention-logit soft-capping (``softcap``) is applied to the
  scores as transformers' eager attention does. Sliding-window layers (Mistral, Gemma-2/3) are served only
  while every sequence fits the window (the mask is then plain causal); a window that cuts a sequence is
  refused: at start-up by ``check_sliding_window`` (the run's longest prompt plus its new tokens), and by
  ``attention`` itself if a mask ever is not causal-with-padding.

Sampling is already per sequence (``rollout.torch_engine.sample_rows``: one seeded generator per row).

CUDA is not covered here: on GPUs the same guarantees need GPU kernels — Thinking Machines'
``batch_invariant_ops`` (``set_batch_invariant_mode()``: Triton GEMM with a fixed tiling, log-softmax and
mean per row) for the trainer and vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) for a vLLM
sampler. ``enable`` raises for a model on any device other than the CPU rather than pretend.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings

import torch
from torch import Tensor

NAME = "batch_invariant"
#: every float matrix product of a forward pass runs as [GEMM_ROWS, K] x [K, N] calls: rows in blocks of this
#: many (the last one zero-padded), whatever M is. 64: the engine's decode of a GRPO step (P x G = 64 rows)
#: is one call, the update's 1600-row products 25 (16 cost 1.5x the default kernels on a whole step here, 64 1.3x)
GEMM_ROWS = 64
#: keys per attention block (the fixed split over keys; the N of every score product)
KEY_BLOCK = 64
#: query rows per attention product: every score product is [QUERY_ROWS, d] x [d, KEY_BLOCK] and every value
#: product [QUERY_ROWS, KEY_BLOCK] x [KEY_BLOCK, d] (a decode step's 3 query heads per key head: one block)
QUERY_ROWS = 16


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def _in_backward() -> bool:
    """True while autograd runs a backward function (the mode leaves the backward pass to torch's kernels)."""
    return torch._C._current_autograd_node() is not None


def _row_blocks(a: Tensor, rows: int) -> Tensor:
    """``a`` [M, K] as a contiguous, 64-byte aligned [ceil(M / rows) * rows, K] buffer (zero rows appended)."""
    m = a.shape[0]
    total = -(-m // rows) * rows
    if total == m and a.is_contiguous() and a.data_ptr() % 64 == 0:
        return a
    out = a.new_zeros((total, a.shape[1]))
    out[:m] = a
    return out


# -- the thread count the mode runs at --------------------------------------------------------------------
_threads: list[int] = []  # the torch thread count recorded by BatchInvariantMode.enable (empty: not enabled)
_native_bf16: list[bool] = []  # native_bf16(), read at import and by BatchInvariantMode.enable


def _check_threads() -> None:
    """RuntimeError when the calling thread's torch thread count differs from the one the mode was enabled at.

    A BLAS library splits a call's work over its threads by the call's shape *and the thread count*; the mode
    fixes the shapes, so the thread count must stay fixed too, for the engine's calls and the trainer's alike
    (an async rollout producer copies the trainer's count)."""
    if _threads and torch.get_num_threads() != _threads[0]:
        raise RuntimeError(
            f"kernels=batch_invariant was enabled at {_threads[0]} torch threads and a product now "
            f"runs at {torch.get_num_threads()}: the bits of a product depend on the thread count, "
            f"so the mode needs one count for the whole run (the config's `threads`)"
        )


# -- matrix products ---------------------------------------------------------------------------------
#: oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA``) that keep its native bf16 dot products (AVX512-BF16, AMX)
_NATIVE_BF16_ISAS = {
    "ALL",
    "AVX512_CORE_BF16",
    "AVX512_CORE_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
}


def native_bf16() -> bool:
    """Whether oneDNN computes bf16 products with the CPU's own bf16 dot products (AVX512-BF16 or AMX) and not
    with its float32 emulation (AVX-512 without BF16: an Intel Xeon before Cooper Lake, or
    ``ONEDNN_MAX_CPU_ISA`` capped below AVX512_CORE_BF16). The emulation's rows depend on their position in
    the call at thread counts that do not divide its work evenly (3, 5 and 6 threads, measured here with
    the cap), so the mode computes bf16 products in float32 there (``_blocked_product``)."""
    if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap is None or cap.strip().upper() in _NATIVE_BF16_ISAS


_native_bf16[:] = [native_bf16()]


def _blocked_product(a: Tensor, b: Tensor, bias: Tensor | None = None, beta=1, alpha=1) -> Tensor:
    """``a @ b`` (or ``beta * bias + alpha * a @ b``) as native calls of one shape per ``b``: the rows of ``a``
    in blocks of ``GEMM_ROWS`` (the last one zero-padded), each block one [GEMM_ROWS, K] x [K, N] call into a
    64-byte aligned slice of the output."""
    _check_threads()
    if a.dtype == torch.bfloat16 and not _native_bf16[0]:  # bf16 values are exact in float32; MKL's float32
        # products have no position dependence; the result is rounded to bf16 as oneDNN rounds its own
        return _blocked_product(a.float(), b.float(), None if bias is None else bias.float(), beta, alpha).to(
            torch.bfloat16
        )
    m, n = a.shape[0], b.shape[1]
    padded = _row_blocks(a, GEMM_ROWS)
    per_row = bias is not None and bias.dim() == 2 and bias.shape[0] == m and m > 1
    if per_row:  # a per-row bias is cut into the same blocks
        bias = _row_blocks(bias.expand(m, n), GEMM_ROWS)
    out = a.new_empty((padded.shape[0], n))
    for r0 in range(0, padded.shape[0], GEMM_ROWS):
        r1 = r0 + GEMM_ROWS
        if bias is None:
            torch.ops.aten.mm.out(padded[r0:r1], b, out=out[r0:r1])
        else:
            torch.ops.aten.addmm.out(
                bias[r0:r1] if per_row else bias, padded[r0:r1], b, beta=beta, alpha=alpha, out=out[r0:r1]
            )
    return out if out.shape[0] == m else out[:m]


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for a [M, K] and b [K, N] (any float dtype) whose rows depend only on their own values,
    whatever M is, at the thread count the mode was enabled at.

    The rows of ``a`` are cut into blocks of ``GEMM_ROWS`` (the last one zero-padded) and each block is one
    native ``aten::mm.out`` call of shape [GEMM_ROWS, K] x [K, N]. A BLAS library picks its kernel, its split
    of the work over threads and whether it splits the sum over K from the call's shape and the thread
    count: measured on MKL's Intel path (MKL told it runs on an Intel CPU with AVX-512, 2 threads), one call
    of 64-128 rows with K=1536 split the sum over K and gave every row other bits than a 16-row or a
    256-row call; oneDNN's bf16 kernels without AVX512-BF16 did the same for odd M. With one shape per weight
    matrix and one thread count (``_check_threads``) every call of a run is computed the same way, so a
    row's bits cannot depend on the rows beside it. Integer dtypes, M = 0 and the backward pass
    (``_in_backward``) use the native kernel. Returns [M, N] in the inputs' dtype.
    """
    m = a.shape[0]
    if not a.is_floating_point() or m == 0 or _in_backward():
        out = a.new_empty((m, b.shape[1]))
        return torch.ops.aten.mm.out(a, b, out=out)
    return _blocked_product(a, b)


def addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    """``beta * bias + alpha * (a @ b)`` with ``mm``'s row guarantee (bias [N], [1, N] or [M, N])."""
    m = a.shape[0]
    if not a.is_floating_point() or m == 0 or _in_backward():
        out = a.new_empty((m, b.shape[1]))
        return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)
    return _blocked_product(a, b, bias, beta, alpha)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for a [B, M, K] and b [B, K, N]: where ``b`` is one [K, N] matrix broadcast over the batch
    (stride 0 on its batch axis, or B = 1), the B·M rows of ``a`` go through ``mm``'s blocked product, so each row gets
    the bits it gets there; any other batch uses the native kernel. Returns [B, M, N] in the inputs' dtype.

    Why: ``torch.matmul`` computes a linear layer of a [B, M, K] input as one ``aten::mm`` of the rows folded to
    [B·M, K] when the weight requires grad or the fold is a view, and otherwise as ``aten::bmm`` against the
    weight expanded over the batch. A frozen copy of the policy (the async rollout engine's own copy, the KL
    reference) scoring the last position of a prefill (a strided [B, 1, K] slice) took that second route and
    missed the mode's ``mm``: on an AVX2-only AMD EPYC its log-probs then differed from the trainer's in the
    last bit (``rollout.mode=async`` logged ``train/r_num_abs`` 6e-8; on an AVX512 EPYC the bits happened to
    agree). The attention kernel's own batched products ([QUERY_ROWS, d] x [d, KEY_BLOCK] and the value
    products, whatever their batch) always keep the native kernel (``_keeps_native_bmm``)."""
    one_matrix = b.shape[0] == 1 or b.stride(0) == 0  # a batch of 1 is one product too
    if a.is_floating_point() and a.dim() == 3 and b.dim() == 3 and one_matrix and a.numel() and b.numel():
        if not _in_backward() and not getattr(_native_bmm, "depth", 0):
            rows = a.reshape(a.shape[0] * a.shape[1], a.shape[2])
            return _blocked_product(rows, b[0]).view(a.shape[0], a.shape[1], b.shape[2])
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    return torch.ops.aten.bmm.out(a, b, out=out)


_native_bmm = threading.local()  # depth > 0: this thread is inside ``attention``, whose bmm calls stay native


def _keeps_native_bmm(fn):
    """``fn`` with every ``aten::bmm`` it calls on the native kernel (per thread): the attention kernel fixes its
    own product shapes, and a batch of one sequence's single block must be computed as in a larger batch."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _native_bmm.depth = getattr(_native_bmm, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _native_bmm.depth -= 1

    return wrapper


# -- row reductions ----------------------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm, row by row: ``weight * (x / sqrt(mean(x**2, -1) + eps)).to(x.dtype)``.

    x: [..., H] any float dtype; weight: [H]; returns x's shape, in the dtype of ``weight * x`` (as
    transformers' ``LlamaRMSNorm``). The mean of squares is a float32 reduction over each row's own H
    values on a contiguous [rows, H] layout; a single row is reduced inside a block of two, so torch never
    splits one row's sum across threads.
    """
    dtype = x.dtype
    h = x.to(torch.float32)
    rows = h.reshape(-1, h.shape[-1]).contiguous()
    n = rows.shape[0]
    if n == 1:
        rows = _pad_rows(rows, 2)
    variance = rows.pow(2).mean(-1, keepdim=True)[:n].reshape(*h.shape[:-1], 1)
    return weight * (h * torch.rsqrt(variance + eps)).to(dtype)


def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMSNorm, row by row: ``(x_f32 / sqrt(mean(x_f32**2, -1) + eps) * (1 + weight_f32)).to(x.dtype)``.

    x: [..., H] any float dtype; weight: [H] (stored as the offset from 1, as transformers' ``GemmaRMSNorm``,
    ``Gemma2RMSNorm``, ``Gemma3RMSNorm``); returns x's shape and dtype. The reduction is ``rms_norm``'s: float32
    over each row's own H values, a single row inside a block of two.
    """
    h = x.to(torch.float32)
    rows = h.reshape(-1, h.shape[-1]).contiguous()
    n = rows.shape[0]
    if n == 1:
        rows = _pad_rows(rows, 2)
    variance = rows.pow(2).mean(-1, keepdim=True)[:n].reshape(*h.shape[:-1], 1)
    return (h * torch.rsqrt(variance + eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The gated RMSNorm of Gated DeltaNet layers (transformers' ``Qwen3_5RMSNormGated``, Qwen3-Next's), row by
    row: ``(rms_norm(x, weight, eps) * silu(gate_f32)).to(x.dtype)``. x, gate: [..., H]; weight: [H]. The
    reduction is ``rms_norm``'s."""
    return (rms_norm(x, weight, eps) * torch.nn.functional.silu(gate.to(torch.float32))).to(x.dtype)


def _eps(module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    return rms_norm(hidden_states, self.weight, _eps(self))


def _gemma_rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    return gemma_rms_norm(hidden_states, self.weight, _eps(self))


def _gated_rms_norm_forward(self, hidden_states: Tensor, gate: Tensor) -> Tensor:
    return gated_rms_norm(hidden_states, gate, self.weight, _eps(self))


#: the norm formulas the mode covers: name -> (kernel, the forward installed on a class); "gated" takes the gate
#: as its second argument
NORM_FORMULAS = {
    "llama": (rms_norm, _rms_norm_forward),
    "gemma": (gemma_rms_norm, _gemma_rms_norm_forward),
    "gated": (gated_rms_norm, _gated_rms_norm_forward),
}


def _norm_formula(module: torch.nn.Module) -> str | None:
    """Which of ``NORM_FORMULAS`` the module's own ``forward`` computes (probed on a copy with random weights, in
    float32, within 1e-5), or None when it is none of them."""
    import copy

    weight, eps = getattr(module, "weight", None), _eps(module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return None
    probe = copy.deepcopy(module).float().cpu()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(weight.shape, generator=g))
        x = torch.randn(3, weight.shape[0], generator=g) * 3
        try:
            own = probe(x)
        except Exception:  # noqa: BLE001 - a forward with another signature: the gated one, or none we know
            return _gated_formula(probe, x, eps, g)
        for name, (kernel, _) in NORM_FORMULAS.items():
            if name == "gated":
                continue
            ours = kernel(x, probe.weight, eps)
            if ours.shape == own.shape and torch.allclose(ours, own, rtol=1e-5, atol=1e-6):
                return name
    return None


def _gated_formula(probe: torch.nn.Module, x: Tensor, eps: float, g: torch.Generator) -> str | None:
    """ "gated" when ``probe(x, gate)`` computes ``gated_rms_norm`` (within 1e-5), else None."""
    gate = torch.randn(x.shape, generator=g) * 3
    try:
        own = probe(x, gate)
    except Exception:  # noqa: BLE001 - another signature still: not a formula we know
        return None
    ours = gated_rms_norm(x, gate, probe.weight, eps)
    return "gated" if ours.shape == own.shape and torch.allclose(ours, own, rtol=1e-5, atol=1e-6) else None


def check_no_experts(model: torch.nn.Module) -> None:
    """ValueError naming the class for a mixture-of-experts model (its config's ``num_experts`` or
    ``num_local_experts`` > 1: Qwen3.5-MoE, Qwen3-Next, ...): which tokens an expert's products gather depends on
    the batch, and the mode has no routing replay, so the engine's and the trainer's log-probs would differ."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    experts = max(int(getattr(text, "num_experts", 0) or 0), int(getattr(text, "num_local_experts", 0) or 0))
    if experts > 1:
        raise ValueError(
            f"kernels=batch_invariant does not cover {type(model).__name__}'s mixture-of-experts layers ({experts} "
            "experts): the tokens each expert's products gather depend on the batch and the mode has no routing "
            "replay; use kernels=default for this model"
        )


def norm_kernels(models) -> dict[type, str]:
    """The norm classes of ``models`` (leaf modules whose class name contains "Norm") -> their formula in
    ``NORM_FORMULAS``. Raises ValueError naming every norm class whose forward computes neither formula (e.g.
    ``nn.LayerNorm``): the mode would leave it on torch's batch-variant reduction."""
    found: dict[type, str | None] = {}
    for model in models:
        for module in model.modules():
            cls = type(module)
            if "Norm" not in cls.__name__ or cls in found or next(module.children(), None) is not None:
                continue
            found[cls] = _norm_formula(module)
    unsupported = sorted(cls.__name__ for cls, formula in found.items() if formula is None)
    if unsupported:
        raise ValueError(
            f"kernels=batch_invariant does not cover the norm layer(s) {unsupported}: their forward is neither "
            f"Llama's RMSNorm (weight * x / rms), Gemma's ((1 + weight) * x / rms) nor the gated one "
            f"(weight * x / rms * silu(gate)), the formulas the batch-invariant kernels implement; use "
            f"kernels=default for this model"
        )
    return {cls: formula for cls, formula in found.items() if formula is not None}


def sliding_window_limit(config) -> int | None:
    """The smallest attention window of a transformers config's sliding-window layers (tokens), or None when no
    layer attends through one (``sliding_window`` unset, ``use_sliding_window`` off, or no layer of type
    ``sliding_attention`` in ``layer_types``)."""
    config = getattr(config, "text_config", None) or config
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def check_sliding_window(config, tokens: int) -> None:
    """ValueError when a sliding-window layer of ``config`` would cut a sequence of ``tokens`` tokens (the run's
    longest padded prompt plus its new tokens): batch-invariant attention needs each query to see its whole
    sequence (see ``attention``). Names the window and both numbers."""
    window = sliding_window_limit(config)
    if window is not None and tokens > window:
        raise ValueError(
            f"kernels=batch_invariant does not cover sliding-window attention: the model's sliding_window="
            f"{window} tokens is shorter than the run's longest sequence ({tokens} tokens: longest prompt plus "
            f"max_new_tokens), and the batch-invariant attention needs every query to see its whole sequence; "
            f"use kernels=default, or shorter prompts / max_new_tokens (at most {window} tokens in all)"
        )


def log_softmax(x: Tensor, dim: int = -1, half_to_float: bool = False) -> Tensor:
    """log-softmax over ``dim`` computed per row on a contiguous [rows, V] layout (a lone row padded to two).

    x: any shape and float dtype; returns x's shape (float32 when ``half_to_float``). This is the CPU
    kernel behind ``F.log_softmax`` in batch-invariant mode (it calls the native ``_log_softmax.out``).
    """
    dim = dim % x.dim() if x.dim() else 0
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1]).contiguous() if moved.dim() else moved.reshape(1, 1)
    n = rows.shape[0]
    if n == 1:
        rows = _pad_rows(rows, 2)
    out_dtype = torch.float32 if half_to_float and x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    out = rows.new_empty(rows.shape, dtype=out_dtype)
    torch.ops.aten._log_softmax.out(rows, -1, half_to_float, out=out)
    return out[:n].reshape(moved.shape).movedim(-1, dim)


# -- attention ---------------------------------------------------------------------------------------
def attention_mask(*args, **kwargs):
    """The mask function registered beside ``attention``: transformers' boolean [B, 1, Lq, Lk] mask (True =
    attend), always materialised (never None for "use is_causal"), so padding is always visible to
    ``attention``. Without a registered mask function transformers would call the attention unmasked."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


_last_ranges: list = []  # (mask, b, lq, lk, result) of the last call: every layer of a forward shares one mask


def _key_ranges(mask: Tensor | None, b: int, lq: int, lk: int, device) -> tuple[Tensor, Tensor]:
    """(shift [B], count [B, Lq]): each sequence's first real key and the number of keys each query sees.

    Raises ValueError when a query's visible keys are not one contiguous range starting at its sequence's
    first real key (left/right padding plus causal masking always are; sliding windows or packed sequences
    are not supported). The result for the mask object of the previous call is reused (all layers of one
    forward receive the same mask tensor).
    """
    if _last_ranges and _last_ranges[0][0] is mask and mask is not None and _last_ranges[0][1:4] == (b, lq, lk):
        return _last_ranges[0][4]
    result = _compute_key_ranges(mask, b, lq, lk, device)
    _last_ranges[:] = [(mask, b, lq, lk, result)]
    return result


def _compute_key_ranges(mask: Tensor | None, b: int, lq: int, lk: int, device) -> tuple[Tensor, Tensor]:
    if mask is None:  # causal, no padding: query i (at kv index lk - lq + i) sees keys 0..lk-lq+i
        count = (torch.arange(lq, device=device) + (lk - lq + 1)).expand(b, lq)
        return torch.zeros(b, dtype=torch.long, device=device), count
    if mask.dtype != torch.bool:  # an additive float mask: 0 = attend, -inf/min = masked
        mask = mask == 0
    mask = mask[:, 0].expand(b, lq, lk)
    count = mask.sum(-1)
    first = mask.to(torch.int8).argmax(-1)
    seen = count > 0
    big = torch.full_like(first, lk)
    shift = torch.where(seen, first, big).amin(-1).clamp(max=lk - 1)
    keys = torch.arange(lk, device=device)
    rebuilt = (keys >= shift[:, None, None]) & (keys < (shift[:, None] + count)[..., None])
    if not torch.equal(rebuilt, mask):
        raise ValueError(
            "batch-invariant attention needs causal masks with left/right padding: each query must "
            "see one contiguous range of keys starting at its sequence's first real token "
            "(sliding windows and packed sequences are not supported)"
        )
    return shift, count


@_keeps_native_bmm
def attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Scaled dot-product attention whose output for a query depends only on its own sequence's real keys.

    query: [B, H, Lq, d]; key, value: [B, KVH, Lk, d] (H a multiple of KVH: grouped-query attention);
    attention_mask: the boolean [B, 1, Lq, Lk] mask of ``attention_mask`` (or an additive float mask, or
    None for plain causal). Any float dtype; computed in float32 with autocast off, returned in query's
    dtype as [B, Lq, H, d] (transformers' attention-interface contract), with None for the weights.
    ``dropout`` must be 0 (RL scoring and sampling use none). Fully masked queries (left padding) get 0.
    ``softcap``: Gemma-2's attention-logit soft-capping, scores -> softcap * tanh(scores / softcap) after the
    scaling (as transformers' eager attention), or None.

    The same call serves the trainer (Lq = Lk, causal), the engine's prefill, and its decode (Lq = 1
    against the KV cache), and gives a query bit-identical outputs in all three: see the module docstring.
    Raises ValueError for masks that are not causal-with-padding and for dropout > 0.
    """
    if dropout:
        raise ValueError("batch-invariant attention has no dropout; got dropout > 0")
    b, h, lq, d = query.shape
    kvh, lk = key.shape[1], key.shape[2]
    rep = h // kvh
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    device = query.device
    with torch.autocast(device_type=device.type, enabled=False):
        shift, count = _key_ranges(attention_mask, b, lq, lk, device)
        nblk = -(-max(int(count.max()), 1) // KEY_BLOCK)
        width = nblk * KEY_BLOCK
        bh = b * kvh
        # keys/values re-laid out from each sequence's first real token (index j = real position j), as
        # [B*KVH * width, d] rows picked from the cache. Positions past the cache's end repeat its last key:
        # they lie beyond every query's visible count, so their scores are masked to -inf and their
        # probabilities are exactly 0 (times a finite value: exactly 0)
        pos = (shift[:, None] + torch.arange(width, device=device)).clamp(max=lk - 1)  # [B, width]
        rows = ((torch.arange(bh, device=device) * lk)[:, None] + pos.repeat_interleave(kvh, dim=0)).reshape(-1)
        k = key.reshape(bh * lk, d).index_select(0, rows).view(bh, nblk, KEY_BLOCK, d).float()
        v = value.reshape(bh * lk, d).index_select(0, rows).view(bh, nblk, KEY_BLOCK, d).float()
        # the query heads sharing a key/value head are the rows of one [B*KVH, rows, d] matrix, cut into
        # blocks of QUERY_ROWS rows (zero rows appended): every score product is [QUERY_ROWS, d] x [d, KEY_BLOCK]
        # and every value product [QUERY_ROWS, KEY_BLOCK] x [KEY_BLOCK, d], whatever Lq, the batch or the
        # number of key blocks (one batched call per key block, each batch item one query block)
        n_rows = rep * lq
        nq = -(-n_rows // QUERY_ROWS)
        m = nq * QUERY_ROWS
        q = query.float().reshape(bh, n_rows, d)
        visible = count[:, None, None, :].expand(b, kvh, rep, lq).reshape(bh, n_rows)
        if m > n_rows:
            q = torch.cat([q, q.new_zeros(bh, m - n_rows, d)], dim=1)
            visible = torch.cat([visible, visible.new_zeros(bh, m - n_rows)], dim=1)
        q = q.reshape(bh * nq, QUERY_ROWS, d)
        scores = torch.stack(
            [  # [nblk, B*KVH, rows, KEY_BLOCK]
                torch.bmm(
                    q, k[:, j].transpose(1, 2)[:, None].expand(bh, nq, d, KEY_BLOCK).reshape(bh * nq, d, KEY_BLOCK)
                ).view(bh, m, KEY_BLOCK)
                for j in range(nblk)
            ]
        )
        scores.mul_(scale)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        key_pos = torch.arange(width, device=device).view(nblk, 1, 1, KEY_BLOCK)
        scores.masked_fill_(key_pos >= visible[None, :, :, None], float("-inf"))
        # the exact row maximum (order-free); softmax does not depend on the shift, so no gradient through it
        peak = scores.detach().amax(dim=(0, 3), keepdim=True)
        peak = torch.where(torch.isfinite(peak), peak, 0.0)
        p = scores.sub_(peak).exp_()  # masked keys: exactly 0
        sums = p.sum(-1)  # [nblk, B*KVH, rows]: each block's row sums
        acc, total = None, sums[0]
        for j in range(nblk):  # fixed order over key blocks; blocks past a query's keys add exact zeros
            vj = v[:, j][:, None].expand(bh, nq, KEY_BLOCK, d).reshape(bh * nq, KEY_BLOCK, d)
            part = torch.bmm(p[j].view(bh * nq, QUERY_ROWS, KEY_BLOCK), vj).view(bh, m, d)
            acc = part if acc is None else acc + part
            if j:
                total = total + sums[j]
        # a query without keys (left padding) has acc = 0 and total = 0: 0 / tiny = 0
        out = acc / total.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).tiny)
        out = out[:, :n_rows].reshape(b, kvh, rep, lq, d).reshape(b, h, lq, d)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


# -- installing and removing the mode ----------------------------------------------------------------
class BatchInvariantMode:
    """Installs the batch-invariant kernels for the CPU dispatch key and ``models``; removes them cleanly.

    ``enable()``: registers ``mm``/``addmm``/``bmm``/``log_softmax`` as the CPU kernels of ``aten::mm``,
    ``aten::addmm``, ``aten::bmm`` and ``aten::_log_softmax`` (``torch.library``; process-wide while enabled), registers
    ``attention`` and ``attention_mask`` as ``"batch_invariant"`` in transformers' attention and mask
    registries, switches every ``model.config._attn_implementation`` to it, and replaces the forward of
    the models' norm classes by ``rms_norm`` or ``gemma_rms_norm`` (``norm_kernels``). ``disable()`` undoes
    all of it (the previous kernels, the models' attention implementations and the classes' forwards come
    back). Also a context manager.

    Models copied (``copy.deepcopy``) while enabled inherit the attention setting. Raises ValueError for a
    model with parameters off the CPU (see the module docstring for CUDA) or a norm layer neither formula
    covers (``norm_kernels``; nothing is installed then), and RuntimeError when another
    ``BatchInvariantMode`` is already enabled.
    """

    _active: "BatchInvariantMode | None" = None

    def __init__(self, *models: torch.nn.Module):
        self.models = [m for m in models if m is not None]
        self._lib = None
        self._saved_attn: list[tuple[object, str]] = []
        self._saved_forward: dict[type, object] = {}

    @property
    def enabled(self) -> bool:
        return self._lib is not None

    def enable(self) -> "BatchInvariantMode":
        if self.enabled:
            return self
        if BatchInvariantMode._active is not None:
            raise RuntimeError("another BatchInvariantMode is already enabled; disable it first")
        for model in self.models:
            devices = {p.device.type for p in model.parameters()}
            if devices - {"cpu"}:
                raise ValueError(
                    f"kernels=batch_invariant covers the CPU only; this model has parameters on {sorted(devices)}. "
                    "On CUDA use Thinking Machines' batch_invariant_ops (set_batch_invariant_mode) for the trainer "
                    "and vLLM's VLLM_BATCH_INVARIANT=1 for a vLLM sampler; lit_rl does not wire them in this version"
                )
        for model in self.models:
            check_no_experts(model)
        norms = norm_kernels(self.models)  # before anything is installed: a refusal leaves nothing behind
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, attention_mask)
        for model in self.models:
            for config in _configs(model):
                self._saved_attn.append((config, config._attn_implementation))
                config._attn_implementation = NAME
        for cls, formula in norms.items():
            self._saved_forward[cls] = cls.__dict__.get("forward")
            cls.forward = NORM_FORMULAS[formula][1]
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns that it overrides a kernel: that is the point here
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            lib.impl("mm", mm, "CPU")
            lib.impl("addmm", addmm, "CPU")
            lib.impl("bmm", bmm, "CPU")
            lib.impl("_log_softmax", log_softmax, "CPU")
        self._lib = lib
        _threads[:] = [torch.get_num_threads()]
        _native_bf16[:] = [native_bf16()]
        BatchInvariantMode._active = self
        return self

    def disable(self) -> None:
        if not self.enabled:
            return
        self._lib._destroy()
        _threads.clear()
        self._lib = None
        for cls, forward in self._saved_forward.items():
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward
        self._saved_forward.clear()
        for config, impl in reversed(self._saved_attn):
            config._attn_implementation = impl
        self._saved_attn.clear()
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface._global_mapping.pop(NAME, None)
        AttentionMaskInterface._global_mapping.pop(NAME, None)
        BatchInvariantMode._active = None
        _last_ranges.clear()

    def __enter__(self) -> "BatchInvariantMode":
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()


def _configs(model: torch.nn.Module):
    """The model's config and its sub-configs that carry an attention implementation."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    out = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out.append(sub)
    return out
