"""FLOP counts of an RL step, for ``perf/update_tflops``, ``perf/rollout_tflops`` and ``perf/mfu``.

The convention is verl's ``FlopsCounter`` (verl/utils/flops_counter.py, the dense decoder estimate):

    update:  6 · N · Σ_i S_i  +  12 · layers · heads · head_dim · Σ_i S_i²      (forward + backward)
    rollout: 2 · N · Σ_i T_i  +   4 · layers · heads · head_dim · Σ_i Σ_{t=P_i+1}^{P_i+T_i} t   (forward)

with S_i = P_i + T_i the valid prompt and response tokens of sequence i, and N the dense parameter count
(``dense_params``). The update's attention term counts the full S×S score and value products (no causal
halving, as verl); a generated token at position t attends to t keys (QKᵀ and the value sum, 2·t·head_dim
each per head). Activation recompute (gradient checkpointing) is not counted, nor are the extra forward
passes some settings add (the reference model for the KL, π_old snapshots, stale-row scoring): MFU is then
a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlopModel:
    """The numbers of a decoder-only transformer that the FLOP count needs.

    dense_params: N, parameters that multiply every token (verl: per layer the MLP's 3·hidden·intermediate
        and the attention projections hidden·(q + k + v + o), plus embedding and LM head 2·vocab·hidden,
        counted twice even when tied).
    layers, heads, head_dim: for the attention term.
    """

    dense_params: int
    layers: int
    heads: int
    head_dim: int
    #: Gated DeltaNet hybrids: Σ over the linear-attention layers of value heads · key dim · value dim (each
    #: token's state update and read cost 8 FLOPs per state entry in the forward: decay, Sᵀk, the rank-one
    #: update, Sᵀq); 0 for attention-only models. ``layers`` then counts the full-attention layers only
    linear_unit: int = 0

    @classmethod
    def from_config(cls, config, num_parameters: int | None = None) -> "FlopModel":
        """From a transformers config of a Llama-family model (hidden_size, intermediate_size,
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size). A config without
        ``intermediate_size`` (another architecture) takes N = ``num_parameters`` (the model's parameter
        count) instead; raises ValueError if that is not given either."""
        if "linear_attention" in (getattr(config, "layer_types", None) or ()):
            return cls.hybrid(config)
        hidden, layers = config.hidden_size, config.num_hidden_layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        intermediate = getattr(config, "intermediate_size", None)
        if intermediate is None:
            if num_parameters is None:
                raise ValueError(f"{type(config).__name__} has no intermediate_size: pass num_parameters")
            return cls(int(num_parameters), layers, heads, head_dim)
        mlp = 3 * hidden * intermediate  # gate, up, down (SwiGLU)
        attention = hidden * (heads * head_dim + 2 * kv_heads * head_dim + heads * head_dim)  # q, k, v, o
        embeddings = 2 * config.vocab_size * hidden  # embedding + LM head
        return cls((mlp + attention) * layers + embeddings, layers, heads, head_dim)

    @classmethod
    def hybrid(cls, config) -> "FlopModel":
        """From a Gated DeltaNet hybrid's config (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: ``layer_types``). Per
        linear-attention layer N counts its projections (q, k, v: hidden·(2·Hk·dk + Hv·dv); the output gate z and
        out_proj: 2·hidden·Hv·dv; the decay and write rate: 2·hidden·Hv) and the depthwise conv
        ((2·Hk·dk + Hv·dv)·kernel); per full-attention layer q (doubled: its output gate), k, v, o; per layer the
        MLP, or for a mixture of experts the ``num_experts_per_tok`` experts a token runs, the shared expert and the
        router; plus embedding and LM head. The state term goes to ``linear_unit``, the S² term to the
        full-attention layers only."""
        hidden, types = config.hidden_size, list(config.layer_types)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        conv = 2 * hk * dk + hv * dv
        linear = hidden * conv + 2 * hidden * hv * dv + 2 * hidden * hv + conv * config.linear_conv_kernel_dim
        attention = hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim + heads * head_dim)
        experts = int(getattr(config, "num_experts", 0) or 0)
        if experts:
            mlp = 3 * hidden * config.moe_intermediate_size * config.num_experts_per_tok + hidden * experts
            mlp += 3 * hidden * int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        else:
            mlp = 3 * hidden * config.intermediate_size
        n_linear = types.count("linear_attention")
        dense = n_linear * linear + (len(types) - n_linear) * attention + len(types) * mlp
        dense += 2 * config.vocab_size * hidden
        return cls(dense, len(types) - n_linear, heads, head_dim, linear_unit=n_linear * hv * dk * dv)

    @property
    def attention_unit(self) -> int:
        """layers · heads · head_dim: the attention FLOPs per (query, key) pair are a multiple of it."""
        return self.layers * self.heads * self.head_dim

    def update_flops(self, seq_lengths) -> float:
        """FLOPs of one forward + backward pass over sequences of ``seq_lengths`` (ints: S_i, valid prompt +
        response tokens): 6·N·ΣS_i + 12·layers·heads·head_dim·ΣS_i² (+ 24·linear_unit·ΣS_i for hybrids)."""
        lengths = [int(s) for s in seq_lengths]
        tokens = sum(lengths)
        state = 3 * 8.0 * self.linear_unit * tokens  # forward + backward of the linear-attention states
        return 6.0 * self.dense_params * tokens + 12.0 * self.attention_unit * sum(s * s for s in lengths) + state

    def rollout_flops(self, prompt_lengths, response_lengths) -> float:
        """FLOPs of generating ``response_lengths`` (T_i) tokens after prompts of ``prompt_lengths`` (P_i),
        one token at a time with a KV cache: 2·N per generated token plus 4·layers·heads·head_dim·t for the
        token at position t (it attends to t keys). The prompt's prefill is not counted."""
        total = 0.0
        for p, t in zip(prompt_lengths, response_lengths):
            p, t = int(p), int(t)
            positions = t * p + t * (t + 1) // 2  # Σ_{k=p+1}^{p+t} k
            total += (2.0 * self.dense_params + 8.0 * self.linear_unit) * t + 4.0 * self.attention_unit * positions
        return total
