"""The decode step's attention: lit_rl's kernel (``engine.decode_attention``) against torch's SDPA, and the
engine-trainer gap with it on and off.

    python benchmarks/decode_attention.py                 # both parts (about 4 min on 2 cores)
    python benchmarks/decode_attention.py --no-gap        # the per-layer timings only (seconds)
    python benchmarks/decode_attention.py --blocks 20     # more paired blocks for the gap

Timings: one layer's decode attention for SmolLM2-135M's heads (3 key/value heads x 3 grouped query heads of 64)
at 64 rows and contexts of 40 / 107 / 250 positions (and 8 rows at 107), bf16 and float32, each layer's keys and
values sliced from a cache reserved for 256 positions over 30 layers as the engine holds them, left padding on a
quarter of the rows; SDPA as transformers calls it for a padded batch (the grouped heads as query rows of one
problem, the boolean mask). Best of 5 passes over the 30 layers; milliseconds a layer and the ratio.

Gap: the mean over sampled tokens of |trainer log-prob - rollout log-prob| (``train/logprob_abs_diff``'s
quantity), SmolLM2-135M under bf16 autocast, 8 prompts x G = 8, up to 64 tokens with the stop token; each block
generates the same seeds once with the kernel and once with SDPA (paired), the trainer scores both under bf16
autocast. Verdict rule, stated before the run: the kernel leaves the gap no larger if the 95% t-interval of the
paired relative difference (on - off) / off lies below +5%; an interval reaching above +5% is "not settled".
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import ensure_quiet  # noqa: E402

from lit_rl.kernels import decode_attention as da  # noqa: E402
from lit_rl.run.hardware import keep_freed_memory  # noqa: E402
from lit_rl.tools.compare.stats import t_interval  # noqa: E402


def layer_timings(dtype: torch.dtype, rows: int, length: int, layers: int = 30, repeats: int = 5):
    """(SDPA ms, kernel ms) a layer, and the largest |difference| of their outputs."""
    kvh, group, dim, reserved = 3, 3, 64, 256
    g = torch.Generator().manual_seed(0)
    caches = [[torch.randn(rows, kvh, reserved, dim, generator=g).to(dtype) for _ in range(2)] for _ in range(layers)]
    q = torch.randn(rows, kvh, group, dim, generator=g).to(dtype)
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    mask[: rows // 4, ..., : length // 3] = False  # left-padded rows
    scale = dim**-0.5

    def sdpa(k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def kernel(k, v):
        return da.attention(q, k, v, mask[:, 0, 0, :], scale)

    out = []
    with torch.no_grad():
        for fn in (sdpa, kernel):
            best = math.inf
            for _ in range(repeats + 1):
                t = time.perf_counter()
                for k, v in caches:
                    fn(k[:, :, :length], v[:, :, :length])
                best = min(best, (time.perf_counter() - t) / layers)
            out.append(best * 1e3)
        k, v = caches[0]
        diff = sdpa(k[:, :, :length], v[:, :, :length]).float() - kernel(k[:, :, :length], v[:, :, :length]).float()
    return out[0], out[1], diff.abs().max().item()


def gap_study(blocks: int) -> None:
    from rollout_throughput import prompts_for

    from lit_rl.logprobs import response_logprobs
    from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy
    from lit_rl.rollout.torch_engine import TorchEngine
    from lit_rl.rollout.types import SamplingConfig, left_pad

    model, tok = load_policy(ModelConfig(SMOLLM2_ID))
    prompts = [p for p in prompts_for(tok, 8) for _ in range(8)]
    params = SamplingConfig(temperature=1.0, max_new_tokens=64)
    stops = [tok.eos_token_id]
    engines = {on: TorchEngine(model, tok.pad_token_id, stops, decode_attention=on) for on in (False, True)}
    gaps: dict[bool, list[float]] = {False: [], True: []}
    for b in range(blocks):
        for on in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                r = engines[on].generate(prompts, params, [1000 * b + i for i in range(len(prompts))])
                ids, mask = left_pad(r.prompt_ids, tok.pad_token_id)
                with torch.no_grad():
                    s = response_logprobs(model, ids, mask, r.response_ids, r.response_mask, with_entropy=False)
            gaps[on].append((s.logprobs.float() - r.rollout_logprobs).abs()[r.response_mask].mean().item())
        print(f"# block {b + 1}/{blocks}: gap SDPA {gaps[False][-1]:.4e}, kernel {gaps[True][-1]:.4e}", flush=True)
    ci = t_interval([a - b for a, b in zip(gaps[True], gaps[False])])  # the paired differences, 95%
    off = sum(gaps[False]) / blocks
    mean, lo, hi = ci.mean, ci.lo / off, ci.hi / off
    verdict = "no larger (the interval lies below +5%)" if hi < 0.05 else "not settled (the interval reaches +5%)"
    print(f"\n## engine-trainer gap, {blocks} paired blocks of 64 rollouts (bf16 autocast)")
    print(f"SDPA {off:.4e}, kernel {sum(gaps[True]) / blocks:.4e}; kernel - SDPA {mean / off:+.1%} "
          f"(95% CI {lo:+.1%} .. {hi:+.1%}): {verdict}")  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=10, help="paired blocks of the gap study")
    ap.add_argument("--no-gap", action="store_true", help="the per-layer timings only")
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    if args.blocks < 2:
        sys.exit("--blocks must be at least 2 (the interval needs a spread)")
    ensure_quiet(args.force)
    keep_freed_memory()
    why = da.build()
    if why:
        sys.exit(f"the decode attention kernel is not available: {why}")
    print("\n## one layer's decode attention, 3 KV heads x 3 grouped query heads of 64, 30 layers' caches")
    print("| dtype | rows | context | SDPA ms | kernel ms | SDPA / kernel | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for rows, length in ((64, 40), (64, 107), (64, 250), (8, 107)):
            sdpa, kernel, diff = layer_timings(dtype, rows, length)
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {rows} | {length} | {sdpa:.3f} | {kernel:.3f} | {sdpa / kernel:.2f}x | {diff:.1e} |",
                  flush=True)  # fmt: skip
    if not args.no_gap:
        gap_study(args.blocks)


if __name__ == "__main__":
    main()
