"""Stage 2 of the GPU check (scripts/gpu_check.sh): timings on random-initialised models, no weights needed.

    python scripts/gpu_timings.py            # on a CUDA machine; writes $GPU_CHECK_REPORT/timings.json if set
    python scripts/gpu_timings.py --smoke    # on CPU: the same code at 2 prompts x G = 2 x 8 tokens (no figures)

The main job's layout: 8 prompts x G = 8 completions x 256 new tokens (no stop token: every completion runs to
256), prompts of 64 random token ids, bf16 autocast over float32 weights (trainer.precision=auto on a bf16 GPU).
For SmolLM2-135M and a Qwen3-0.6B-shaped model (their configs below): rollout tokens/s of the embedded engine,
the update's seconds and perf/mfu (verl's FLOP count, lit_rl.run.flops) against the GPU's nominal peak and
against a bf16 matmul measured there (8192^3), and seconds per step (rollout + update). The update is one
policy-gradient step over the 64 sequences in micro-batches of 16 (response_logprobs, backward, AdamW): the
trainer's forward and backward, not the whole recipe (no reference, no verifier). Then TRL's GRPOTrainer on
SmolLM2-135M's shape at the same layout (``trl_step``: transformers' generate, TRL without vLLM).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

PROMPTS, G, NEW_TOKENS, PROMPT_LEN, MICRO = 8, 8, 256, 64, 16
SMOKE = "--smoke" in sys.argv
if SMOKE:
    PROMPTS, G, NEW_TOKENS, PROMPT_LEN, MICRO = 2, 2, 8, 8, 2
DEVICE = "cpu" if SMOKE else "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


#: the models' shapes (from their published config.json files); vocabularies as published, embeddings tied
MODELS = {
    "SmolLM2-135M": (
        "LlamaConfig",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "Qwen3-0.6B-shaped": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
}


def measured_matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """Best-of-3 TFLOP/s of a bf16 [n, n] x [n, n] product on the GPU."""
    n, reps = (512, 2) if SMOKE else (n, reps)
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    torch.mm(a, b)
    best = 0.0
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12)
    return best


def build(kind: str, fields: dict):
    import transformers

    config = getattr(transformers, kind)(**fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).train(), config


def rollout(model, vocab: int):
    from lit_rl.rollout.torch_engine import TorchEngine
    from lit_rl.rollout.types import SamplingConfig

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(PROMPTS)]
    rows = [p for p in prompts for _ in range(G)]
    engine = TorchEngine(model, pad_token_id=0, stop_token_ids=[])
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        engine.generate(rows[:4], SamplingConfig(max_new_tokens=4), seeds=list(range(4)))  # warm-up
        sync()
        t0 = time.perf_counter()
        r = engine.generate(rows, SamplingConfig(max_new_tokens=NEW_TOKENS), seeds=list(range(len(rows))))
        sync()
    return r, time.perf_counter() - t0


def update(model, r) -> float:
    """Seconds of one policy-gradient step over the rollouts (micro-batches of MICRO), the second of two."""
    from lit_rl.logprobs import response_logprobs
    from lit_rl.rollout.types import left_pad

    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    pi, pm = left_pad(r.prompt_ids, 0)
    ids, mask = r.response_ids.to(DEVICE), r.response_mask.to(DEVICE)
    pi, pm = pi.to(DEVICE), pm.to(DEVICE)
    adv = torch.randn(ids.shape[0], 1, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    seconds = 0.0
    for _ in range(2):
        sync()
        t0 = time.perf_counter()
        for i in range(0, ids.shape[0], MICRO):
            s = slice(i, i + MICRO)
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                lp = response_logprobs(model, pi[s], pm[s], ids[s], mask[s], with_entropy=False).logprobs
            (-(lp * adv[s])[mask[s]].sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        seconds = time.perf_counter() - t0
    return seconds


def time_model(name: str, kind: str, fields: dict, peaks: dict) -> dict:
    from lit_rl.run.flops import FlopModel

    model, config = build(kind, fields)
    r, gen_s = rollout(model, config.vocab_size)
    tokens = int(r.response_mask.sum())
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train_s = update(model, r)
    flops = FlopModel.from_config(config)
    lengths = [len(p) + int(m.sum()) for p, m in zip(r.prompt_ids, r.response_mask)]
    update_tflops = flops.update_flops(lengths) / train_s / 1e12
    out = {
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "generated_tokens": tokens,
        "rollout_s": gen_s,
        "rollout_tokens_per_s": tokens / gen_s,
        "update_s": train_s,
        "update_tflops": update_tflops,
        "step_s": gen_s + train_s,
        "update_peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else None,
        **{f"mfu_vs_{k}": update_tflops / v for k, v in peaks.items()},
    }
    print(name, json.dumps(out), flush=True)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def trl_step(fields: dict) -> dict:
    """TRL's GRPOTrainer on the same layout and the same random-initialised SmolLM2-135M shape: two steps, the
    second's figures. Generation is transformers' ``generate`` (TRL without vLLM), bf16 autocast (``bf16=True``),
    no KL, one update per batch, micro-batches of MICRO; prompts are PROMPT_LEN random tokens, decoded to text
    (TRL takes text prompts), rewards random. TRL stops a completion at the end-of-text token, which a random
    model rarely samples: the generated token count is reported beside the times."""
    import tempfile

    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from lit_rl.models import SMOLLM2_ID, load_tokenizer

    tok = load_tokenizer(SMOLLM2_ID)
    config = transformers.LlamaConfig(**fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    texts = [tok.decode(torch.randint(0, len(tok), (PROMPT_LEN,), generator=gen)) for _ in range(2 * PROMPTS)]
    rewards = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"step": [], "rollout": [], "tokens": []}

    def reward(prompts, completions, **kwargs):
        return torch.rand(len(completions), generator=rewards).tolist()

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=SMOKE, bf16=True, per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=PROMPTS * G // MICRO, num_generations=G, max_completion_length=NEW_TOKENS,
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, learning_rate=1e-6, max_steps=2,
            logging_steps=1, save_strategy="no", report_to=[], shuffle_dataset=False, seed=0,
        )  # fmt: skip
        ds = Dataset.from_list([{"prompt": t} for t in texts])
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=ds, processing_class=tok)
        original = trainer._generate_and_score_completions

        def timed(inputs):
            t0 = time.perf_counter()
            result = original(inputs)
            sync()
            times["rollout"].append(time.perf_counter() - t0)
            times["tokens"].append(float(result["completion_mask"].sum()))
            return result

        trainer._generate_and_score_completions = timed

        class StepTimer(transformers.TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.t = time.perf_counter()

            def on_step_end(self, *a, **k):
                sync()
                times["step"].append(time.perf_counter() - self.t)

        trainer.add_callback(StepTimer())
        trainer.train()
    step, gen_s = times["step"][-1], times["rollout"][-1]
    out = {"generation": "transformers generate (TRL without vLLM)", "generated_tokens": times["tokens"][-1],
           "rollout_s": gen_s, "rollout_tokens_per_s": times["tokens"][-1] / gen_s, "update_s": step - gen_s,
           "step_s": step}  # fmt: skip
    print("TRL GRPOTrainer SmolLM2-135M", json.dumps(out), flush=True)
    return out


def main() -> int:
    from lit_rl.run.hardware import peak_flops

    nominal, source = peak_flops("bf16-mixed", "cpu" if SMOKE else "gpu")
    peaks = {"nominal": nominal / 1e12, "measured_matmul": measured_matmul_tflops()}
    result = {
        "gpu": None if SMOKE else torch.cuda.get_device_name(),
        "smoke": SMOKE,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "layout": f"{PROMPTS} prompts x G={G} x {NEW_TOKENS} new tokens, prompts of {PROMPT_LEN} tokens",
        "peak_tflops": peaks,
        "peak_source": source,
        "models": {},
        "trl_grpo_trainer": "not run yet",
    }
    print(json.dumps({k: v for k, v in result.items() if k != "models"}), flush=True)
    folder = os.environ.get("GPU_CHECK_REPORT")
    for name, (kind, fields) in MODELS.items():
        result["models"][name] = time_model(name, kind, fields, peaks)
        if folder:  # after each model: a timeout leaves what finished
            with open(os.path.join(folder, "timings.json"), "w") as f:
                json.dump(result, f, indent=2)
    try:
        import trl
    except ImportError:
        result["trl_grpo_trainer"] = "trl not installed (scripts/gpu_wheels.txt carries it)"
    else:
        try:
            result["trl_grpo_trainer"] = {"trl": trl.__version__, **trl_step(MODELS["SmolLM2-135M"][1])}
        except Exception as e:  # noqa: BLE001 - reported; the lit_rl figures above stand
            result["trl_grpo_trainer"] = f"failed: {type(e).__name__}: {e}"
    if folder:
        with open(os.path.join(folder, "timings.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({"trl_grpo_trainer": result["trl_grpo_trainer"]}), flush=True)
    return 0


if __name__ == "__main__":
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("gpu_timings.py needs a CUDA device")
    sys.exit(main())
