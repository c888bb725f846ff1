"""``model``: what the policy is and its LoRA adapter, as the config groups give them and ``models.load_policy``
loads them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: ``model.lora.target_modules`` default: the attention and MLP projections of the families lit_rl is tested on
#: (Llama, Qwen2/3, Mistral, Gemma: q/k/v/o_proj, gate/up/down_proj; Phi-3: fused qkv_proj and gate_up_proj) and
#: the Gated DeltaNet projections (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj; Qwen3-Next:
#: in_proj_qkvz, in_proj_ba). PEFT matches them as name suffixes; the names a model lacks are skipped.
LORA_TARGETS = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"),
    *("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "in_proj_qkvz", "in_proj_ba", "out_proj"),
)


@dataclass
class LoraConfig:
    """``model.lora``: a LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3:
    h = W0 x + (alpha / r) B A x) trained with PEFT on the frozen base. ``r = 0``: off (full fine-tuning)."""

    #: the adapter's rank; 0 = off (full fine-tuning)
    r: int = 0
    #: the scale is alpha / r (Hu et al. 2021, eq. 3)
    alpha: float = 16.0
    #: dropout on the adapter's input (PEFT's lora_dropout), in [0, 1); acts only with ``model.keep_dropout=true``
    dropout: float = 0.0
    #: module-name suffixes that get an adapter: the attention and MLP projections (Phi-3's fused ones too) and
    #: the Gated DeltaNet projections
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    #: policy/ at the end holds the adapter (false) or the merged full model (true)
    merge_on_export: bool = False


@dataclass
class ModelConfig:
    """``model``: what to load (``models.load_policy``). ``lora`` may be given as a mapping of its fields."""

    #: ``tiny`` (random-init 2-layer Llama), a hub id (org/name) or a local folder
    name_or_path: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    #: weights' dtype: float32 (training keeps float32 master weights) | bfloat16
    dtype: str = "float32"
    #: sdpa | eager | flash_attention_2 (CUDA with the flash_attn package; refused on the CPU)
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    #: recompute layer activations in backward (less memory, ~15% more time)
    gradient_checkpointing: bool = False
    #: false: every dropout probability (the checkpoint's attention / hidden / embedding dropout, and
    #: ``lora.dropout``) is 0 in the trainer's forward, as deterministic as the engine's and the reference's (which
    #: run in eval mode); true: keep them, and ``train/logprob_abs_diff`` then measures the dropout noise too
    keep_dropout: bool = False
    #: seed of the random initialisation (``tiny`` only)
    init_seed: int = 0
    #: LoRA adapter (r = 0: off)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        if isinstance(self.lora, Mapping):
            self.lora = LoraConfig(**self.lora)
