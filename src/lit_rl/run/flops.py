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

    @classmethod
    def from_config(cls, config, num_parameters: int | None = None) -> "FlopModel":
        """From a transformers config of a Llama-family model (hidden_size, intermediate_size,
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size). A config without
        ``intermediate_size`` (another architecture) takes N = ``num_parameters`` (the model's parameter
        count) instead; raises ValueError if that is not given either."""
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

    @property
    def attention_unit(self) -> int:
        """layers · heads · head_dim: the attention FLOPs per (query, key) pair are a multiple of it."""
        return self.layers * self.heads * self.head_dim

    def update_flops(self, seq_lengths) -> float:
        """FLOPs of one forward + backward pass over sequences of ``seq_lengths`` (ints: S_i, valid prompt +
        response tokens): 6·N·ΣS_i + 12·layers·heads·head_dim·ΣS_i²."""
        lengths = [int(s) for s in seq_lengths]
        return 6.0 * self.dense_params * sum(lengths) + 12.0 * self.attention_unit * sum(s * s for s in lengths)

    def rollout_flops(self, prompt_lengths, response_lengths) -> float:
        """FLOPs of generating ``response_lengths`` (T_i) tokens after prompts of ``prompt_lengths`` (P_i),
        one token at a time with a KV cache: 2·N per generated token plus 4·layers·heads·head_dim·t for the
        token at position t (it attends to t keys). The prompt's prefill is not counted."""
        total = 0.0
        for p, t in zip(prompt_lengths, response_lengths):
            p, t = int(p), int(t)
            positions = t * p + t * (t + 1) // 2  # Σ_{k=p+1}^{p+t} k
            total += 2.0 * self.dense_params * t + 4.0 * self.attention_unit * positions
        return total
