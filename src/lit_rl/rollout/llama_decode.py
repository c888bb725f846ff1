"""The embedded engine's cached decode step on a Llama model without transformers' per-module plumbing, its sibling
projections fused.

A cached decode step feeds one token per row through every layer. transformers' ``LlamaForCausalLM`` forward does
the arithmetic of that step through ~25 module calls a layer (each with its hooks, keyword plumbing and deprecation
wrappers) and three separate products on the same input for the query, key and value projections (two for the gate
and up projections). ``decode_logits`` runs the same operations in the same order, calling each norm's and
projection's own forward and transformers' own rotary embedding (its cos and sin; the rotation ``q * cos +
rotate_half(q) * sin`` in 4 calls a layer instead of 16, the same float operations: ``_rotary``), causal-mask builder
and registered attention function, so the logits are the same bits; where the engine's products run from oneDNN's
packed weights (``engine.packed_linear``), the q/k/v projections are one packed product of the three weights stacked
and gate/up another (``WeightCasts.fused_linear``), where ``kernels.packed_linear.fused_differ`` found the stacked
product's bits equal to the separate ones on the model's shapes.

Measured on SmolLM2-135M (AMD EPYC with AVX512-BF16, 2 threads, ``benchmarks/decode_roofline.py``, the numbers in
benchmarks/README.md): the per-step time falls most at small batches, where the plumbing is a larger part of it.

Where it runs: the model is exactly transformers' ``LlamaForCausalLM`` of ``LlamaDecoderLayer`` s (``unsupported``
says why not otherwise: another architecture, a subclass), with no forward hook and no instance ``forward`` on a
module it bypasses at the rollout's start (``rerouted``; a linear layer of another class, such as a LoRA layer, runs
its own forward, unstacked), not under ``kernels=batch_invariant`` (whose reference path is transformers' forward),
and only after ``DecodeParity.ok`` ran one decode step both ways on the model at the rollout's dtype, threads and
packing and found the logits equal bit for bit (a transformers version whose Llama forward does something else falls
back to it with a message). The engine's prefill, refills and re-prefills keep transformers' forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import BatchInvariantMode

_LLAMA = None


def _llama():
    global _LLAMA
    if _LLAMA is None:
        from transformers.models.llama import modeling_llama

        _LLAMA = modeling_llama
    return _LLAMA


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def rerouted(model: torch.nn.Module) -> str:
    """ "" when nothing set on ``model`` since it was built would be skipped by ``decode_logits``, else what: a
    forward hook (a module's or a global one), or an instance ``forward`` on a module it does not call through its
    ``forward`` (the model, its layers, attention and MLP blocks and norms; a linear layer's own ``forward``, as
    ``WeightCasts.installed`` sets, is called). Asked at every rollout (``DecodeParity.ok``)."""
    if _global_hooks():
        return "a global forward hook is registered"
    for name, module in model.named_modules():
        if _hooked(module):
            return f"{name or 'the model'} has a forward hook"
        if "forward" in vars(module) and not isinstance(module, torch.nn.Linear):
            return f"{name or 'the model'} has its own forward set on the instance"
    return ""


def unsupported(model: torch.nn.Module) -> str:
    """ "" when ``decode_logits`` can run ``model``'s decode steps by its classes, else why not (the model's
    class, a layer of another class); ``rerouted`` says whether hooks or instance forwards set later are in the way."""
    ll = _llama()
    if type(model) is not ll.LlamaForCausalLM or type(model.model) is not ll.LlamaModel:
        return f"{type(model).__name__} is not transformers' LlamaForCausalLM"
    layers = list(model.model.layers)
    for layer in layers:
        kinds = (
            (layer, ll.LlamaDecoderLayer),
            (layer.self_attn, ll.LlamaAttention),
            (layer.mlp, ll.LlamaMLP),
            (layer.input_layernorm, ll.LlamaRMSNorm),
            (layer.post_attention_layernorm, ll.LlamaRMSNorm),
        )
        for module, kind in kinds:
            if type(module) is not kind:
                return f"{type(module).__name__} where LlamaForCausalLM has {kind.__name__}"
    if type(model.model.norm) is not ll.LlamaRMSNorm:
        return f"final norm {type(model.model.norm).__name__}"
    return ""


def _call(module: torch.nn.Module, x: Tensor) -> Tensor:
    """``module(x)`` without ``nn.Module.__call__``'s hook plumbing (``rerouted`` refused hooked models): the
    instance's own forward where one is set (``WeightCasts.installed`` routes linear layers so), else its class's."""
    own = vars(module).get("forward")
    return own(x) if own is not None else type(module).forward(module, x)


def _rotary(x: Tensor, cos: Tensor, sin_signed: Tensor, half: int) -> Tensor:
    """transformers' ``(x * cos) + (rotate_half(x) * sin)``, the same bits, with ``sin_signed`` = sin with its first
    half negated (``decode_logits``)."""
    return (x * cos) + (torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed)


def decode_logits(model, casts, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache) -> Tensor:
    """The logits [B, V] of one cached decode step of a ``LlamaForCausalLM`` (``unsupported`` is ""): input_ids
    [B, 1] int64, attention_mask [B, L] (the context and the new position), position_ids [B, 1] int64, ``cache`` the
    engine's ``DynamicCache`` (written in place, as transformers' forward writes it). ``casts``: the engine's
    ``WeightCasts``, installed on ``model`` (its packed and fused products, where on). The same operations as
    ``model(input_ids=..., attention_mask=..., position_ids=..., cache=cache, use_cache=True,
    logits_to_keep=1).logits[:, -1]`` (transformers 5's modeling_llama), in the same order."""
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ll = _llama()
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    mask = create_causal_mask(
        config=inner.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache, position_ids=position_ids
    )
    cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # as apply_rotary_pos_emb unsqueezes them, once a step
    half = sin.shape[-1] // 2
    # rotate_half(x) * sin = cat(-x2, x1) * sin = cat(x2, x1) * cat(-s1, s2) elementwise: (-a) * b and a * (-b) are
    # the same float, so the sign goes into sin once a step and each layer's q and k take one cat, not a neg and a cat
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(inner.config._attn_implementation, ll.eager_attention_forward)
    for layer in inner.layers[: inner.config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        residual = hidden
        x = ll.LlamaRMSNorm.forward(layer.input_layernorm, hidden)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        qkv = casts.fused_linear(x, (attn.q_proj, attn.k_proj, attn.v_proj), split=False)
        if qkv is None:
            q, k, v = (_call(m, x).view(shape).transpose(1, 2) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
            q, k = (_rotary(t, cos, sin_signed, half) for t in (q, k))
        else:  # q and k side by side in one product: rotated together (elementwise, so the same bits)
            heads = attn.q_proj.out_features // attn.head_dim
            qk = attn.q_proj.out_features + attn.k_proj.out_features
            qk_rotated = _rotary(qkv[..., :qk].view(shape).transpose(1, 2), cos, sin_signed, half)
            q, k, v = qk_rotated[:, :heads], qk_rotated[:, heads:], qkv[..., qk:].view(shape).transpose(1, 2)
        k, v = cache.update(k, v, attn.layer_idx)
        out, _ = attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
        out = out.reshape(*x.shape[:-1], -1).contiguous()
        hidden = residual + _call(attn.o_proj, out)
        residual = hidden
        x = ll.LlamaRMSNorm.forward(layer.post_attention_layernorm, hidden)
        gate_up = casts.fused_linear(x, (mlp.gate_proj, mlp.up_proj))
        gate, up = gate_up if gate_up is not None else [_call(m, x) for m in (mlp.gate_proj, mlp.up_proj)]
        hidden = residual + _call(mlp.down_proj, mlp.act_fn(gate) * up)
    hidden = ll.LlamaRMSNorm.forward(inner.norm, hidden)
    return _call(model.lm_head, hidden[:, -1:, :])[:, -1]


class DecodeParity:
    """Whether ``decode_logits`` runs an engine's decode steps: ``ok(engine, model)`` decides once per rollout
    (``begin``: the engine calls it as each rollout starts; the answer is kept for the rollout's later decode
    steps). It asks ``unsupported`` once per model and ``rerouted`` once per rollout, and, per (model,
    dtype, autocast, threads, packing), runs one decode step of two short rows (one left-padded) both ways from copies
    of one prefilled cache and compares the logits bit for bit (an exception in lit_rl's step counts as a difference);
    prints each new reason once (why not, where it is off). Off under ``kernels=batch_invariant`` and where
    ``enabled`` is False (an attribute of this engine; a rollout process's engine has its own)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._why: dict[int, str] = {}
        self._checked: dict[tuple, bool] = {}
        self._said: set[str] = set()
        self._now: bool | None = None  # this rollout's answer (None: not decided yet)

    def begin(self) -> None:
        """A rollout starts: ``ok`` decides again at its first decode step."""
        self._now = None

    def _say(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            print(f"lit_rl: decode steps through transformers' forward ({why})", flush=True)

    def ok(self, engine, model: torch.nn.Module) -> bool:
        if self._now is None:
            self._now = self._decide(engine, model)
        return self._now

    def _decide(self, engine, model: torch.nn.Module) -> bool:
        if not self.enabled or BatchInvariantMode._active is not None:
            return False
        why = self._why.get(id(model))
        if why is None:
            why = self._why[id(model)] = unsupported(model)
        why = why or rerouted(model)
        if why:
            self._say(why)
            return False
        device = next(model.parameters()).device.type
        key = (
            id(model),
            next(model.parameters()).dtype,
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None,
            torch.get_num_threads(),
            engine.casts._pack_threads,
        )
        if key not in self._checked:
            same = self._parity(engine, model)
            self._checked[key] = same
            print(
                "lit_rl: decode steps through lit_rl's Llama step (the same logits bits as transformers' forward, "
                "checked)" if same else "lit_rl: decode steps through transformers' forward (lit_rl's Llama step "
                "gave other logits bits on this model and settings)",
                flush=True,
            )  # fmt: skip
        return self._checked[key]

    @staticmethod
    def _parity(engine, model) -> bool:
        import copy

        from ..logprobs import position_ids_from_mask

        device = next(model.parameters()).device
        vocab = model.config.vocab_size
        ids = torch.tensor([[0, 5 % vocab, 7 % vocab], [3 % vocab, 11 % vocab, 2 % vocab]], device=device)
        mask = torch.tensor([[0, 1, 1], [1, 1, 1]], device=device)
        with torch.no_grad():
            cache = engine._new_cache(8)
            model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), cache=cache,
                  use_cache=True, logits_to_keep=1)  # fmt: skip
            step_ids = torch.tensor([[13 % vocab], [17 % vocab]], device=device)
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device=device)], dim=1)
            positions = position_ids_from_mask(step_mask)[:, -1:]
            other = copy.deepcopy(cache)
            ref = model(input_ids=step_ids, attention_mask=step_mask, position_ids=positions, cache=cache,
                        use_cache=True, logits_to_keep=1).logits[:, -1]  # fmt: skip
            try:
                got = decode_logits(model, engine.casts, step_ids, step_mask, positions, other)
            except Exception as err:  # noqa: BLE001  (anything it cannot run: transformers' forward instead)
                print(f"lit_rl: lit_rl's Llama step failed on this model ({type(err).__name__}: {err})", flush=True)
                return False
        return bool(torch.equal(ref, got))
