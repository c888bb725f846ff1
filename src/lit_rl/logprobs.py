"""Per-token log-probs of responses under the trainer's policy, without materialising [N, T, V] logits.

The backbone runs once on ``[prompt | response]``; the output projection, the model's own head-side
transform (``head_transform``: Gemma-2/3's final soft-capping, Cohere's and Granite's logit scaling), log-softmax
and gather run in chunks of rows under activation checkpointing, so at most ``chunk_tokens x V`` float32 logits
exist at a time, in the forward and in the backward pass alike. ``check_head_parity`` proves at start-up that
this equals log_softmax of the model's own ``model(...).logits``, so a head-side transform of an architecture
not listed here is refused rather than silently trained on another distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .rollout.weight_casts import linear_params


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """[N, L] bool/int mask -> [N, L] int64 positions: 0 at each row's first real token, counting up.

    Left padding gets position 0 (it is masked out of attention anyway). The engine and the trainer both
    use this, so the same token sits at the same rotary position in both.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def support_mask(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """bool [..., V]: the tokens a top-k / top-p sampler may draw (True = kept), from float logits [..., V]
    already divided by the temperature. top_k = 0 and top_p = 1 keep everything; top-k applies first, then
    top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p (as vLLM and
    transformers' samplers do). Ties at the k-th logit are all kept."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        keep = logits >= kth
    if top_p < 1.0:
        masked = logits.masked_fill(~keep, float("-inf"))
        sorted_logits, order = torch.sort(masked, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # mass before this token already reaches top_p
        keep = keep & ~torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return keep


def process_logits(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Log-probs of the distribution a sampler with these settings draws from.

    logits: [..., V] any float dtype; returns float32 [..., V] log-probs (nats), -inf outside the
    top-k / top-p support (``support_mask``). temperature must be > 0; at 1 the division is skipped (x / 1 is x
    exactly: a pass over [..., V] saved, no bit changed).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k or top_p < 1.0:
        logits = logits.masked_fill(~support_mask(logits, top_k, top_p), float("-inf"))
    return F.log_softmax(logits, dim=-1)


@dataclass(frozen=True)
class HeadTransform:
    """What a causal LM does to its output layer's logits before returning them (transformers' ``forward``).

    softcap: c of ``c * tanh(z / c)`` (``config.final_logit_softcapping``: Gemma-2, Gemma-3), or None;
    scale: a factor ``z * scale`` (Cohere's ``logit_scale``; Granite's ``1 / logits_scaling``), 1.0 if none.
    ``__call__``: float logits [..., V] -> transformed logits, same shape and dtype (scale, then soft-cap,
    as those models apply them).
    """

    softcap: float | None = None
    scale: float = 1.0

    def __call__(self, logits: Tensor) -> Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def identity(self) -> bool:
        return not self.softcap and self.scale == 1.0


def head_transform(model: torch.nn.Module) -> HeadTransform:
    """The head-side logit transform of ``model`` read from its config (``HeadTransform``): Gemma-2/3's
    ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``. Transforms of other
    architectures are caught by ``check_head_parity``, not guessed here."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config  # multimodal wrappers keep the LM's config inside
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = 1.0
    if isinstance(getattr(config, "logit_scale", None), (int, float)):
        scale *= float(config.logit_scale)
    if isinstance(getattr(config, "logits_scaling", None), (int, float)) and config.logits_scaling:
        scale /= float(config.logits_scaling)
    return HeadTransform(float(softcap) if softcap else None, scale)


