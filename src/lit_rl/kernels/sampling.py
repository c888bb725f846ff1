"""A decode step's next tokens and their log-probs in one kernel call (``engine.fused_sampler``).

The embedded engine samples each row's next token by inverse CDF with one uniform u from the row's own generator
(``rollout.torch_engine.sample_rows``): ``logp = log_softmax(logits.float() / T)``, then ``cumsum(exp(logp))`` and
a search for ``u * total``. On SmolLM2's 49,152-entry vocabulary at 64 rows that is five passes over a [64, 49152]
float32 tensor (the cast, the log-softmax, the exp, the cumsum, the search) and ~5 ms of a ~53 ms decode step (AMD
EPYC, 2 threads, torch.profiler: cumsum 1.9, exp 1.6, log-softmax 0.9, the cast 0.6 ms). ``sample`` does the same
draw in one call, per row (``csrc/sampling.cpp``, rows split over the threads):

1. m = max_v x_v with x = logits / T, read from the logits in their own dtype (bf16 or float32);
2. e_v = exp(x_v − m) (a vectorised exp, within 2 ulp of ``expf``), kept in a row buffer, and the sum of each
   block of 256 entries (float32 within a block, the blocks' sums added in float64: S);
3. the first v whose running sum of e reaches u · S with e_v > 0 (the block found from the block sums, then entry by
   entry inside it), and its log-prob ``(x_v − m) − log(S)``, the formula of ``log_softmax``.

The distribution is the same, softmax(logits / T); the arithmetic is not the same bits as the five torch calls:
the sum's order and the exp differ in the last bits, so a log-prob differs from ``log_softmax``'s by a few ulp (≲ 1e-6
nats; the tests bound it) and the token differs from ``sample_rows``' only when u · S falls within that rounding of
a boundary between two tokens' CDF steps (the same uniforms are drawn from the same generators, so otherwise the
same token). Under ``kernels=batch_invariant``, whose sampler must reproduce its reference bits, it is off; with
``engine.fused_sampler=false`` the torch calls run. The engine uses it only for plain sampling: no logit noise,
top-k or top-p, recorded top-k head or tail samples (those need the full log-probs).

vLLM's CPU sampler and TRL (transformers' ``generate``: softmax then ``torch.multinomial``) also draw with their own
arithmetic; neither promises the bits of a reference. What this project promises instead is measured: the engine's
log-probs against the trainer's (``train/logprob_abs_diff``), which a few-ulp change of the sampler's arithmetic
cannot move beside the bf16 gap (~3e-2) or the float32 one (~3e-6).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: the logits' dtypes the kernel reads
DTYPES = (torch.bfloat16, torch.float32)


def check_setting(setting) -> None:
    """Raise ValueError naming ``engine.fused_sampler`` for a value other than auto, true or false."""
    if not (setting == "auto" or isinstance(setting, bool)):
        raise ValueError(f"engine.fused_sampler must be auto, true or false, got {setting!r}")


def available() -> str:
    """ "" when ``torch.ops.lit_rl.sample_next`` is usable (``decode_attention.build``: compiled on first use where a
    C++ toolchain is), else why not."""
    from . import decode_attention

    return decode_attention.build()


def serves(logits: Tensor) -> bool:
    """Whether ``sample`` runs on ``logits``: a 2-D CPU tensor of a dtype in ``DTYPES`` (any row stride)."""
    return logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in DTYPES


def sample(logits: Tensor, uniforms: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """One token per row of softmax(``logits`` / ``temperature``) by inverse CDF (module docstring).

    logits: [B, V] bf16 or float32 on the CPU (``serves``); uniforms: [B] float32 in [0, 1), row r's draw;
    temperature > 0 (1.0 divides nothing). Returns (ids [B] int64, log-probs [B] float32 of those ids under
    softmax(logits / T), nats). Raises ValueError naming the row for a row with a NaN or +inf or every entry −inf,
    RuntimeError where the kernel is not built (``available``'s reason) and for other shapes or dtypes (from the
    kernel, naming the operand).
    """
    why = available()
    if why:
        raise RuntimeError(f"lit_rl's sampling kernel is not built: {why}")
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()  # any row stride; entries one after another
    ids, logprobs = torch.ops.lit_rl.sample_next(rows, uniforms.float(), float(temperature))
    bad = ids < 0
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"logits row {row} has a NaN or +inf, or no finite entry: nothing to sample")
    return ids, logprobs
