"""``model``: what the policy is, and its LoRA adapter (``models.ModelSpec`` and ``models.LoraSpec`` mirror them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraConfig:
    """``model.lora``: a LoRA adapter trained with PEFT on the frozen base (``models.LoraSpec`` mirrors it)."""

    #: the adapter's rank; 0 = off (full fine-tuning)
    r: int = 0
    #: the scale is alpha / r (Hu et al. 2021, eq. 3)
    alpha: float = 16.0
    #: dropout on the adapter's input (PEFT's lora_dropout), in [0, 1)
    dropout: float = 0.0
    #: module-name suffixes that get an adapter: the attention and MLP projections (Phi-3's fused ones too)
    target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "qkv_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "gate_up_proj",
        ]
    )
    #: policy/ at the end holds the adapter (false) or the merged full model (true)
    merge_on_export: bool = False


@dataclass
class ModelConfig:
    """``model``: what to load (``models.ModelSpec`` mirrors it)."""

    #: ``tiny`` (random-init 2-layer Llama), a hub id (org/name) or a local folder
    name_or_path: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    #: weights' dtype: float32 (training keeps float32 master weights) | bfloat16
    dtype: str = "float32"
    #: sdpa | eager | flash_attention_2 (CUDA with the flash_attn package; refused on the CPU)
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    #: recompute layer activations in backward (less memory, ~15% more time)
    gradient_checkpointing: bool = False
    #: seed of the random initialisation (``tiny`` only)
    init_seed: int = 0
    #: LoRA adapter (r = 0: off)
    lora: LoraConfig = field(default_factory=LoraConfig)