@torch.no_grad()
def check_head_parity(model: torch.nn.Module, vocab_size: int | None = None, tokens: int = 8) -> float:
    """Largest |trainer log-prob - log_softmax(model(...).logits)| (nats) over a short random sequence.

    The trainer scores with the backbone, the output layer and ``head_transform``; this runs the model's own
    ``forward`` on ``tokens`` random ids (seeded; a left-padded second row too) in eval mode (no dropout) and
    compares. Raises ValueError naming the model class when the gap exceeds 1e-3 nats (float32 weights) or
    5e-2 (16-bit): the model transforms its logits in a way lit_rl does not reproduce, and training on it
    would optimise another distribution than the one it samples.
    """
    was_training = model.training
    model.eval()
    try:
        param = next(model.parameters())
        rows = model.get_output_embeddings().weight.shape[0]
        vocab = min(vocab_size or rows, rows, model.get_input_embeddings().weight.shape[0])
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (2, tokens), generator=g).to(param.device)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0  # a left-padded row, as the trainer's batches have
        p = tokens // 2
        scores = response_logprobs(
            model, ids[:, :p], mask[:, :p], ids[:, p:], mask[:, p:].bool(), with_entropy=False
        ).logprobs
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False
        ).logits
        own = F.log_softmax(logits.float(), -1)[:, p - 1 : -1].gather(-1, ids[:, p:, None]).squeeze(-1)
    finally:
        model.train(was_training)
    gap = (scores - own).abs().max().item()
    tol = 1e-3 if param.dtype == torch.float32 else 5e-2
    if not gap <= tol:
        raise ValueError(
            f"{type(model).__name__}: the trainer's log-probs (backbone -> output layer -> {head_transform(model)}) "
            f"differ from log_softmax of the model's own logits by {gap:.3g} nats (> {tol}): the model transforms "
            f"its logits in a way lit_rl does not reproduce (a head-side transform it does not know), so it "
            f"cannot be trained here"
        )
    return gap


@dataclass
class TokenScores:
    """The trainer's view of a batch of responses (N rows, T response positions).

    logprobs: [N, T] float32 log pi(y_t) with gradient; entropy: [N, T] float32 (with gradient only when asked,
    ``response_logprobs(entropy_grad=True)``: the entropy bonus);
    head_logprobs: [N, T, k] float32 log pi at given ids (the engine's top-k), with gradient, or None;
    hidden: [N, T, H] backbone states that predict each response token (for a value head), or None.
    All are 0 on padding.
    """

    logprobs: Tensor
    entropy: Tensor
    head_logprobs: Tensor | None = None
    hidden: Tensor | None = None


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    head_ids: Tensor | None,
    top_k: int = 0,
    top_p: float = 1.0,
    transform: HeadTransform | None = None,
    entropy_grad: bool = False,
):
    logits = F.linear(hidden, weight, bias)
    if transform is not None and not transform.identity:
        # in the output layer's dtype (bf16 under autocast), as the model's own forward -- and so the sampler --
        # applies it: capped in float32 instead, a Gemma-2 run under bf16-mixed was 2e-4 per token off the engine
        logits = transform(logits)
    logits = logits.float() / temperature
    if top_k or top_p < 1.0:  # the sampler's truncated distribution; the sampled token always in its support
        with torch.no_grad():
            keep = support_mask(logits, top_k, top_p)
            keep.scatter_(-1, targets.unsqueeze(-1), True)
        logits = logits.masked_fill(~keep, float("-inf"))
    logp = F.log_softmax(logits, dim=-1)
    # one gather for the sampled token and the SC head: its backward scatters into a single [rows, V] buffer
    ids = targets.unsqueeze(-1) if head_ids is None else torch.cat([targets.unsqueeze(-1), head_ids], dim=-1)
    picked = logp.gather(-1, ids)
    token_logp = picked[:, 0]
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # p·log p with log p := 0 outside the support (p = 0 there), so no inf·0 reaches the backward
            entropy = -(logp.exp() * torch.where(torch.isfinite(logp), logp, 0.0)).sum(-1)
    else:
        entropy = torch.zeros_like(token_logp)
    return token_logp, entropy, picked[:, 1:]


