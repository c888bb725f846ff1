"""Rollout throughput: the embedded engine, vLLM and transformers' ``generate``, same work, one run.

    python benchmarks/rollout_throughput.py            # SmolLM2-135M, 64 prompts x 64 new tokens
    python benchmarks/rollout_throughput.py --no-vllm  # without the vLLM rows
    python benchmarks/rollout_throughput.py --fixed-length  # no stop token: every row decodes 64 tokens
    python benchmarks/rollout_throughput.py --no-vllm --compare-prefix-sharing  # the shared opening fed once or not

vLLM (``engine=vllm``; here the CPU build) runs as lit_rl runs it: in-process, eager, weights pushed from the
trainer's model, per-request seeds, log-probs of the sampled token returned; its start-up (once per run) is
printed apart and not in the timings.

Both sample at temperature 1 (no top-k/top-p) until the stop token or 64 new tokens; tokens/s counts the
generated tokens (up to and including the stop token) per second of wall time. With ``--fixed-length`` no token
stops a row (the engines get no stop tokens, ``generate`` gets ``min_new_tokens`` = the cap), so every system
generates exactly prompts x new tokens and the timings compare the same work, not samples that stopped at
different lengths. Each system runs once as
warm-up and then ``--repeats`` times; the best time is reported. Ratios are engine / generate at the same
precision: float32 weights, and bfloat16 (the engine under bf16 autocast, as training runs it with
``trainer.precision=bf16-mixed``: the run's own module, built by ``lit_rl.run.train.build_module``, its engine
with the run's options; generate with bf16 weights).

Two scenarios: 64 distinct prompts, and the RL layout, 8 prompts x G = 8 samples each, where the engine
prefills each prompt once and shares its KV cache across the group (generate prefills all 64 rows).

``--compare-prefix-sharing``: also the run's engine with distinct prompts' shared opening prefilled once
(``kv_continuation.common_prefix_prefill``, the default) and with every prompt prefilled whole
(``engine.prefix_sharing = False``), alternately (off, on, on, off, ...), ``--repeats`` times each (at least 3)
after a warm-up, per scenario where the engine shares an opening: tokens/s of the best of each and their ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import ensure_quiet, machine  # noqa: E402

from lit_rl.models import SMOLLM2_ID, ModelConfig, load_policy  # noqa: E402
from lit_rl.rollout.torch_engine import TorchEngine  # noqa: E402
from lit_rl.rollout.types import SamplingConfig, left_pad  # noqa: E402
from lit_rl.run.hardware import keep_freed_memory  # noqa: E402
from lit_rl.tasks import ArithmeticTask  # noqa: E402


def prompts_for(tok, n):
    task = ArithmeticTask(seed=0, digits=2)
    out = []
    for ex in list(task.train_examples())[:n]:
        ids = tok.apply_chat_template(task.messages(ex), add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def best_generate(eng, prompts, new_tokens, repeats, autocast=False):
    """(seconds, generated tokens) of the fastest of ``repeats`` timed ``eng.generate`` calls after a warm-up."""
    params = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    best = None
    for r in range(repeats + 1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            t = time.perf_counter()
            out = eng.generate(prompts, params, seeds=[1000 * r + i for i in range(len(prompts))])
            dt = time.perf_counter() - t
        if r and (best is None or dt < best[0]):
            best = (dt, int(out.response_mask.sum()))
    return best


def stops(tok, fixed_length):
    return [] if fixed_length else [tok.eos_token_id]


def time_engine(model, tok, prompts, args, autocast):
    eng = TorchEngine(model, tok.pad_token_id, stops(tok, args.fixed_length))
    return best_generate(eng, prompts, args.new_tokens, args.repeats, autocast)


def time_trainer_engine(model, tok, prompts, args):
    """The engine of the run's own GRPO module (as ``recipes/train.py`` builds it) under bf16 autocast."""
    from _common import grpo_module

    eng = grpo_module(model, tok, args.new_tokens, args.group_size).engine
    eng.stop_token_ids = stops(tok, args.fixed_length)
    return best_generate(eng, prompts, args.new_tokens, args.repeats, autocast=True)


def time_vllm(model, tok, prompts, args, dtype):
    from lit_rl.rollout.vllm_engine import VLLMEngine

    new_tokens, repeats = args.new_tokens, args.repeats
    stop_ids = stops(tok, args.fixed_length)
    eng = VLLMEngine(model, tok.pad_token_id, stop_ids, dtype=dtype, kv_cache_gb=2.0, max_model_len=1024)
    try:
        eng.sync_weights(0)
        print(f"# vLLM {dtype}: start-up {eng.start_seconds:.1f} s, weight sync {eng.sync_seconds:.2f} s", flush=True)
        return best_generate(eng, prompts, new_tokens, repeats)
    finally:
        eng.close()


def time_generate(model, tok, prompts, args):
    new_tokens, repeats = args.new_tokens, args.repeats
    ids, mask = left_pad(prompts, tok.pad_token_id)
    best = None
    for r in range(repeats + 1):
        torch.manual_seed(r)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask.long(),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens if args.fixed_length else 0,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        dt = time.perf_counter() - t
        gen = out[:, ids.shape[1] :]
        # valid tokens: up to and including the first stop token of each row
        is_eos = gen == tok.eos_token_id
        after = (is_eos.cumsum(-1) - is_eos.long()) > 0
        tokens = int((~after).sum())
        if r and (best is None or dt < best[0]):
            best = (dt, tokens)
    return best


