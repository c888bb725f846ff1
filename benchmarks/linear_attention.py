"""Cost of ``kernels.linear_attention=recurrent`` on the trainer: forward and backward time per token.

    python benchmarks/linear_attention.py [--bf16]                         # ~100M Qwen3.5-shaped, 8 x 100 + 100 tokens
    python benchmarks/linear_attention.py --hidden 64 --layers 4 --rows 2 --prompt 8 --response 8 --repeats 1 --force
    python benchmarks/linear_attention.py --bf16 --kernels batch_invariant    # the run's setting: auto -> recurrent

A random Qwen3.5-shaped model (3 Gated DeltaNet layers to 1 full-attention layer, as the released models) and
an attention model of the same width and depth (Qwen3, same vocabulary), built in memory (no download). Three
settings, side by side, alternating ``--repeats`` times after a warm-up, on the same token batch
(``--rows`` sequences of ``--prompt`` + ``--response`` tokens, log-probs of the response through
``logprobs.response_logprobs``, backward of their sum):

* ``chunked``: transformers' chunked algorithm, forward and backward (the stock trainer);
* ``recurrent``: the recurrent algorithm's forward, the chunked algorithm's backward
  (``kernels.linear_attention.RecurrentForwardChunkedBackward``): the backward recomputes the chunked forward;
* ``attention``: the attention model, for scale.

``--kernels batch_invariant`` runs all three under the batch-invariant kernels (``recurrent`` is then what
``kernels=batch_invariant`` trains with, ``chunked`` its ``linear_attention=chunked`` split). Reports the
median milliseconds per token of a training step's three passes (pi_old's no-grad forward, the forward with
gradients, the backward) and the ratios recurrent / chunked of the whole step and of forward + backward.
``--save-model DIR`` instead saves the Qwen3.5-shaped model (with the SmolLM2 tokenizer and its vocabulary) as a
folder for ``recipes/train.py model.name_or_path=DIR`` (the stock-vs-fixed gap runs of docs/kernels.md) and
exits. The target: a recurrent step at most 2x a chunked one on the ~100M model at ~100-token
responses. Timings need an otherwise idle machine (``_common.ensure_quiet``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import ensure_quiet  # noqa: E402

from lit_rl.kernels import kernel_mode  # noqa: E402
from lit_rl.logprobs import response_logprobs  # noqa: E402


def models(hidden: int, layers: int, vocab: int):
    """(Qwen3.5-shaped model, attention model) of width ``hidden``, ``layers`` deep, random, float32."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    heads = max(hidden // 128, 2)
    head_dim = hidden // heads
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=head_dim,
        tie_word_embeddings=True,
    )
    value_heads = max(heads, 16)  # a multiple of 16, as released models have (batch_invariant needs it)
    key_heads = max(heads // 2, 1)
    if value_heads % key_heads:  # each key head serves a whole number of value heads (768 wide: 3 -> 8)
        key_heads = value_heads // 2
    linear = dict(
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
    )
    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**common, **linear))
    attention = AutoModelForCausalLM.from_config(Qwen3Config(**common))
    return hybrid, attention


def save_model(args) -> None:
    """The Qwen3.5-shaped model of ``models`` with the SmolLM2 tokenizer, saved to ``args.save_model``."""
    from lit_rl.models import SMOLLM2_ID, load_tokenizer

    tokenizer = load_tokenizer(SMOLLM2_ID)
    hybrid, _ = models(args.hidden, args.layers, len(tokenizer))
    hybrid.config.pad_token_id, hybrid.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    hybrid.config.bos_token_id = tokenizer.bos_token_id
    hybrid.save_pretrained(args.save_model)
    tokenizer.save_pretrained(args.save_model)
    print(f"saved {sum(p.numel() for p in hybrid.parameters()) / 1e6:.0f}M parameters to {args.save_model}")


def time_pass(model, ids, mask, response) -> tuple[float, float, float]:
    """Seconds of a training step's three passes over the batch: the no-grad forward (pi_old's log-probs), the
    forward with gradients (log-probs of ``response``) and the backward of their sum."""
    model.zero_grad(set_to_none=True)
    valid = torch.ones_like(response, dtype=torch.bool)
    start = time.perf_counter()
    with torch.no_grad():
        response_logprobs(model, ids, mask, response, valid)
    old = time.perf_counter()
    lp = response_logprobs(model, ids, mask, response, valid).logprobs
    mid = time.perf_counter()
    lp.sum().backward()
    return old - start, mid - old, time.perf_counter() - mid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--response", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--force", action="store_true", help="time even if other processes use the CPU")
    parser.add_argument("--bf16", action="store_true", help="under bf16 autocast (trainer.precision=bf16-mixed)")
    parser.add_argument(
        "--kernels", default="default", choices=["default", "batch_invariant"], help="the kernel mode of every setting"
    )
    parser.add_argument("--save-model", default=None, help="save the Qwen3.5-shaped model to this folder and exit")
    args = parser.parse_args()
    if args.save_model:
        save_model(args)
        return
    ensure_quiet(args.force)
    hybrid, attention = models(args.hidden, args.layers, args.vocab)
    sizes = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (hybrid, attention)]
    print(f"# Qwen3.5-shaped {sizes[0]:.0f}M parameters, attention model {sizes[1]:.0f}M")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.rows, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    response = torch.randint(0, args.vocab, (args.rows, args.response), generator=g)
    tokens = args.rows * (args.prompt + args.response)
    settings = {
        "chunked": (hybrid, "chunked"),
        "recurrent": (hybrid, "recurrent"),
        "attention": (attention, "chunked"),
    }
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in settings}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, (model, mode) in settings.items():
            cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
            with kernel_mode(args.kernels, model, linear_attention=mode), cast:
                measured = time_pass(model, ids, mask, response)
            if repeat:
                times[name].append(measured)
    print(f"{'setting':<10} {'no-grad fwd ms/token':>21} {'fwd ms/token':>13} {'bwd ms/token':>13} {'step s':>7}")
    steps, fwd_bwd = {}, {}
    for name, runs in times.items():
        old, fwd, bwd = (statistics.median(r[i] for r in runs) for i in range(3))
        steps[name], fwd_bwd[name] = old + fwd + bwd, fwd + bwd
        cells = " ".join(f"{1e3 * x / tokens:>{w}.2f}" for x, w in ((old, 21), (fwd, 13), (bwd, 13)))
        print(f"{name:<10} {cells} {old + fwd + bwd:>7.2f}")
    ratio = steps["recurrent"] / steps["chunked"]
    print(f"recurrent / chunked: step (no-grad fwd + fwd + bwd) {ratio:.2f}x (target <= 2x), ", end="")
    print(f"fwd + bwd {fwd_bwd['recurrent'] / fwd_bwd['chunked']:.2f}x")
    print(f"chunked / attention (step): {steps['chunked'] / steps['attention']:.2f}x")


if __name__ == "__main__":
    main()