class FusedChunkLogprobs(torch.autograd.Function):
    """``_chunk_logprobs`` without top-k/top-p truncation or a head-side transform, with its backward written out:
    the same values (up to float32 rounding: log-sum-exp instead of log-softmax) and gradients, in about a third of
    the passes over the [rows, V] logits.

    forward(hidden [R, H], weight [V, H], bias [V] or None, targets [R] int64, head_ids [R, k] int64 or None,
    temperature > 0, with_entropy, entropy_grad, chunk_tokens (rows per chunk; None: all R at once)) ->
    (token log-probs [R], entropies [R], head log-probs [R, k]), float32. z = (hidden W^T + b) / T in float32
    (the product in the autocast dtype, as the model's own forward); log p(y) = z_y - logsumexp(z);
    H = logsumexp(z) - sum_v p_v z_v. Only hidden, the ids and the [R] log-sum-exp are kept; the backward
    recomputes z (one product, as activation checkpointing did) and applies d log p(y) / dz = onehot(y) - p and
    dH / dz = -p (log p + H) (the latter only with ``entropy_grad``; otherwise the entropy is a detached
    diagnostic), then the two products of the linear layer's backward. Autocast is restored in the backward as it
    was in the forward (``torch.amp.custom_bwd``).

    The rows run in chunks of ``chunk_tokens`` (the [chunk, V] float32 logits alive at once), all in one call:
    under autocast the weight is cast once for the forward's chunks and once for the backward's (a call per chunk
    under autocast as Lightning enters it, ``cache_enabled=False``, cast the [V, H] weight three times a chunk:
    113 MB each in float32 for SmolLM2), and the weight's gradient is summed over the chunks in float32 in one
    buffer (each chunk's bf16 product converted and added, as autograd summed one float32 gradient per chunk
    before). The same values and gradients as one call per chunk, up to the order of that float32 sum.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(
        ctx, hidden, weight, bias, targets, head_ids, temperature, with_entropy, entropy_grad, chunk_tokens=None
    ):
        w = _autocast_weight(weight)
        ids = targets.unsqueeze(-1) if head_ids is None else torch.cat([targets.unsqueeze(-1), head_ids], dim=-1)
        rows = hidden.shape[0]
        step = max(1, chunk_tokens or rows)
        lse = hidden.new_empty(rows, dtype=torch.float32)
        picked = hidden.new_empty(ids.shape, dtype=torch.float32)
        entropy = hidden.new_zeros(rows, dtype=torch.float32)
        for start in range(0, rows, step):
            part = slice(start, start + step)
            z = F.linear(hidden[part], w, bias).float()
            if temperature != 1.0:
                z = z / temperature
            lse[part] = torch.logsumexp(z, dim=-1)
            picked[part] = z.gather(-1, ids[part]) - lse[part].unsqueeze(-1)
            if with_entropy:
                # sum_v p_v z_v as an elementwise product and a sum: float32 under autocast too (a dot product
                # would be cast to bf16)
                entropy[part] = lse[part] - (z - lse[part].unsqueeze(-1)).exp_().mul_(z).sum(-1)
        ctx.entropy_grad = bool(with_entropy and entropy_grad)
        ctx.temperature = float(temperature)
        ctx.has_bias = bias is not None
        ctx.step = step
        ctx.save_for_backward(hidden, weight, bias if bias is not None else weight.new_empty(0), ids, lse, entropy)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return picked[:, 0], entropy, picked[:, 1:]

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g_token, g_entropy, g_head):
        hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        w = _autocast_weight(weight)
        g_ids = g_token.unsqueeze(-1) if g_head is None else torch.cat([g_token.unsqueeze(-1), g_head], dim=-1)
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = grad_bias = None
        for start in range(0, hidden.shape[0], ctx.step):
            part = slice(start, start + ctx.step)
            logits = F.linear(hidden[part], w, bias)
            grad = _logit_grad(ctx, logits, lse[part], entropy[part], ids[part], g_ids[part], g_entropy, part)
            if want_hidden:
                grad_hidden[part] = grad @ w.to(logits.dtype)
            if want_weight:
                chunk = grad.t() @ hidden[part].to(logits.dtype)
                grad_weight = chunk.to(weight.dtype) if grad_weight is None else grad_weight.add_(chunk)
            if ctx.has_bias and want_bias:
                chunk = grad.sum(0)
                grad_bias = chunk.to(bias.dtype) if grad_bias is None else grad_bias.add_(chunk)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _autocast_weight(weight: Tensor) -> Tensor:
    """``weight`` as autocast's ``F.linear`` would cast it (to the CPU autocast dtype when autocast is on and the
    weight is float32), cast here once: the same values, so the same products."""
    if torch.is_autocast_enabled("cpu") and weight.dtype == torch.float32:
        return weight.to(torch.get_autocast_dtype("cpu"))
    return weight


def _logit_grad(ctx, logits, lse, entropy, ids, g_ids, g_entropy, part) -> Tensor:
    """The gradient of ``FusedChunkLogprobs``' outputs with respect to one chunk's logits, in their dtype."""
    z = logits.float()
    if ctx.temperature != 1.0:
        z = z / ctx.temperature  # (else z is the recomputed product itself: only its dtype is read below)
    g_sum = g_ids.sum(-1, keepdim=True)
    logp = z.sub_(lse.unsqueeze(-1))
    if ctx.entropy_grad and g_entropy is not None:
        p = logp.exp()
        # -g_sum p - g_H p (log p + H), in place over log p
        grad = p.mul_(logp.add_(entropy.unsqueeze(-1)).mul_(g_entropy[part].unsqueeze(-1)).add_(g_sum)).neg_()
    else:
        grad = logp.exp_().mul_(-g_sum)
    grad.scatter_add_(-1, ids, g_ids)
    if ctx.temperature != 1.0:
        grad = grad.div_(ctx.temperature)
    return grad.to(logits.dtype)


def fused_head_applies(top_k: int, top_p: float, transform: "HeadTransform | None") -> bool:
    """Whether ``FusedChunkLogprobs`` computes what ``_chunk_logprobs`` does: no top-k/top-p truncation, no
    head-side transform, and the batch-invariant kernels off (they own log-softmax; the fused path would not
    reduce as the engine's sampler does)."""
    from .kernels.batch_invariant import BatchInvariantMode

    plain = not top_k and top_p >= 1.0 and (transform is None or transform.identity)
    return plain and BatchInvariantMode._active is None


#: ``config.model_type`` of the families whose shared-prefix forward is tested equal to the one-forward path
#: (tests/test_families.py: Llama incl. SmolLM2 and Llama 3, Qwen2/3, Gemma 1-3 incl. sliding windows and
#: Gemma-2's attention soft-capping, Mistral's sliding window, Phi-3; tests/test_hybrids.py: the Gated DeltaNet
#: hybrids Qwen3.5, Qwen3.5-MoE, Qwen3-Next, whose completions continue the prompt's conv and recurrent states);
#: ``update.shared_prefix=auto`` is off for any other, ``true`` refuses it by name
SHARED_PREFIX_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "mistral",
    "phi3",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
)