def compare_prefix_sharing(model, tok, prompts, args):
    """Tokens/s of the run's engine (bf16 autocast) with ``prefix_sharing`` off and on, the same seeds, the best of
    ``--repeats`` (at least 3) alternate timings each after a warm-up: {False: tokens/s, True: tokens/s}."""
    from _common import grpo_module

    eng = grpo_module(model, tok, args.new_tokens, args.group_size).engine
    eng.stop_token_ids = stops(tok, args.fixed_length)
    params, seeds = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens), list(range(len(prompts)))
    best = {False: 0.0, True: 0.0}
    for r in range(max(args.repeats, 3) + 1):  # round 0: the warm-ups; at least 3 timings a side
        for value in (False, True) if r % 2 == 0 else (True, False):
            eng.prefix_sharing = value
            with torch.autocast("cpu", dtype=torch.bfloat16):
                t = time.perf_counter()
                out = eng.generate(prompts, params, seeds=seeds)  # the same seeds both ways: (nearly) the same tokens
                dt = time.perf_counter() - t
            if r:
                best[value] = max(best[value], int(out.response_mask.sum()) / dt)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8, help="G of the second, RL-shaped scenario")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    ap.add_argument("--no-vllm", action="store_true", help="leave out the vLLM rows")
    ap.add_argument("--fixed-length", action="store_true", help="no stop token: every row decodes --new-tokens")
    ap.add_argument(
        "--compare-prefix-sharing", action="store_true", help="the run's engine with the shared opening fed once or not"
    )
    args = ap.parse_args()
    ensure_quiet(args.force)
    print(f"# {keep_freed_memory()}")  # as a run's process does (``lit_rl.run.resolve``)
    import importlib.util

    if not args.no_vllm and importlib.util.find_spec("vllm") is None:
        sys.exit("vLLM is not installed (LIT_RL_VLLM=1 bash scripts/setup.sh); run with --no-vllm to leave it out")
    model, tok = load_policy(ModelConfig(args.model))
    model.eval()
    prompts = prompts_for(tok, args.prompts)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    print(f"# {machine()}")
    report(f"{args.prompts} distinct prompts x {args.new_tokens} new tokens", model, bf16, tok, prompts, args)
    g = args.group_size
    grouped = [p for p in prompts[: args.prompts // g] for _ in range(g)]
    report(
        f"RL layout: {args.prompts // g} prompts x G={g} samples x {args.new_tokens} new tokens",
        model,
        bf16,
        tok,
        grouped,
        args,
    )


def report(title, model, bf16, tok, prompts, args):
    rows = [
        ("embedded engine", "float32", time_engine(model, tok, prompts, args, False)),
        ("transformers generate", "float32", time_generate(model, tok, prompts, args)),
        ("embedded engine", "bf16 autocast", time_trainer_engine(model, tok, prompts, args)),
        ("embedded engine", "bf16 weights", time_engine(bf16, tok, prompts, args, False)),
        ("transformers generate", "bf16 weights", time_generate(bf16, tok, prompts, args)),
    ]
    if not args.no_vllm:
        rows += [
            ("vLLM (colocated)", "float32", time_vllm(model, tok, prompts, args, "float32")),
            ("vLLM (colocated)", "bf16 weights", time_vllm(model, tok, prompts, args, "bfloat16")),
        ]
    fixed = ", fixed length (no stop token)" if args.fixed_length else ""
    print(f"\n## {args.model}: {title}{fixed}")
    print("| system | precision | seconds | tokens | tokens/s |\n|---|---|---|---|---|")
    tps = {}
    for name, prec, (dt, tokens) in rows:
        tps[(name, prec)] = tokens / dt
        print(f"| {name} | {prec} | {dt:.2f} | {tokens} | {tokens / dt:.1f} |")
    g32, gbf = tps[("transformers generate", "float32")], tps[("transformers generate", "bf16 weights")]
    print(f"\nratio engine/generate, float32: {tps[('embedded engine', 'float32')] / g32:.2f}x")
    engine_bf16 = tps[("embedded engine", "bf16 autocast")]
    print(f"ratio engine (bf16 autocast)/generate (bf16 weights): {engine_bf16 / gbf:.2f}x")
    print(f"ratio engine (bf16 weights)/generate (bf16 weights): {tps[('embedded engine', 'bf16 weights')] / gbf:.2f}x")
    print(f"ratio engine (bf16 autocast)/generate (float32): {tps[('embedded engine', 'bf16 autocast')] / g32:.2f}x")
    if not args.no_vllm:
        v32, vbf = tps[("vLLM (colocated)", "float32")], tps[("vLLM (colocated)", "bf16 weights")]
        print(f"ratio vLLM/generate, float32: {v32 / g32:.2f}x; bf16 weights: {vbf / gbf:.2f}x")
        print(
            f"ratio vLLM/embedded engine, float32: {v32 / tps[('embedded engine', 'float32')]:.2f}x; "
            f"vLLM (bf16 weights)/engine (bf16 autocast): {vbf / tps[('embedded engine', 'bf16 autocast')]:.2f}x"
        )
        print(f"ratio engine (bf16 autocast, the run's)/vLLM (bf16 weights): {engine_bf16 / vbf:.2f}x")
    if args.compare_prefix_sharing:
        from lit_rl.rollout.kv_continuation import common_prefix

        distinct = list(dict.fromkeys(tuple(p) for p in prompts))
        if not common_prefix(distinct):
            print("the run's engine, the shared opening once / every prompt whole: not compared (the engine does "
                  "not share an opening here: too few positions spared, kv_continuation.common_prefix)")  # fmt: skip
        else:
            both = compare_prefix_sharing(model, tok, prompts, args)
            print(
                f"the run's engine, the shared opening once / every prompt whole (alternately, best of "
                f"{max(args.repeats, 3)}): {both[True]:.1f} / {both[False]:.1f} tokens/s = "
                f"{both[True] / both[False]:.2f}x"
            )


if __name__ == "__main__":
    main()
