"""The embedded engine's decode step beside the machine's limits: seconds per step, compute bound, memory bound.

    python benchmarks/decode_roofline.py                         # SmolLM2-135M, batch 1/8/64, bf16 and float32
    python benchmarks/decode_roofline.py --batches 64 --profile  # plus the per-op shares of the decode step
    python benchmarks/decode_roofline.py --batches 1,2 --context 16 --steps 4 --repeats 1 --force  # a quick check
    python benchmarks/decode_roofline.py --dtypes bf16 --compare-casts  # weights cast once vs at every step
    python benchmarks/decode_roofline.py --dtypes bf16 --compare-packed  # oneDNN-packed weights vs the casts alone
    python benchmarks/decode_roofline.py --dtypes bf16 --compare-llama-step  # lit_rl's Llama step vs transformers'
    python benchmarks/decode_roofline.py --batches 8,64 --compare-sampler  # the sampling kernel vs torch's calls

For each batch B and compute dtype the engine (``TorchEngine`` on the float32 module, as training runs it: bf16
under ``torch.autocast`` entered as Lightning's ``bf16-mixed`` enters it, with ``cache_enabled=False``, or plain
float32 with the products ``kernels.fp32_gemm`` picks, ``--fp32-gemm``, default ``auto`` as in
``conf/kernels/default.yaml``) decodes B rows with no stop token, so every row decodes every step.
Seconds per decode step = (time of ``generate`` with 1 + S new tokens − time with 1 new token) / S: the prefill
and the first token cancel out; best of ``--repeats`` after a warm-up.

The two bounds, at the mean context C = prompt + S/2 positions:

- compute: FLOPs of one step / the probed matmul peak (``run.hardware.probe_flops`` at the dtype and the run's
  threads). FLOPs = B · (2 · (N − V·H) + 4 · layers · heads · head_dim · C): the products of every
  parameter that multiplies the token (``run.flops.FlopModel``'s N less the input embedding, a lookup) and the
  attention over C keys.
- memory: bytes one step must read at least / the bandwidth of a STREAM-like probe (``c = a + s·b`` over
  arrays far larger than the caches, on the run's threads, best of 5; 3 arrays' bytes per pass): the
  weights at the compute dtype once (2 B per parameter in bf16, 4 in float32; the input embedding only its
  B rows) plus the KV cache of B rows at C positions (2 · layers · kv_heads · head_dim values at the compute
  dtype: the engine's cache holds them in the dtype the attention reads, bf16 under autocast).

ratio = seconds per step / the larger bound (1.0 = at the machine's limit). ``--compare-casts`` (bf16): the engine's
linear weights cast to bf16 once per rollout (``rollout.weight_casts``, the engine's default) against autocast
casting them at every decode step (``engine.casts.enabled = False``, the engine before), timed alternately in
one process (old, new, new, old, ...), each ``--repeats`` times, and the ratio old / new of the best of each
(both with ``engine.packed_linear`` off). ``--compare-packed`` (bf16): the decode steps' products from weights held
in oneDNN's packed layout (``kernels.packed_linear``, ``engine.packed_linear=true``: used where its start-up check
finds F.linear's bits) against the casts alone (``false``), timed alternately the same way, with a check that both
sample the same tokens and log-probs, bit for bit, and the line saying what ``auto`` picks on this machine.
``--compare-llama-step`` (bf16, the engine's packed products as ``auto`` picks them): the decode steps through lit_rl's
Llama step (``rollout.llama_decode``: fewer calls, q/k/v and gate/up stacked) against transformers' forward
(``engine.llama_step.enabled = False``), timed alternately the same way, with the same bit-for-bit check.
``--compare-sampler`` (each dtype): each step's tokens and log-probs from lit_rl's sampling kernel
(``kernels.sampling``, ``engine.fused_sampler``) against torch's calls (log-softmax, exp, cumsum, search), timed
alternately the same way; the same seeds, so it also prints the share of positions where both sampled the same
token (the prefix up to a row's first difference) and the largest log-prob difference there (the kernel's own sum
and exp: a few ulp).
The process keeps freed memory as a run does (``run.hardware.keep_freed_memory``; ``--glibc-malloc`` leaves
glibc's defaults, to see what that saves). The machine must be quiet (the script refuses a busy one like the
other benchmarks; ``--force`` times anyway).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import ensure_quiet  # noqa: E402

from lit_rl.kernels import kernel_mode, packed_linear  # noqa: E402
from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy  # noqa: E402
from lit_rl.rollout.torch_engine import TorchEngine  # noqa: E402
from lit_rl.rollout.types import SamplingConfig  # noqa: E402
from lit_rl.run.flops import FlopModel  # noqa: E402
from lit_rl.run.hardware import keep_freed_memory, probe_flops  # noqa: E402

DTYPES = {"bf16": ("bf16-mixed", torch.bfloat16, 2), "float32": ("32-true", torch.float32, 4)}


def stream_bandwidth(elements: int = 1 << 25, repeats: int = 5) -> float:
    """Bytes/s of ``c = a + s·b`` on float32 arrays of ``elements`` (128 MiB each by default), best of
    ``repeats``: 3 · 4 · elements bytes move per pass (two reads, one write)."""
    a, b, c = torch.rand(elements), torch.rand(elements), torch.empty(elements)
    torch.add(a, b, alpha=0.5, out=c)  # warm-up: pages touched
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.add(a, b, alpha=0.5, out=c)
        best = min(best, time.perf_counter() - t)
    return 3 * 4 * elements / best


def step_bounds(model, batch: int, context: float, bytes_per: int, peak: float, bandwidth: float):
    """(FLOPs, bytes, compute-bound seconds, memory-bound seconds) of one decode step of ``batch`` rows."""
    cfg = model.config
    fm = FlopModel.from_config(cfg)
    lookup = cfg.vocab_size * cfg.hidden_size
    flops = batch * (2 * (fm.dense_params - lookup) + 4 * fm.layers * fm.heads * fm.head_dim * context)
    params = sum(p.numel() for p in model.parameters())
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv = batch * context * 2 * cfg.num_hidden_layers * kv_heads * fm.head_dim * bytes_per
    untied = not getattr(cfg, "tie_word_embeddings", False)
    weights = (params - (lookup if untied else 0)) * bytes_per + batch * cfg.hidden_size * bytes_per
    nbytes = weights + kv
    return flops, nbytes, flops / peak, nbytes / bandwidth


def timed_generate(engine, prompts, new_tokens: int, autocast: bool, seed: int) -> float:
    params = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):  # as Lightning's
        t = time.perf_counter()
        out = engine.generate(prompts, params, seeds=[seed + i for i in range(len(prompts))])
        dt = time.perf_counter() - t
    if int(out.response_mask.sum()) != len(prompts) * new_tokens:
        raise RuntimeError("a row stopped early: the step timing needs every row to decode to the cap")
    return dt


def seconds_per_step(engine, prompts, steps: int, autocast: bool, repeats: int) -> float:
    """Best over ``repeats`` (after a warm-up) of (generate(1 + steps) − generate(1)) / steps."""
    best = float("inf")
    for r in range(repeats + 1):
        one = timed_generate(engine, prompts, 1, autocast, 1000 * r)
        full = timed_generate(engine, prompts, 1 + steps, autocast, 1000 * r)
        if r:
            best = min(best, (full - one) / steps)
    return best


def alternately(
    engine, prompts, steps: int, repeats: int, attribute: str, owner=None, autocast: bool = True
) -> tuple[float, float]:
    """Seconds per decode step (bf16, or float32 with ``autocast`` False; best of ``repeats`` each) with
    ``owner.<attribute>`` (default ``engine.casts``) False and True, timed alternately (False, True, True, False, ...)
    after a warm-up of each: (False's, True's). Leaves it True."""
    owner = engine.casts if owner is None else owner
    best = {False: float("inf"), True: float("inf")}
    for value in (False, True):  # warm-up (and the packed products' start-up check)
        setattr(owner, attribute, value)
        seconds_per_step(engine, prompts, steps, autocast, 1)
    for r in range(repeats):
        for value in (False, True) if r % 2 == 0 else (True, False):
            setattr(owner, attribute, value)
            best[value] = min(best[value], seconds_per_step(engine, prompts, steps, autocast, 1))
    setattr(owner, attribute, True)
    return best[False], best[True]


def same_rollouts(engine, prompts, steps: int, owner, attribute: str) -> bool:
    """Whether bf16 rollouts of ``prompts`` with ``owner.<attribute>`` False and True sample the same tokens and
    log-probs bit for bit (same seeds). Leaves it True."""
    out = {}
    for value in (False, True):
        setattr(owner, attribute, value)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            out[value] = engine.generate(prompts, SamplingConfig(max_new_tokens=1 + steps), list(range(len(prompts))))
    return torch.equal(out[False].response_ids, out[True].response_ids) and torch.equal(
        out[False].rollout_logprobs, out[True].rollout_logprobs
    )


def compare_casts(engine, prompts, steps: int, repeats: int) -> tuple[float, float]:
    """bf16 seconds per decode step with the weights cast at every step (the engine's ``casts`` off: autocast's
    own) and cast once per rollout (on), packed products off, timed alternately: (per step, once)."""
    engine.casts.packed = False
    return alternately(engine, prompts, steps, repeats, "enabled")


def compare_packed(engine, prompts, steps: int, repeats: int) -> tuple[float, float, bool]:
    """bf16 seconds per decode step with the casts alone (``engine.packed_linear=false``) and with the packed
    products (``true``), timed alternately, and whether both sample the same tokens and log-probs bit for bit:
    (casts alone, packed, same bits)."""
    old, new = alternately(engine, prompts, steps, repeats, "packed")
    return old, new, same_rollouts(engine, prompts, steps, engine.casts, "packed")


def compare_llama_step(engine, prompts, steps: int, repeats: int) -> tuple[float, float, bool]:
    """bf16 seconds per decode step through transformers' forward and through lit_rl's Llama step, timed
    alternately, and whether both sample the same tokens and log-probs bit for bit: (transformers', lit_rl's, same)."""
    old, new = alternately(engine, prompts, steps, repeats, "enabled", engine.llama_step)
    return old, new, same_rollouts(engine, prompts, steps, engine.llama_step, "enabled")


def compare_sampler(engine, prompts, steps: int, repeats: int, autocast: bool) -> tuple[float, float, float, float]:
    """Seconds per decode step with torch's sampling calls (``engine.fused_sampler = False``) and lit_rl's kernel
    (True), timed alternately, then one rollout each with the same seeds: (torch's, the kernel's, the share of
    positions before each row's first differing token, the largest |log-prob difference| over those positions)."""
    old, new = alternately(engine, prompts, steps, repeats, "fused_sampler", engine, autocast)
    out = {}
    for value in (False, True):
        engine.fused_sampler = value
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=autocast):
            out[value] = engine.generate(prompts, SamplingConfig(max_new_tokens=1 + steps), list(range(len(prompts))))
    ids, kernel_ids = out[False].response_ids, out[True].response_ids
    prefix = (ids == kernel_ids).long().cumprod(-1).bool()  # each row up to its first other token
    diff = (out[False].rollout_logprobs - out[True].rollout_logprobs).abs()[prefix]
    return old, new, float(prefix.float().mean()), float(diff.max()) if diff.numel() else float("nan")