def resolve_shared_prefix(setting, model: torch.nn.Module, group_size: int) -> tuple[bool, str]:
    """``update.shared_prefix`` (auto | True | False) for ``model`` at ``rollout.group_size`` ->
    (on, why: empty when on or set false).

    auto is on when group_size >= 2, the model's family is in ``SHARED_PREFIX_FAMILIES`` and its layers are not
    gradient-checkpointed (transformers drops the KV cache inside checkpointed layers); otherwise off, with the
    reason. True raises ValueError naming the family or the checkpointing it cannot serve; group_size 1 is
    allowed (nothing to share: every micro-batch takes the one-forward path). Raises ValueError for another value.
    """
    if setting is False:
        return False, ""
    if setting not in ("auto", True):
        raise ValueError(f"update.shared_prefix={setting!r} is not allowed: choose auto, true or false")
    config = getattr(model, "config", None)
    family = getattr(getattr(config, "text_config", None) or config, "model_type", None)
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    why = ""
    if family not in SHARED_PREFIX_FAMILIES:
        why = (
            f"model family {family!r} ({type(model).__name__}) is not one whose shared-prefix forward is tested "
            f"(supported: {', '.join(SHARED_PREFIX_FAMILIES)})"
        )
    elif checkpointing:
        why = "model.gradient_checkpointing is on: checkpointed layers drop the KV cache the completions would reuse"
    if why and setting is True:
        raise ValueError(f"update.shared_prefix=true: {why}; choose auto or false")
    if why:
        return False, why
    if setting == "auto" and group_size < 2:
        return False, f"rollout.group_size={group_size}: no prompt is shared"
    return True, ""


