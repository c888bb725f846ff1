"""Tiny random models of the architectures people train, saved as loadable folders (``model.name_or_path``).

Each family keeps what sets it apart from Llama (``FAMILIES``: Qwen2's biased q/k/v, Qwen3's q/k norms, Llama 3's
rope scaling, Gemma's scaled embeddings and (1 + weight) norms, Gemma-2/3's logit soft-capping and sliding-window
layers, Mistral's sliding window, Phi-3's fused qkv / gate_up), at the tiny model's size (2 layers, hidden 64,
head_dim 32: vLLM's CPU attention needs head_dim >= 32), with the SmolLM2 tokenizer and its chat template (as the
``tiny`` model). Sliding windows are 8 tokens, shorter than the tests' prompts, so the window is exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lit_rl.models import SMOLLM2_ID, load_tokenizer

#: the tiny model's shape, shared by every family
BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
WINDOW = 8

#: family -> (transformers config class, what differs from ``BASE``)
FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),  # q/k/v projections with biases
    "qwen3": ("Qwen3Config", {"use_sliding_window": False}),  # RMSNorm on q and k per head
    "llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,  # short, so the scaled frequencies matter
            }
        },
    ),
    "gemma": ("GemmaConfig", {"hidden_activation": "gelu_pytorch_tanh"}),  # sqrt(H)-scaled embeddings, 1 + w norms
    "gemma2": (
        "Gemma2Config",
        {
            "final_logit_softcapping": 3.0,  # small caps, so that the tanh bends the tiny model's logits
            "attn_logit_softcapping": 2.0,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 32,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "final_logit_softcapping": 3.0,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 32,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "phi3": ("Phi3Config", {"sliding_window": None, "pad_token_id": None}),  # fused qkv_proj and gate_up_proj
}

#: Gated DeltaNet hybrids: 4 layers, 3 linear-attention (conv + recurrent state) and 1 full attention (gated
#: q, partial rope), linear heads of 32 (4 key heads, 16 value heads: the grouped form is exercised, and 16 value
#: heads fill whole float32 vectors, as every released model's 16-64: see kernels.linear_attention.check_vector_width)
LINEAR = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=4,
    linear_num_value_heads=16,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
HYBRIDS: dict[str, tuple[str, dict]] = {
    "qwen3_5": ("Qwen3_5TextConfig", LINEAR),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {**LINEAR, **MOE}),
    "qwen3_next": ("Qwen3NextConfig", {**LINEAR, **MOE, "decoder_sparse_step": 1, "mlp_only_layers": []}),
}

#: families whose layers attend through a sliding window
SLIDING = ("gemma2", "gemma3", "mistral")


def family_config(family: str, vocab_size: int, **overrides):
    """The transformers config of a tiny ``family`` model (``FAMILIES``), ``overrides`` applied last."""
    import transformers

    cls, extra = {**FAMILIES, **HYBRIDS}[family]
    kwargs = {**BASE, **extra, "vocab_size": vocab_size, **overrides}
    if family == "phi3":  # Phi-3 derives head_dim from hidden / heads and has no head_dim argument
        kwargs.pop("head_dim")
    return getattr(transformers, cls)(**kwargs)


def build_family(family: str, folder: str | Path, seed: int = 0, **overrides) -> Path:
    """Save a random-init tiny ``family`` model (float32 safetensors) and the SmolLM2 tokenizer into ``folder``.

    Weights are drawn with ``seed``; norm weights are perturbed too, so a norm formula that ignores them (or
    Gemma's 1 + w) cannot pass a parity test by chance. Returns the folder.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    tokenizer = load_tokenizer(SMOLLM2_ID)
    config = family_config(family, len(tokenizer), **overrides)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