def profile_step(engine, prompts, steps: int, autocast: bool, top: int) -> None:
    """Print the ``top`` ops of one decode step by self CPU time: the profile of ``generate(1 + steps)`` less that of
    ``generate(1)``, op by op and input shape by input shape, over ``steps`` (as in the timing, the prefill and the
    first token cancel; shapes whose call count is the same in both, the prefill's, are left out, so its run-to-run
    noise does not count): ms and calls per step and the share of the step's self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    def per_shape(new_tokens: int) -> dict[tuple[str, str], tuple[float, int]]:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            timed_generate(engine, prompts, new_tokens, autocast, 7)
        return {(e.key, str(e.input_shapes)): (e.self_cpu_time_total, e.count) for e in prof.key_averages(True)}

    timed_generate(engine, prompts, 1 + steps, autocast, 7)  # warm-up
    one, full = per_shape(1), per_shape(1 + steps)
    ops: dict[str, list[float]] = {}
    for key, (t, n) in full.items():
        t0, n0 = one.get(key, (0.0, 0))
        if n > n0:
            op = ops.setdefault(key[0], [0.0, 0.0])
            op[0] += (t - t0) / steps
            op[1] += (n - n0) / steps
    total = sum(t for t, _ in ops.values())
    print(f"decode step, self CPU time under the profiler: {total / 1e3:.1f} ms")
    print("| op | ms / step | calls / step | share |\n|---|---|---|---|")
    for key, (t, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {key} | {t / 1e3:.2f} | {n:.1f} | {t / total:.1%} |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--batches", default="1,8,64", help="comma-separated decode batch sizes")
    ap.add_argument("--dtypes", default="bf16,float32", help=f"comma-separated, of {list(DTYPES)}")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens of every row")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also print the per-op shares of each setting")
    ap.add_argument("--top", type=int, default=15, help="ops listed by --profile")
    ap.add_argument(
        "--compare-casts", action="store_true", help="bf16: weights cast once per rollout vs at every step, alternately"
    )
    ap.add_argument(
        "--compare-packed", action="store_true", help="bf16: oneDNN-packed weights vs the casts alone, alternately"
    )
    ap.add_argument(
        "--compare-llama-step", action="store_true", help="bf16: lit_rl's Llama decode step vs transformers' forward"
    )
    ap.add_argument(
        "--compare-sampler", action="store_true", help="lit_rl's sampling kernel vs torch's calls, alternately"
    )
    ap.add_argument("--fp32-gemm", default="auto", help="kernels.fp32_gemm for the float32 products, as a run's")
    ap.add_argument(
        "--glibc-malloc", action="store_true", help="leave glibc's malloc thresholds (a run keeps freed memory)"
    )
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or min(batches) < 1 or args.steps < 1 or args.context < 1 or args.repeats < 1:
        sys.exit(f"--dtypes must be of {list(DTYPES)} (got {bad}); batches, steps, context, repeats >= 1")
    ensure_quiet(args.force)
    print(f"# {'malloc: glibc defaults (--glibc-malloc)' if args.glibc_malloc else keep_freed_memory()}")
    model, tok = load_policy(ModelConfig(args.model))
    model.eval()
    engine = TorchEngine(model, tok.pad_token_id, stop_token_ids=[])  # no stop token: every row to the cap
    kernels = kernel_mode("default", model, fp32_gemm=args.fp32_gemm)  # the float32 products as a run picks them
    threads = torch.get_num_threads()
    bandwidth = stream_bandwidth()
    print(f"# STREAM-like bandwidth (c = a + s*b, float32, {threads} threads, best of 5): {bandwidth / 1e9:.1f} GB/s")
    gen = torch.Generator().manual_seed(0)
    context = args.context + args.steps / 2
    rows, casts, packs, steps_ab, samplers = [], [], [], [], []
    for name in dtypes:
        precision, _, bytes_per = DTYPES[name]
        peak = probe_flops(precision, threads)
        print(f"# matmul peak, {name}, {threads} threads: {peak / 1e12:.3f} TFLOP/s", flush=True)
        for b in batches:
            prompts = torch.randint(0, model.config.vocab_size, (b, args.context), generator=gen).tolist()
            autocast = name == "bf16"
            if args.compare_casts and autocast:
                with kernels:
                    old, step = compare_casts(engine, prompts, args.steps, args.repeats)
                casts.append((b, old, step))
                print(f"# bf16 batch {b}: cast every step {old * 1e3:.1f} ms, once {step * 1e3:.1f} ms", flush=True)
            elif args.compare_packed and autocast:
                with kernels:
                    old, step, same = compare_packed(engine, prompts, args.steps, args.repeats)
                packs.append((b, old, step, same))
                print(f"# bf16 batch {b}: casts alone {old * 1e3:.1f} ms, packed {step * 1e3:.1f} ms", flush=True)
            elif args.compare_llama_step and autocast:
                with kernels:
                    old, step, same = compare_llama_step(engine, prompts, args.steps, args.repeats)
                steps_ab.append((b, old, step, same))
                print(f"# bf16 batch {b}: transformers' {old * 1e3:.1f} ms, lit_rl's {step * 1e3:.1f} ms", flush=True)
            elif args.compare_sampler:
                with kernels:
                    old, step, same, diff = compare_sampler(engine, prompts, args.steps, args.repeats, autocast)
                samplers.append((name, b, old, step, same, diff))
                print(
                    f"# {name} batch {b}: torch's sampling {old * 1e3:.1f} ms, the kernel {step * 1e3:.1f} ms",
                    flush=True,
                )
            else:
                with kernels:
                    step = seconds_per_step(engine, prompts, args.steps, autocast, args.repeats)
            flops, nbytes, t_c, t_m = step_bounds(model, b, context, bytes_per, peak, bandwidth)
            rows.append((name, b, step, flops, nbytes, t_c, t_m))
            print(f"# {name} batch {b}: {step * 1e3:.1f} ms per decode step", flush=True)
            if args.profile:
                print(f"\n### per-op profile: {name}, batch {b}, {args.steps} decode steps")
                with kernels:
                    profile_step(engine, prompts, args.steps, autocast, args.top)
    title = f"prompt {args.context} + {args.steps} new tokens (bounds at C = {context:g})"
    print(f"\n## {args.model}: decode step, {title}, kernels=default, fp32_gemm={args.fp32_gemm}")
    print("| dtype | batch | ms / step | GFLOP | MB read | compute bound ms | memory bound ms | ratio to larger |")
    print("|---|---|---|---|---|---|---|---|")
    for name, b, step, flops, nbytes, t_c, t_m in rows:
        print(
            f"| {name} | {b} | {step * 1e3:.1f} | {flops / 1e9:.2f} | {nbytes / 1e6:.0f} | {t_c * 1e3:.1f} | "
            f"{t_m * 1e3:.1f} | {step / max(t_c, t_m):.1f}x |"
        )
    if casts:
        print(
            f"\n## bf16 weights cast at every decode step (before) / once per rollout, {threads} threads, alternately"
        )
        print("| batch | cast every step, ms / step | cast once, ms / step | ratio |\n|---|---|---|---|")
        for b, old, new in casts:
            print(f"| {b} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.2f}x |")
    if packs:
        with kernels:
            print(f"\n# lit_rl: {packed_linear.resolve('auto', model)[1]}")
        print(f"\n## bf16 products from oneDNN-packed weights / the casts alone, {threads} threads, alternately")
        print("| batch | casts alone, ms / step | packed, ms / step | ratio | same tokens and log-probs |")
        print("|---|---|---|---|---|")
        for b, old, new, same in packs:
            print(f"| {b} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.2f}x | {'yes' if same else 'NO'} |")

    if samplers:
        print(f"\n## decode steps, torch's sampling calls / lit_rl's sampling kernel, {threads} threads, alternately")
        print("| dtype | batch | torch's, ms / step | kernel, ms / step | ratio | same tokens | max log-prob diff |")
        print("|---|---|---|---|---|---|---|")
        for name, b, old, new, same, diff in samplers:
            print(f"| {name} | {b} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.2f}x | {same:.1%} | {diff:.1e} |")
    if steps_ab:
        print(f"\n## bf16 decode steps, transformers' forward / lit_rl's Llama step, {threads} threads, alternately")
        print("| batch | transformers', ms / step | lit_rl's, ms / step | ratio | same tokens and log-probs |")
        print("|---|---|---|---|---|")
        for b, old, new, same in steps_ab:
            print(f"| {b} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.2f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