def gradient_checkpointing_active(model: torch.nn.Module) -> bool:
    """True when a forward of ``model`` now would checkpoint its layers: a submodule has transformers'
    ``gradient_checkpointing`` on, the model is in training mode and gradients are enabled. transformers then
    drops the KV cache inside each layer (``GradientCheckpointingLayer``), so a prefix cache cannot be reused."""
    if not (model.training and torch.is_grad_enabled()):
        return False
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def shared_prefix_applies(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor) -> bool:
    """True when ``response_logprobs(shared_prefix=True)`` runs the shared forward on this micro-batch: at
    least two rows have the same prompt (ids [N, P] and mask [N, P]), the prompts are not empty, and the
    model's layers are not checkpointed in this pass (``gradient_checkpointing_active``)."""
    if prompt_ids.shape[0] < 2 or prompt_ids.shape[1] == 0 or gradient_checkpointing_active(model):
        return False
    keys = torch.cat([prompt_ids, prompt_mask.long()], dim=1)
    return torch.unique(keys, dim=0).shape[0] < keys.shape[0]


#: a backbone forward's fixed cost, counted in token positions, when the shared-prefix path splits a micro-batch's
#: completions into forwards of similar length (``response_buckets``): a split is taken where it saves more padded
#: positions than this
BUCKET_OVERHEAD_TOKENS = 64


