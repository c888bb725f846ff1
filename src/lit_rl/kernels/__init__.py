"""Kernel modes (the ``kernels`` config group): ``default`` (torch's and transformers' own kernels, with float32
products through oneDNN where that is measured faster: ``fp32_gemm``) or ``batch_invariant``
(``batch_invariant.BatchInvariantMode``: the engine's rollout log-probs equal the trainer's bit for bit before the
first update). Gated DeltaNet layers (Qwen3.5, Qwen3-Next) run the algorithm ``kernels.linear_attention`` names on
every forward (``linear_attention``: recurrent under batch_invariant by default)."""

from __future__ import annotations

import contextlib

from ..choices import ATTENTION_BACKWARD_CHOICES, KERNELS
from .attention_backward import active as attention_backward_active
from .attention_backward import resolve as resolve_attention_backward
from .batch_invariant import BatchInvariantMode
from .fp32_gemm import OneDNNGemm
from .fp32_gemm import resolve as resolve_fp32_gemm
from .linear_attention import LinearAttentionKernels, resolve_linear_attention


class Stacked:
    """Context managers entered in order and left in reverse: the kernel mode and the linear-attention mode."""

    def __init__(self, *modes):
        self.modes = modes

    def __enter__(self):
        for i, mode in enumerate(self.modes):
            try:
                mode.__enter__()
            except BaseException:
                for entered in reversed(self.modes[:i]):
                    entered.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)


def kernel_mode(
    name: str,
    *models,
    fp32_gemm: str = "aten",
    linear_attention: str = "auto",
    attention_backward: str = "flash",
    attention_dtype=None,
):
    """``_base_mode(name, *models, fp32_gemm=...)`` together with ``LinearAttentionKernels`` for the Gated
    DeltaNet layers of ``models`` in ``resolve_linear_attention(linear_attention, name)`` (printed when the models
    have such layers), and under ``default`` the trainer's attention backward ``attention_backward`` resolved for
    ``models[0]`` at ``attention_dtype`` (``attention_backward.resolve``, printed unless flash). Raises ValueError
    for a value outside the choices, naming the field."""
    from .linear_attention import check_vector_width, gated_deltanet_modules

    la = resolve_linear_attention(linear_attention, name)
    hybrid = bool(gated_deltanet_modules(*models))
    if hybrid and name == "batch_invariant" and la == "recurrent":
        check_vector_width(*models)
    base = _base_mode(name, *models, fp32_gemm=fp32_gemm)
    if name == "default" and models and attention_backward != "flash":
        import torch

        threshold, why = resolve_attention_backward(attention_backward, models[0], attention_dtype or torch.float32)
        print(f"lit_rl: {why}", flush=True)
        base = Stacked(base, attention_backward_active(threshold))
    elif attention_backward not in ATTENTION_BACKWARD_CHOICES:
        raise ValueError(f"kernels.attention_backward={attention_backward!r} is not allowed")
    if not hybrid:
        return base
    print(
        f"lit_rl: kernels.linear_attention={linear_attention} -> {la}: Gated DeltaNet layers run the {la} "
        + (
            "algorithm on every forward (engine prefill, decode, trainer), the chunked one in the backward"
            if la == "recurrent"
            else "algorithm in full forwards, the recurrent one in the engine's decode (a small gap)"
        ),
        flush=True,
    )
    return Stacked(base, LinearAttentionKernels(la, *models))


def _base_mode(name: str, *models, fp32_gemm: str = "aten"):
    """A context manager that runs its body under kernel mode ``name`` for ``models`` (transformers causal
    LMs): ``default`` changes nothing but the float32 products, through oneDNN (``fp32_gemm.OneDNNGemm``) when
    ``fp32_gemm.resolve(fp32_gemm, models[0])`` says so (it prints which and why); ``batch_invariant`` is
    ``BatchInvariantMode(*models)`` (``fp32_gemm`` must then be aten or auto: its own kernels run every product).
    Raises ValueError for another name or an ``fp32_gemm`` value outside ``fp32_gemm.CHOICES``."""
    if name == "default":
        on, why = resolve_fp32_gemm(fp32_gemm, models[0]) if models else (False, "")
        if fp32_gemm != "aten":
            print(f"lit_rl: {why}", flush=True)
        return OneDNNGemm() if on else contextlib.nullcontext()
    if name == "batch_invariant":
        import torch

        if fp32_gemm not in ("aten", "auto"):
            raise ValueError(f"kernels.fp32_gemm={fp32_gemm!r} with kernels=batch_invariant: leave it at aten")

        from .batch_invariant import GEMM_ROWS

        print(
            f"lit_rl: kernels=batch_invariant: matrix products in fixed blocks of {GEMM_ROWS} rows at "
            f"{torch.get_num_threads()} torch threads (the thread count stays fixed for the run); "
            f"CPU only",
            flush=True,
        )
        return BatchInvariantMode(*models)
    raise ValueError(f"kernels={name!r} is not allowed: choose one of {list(KERNELS)}")


def attention_kv_dtype(model):
    """The dtype ``model``'s attention reads its keys and values in right now, for a KV cache to hold them in:
    the autocast dtype when ``torch.autocast`` is on for the model's device and every attention implementation
    of the model is transformers' ``sdpa`` (torch's ``scaled_dot_product_attention`` is on autocast's
    lower-precision list: it casts its float32 keys and values to that dtype at every call, so values cast once
    when written are the very values it reads); None otherwise (the attention reads them as given: the
    batch-invariant attention computes in float32 from them). Returns a ``torch.dtype`` or None."""
    import torch

    from .batch_invariant import _configs

    device = next(model.parameters()).device.type
    configs = _configs(model)
    if not configs or not torch.is_autocast_enabled(device):
        return None
    if any(getattr(c, "_attn_implementation", None) != "sdpa" for c in configs):
        return None
    return torch.get_autocast_dtype(device)


__all__ = ["KERNELS", "BatchInvariantMode", "LinearAttentionKernels", "OneDNNGemm", "attention_kv_dtype", "kernel_mode"]