def response_buckets(lengths: list[int], overhead: int = BUCKET_OVERHEAD_TOKENS) -> list[int]:
    """Where to cut completions sorted longest first (``lengths``, non-increasing) into forwards of similar
    length: the ends of the buckets (exclusive), minimising sum over buckets of (rows x its longest length +
    ``overhead``), the positions each forward pays for (padding included) plus a fixed cost per forward. Exact
    dynamic programme over contiguous buckets, O(N^2) for N rows."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n  # best[j]: the cost of rows [0, j)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * lengths[i] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    ends, j = [], n
    while j > 0:
        ends.append(j)
        j = cut[j]
    return ends[::-1]


def _shared_prefix_hidden(
    backbone: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> Tensor:
    """[N, T, H] backbone states that predict each response token, each distinct prompt encoded once.

    prompt_ids/prompt_mask: [N, P] left-padded; response_ids/response_mask: [N, T] right-padded. The k distinct
    prompts (rows equal in ids and mask) run once, [k, P], with a KV cache (``transformers.DynamicCache``, as the
    embedded engine's prefill). The completions then run on top of it, sorted by length and cut into forwards of
    similar length (``response_buckets``: a micro-batch of whole groups mixes short and long completions), each with
    its rows' prompt keys/values taken by an index (``state_cache.gather_rows``: its backward sums each prompt's
    key/value gradients over the rows that read them one row after another, the same bits at every run), attention
    mask [prompt_mask; response_mask] and position ids that continue each prompt's (``position_ids_from_mask`` of
    the whole row): the same keys, positions and causal order as the one-forward path, so the same function of the
    weights (Prefix Grouper, Liu et al. 2025, arXiv 2506.05433). Gated DeltaNet hybrids (``state_cache.is_hybrid``):
    the prompts run with the engine's hybrid cache layout and each completion continues its prompt's final conv and
    recurrent states as well as its keys and values (``state_cache.continuation_cache``): the conv reads the
    prompt's last inputs, the recurrence starts from the prompt's state (its value under
    ``kernels.linear_attention=recurrent`` is the one-forward path's bit for bit; the chunked algorithm cuts its
    64-token chunks elsewhere). The state that predicts response token 0 is the prompt's last position; token j >
    0's is response position j - 1. States past a row's last response token are 0.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from .rollout.state_cache import continuation_cache, gather_rows, hybrid_cache, is_hybrid

    p, t = prompt_ids.shape[1], response_ids.shape[1]
    keys = torch.cat([prompt_ids, prompt_mask.long()], dim=1)
    unique, row_of = torch.unique(keys, dim=0, return_inverse=True)
    u_ids, u_mask = unique[:, :p], unique[:, p:]
    # one embedding lookup for the prompts and every completion: its backward builds the dense [V, H] gradient of
    # the (often tied) embedding once per micro-batch, not once per forward
    k = u_ids.shape[0]
    embeds = backbone.get_input_embeddings()(torch.cat([u_ids.reshape(-1), response_ids.reshape(-1)]))
    prompt_embeds, response_embeds = embeds[: k * p].view(k, p, -1), embeds[k * p :].view(len(response_ids), t, -1)
    hybrid = is_hybrid(backbone)  # linear-attention layers: the prompt's conv and recurrent states, not only KV
    cache = hybrid_cache(backbone, DynamicLayer) if hybrid else DynamicCache()
    prompt_hidden = backbone(
        inputs_embeds=prompt_embeds,
        attention_mask=u_mask,
        position_ids=position_ids_from_mask(u_mask),
        cache=cache,
        use_cache=True,
    ).last_hidden_state
    kv = [] if hybrid else [(layer.keys, layer.values) for layer in cache.layers]
    first = prompt_hidden[:, -1:]  # [k, 1, H]: the prompt's last position predicts response token 0
    lengths = response_mask.sum(-1)
    order = torch.argsort(lengths, descending=True, stable=True)
    sorted_lengths = lengths[order].tolist()
    parts, start = [], 0
    for end in response_buckets(sorted_lengths):
        rows = order[start:end]
        width = max(int(sorted_lengths[start]), 1)
        start = end
        src = row_of[rows]
        bucket_cache = (
            continuation_cache(cache, src)
            if hybrid
            else DynamicCache(ddp_cache_data=[(gather_rows(k, src), gather_rows(v, src)) for k, v in kv])
        )
        attention_mask = torch.cat([prompt_mask[rows].long(), response_mask[rows, :width].long()], dim=1)
        position_ids = position_ids_from_mask(attention_mask)[:, p:]
        hidden = backbone(
            inputs_embeds=response_embeds[rows, :width],
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=bucket_cache,
            use_cache=True,
        ).last_hidden_state
        hidden = torch.cat([gather_rows(first, src), hidden[:, : width - 1]], dim=1)
        parts.append(F.pad(hidden, (0, 0, 0, t - width)) if width < t else hidden[:, :t])
    return torch.cat(parts)[torch.argsort(order)]


def response_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    with_entropy: bool = True,
    return_hidden: bool = False,
    head_ids: Tensor | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    entropy_grad: bool = False,
    shared_prefix: bool = False,
    env_mask: Tensor | None = None,
) -> TokenScores:
    """Log-probs of each response token under ``model``, at the sampler's temperature.

    prompt_ids/prompt_mask: [N, P] left-padded; response_ids/response_mask: [N, T] right-padded.
    head_ids: [N, T, k] int64 ids (the rollout engine's recorded top-k) whose log-probs to gather too, for
    score centering. Returns ``TokenScores``; ``hidden`` only with ``return_hidden``.

    The logits are the model's own: the output layer, then its head-side transform (``head_transform``, e.g.
    Gemma-2/3's soft-capping). The distribution scored is the one the sampler draws from: softmax(logits /
    temperature), truncated
    to the top-k / top-p support (``support_mask`` on the trainer's own logits) and renormalised there.
    The sampled token is always kept in the support, so a token the engine drew just inside its boundary
    (numerical mismatch) gets a finite log-prob instead of -inf; head ids outside the support get -inf,
    which score centering drops. ``chunk_tokens`` bounds the rows of float32 logits alive at once.
    ``entropy_grad``: the entropy of that same distribution keeps its gradient (the entropy bonus,
    ``loss.entropy_coef``); otherwise it is a detached diagnostic.
    ``shared_prefix``: rows with identical prompts (a GRPO group) run their prompt's forward once
    (``_shared_prefix_hidden``; the same values and gradients, Prefix Grouper, Liu et al. 2025,
    arXiv 2506.05433); rows whose prompts differ, or a model checkpointing its layers in a backward-taking
    pass (``shared_prefix_applies``), take the one-forward path.
    ``env_mask``: [N, T] bool, the environment's tokens of multi-turn episodes: attended to like the rest of
    the sequence, never scored (log-prob, entropy and head 0 there, as on padding); None: there are none.
    """
    n, p = prompt_ids.shape
    attended = response_mask if env_mask is None else response_mask | env_mask
    t = response_ids.shape[1]
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    if shared_prefix and t > 0 and shared_prefix_applies(model, prompt_ids, prompt_mask):
        hidden = _shared_prefix_hidden(backbone, prompt_ids, prompt_mask, response_ids, attended)
    else:
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, attended], dim=1).long()
        position_ids = position_ids_from_mask(attention_mask)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        hidden = hidden[:, p - 1 : p + t - 1]  # position j predicts response token j
    # the output layer's weight and bias as its forward would hand them to F.linear: cast once per pass when a
    # ``WeightCasts`` is installed on the model (the trainer's no-grad passes), else the layer's own
    head_weight, head_bias = linear_params(model.get_output_embeddings())
    transform = head_transform(model)
    flat_h = hidden.reshape(n * t, hidden.shape[-1])  # explicit: a micro-batch of empty responses has t = 0
    flat_y = response_ids.reshape(n * t)
    flat_m = response_mask.reshape(n * t)
    rows = flat_m.nonzero().squeeze(-1)  # only valid tokens pay for the projection
    k = head_ids.shape[-1] if head_ids is not None else 0
    flat_head = head_ids.reshape(n * t, k) if head_ids is not None else None
    logp = hidden.new_zeros(n * t, dtype=torch.float32)
    ent = hidden.new_zeros(n * t, dtype=torch.float32)
    head = hidden.new_zeros(n * t, k, dtype=torch.float32)
    fused = torch.is_grad_enabled() and fused_head_applies(top_k, top_p, transform)
    # the fused head takes every row in one call and chunks them itself (the weight cast once each way)
    step = max(rows.numel(), 1) if fused else chunk_tokens
    for start in range(0, rows.numel(), step):
        idx = rows[start : start + step]
        head_idx = flat_head[idx] if flat_head is not None else None
        if fused:
            lp, en, hd = FusedChunkLogprobs.apply(
                flat_h[idx], head_weight, head_bias, flat_y[idx], head_idx, temperature, with_entropy, entropy_grad,
                chunk_tokens,
            )  # fmt: skip
        else:
            args = (flat_h[idx], head_weight, head_bias, flat_y[idx], temperature, with_entropy, head_idx, top_k,
                    top_p, transform, entropy_grad)  # fmt: skip
            if torch.is_grad_enabled():
                lp, en, hd = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            else:
                lp, en, hd = _chunk_logprobs(*args)
        logp = logp.index_put((idx,), lp)
        ent = ent.index_put((idx,), en)
        if k:
            head = head.index_put((idx,), hd)
    return TokenScores(
        logp.view(n, t), ent.view(n, t), head.view(n, t, k) if k else None, hidden if return_hidden else None
    )
