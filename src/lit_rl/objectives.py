"""Policy-gradient objectives, advantage estimators and loss reductions.

Pure tensor functions: no module state, no config objects.

Conventions:
    N: number of completions in the batch.
    T: padded response length.
    ``mask``: bool (or 0/1 float) tensor [N, T] of valid response tokens (no prompt, no padding).
        Any nonzero entry counts as valid; masked positions may hold any finite or non-finite value,
        the masked reductions never read them.
    Every per-token "loss" returned here is the quantity to MINIMISE, i.e. the negative of the
    surrogate objective ℓ that the papers maximise.

Sources:
    PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms".
    GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation".
    GRPO: Shao et al. 2024, "DeepSeekMath".
    DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale".
    Dr.GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective".
    GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization".
    CISPO: MiniMax 2025, "MiniMax-M1".
    SAPO: Qwen team 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347.
    RLOO: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
        from Human Feedback in LLMs".
    KL estimators: Schulman 2020, "Approximating KL Divergence" (blog post).
"""

import math
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

# the choices of loss.reduction, algo.baseline, advantage.std / scale, kl.estimator / mode: torch-free, so that
# config.validate checks them before torch loads
from .choices import BASELINES, KL_KINDS, KL_MODES, REDUCTION_MODES, SCALES, STD_KINDS  # noqa: F401  (re-exported)

# ----------------------------------------------------------------------------------------------
# Masked reductions
# ----------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x`` over the positions where ``mask`` is set.

    Args:
        x: float tensor of any shape.
        mask: bool or 0/1 float tensor, same shape as ``x``. Nonzero entries are valid.
        dim: dimension to reduce; ``None`` reduces over all elements.

    Returns:
        Float tensor: a scalar if ``dim`` is None, else ``x`` with ``dim`` removed.
        Masked-out positions contribute exactly 0 (and 0 gradient) whatever value they hold,
        including inf/NaN.

    Raises:
        ValueError: if ``mask`` and ``x`` have different shapes.
    """
    _check_same_shape(x, mask, "x", "mask")
    values = torch.where(mask.bool(), x, torch.zeros_like(x))
    if dim is None:
        return values.sum()
    return values.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set; 0 (not NaN) where the mask is empty.

    Args:
        x: float tensor of any shape.
        mask: bool or 0/1 float tensor, same shape as ``x``. Nonzero entries are valid.
        dim: dimension to reduce; ``None`` reduces over all elements.

    Returns:
        Float tensor: a scalar if ``dim`` is None, else ``x`` with ``dim`` removed.

    Raises:
        ValueError: if ``mask`` and ``x`` have different shapes.
    """
    total = masked_sum(x, mask, dim)
    mask = mask.bool()
    count = (mask.sum() if dim is None else mask.sum(dim)).to(total.dtype)
    # `total` is 0 where `count` is 0, so dividing by 1 there gives 0.
    return total / count.clamp(min=1)


def reduce_loss(
    token_loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Optional[Union[float, Tensor]] = None,
    num_seqs: Optional[Union[float, Tensor]] = None,
    max_response_length: Optional[int] = None,
) -> Tensor:
    """Reduce a per-token loss [N, T] to a scalar.

    Modes (T_i = valid tokens of row i):
        ``"token_mean"`` (DAPO): Σ_i Σ_t loss / num_tokens.
        ``"seq_mean_token_mean"`` (GRPO): Σ_i (Σ_t loss / T_i) / num_seqs.
        ``"seq_mean_token_sum"``: Σ_i Σ_t loss / num_seqs.
        ``"constant"`` (Dr.GRPO): Σ_i Σ_t loss / (num_seqs · max_response_length).

    ``num_tokens`` and ``num_seqs`` should be the totals of the WHOLE optimizer step (all
    micro-batches, all ranks), so that summing this function's result over micro-batches gives the
    loss of the whole batch at once. If None, this call's own totals are used: ``mask.sum()`` and
    the number of rows with T_i > 0. Rows with T_i = 0 contribute 0 (no NaN). A zero denominator
    (an entirely empty step) gives 0.

    Args:
        token_loss: float [N, T], the per-token loss to minimise.
        mask: bool or 0/1 float [N, T].
        mode: one of ``REDUCTION_MODES``.
        num_tokens: total valid tokens of the step (used by ``"token_mean"``).
        num_seqs: total sequences of the step (used by the other modes).
        max_response_length: L_max, required by ``"constant"``.

    Returns:
        Scalar float tensor.

    Raises:
        ValueError: unknown ``mode``; ``"constant"`` without ``max_response_length``;
            ``token_loss`` not 2-D or a shape mismatch with ``mask``.
    """
    if mode not in REDUCTION_MODES:
        raise ValueError(f"Unknown loss reduction mode {mode!r}; expected one of {REDUCTION_MODES}")
    if token_loss.dim() != 2:
        raise ValueError(f"token_loss must be [N, T], got shape {tuple(token_loss.shape)}")
    _check_same_shape(token_loss, mask, "token_loss", "mask")

    lengths = mask.bool().sum(-1)
    if num_tokens is None:
        num_tokens = lengths.sum()
    if num_seqs is None:
        num_seqs = (lengths > 0).sum()

    if mode == "token_mean":
        return _safe_div(masked_sum(token_loss, mask), num_tokens)
    if mode == "seq_mean_token_mean":
        per_seq = masked_mean(token_loss, mask, dim=-1)
        return _safe_div(per_seq.sum(), num_seqs)
    if mode == "seq_mean_token_sum":
        return _safe_div(masked_sum(token_loss, mask), num_seqs)
    # "constant"
    if max_response_length is None:
        raise ValueError("reduce_loss mode 'constant' (Dr.GRPO) needs max_response_length")
    num_seqs = torch.as_tensor(num_seqs, dtype=token_loss.dtype, device=token_loss.device)
    return _safe_div(masked_sum(token_loss, mask), num_seqs * max_response_length)


def sequence_loss_mean(seq_loss: Tensor, seq_mask: Tensor) -> Tensor:
    """Average a sequence-level loss over valid sequences, without re-weighting by length.

    Example: per-sequence losses [1, 0] with lengths [2, 4] give 0.5 (a token-weighted mean would
    give 1/3).

    Args:
        seq_loss: float [N], one loss per sequence.
        seq_mask: bool or 0/1 float, either [N] (valid sequences) or the token mask [N, T]
            (a row is valid when it has at least one valid token).

    Returns:
        Scalar float tensor; 0 if no sequence is valid.

    Raises:
        ValueError: if ``seq_mask`` is neither [N] nor [N, T] with the same N.
    """
    if seq_mask.dim() == seq_loss.dim() + 1:
        seq_mask = seq_mask.bool().any(-1)
    return masked_mean(seq_loss, seq_mask)


# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    alpha: float = 1.0,
    eps: float = 1e-6,
    valid: Optional[Tensor] = None,
    std: str = "population",
    scale: str = "group",
    batch_std: Optional[float] = None,
) -> Tensor:
    """Group-relative advantages A_i = (R_i − mean_g R) / (σ + eps)^alpha.

    GRPO (Shao et al. 2024) is ``alpha=1``; Dr.GRPO (Liu et al. 2025) is ``alpha=0`` (no std
    division). σ is, by ``scale``: ``"group"`` the std of the completion's group (GRPO); ``"batch"`` the
    std of every valid reward of the step (TRL's ``scale_rewards="batch"``, after Liu et al. 2025's
    critique of the group std); ``"none"`` no division (as ``alpha=0``; TRL's ``scale_rewards="none"``).
    ``std="population"`` divides the squared deviations by n (lit_rl's default, SPEC vector 1),
    ``"sample"`` by n − 1 (torch's default ``std()``, which TRL and verl call). Rewards [1, 0] of one
    group: ±0.999998 (population, eps 1e-6), ±0.707106 (sample, eps 1e-6 = verl's GRPO, ±0.70711),
    TRL's eps 1e-4 gives ±0.70700. Groups are identified by ``group_ids`` (the prompt id), never by
    position, so any layout works (e.g. interleaved [p1, p2, p1, p2]).

    Invalid completions (e.g. zero generated tokens) are excluded from their group's mean and std
    (and from the batch std) and get advantage 0. A group whose valid rewards are all equal (or that has
    no valid member) gets exactly 0 advantages. A sample std of a single reward is taken as 0.

    Args:
        rewards: float [N].
        group_ids: integer [N], the group (prompt) of each completion.
        alpha: std-normalisation exponent in [0, 1].
        eps: added to the std before the power.
        valid: bool [N]; None means every completion is valid.
        std: one of ``STD_KINDS``.
        scale: one of ``SCALES``.
        batch_std: with ``scale="batch"``, the step's std when it spans more than these rewards (several
            data-parallel ranks); None computes it from ``rewards``.

    Returns:
        Float [N] advantages (same dtype as ``rewards``, float32 if ``rewards`` is not floating).

    Raises:
        ValueError: ``alpha`` outside [0, 1]; unknown ``std`` or ``scale``; ``rewards`` not 1-D; shape
            mismatch of ``group_ids`` or ``valid`` with ``rewards``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if std not in STD_KINDS:
        raise ValueError(f"Unknown std {std!r}; expected one of {STD_KINDS}")
    if scale not in SCALES:
        raise ValueError(f"Unknown scale {scale!r}; expected one of {SCALES}")
    rewards = _as_float(rewards)
    _check_1d(rewards, "rewards")
    _check_same_shape(rewards, group_ids, "rewards", "group_ids")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    _check_same_shape(rewards, valid, "rewards", "valid")
    valid = valid.bool()

    inverse, num_groups = _group_index(group_ids)
    zeros = rewards.new_zeros(num_groups)
    valid_rewards = torch.where(valid, rewards, torch.zeros_like(rewards))

    count = zeros.index_add(0, inverse, valid.to(rewards.dtype)).clamp(min=1)
    mean = zeros.index_add(0, inverse, valid_rewards) / count
    centered = rewards - mean[inverse]
    if scale == "group":
        squared = torch.where(valid, centered**2, torch.zeros_like(centered))
        dof = count if std == "population" else (count - 1).clamp(min=1)
        sigma = ((zeros.index_add(0, inverse, squared) / dof).sqrt())[inverse]
        advantages = centered / (sigma + eps) ** alpha
    elif scale == "batch":
        sigma = reward_std(rewards, valid, std) if batch_std is None else batch_std
        advantages = centered / (torch.as_tensor(sigma, dtype=rewards.dtype) + eps) ** alpha
    else:
        advantages = centered
    # Exactly 0 for groups without reward variance, whatever the rounding of the mean.
    has_variance = _group_has_variance(rewards, valid, inverse, num_groups)
    keep = valid & has_variance[inverse]
    return torch.where(keep, advantages, torch.zeros_like(advantages))


def gdpo_advantages(
    parts: Tensor,
    weights: Sequence[float],
    group_ids: Tensor,
    alpha: float = 1.0,
    eps: float = 1e-6,
    valid: Optional[Tensor] = None,
    std: str = "population",
    scale: str = "group",
    sum_over_ranks: Optional[Callable[[Tensor], Tensor]] = None,
) -> tuple[Tensor, Tensor]:
    """GDPO's advantage of several rewards (``advantage.multi_reward=normalize_then_sum``): each reward normalised
    within its group first, so that no reward's scale drowns the others, then summed with its weight, then whitened
    over the step: A = (S − mean S) / (std S + eps), S_i = Σ_k w_k A_k,i.

    Each reward's own A_k is ``group_advantages`` with the ``advantage`` group's ``alpha``, ``eps``, ``std`` and
    ``scale`` (``scale=batch``: reward k's std over the step; ``none``: centred only). A reward that is None (NaN
    in ``parts``) is left out of that reward's group statistics and gets A_k = 0 there (TRL's nan-aware form). The
    whitening takes ``std``'s kind and ``eps`` over the valid rows of the whole step (every rank's, through
    ``sum_over_ranks``); invalid rows get 0. Unlike GRPO, a group whose rewards all agree then gets −mean S / std S,
    not 0: the whitening shifts every row (as the peers do).

    Rewards r1 = [1, 1, 0, 0], r2 = [1, 1, 1, 0] of one group, weights [1, 1], population std, eps 1e-6:
    [0.8881, 0.8881, −0.2379, −1.5382] (SPEC vector 18; summing first gives [0.9045, 0.9045, −0.3015, −1.5076]).
    Peers: TRL (``multi_objective_aggregation="normalize_then_sum"``) normalises with eps 1e-4 and whitens with the
    sample std (torch's ``std()``): ``advantage.std=sample advantage.eps=1e-4`` here; verl's
    ``compute_gdpo_outcome_advantage`` whitens over tokens (``masked_whiten``: each completion weighted by its
    length) where lit_rl whitens over completions.

    Args:
        parts: float [N, K], reward k of completion i (NaN: None).
        weights: K weights (``reward.weights``).
        group_ids: integer [N]; alpha, eps, std, scale: as ``group_advantages``.
        valid: bool [N] (completions with a response) or None (all).
        sum_over_ranks: maps a float64 tensor to its sum over data-parallel ranks; None: one rank.

    Returns:
        (advantages [N], per-reward advantages A_k [K, N]), float32.

    Raises:
        ValueError: ``parts`` not [N, K] with K = len(weights) and N = len(group_ids); as ``group_advantages``.
    """
    if parts.dim() != 2 or parts.shape[1] != len(weights) or parts.shape[0] != group_ids.shape[0]:
        raise ValueError(
            f"parts must be [N, K] with N = {group_ids.shape[0]} completions and K = {len(weights)} weights, "
            f"got {tuple(parts.shape)}"
        )
    parts = parts.float()
    n = parts.shape[0]
    valid = torch.ones(n, dtype=torch.bool, device=parts.device) if valid is None else valid.bool()
    reduce = sum_over_ranks if sum_over_ranks is not None else (lambda t: t)
    per_reward = []
    for k in range(parts.shape[1]):
        r = parts[:, k]
        ok = valid & ~r.isnan()
        r = torch.where(ok, r, torch.zeros_like(r))
        batch_std = None
        if scale == "batch":
            moments = reduce(torch.stack([ok.sum().double(), r.double().sum(), (r.double() ** 2).sum()]))
            batch_std = float(std_from_moments(*moments.tolist(), std))
        per_reward.append(group_advantages(r, group_ids, alpha, eps, ok, std, scale, batch_std))
    per_reward = torch.stack(per_reward) if per_reward else parts.new_zeros(0, n)
    w = torch.tensor([float(x) for x in weights], dtype=parts.dtype, device=parts.device)
    combined = (w[:, None] * per_reward).sum(0)
    c = torch.where(valid, combined, torch.zeros_like(combined)).double()
    count, total, total_sq = reduce(torch.stack([valid.sum().double(), c.sum(), (c**2).sum()])).tolist()
    mean = total / count if count else 0.0
    sigma = float(std_from_moments(count, total, total_sq, std))
    advantages = (combined - mean) / (sigma + eps)
    return torch.where(valid, advantages, torch.zeros_like(advantages)).float(), per_reward.float()


def opd_advantages(
    advantages: Tensor, student_logprobs: Tensor, teacher_logprobs: Tensor, coef: float, mask: Tensor
) -> Tensor:
    """On-policy distillation in the advantage (``distill.mode=advantage``; slime ``--use-opd``): the per-token
    advantage A_t = A − coef · (log π_student(y_t) − log π_teacher(y_t)), the sampled token's reverse-KL estimate
    (k1) subtracted with its coefficient; 0 on padding. With μ = π its policy-gradient term −A_t ∇log π_θ(y_t)
    has expectation coef · ∇ Σ_t E_{h_t}[KL(π(·|h_t) ‖ π_teacher(·|h_t))] (the per-position KL, its prefixes
    held fixed: no cost-to-go, slime's and Thinking Machines' discount 0), the full sequence KL's gradient for
    one-token responses. A teacher equal to the student adds exactly 0.

    Student [−1, −2], teacher [−1.5, −1], coef 1, A = 0 → [−0.5, +1.0] (SPEC vector 19).

    Args:
        advantages: float [N] (one per completion) or [N, T].
        student_logprobs, teacher_logprobs: float [N, T] log-probs of the sampled tokens (no gradient), the
            teacher's under the sampler's temperature and truncation.
        coef: ``distill.coef`` (>= 0).
        mask: bool [N, T] valid response tokens.

    Returns:
        float32 [N, T].

    Raises:
        ValueError: shapes that differ.
    """
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.shape != mask.shape:
        raise ValueError(
            f"student_logprobs {tuple(student_logprobs.shape)}, teacher_logprobs {tuple(teacher_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have one shape [N, T]"
        )
    base = _broadcast_advantages(advantages.float(), student_logprobs)
    gap = (student_logprobs.float() - teacher_logprobs.float()).detach()
    out = base - coef * gap
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def opd_loss(
    logprobs: Tensor, teacher_logprobs: Tensor, coef: float, mask: Tensor, num_tokens: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """On-policy distillation as its own loss term (``distill.mode=loss``; prime-rl's form): per token
    coef · sg(log π_θ(y_t) − log π_teacher(y_t)) · log π_θ(y_t), reduced over its own token count
    (Σ_valid ℓ_t / #valid tokens, not the objective's reduction). Its expected gradient under μ = π is
    coef / (tokens per response) · ∇ Σ_t E_{h_t}[KL(π(·|h_t) ‖ π_teacher(·|h_t))] for responses of one length.
    Its value is not the KL. With a teacher equal to the student each token's gap is 0 only where the two forwards
    agree bit for bit (the teacher's own forward may round differently from the trainer's: the term is then a small
    non-zero gradient whose expectation is 0); the log-ratio itself as a loss (no stop-gradient) would have a
    per-sample gradient ∇log π_θ ≠ 0 even then, 0 only in expectation, which is why the gap is held fixed here.

    Args:
        logprobs: float [N, T] log π_θ of the sampled tokens (with gradient).
        teacher_logprobs: float [N, T] (no gradient); coef: ``distill.coef``; mask: bool [N, T].
        num_tokens: the denominator, 0-dim: the whole step's valid tokens when ``mask`` is one micro-batch of it
            (``loss.assemble_loss``: the micro-batches' losses then sum to the step's); None: ``mask``'s own count.

    Returns:
        (the scalar loss, the mean per-token log-ratio over valid tokens: ``train/opd_kl``).

    Raises:
        ValueError: shapes that differ.
    """
    if logprobs.shape != teacher_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, teacher_logprobs {tuple(teacher_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have one shape [N, T]"
        )
    mask = mask.bool()
    gap = (logprobs.detach() - teacher_logprobs).float()
    count = mask.sum().clamp(min=1)
    denominator = count if num_tokens is None else torch.as_tensor(num_tokens).clamp(min=1)
    loss = masked_sum(coef * gap * logprobs, mask) / denominator
    return loss, masked_sum(gap, mask) / count


def reward_std(rewards: Tensor, valid: Optional[Tensor] = None, std: str = "population") -> Tensor:
    """The std of the valid rewards [N]: population (÷ n) or sample (÷ (n − 1), torch's default).

    Args:
        rewards: float [N]; valid: bool [N] or None (all valid); std: one of ``STD_KINDS``.

    Returns:
        0-dim float tensor; 0 for fewer than 2 valid rewards.

    Raises:
        ValueError: unknown ``std``.
    """
    if std not in STD_KINDS:
        raise ValueError(f"Unknown std {std!r}; expected one of {STD_KINDS}")
    rewards = _as_float(rewards)
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    return std_from_moments(valid.sum(), masked_sum(rewards, valid), masked_sum(rewards**2, valid), std).to(
        rewards.dtype
    )


def std_from_moments(count, total, total_sq, std: str = "population") -> Tensor:
    """The std of n values from n, Σx and Σx² (e.g. summed over data-parallel ranks), in float64 from
    the centred form Σx² − (Σx)²/n; 0 for n < 2. ``std``: ``"population"`` (÷ n) or ``"sample"`` (÷ (n − 1))."""
    count, total, total_sq = (torch.as_tensor(x, dtype=torch.float64) for x in (count, total, total_sq))
    if float(count) < 2:
        return torch.zeros((), dtype=torch.float64)
    dof = count if std == "population" else count - 1
    return ((total_sq - total**2 / count).clamp(min=0) / dof).sqrt()


def baseline_advantages(rewards: Tensor, group_ids: Tensor, baseline: str) -> Tensor:
    """REINFORCE advantages A = R − b with a baseline b that does not depend on the sampled y_i.

    Baselines:
        ``"none"``: A_i = R_i.
        ``"batch_mean"``: A_i = R_i − mean over the whole batch.
        ``"rloo"`` (Ahmadian et al. 2024): leave-one-out group mean,
            A_i = R_i − mean_{j in g(i), j != i} R_j.

    Args:
        rewards: float [N].
        group_ids: integer [N], the group (prompt) of each completion.
        baseline: one of ``BASELINES``.

    Returns:
        Float [N].

    Raises:
        ValueError: unknown ``baseline``; a group of size 1 with ``"rloo"``; ``rewards`` not 1-D
            or a shape mismatch with ``group_ids``.
    """
    if baseline not in BASELINES:
        raise ValueError(f"Unknown baseline {baseline!r}; expected one of {BASELINES}")
    rewards = _as_float(rewards)
    _check_1d(rewards, "rewards")
    _check_same_shape(rewards, group_ids, "rewards", "group_ids")

    if baseline == "none":
        return rewards.clone()
    if baseline == "batch_mean":
        return rewards - rewards.mean()
    # "rloo"
    inverse, num_groups = _group_index(group_ids)
    zeros = rewards.new_zeros(num_groups)
    count = zeros.index_add(0, inverse, torch.ones_like(rewards))
    if bool((count < 2).any()):
        raise ValueError("The 'rloo' baseline needs at least 2 completions in every group")
    total = zeros.index_add(0, inverse, rewards)
    leave_one_out_mean = (total[inverse] - rewards) / (count[inverse] - 1)
    return rewards - leave_one_out_mean


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016) over response tokens.

    δ_t = r_t + γ V_{t+1} − V_t and A_t = δ_t + γλ A_{t+1}, where t+1 is the next VALID token
    (masked positions are skipped) and V = A = 0 after the last valid token (bootstrap 0).

    Args:
        rewards: float [N, T] token-level rewards (typically the sequence reward on the last valid
            token, minus an optional per-token KL penalty).
        values: float [N, T] value estimates V(h_t).
        mask: bool or 0/1 float [N, T].
        gamma: discount γ.
        lam: GAE λ.

    Returns:
        (advantages [N, T], returns [N, T]) with returns = advantages + values; both are 0 outside
        ``mask`` and carry no gradient.

    Raises:
        ValueError: if the three tensors do not share one [N, T] shape.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, T], got shape {tuple(rewards.shape)}")
    _check_same_shape(rewards, values, "rewards", "values")
    _check_same_shape(rewards, mask, "rewards", "mask")
    mask = mask.bool()
    rewards = rewards.detach()
    values = values.detach()

    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(valid, values[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
        advantages[:, t] = torch.where(valid, advantage, torch.zeros_like(advantage))
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


# ----------------------------------------------------------------------------------------------
# Policy losses
# ----------------------------------------------------------------------------------------------


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: Optional[float] = None,
    delta: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO clipped surrogate loss (Schulman et al. 2017), with DAPO clip-higher, dual clip and delta.

    r = exp(logprobs − old_logprobs), loss = −min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A).
    ``eps_low = eps_high`` is PPO/GRPO; DAPO (Yu et al. 2025) uses 0.2 / 0.28.

    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5; verl's
    ``clip_ratio_c``): for A < 0 the loss is also bounded by c·|A|, loss = min(loss, −c·A), so a token whose
    ratio ran far above 1 with a negative advantage stops pushing (no gradient). One token, A = −1, r = 4,
    ε = 0.2, c = 3: loss 3 and zero gradient (without: 4, gradient 4 w.r.t. its log-prob).

    Two-sided clip (TRL's ``delta``, INTELLECT-2 report, Prime Intellect 2025): the unclipped ratio is capped,
    r' = min(r, δ), in the first branch: loss = −min(r'·A, clip(r)·A). For δ > 1 + eps_high this is the dual
    clip with c = δ (A > 0: the clipped branch already wins above 1 + eps_high; A < 0: the loss is
    |A|·max(min(r, δ), clip(r)) = min(|A|·max(r, clip(r)), δ|A|)); ``config.validate`` refuses both together.
    With δ ≤ 1 + eps_high it also caps the A > 0 side below the usual clip.

    Args:
        logprobs: float [N, T], current policy log-probs (with gradient).
        old_logprobs: float [N, T], log-probs of the denominator policy (π_old, or the rollout
            engine's); treat as constants, pass them detached.
        advantages: float [N] (broadcast over tokens) or [N, T].
        eps_low: lower clip range ε_low.
        eps_high: upper clip range ε_high.
        clip_ratio_c: dual-clip constant c > 1, or None (off).
        delta: TRL's two-sided bound δ > 1 on the unclipped ratio, or None (off).

    Returns:
        (loss [N, T], clipped_low [N, T] bool, clipped_high [N, T] bool). ``clipped_*`` mark the
        tokens where the clip binds (the clipped branch is the min and differs from the unclipped
        one, so the token has no gradient): clipped_high where A > 0 and r > 1 + eps_high,
        clipped_low where A < 0 and r < 1 − eps_low. Where the dual clip or delta binds see
        ``dual_clip_binds`` (not folded into either). Padding is not masked: reduce with a mask.

    Raises:
        ValueError: on shape mismatch.
    """
    _check_same_shape(logprobs, old_logprobs, "logprobs", "old_logprobs")
    advantages = _broadcast_advantages(advantages, logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    loss = -torch.minimum(unclipped * advantages, clipped_ratio * advantages)
    if clip_ratio_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -clip_ratio_c * advantages), loss)
    ratio = ratio.detach()
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    clipped_low = (advantages < 0) & (ratio < 1.0 - eps_low)
    return loss, clipped_low, clipped_high


def dual_clip_binds(
    log_ratio: Tensor, advantages: Tensor, eps_high: float, clip_ratio_c: Optional[float], delta: Optional[float]
) -> Tensor:
    """Where the dual clip c (or TRL's δ) of ``ppo_clip_loss`` takes a token's gradient away that the ordinary
    clip leaves: c where A < 0 and r > c; δ where A < 0 and r > max(δ, 1 + eps_high), or A > 0 and
    δ < r ≤ 1 + eps_high (above 1 + eps_high the ordinary upper clip binds already). verl logs the dual-clip
    fraction as ``pg_clipfrac_lower``, which is lit_rl's name for the ordinary lower clip; here it is its own
    metric (``train/pg_clipfrac_dual``).

    Args:
        log_ratio: float [N, T], log(π_θ / π_old) (detached here).
        advantages: float [N] or [N, T].
        eps_high: upper clip range.
        clip_ratio_c, delta: as ``ppo_clip_loss``; both None gives all False.

    Returns:
        bool [N, T].

    Raises:
        ValueError: advantages of the wrong shape.
    """
    advantages = _broadcast_advantages(advantages, log_ratio)
    ratio = log_ratio.detach().exp()
    out = torch.zeros_like(ratio, dtype=torch.bool)
    if clip_ratio_c is not None:
        out = out | ((advantages < 0) & (ratio > clip_ratio_c))
    if delta is not None:
        upper = (advantages > 0) & (ratio > delta) & (ratio <= 1.0 + eps_high)
        out = out | upper | ((advantages < 0) & (ratio > max(delta, 1.0 + eps_high)))
    return out


def gspo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO loss (Zheng et al. 2025) with one clipped ratio per sequence, in per-token form.

    Sequence ratio s_i = exp(mean over valid tokens of (logprobs − old_logprobs)), the geometric
    mean of the token ratios; padding values never enter it.

    To return a per-token loss this uses the paper's GSPO-token form:
    s_{i,t} = sg(s_i) · exp(logprobs_t − sg(logprobs_t)). Its value equals s_i (so the clip
    decision is per sequence), and its gradient is s_i ∇log π_t. Every valid token carries
    −min(s_i A_i, clip(s_i, 1 − eps_low, 1 + eps_high) A_i). Reduced with
    ``reduce_loss(..., "seq_mean_token_mean")`` the gradient is exactly that of the
    sequence-level GSPO objective (1/N) Σ_i min(s_i A_i, clip(s_i) A_i); a clipped sequence
    gets zero gradient.

    Args:
        logprobs: float [N, T], current policy log-probs (with gradient).
        old_logprobs: float [N, T], denominator log-probs (constants).
        advantages: float [N], one advantage per sequence.
        mask: bool or 0/1 float [N, T].
        eps_low: lower clip range (sequence level; the paper uses small values such as 3e-4).
        eps_high: upper clip range (sequence level, e.g. 4e-4).

    Returns:
        (loss [N, T] (0 outside ``mask``), clipped_low [N] bool, clipped_high [N] bool), where
        clipped_high marks sequences with A > 0 and s > 1 + eps_high, clipped_low sequences with
        A < 0 and s < 1 − eps_low.

    Raises:
        ValueError: on shape mismatch or if ``advantages`` is not [N].
    """
    _check_same_shape(logprobs, old_logprobs, "logprobs", "old_logprobs")
    _check_same_shape(logprobs, mask, "logprobs", "mask")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"gspo_loss needs one advantage per sequence [N], got shape {tuple(advantages.shape)}")
    mask = mask.bool()
    # Replace padding before any arithmetic so that no padding value (even inf) reaches the
    # forward or the backward pass.
    valid_logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    valid_old = torch.where(mask, old_logprobs, torch.zeros_like(old_logprobs))

    seq_ratio = torch.exp(masked_mean(valid_logprobs - valid_old, mask, dim=-1)).detach()
    token_ratio = seq_ratio.unsqueeze(-1) * torch.exp(valid_logprobs - valid_logprobs.detach())
    adv = advantages.unsqueeze(-1)
    clipped_ratio = token_ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.minimum(token_ratio * adv, clipped_ratio * adv)
    loss = torch.where(mask, loss, torch.zeros_like(loss))

    clipped_high = (advantages > 0) & (seq_ratio > 1.0 + eps_high)
    clipped_low = (advantages < 0) & (seq_ratio < 1.0 - eps_low)
    return loss, clipped_low, clipped_high


def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """CISPO per-token loss (MiniMax-M1, 2025): clip the importance weight, not the update.

    loss_t = −sg(clip(r_t, 1 − eps_low, 1 + eps_high)) · A · logprobs_t, r_t = exp(logprobs_t −
    old_logprobs_t). The weight carries no gradient, so no token loses its gradient: the gradient
    is −clip(r_t) · A · ∇log π_t. Use with token-level reduction (``"token_mean"``).

    Args:
        logprobs: float [N, T], current policy log-probs (with gradient).
        old_logprobs: float [N, T], denominator log-probs (constants).
        advantages: float [N] (broadcast over tokens) or [N, T].
        eps_low: lower clip range of the weight (the paper effectively disables it with a large value).
        eps_high: upper clip range of the weight.

    Returns:
        loss [N, T]; padding is not masked, reduce with a mask.

    Raises:
        ValueError: on shape mismatch.
    """
    _check_same_shape(logprobs, old_logprobs, "logprobs", "old_logprobs")
    advantages = _broadcast_advantages(advantages, logprobs)
    ratio = torch.exp(logprobs.detach() - old_logprobs.detach())
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -weight * advantages * logprobs


def sapo_gate(ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO's soft gate f(r) = σ(τ (r − 1)) · 4/τ, τ = tau_pos where A > 0 and tau_neg otherwise
    (Soft Adaptive Policy Optimization, arXiv 2511.20347). f(1) = 2/τ and df/dr(1) = 1, so on-policy the
    gradient is REINFORCE's; off-policy df/dlog r = 4 r σ(1 − σ) decays smoothly instead of PPO's hard zero.

    Args:
        ratio: float [N, T], r = π_θ / π_old (with gradient for the loss).
        advantages: float [N] or [N, T] (broadcast).
        tau_pos, tau_neg: the gate's temperatures > 0 (the paper's 1.0 and 1.05: negative advantages decay faster).

    Returns:
        float [N, T].

    Raises:
        ValueError: advantages of the wrong shape.
    """
    advantages = _broadcast_advantages(advantages, ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    return torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau


def sapo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO per-token loss −f(r)·A with the soft gate f of ``sapo_gate`` in place of PPO's clip
    (arXiv 2511.20347, its token-level objective; group-normalised advantages as GRPO).

    Example: A = 1, r = 1: loss −2 (= −2/τ_pos), gradient w.r.t. the token's log-prob −1 (REINFORCE's −A);
    A = 1, r = e: gradient −4e·σ(e − 1)(1 − σ(e − 1)) = −1.40220 (PPO's clip would give 0); A = −1, r = 0.5
    (τ_neg = 1.05): loss σ(−0.525)·4/1.05 = 1.41594, gradient 2σ(−0.525)(1 − σ(−0.525)) = 0.46707.

    Args:
        logprobs: float [N, T] with gradient; old_logprobs: float [N, T] (constants);
        advantages: float [N] or [N, T]; tau_pos, tau_neg: as ``sapo_gate``.

    Returns:
        loss [N, T]; padding is not masked, reduce with a mask.

    Raises:
        ValueError: on shape mismatch.
    """
    _check_same_shape(logprobs, old_logprobs, "logprobs", "old_logprobs")
    ratio = torch.exp(logprobs - old_logprobs)
    return -sapo_gate(ratio, advantages, tau_pos, tau_neg) * _broadcast_advantages(advantages, logprobs)


# ----------------------------------------------------------------------------------------------
# Per-token coefficients: ∂ℓ_t / ∂log π, for the sampled token and for any other token
# ----------------------------------------------------------------------------------------------
# Score centering under a correction (``corrections.centering_term``) needs the coefficient a token
# v would have received had it been sampled at position t. Each function below is that coefficient
# for one objective, as a function of log(π_θ(v) / π_old(v)) (elementwise over the last dim J),
# matching autograd's gradient of the loss at the sampled token (tests/test_objectives.py). At the
# first optimizer step of a rollout batch every ratio is 1, and each reduces to −A (CISPO: −A·clip(1)).


def reinforce_coef(log_ratio: Tensor, advantages: Tensor) -> Tensor:
    """∂ℓ/∂log π of ℓ_t = −A · log π(y_t) (REINFORCE): −A, whatever the ratio.

    Args:
        log_ratio: float [N, T, J], log(π_θ / π_old) of the tokens to evaluate.
        advantages: float [N] or [N, T].

    Returns:
        float [N, T, J].

    Raises:
        ValueError: advantages that are neither [N] nor [N, T] for this ``log_ratio``.
    """
    return (-_token_advantages(advantages, log_ratio)).expand_as(log_ratio).to(log_ratio.dtype)


def ppo_clip_coef(
    log_ratio: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: Optional[float] = None,
    delta: Optional[float] = None,
) -> Tensor:
    """∂ℓ/∂log π of ``ppo_clip_loss``: −A·r where no clip binds, 0 where one does.

    ℓ = −min(r A, clip(r, 1 − eps_low, 1 + eps_high) A), r = exp(log_ratio); the clip binds (the token
    has no gradient) where A > 0 and r > 1 + eps_high, or A < 0 and r < 1 − eps_low (Schulman et al.
    2017; DAPO's clip-higher with eps_low ≠ eps_high); the dual clip c where A < 0 and r > c (Ye et al.
    2020); TRL's δ where A > 0 and r > δ, or A < 0 and r > max(δ, 1 + eps_high) (the capped branch
    min(r, δ) is constant above δ; for A < 0 the clipped branch clip(r) = r wins up to 1 + eps_high).

    Args:
        log_ratio: float [N, T, J]; advantages: float [N] or [N, T]; eps_low, eps_high: clip ranges;
        clip_ratio_c, delta: as ``ppo_clip_loss``.

    Returns:
        float [N, T, J].

    Raises:
        ValueError: advantages of the wrong shape.
    """
    adv = _token_advantages(advantages, log_ratio)
    ratio = log_ratio.exp()
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    if clip_ratio_c is not None:
        clipped = clipped | ((adv < 0) & (ratio > clip_ratio_c))
    if delta is not None:  # the capped branch min(r, δ) is constant above δ; for A < 0 clip(r) = r may still win
        clipped = clipped | ((adv > 0) & (ratio > delta)) | ((adv < 0) & (ratio > max(delta, 1.0 + eps_high)))
    return torch.where(clipped, torch.zeros_like(ratio), -adv * ratio)


def cispo_coef(log_ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """∂ℓ/∂log π of ``cispo_loss``: −sg(clip(r, 1 − eps_low, 1 + eps_high)) · A (MiniMax-M1, 2025).

    Args:
        log_ratio: float [N, T, J]; advantages: float [N] or [N, T]; eps_low, eps_high: clip ranges.

    Returns:
        float [N, T, J].

    Raises:
        ValueError: advantages of the wrong shape.
    """
    adv = _token_advantages(advantages, log_ratio)
    return -adv * log_ratio.exp().clamp(1.0 - eps_low, 1.0 + eps_high)


def sapo_coef(log_ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """∂ℓ/∂log π of ``sapo_loss``: −A · 4 r σ(τ(r − 1)) (1 − σ(τ(r − 1))), r = exp(log_ratio) (−A at r = 1).

    Args:
        log_ratio: float [N, T, J]; advantages: float [N] or [N, T]; tau_pos, tau_neg: the gate's temperatures.

    Returns:
        float [N, T, J].

    Raises:
        ValueError: advantages of the wrong shape.
    """
    adv = _token_advantages(advantages, log_ratio)
    return -adv * sapo_weight(log_ratio, adv, tau_pos, tau_neg)


def sapo_weight(log_ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO's gradient weight df/dlog r = 4 r σ(τ(r − 1)) (1 − σ(τ(r − 1))): 1 at r = 1, → 0 far from it.

    Args:
        log_ratio: float, any shape; advantages: float, broadcastable to it (its sign picks τ);
        tau_pos, tau_neg: the gate's temperatures.

    Returns:
        float, ``log_ratio``'s shape.
    """
    ratio = log_ratio.exp()
    adv = advantages.to(ratio.dtype)
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    s = torch.sigmoid(tau * (ratio - 1.0))
    return 4.0 * ratio * s * (1.0 - s)


def gspo_coef(
    log_ratio: Tensor, sampled_log_ratio: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> Tensor:
    """∂ℓ_t/∂log π of ``gspo_loss`` (GSPO-token form) had token v been sampled at position t.

    The sequence ratio with v in place of y_t is s_i(v) = s_i · exp((log r_v − log r_{y_t}) / T_i)
    (s_i the geometric mean of the sampled tokens' ratios, T_i the valid tokens); the coefficient is
    −A_i · s_i(v) where the sequence clip does not bind at s_i(v), else 0 (Zheng et al. 2025). The
    reduction (``seq_mean_token_mean``) supplies the 1 / T_i of the sequence objective.

    Args:
        log_ratio: float [N, T, J], log(π_θ / π_old) of the tokens to evaluate.
        sampled_log_ratio: float [N, T], log(π_θ / π_old) of the sampled tokens (padding ignored).
        advantages: float [N]. mask: bool [N, T]. eps_low, eps_high: sequence-level clip ranges.

    Returns:
        float [N, T, J].

    Raises:
        ValueError: on shape mismatch or advantages that are not [N].
    """
    _check_same_shape(sampled_log_ratio, mask, "sampled_log_ratio", "mask")
    if advantages.shape != sampled_log_ratio.shape[:1]:
        raise ValueError(f"gspo_coef needs one advantage per sequence [N], got shape {tuple(advantages.shape)}")
    valid = mask.bool()
    sampled = torch.where(valid, sampled_log_ratio, torch.zeros_like(sampled_log_ratio))
    lengths = valid.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)  # [N, 1]
    log_s = masked_mean(sampled, valid, dim=-1).to(log_ratio.dtype)[:, None, None]
    seq_ratio = (log_s + (log_ratio - sampled.to(log_ratio.dtype).unsqueeze(-1)) / lengths.unsqueeze(-1)).exp()
    adv = advantages.to(log_ratio.dtype)[:, None, None]
    clipped = ((adv > 0) & (seq_ratio > 1.0 + eps_high)) | ((adv < 0) & (seq_ratio < 1.0 - eps_low))
    return torch.where(clipped, torch.zeros_like(seq_ratio), -adv * seq_ratio)


# ----------------------------------------------------------------------------------------------
# Critic, entropy, KL
# ----------------------------------------------------------------------------------------------


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> Tensor:
    """Per-token clipped value loss (PPO, Schulman et al. 2017; as in OpenAI baselines).

    loss = 0.5 · max((V − R)², (clip(V, V_old − clip, V_old + clip) − R)²).

    Args:
        values: float [N, T], current value estimates (with gradient).
        old_values: float [N, T], value estimates at rollout time.
        returns: float [N, T], targets (e.g. from ``gae``).
        clip: value clip range.

    Returns:
        float [N, T]; padding is not masked, reduce with a mask.

    Raises:
        ValueError: on shape mismatch.
    """
    _check_same_shape(values, old_values, "values", "old_values")
    _check_same_shape(values, returns, "values", "returns")
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H = −Σ_v p_v log p_v of the softmax distribution over the last dimension.

    Computed stably from ``log_softmax`` (logits − logsumexp); vocabulary entries with p = 0
    (including logits of −inf) contribute 0. Half-precision logits are upcast to float32.

    Args:
        logits: float [..., V].

    Returns:
        float [...] (float32 for half-precision input, else the input dtype).
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
    return -(probs * log_probs).sum(-1)


def entropy_bonus_loss(token_loss: Tensor, entropy: Tensor, coef: float) -> Tensor:
    """The per-token loss with an entropy bonus: token_loss − coef · H_t (Williams & Peng 1991; Mnih et al.
    2016, A3C; PPO's c_2 · S[π] term, Schulman et al. 2017 eq. 9).

    H_t is the entropy of π_θ(· | h_t) in nats under the sampler's distribution (its temperature and top-k /
    top-p truncation, ``logprobs.response_logprobs(entropy_grad=True)``), with gradient. Added per token and
    reduced with the policy loss's own ``loss.reduction`` (as verl's ``entropy_coeff``, aggregated with its
    ``loss_agg_mode``), so the bonus weighs tokens as the loss does. A per-token average over the batch (how
    TRL averages entropy) equals this only under ``token_mean``: with ``seq_mean_token_mean`` each completion
    counts once here, so a long completion's tokens weigh less than in a per-token average; with
    ``constant`` the sum is divided by G·L_max. Not importance-weighted by a correction (it is not a
    policy-gradient estimate).

    Args:
        token_loss: float [N, T], the loss to minimise.
        entropy: float [N, T], H_t (with gradient for the bonus to act).
        coef: the bonus's weight (``loss.entropy_coef``; 0 = off).

    Returns:
        float [N, T].

    Raises:
        ValueError: on shape mismatch.
    """
    _check_same_shape(token_loss, entropy, "token_loss", "entropy")
    return token_loss - coef * entropy


#: k3's value at which it leaves its exact form for its tangent, on the side π_θ < π_ref where it grows as
#: π_ref/π_θ (``approx_kl``): the value verl and OpenRLHF clamp k3 at
K3_TANGENT_FROM = 10.0


def k3_knee(value: float = K3_TANGENT_FROM) -> float:
    """The log-weight r₀ > 0 at which k3(r) = e^r − r − 1 equals ``value`` (r = log π_ref − log π_θ), so that
    e^{r₀} = 1 + value + r₀. ``value`` = 10 gives r₀ = 2.610868638…, π_ref/π_θ = 13.6109. Newton's method from
    r = log(1 + value) + 1, to the right of the root, where it converges monotonically (k3 is convex).

    Raises:
        ValueError: ``value`` not > 0.
    """
    if not value > 0:
        raise ValueError(f"k3's tangent point needs a value > 0, got {value}")
    r = math.log1p(value) + 1.0
    for _ in range(100):
        step = (math.exp(r) - r - 1.0 - value) / math.expm1(r)
        r -= step
        if abs(step) <= 1e-15 * r:
            break
    return r


def approx_kl(
    logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3", tangent_from: Optional[float] = K3_TANGENT_FROM
) -> Tensor:
    """Per-token estimators of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman 2020, "Approximating KL
    Divergence"), k3 bounded so that neither its value nor its gradient can overflow.

    With d = logprobs − ref_logprobs and r = −d = log(π_ref/π_θ):
        ``"k1"``: d (unbiased, can be negative).
        ``"k2"``: 0.5 · d² (biased, low variance).
        ``"k3"``: e^r − r − 1 (unbiased, always ≥ 0, 0 when equal) while its value is at most ``tangent_from``
        on the side π_θ < π_ref (r ≤ r₀ = ``k3_knee(tangent_from)``, π_ref/π_θ ≤ 13.61 for the default 10);
        beyond, its tangent at r₀: tangent_from + (e^{r₀} − 1)·(r − r₀). Both are exactly equal (bit for bit,
        value and gradient) wherever the bound does not bind.

    As a loss term (``kl.mode=loss``) what matters is the gradient: ∂k3/∂log π_θ = 1 − π_ref/π_θ, the
    importance weight π_ref/π_θ of k3's forward-KL gradient (docs/configuration.md, "The KL to the
    reference"). Unbounded, it is e^{89} = inf in float32 at a log-ratio of −89 (the step's loss is inf and the
    non-finite guard drops the whole update, its policy-gradient part included) and already 4.85e8 at −20.
    The tangent truncates that weight at e^{r₀} = 13.61, as TIS truncates its own (``corrections``): one
    token's gradient is in [1 − e^{r₀}, 1) = [−12.61, 1) and its value grows at most linearly in |d| (as k3
    already does on the side π_θ > π_ref, where its slope is below 1), finite for every finite log-prob.
    Example: log π_θ = −100, π_ref = 0.5: r = 99.307, value 10 + 12.6109 · 96.696 = 1229.42, gradient
    −12.6109 w.r.t. log π_θ (unbounded: e^{99.3} = inf).

    The peers: verl (``kl_penalty``, ``low_var_kl``) clamps r to [−20, 20] and then the value to [−10, 10];
    OpenRLHF (``compute_approx_kl``) clamps the value to [−10, 10]; TRL's GRPO does not clamp. A value clamp
    gives a token beyond it no gradient at all, so the KL stops pulling exactly the tokens furthest from the
    reference (on the side π_θ > π_ref too: k3 reaches 10 at d ≈ 11), and without verl's first clamp the
    clamped-away gradient is 0 · inf = NaN once e^r overflows. Here the region where k3 is exact on the
    π_θ < π_ref side is theirs (value ≤ 10) and the largest gradient is the largest of theirs (12.61), but the
    pull continues beyond instead of stopping, and nothing is clamped on the side π_θ > π_ref.

    Args:
        logprobs: float [N, T] (any shape), log π_θ (may carry a gradient).
        ref_logprobs: float, the same shape, log π_ref.
        kind: one of ``KL_KINDS``.
        tangent_from: k3's bound (a value > 0), or None for the exact e^r − r − 1 (which overflows to inf for
            r > 88.7 in float32); k1 and k2 ignore it (neither exponentiates).

    Returns:
        float, the shape and dtype of ``logprobs``.

    Raises:
        ValueError: unknown ``kind``, shape mismatch, or ``tangent_from`` not > 0.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"Unknown KL estimator {kind!r}; expected one of {KL_KINDS}")
    _check_same_shape(logprobs, ref_logprobs, "logprobs", "ref_logprobs")
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if tangent_from is None:
        return torch.exp(-log_ratio) + log_ratio - 1.0
    r0 = k3_knee(tangent_from)
    r = -log_ratio
    # e^r only up to r0, so that the branch where() leaves out is finite and passes back 0, never 0 * inf = NaN;
    # where the bound does not bind this is e^r − r − 1 as it was, value and gradient bit for bit
    exact = torch.exp(r.clamp(max=r0)) - r - 1.0
    tangent = tangent_from + math.expm1(r0) * (r - r0)
    return torch.where(r <= r0, exact, tangent)


def kl_penalised_returns(rewards: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-token returns with the KL to the reference folded into the reward (REINFORCE++, Hu et al. 2025;
    the classic RLHF reward of Ziegler et al. 2019 and Ouyang et al. 2022, γ = 1).

    r_t = −β·kl_t at every valid token, plus the sequence reward R_i at its last valid token; the return is
    G_t = Σ_{s ≥ t} r_s over the valid tokens, so G_t = R_i − β Σ_{s ≥ t} kl_s. Example: R = 1, kl = [0.1, 0.3],
    β = 0.5 gives G = [1 − 0.2, 1 − 0.15] = [0.8, 0.85].

    Args:
        rewards: float [N], the sequence rewards (after any baseline).
        kl: float [N, T], the per-token KL estimate to the reference (``approx_kl`` of π_old and π_ref).
        mask: bool [N, T].
        beta: the KL coefficient β ≥ 0.

    Returns:
        float [N, T], 0 outside ``mask``; no gradient.

    Raises:
        ValueError: shape mismatch or ``rewards`` not [N].
    """
    _check_same_shape(kl, mask, "kl", "mask")
    rewards = _as_float(rewards)
    _check_1d(rewards, "rewards")
    if rewards.shape[0] != kl.shape[0]:
        raise ValueError(f"rewards must be [N={kl.shape[0]}], got shape {tuple(rewards.shape)}")
    valid = mask.bool()
    token_rewards = torch.where(valid, -beta * kl.detach().to(rewards.dtype), torch.zeros_like(kl, dtype=rewards.dtype))
    # reversed cumulative sum over valid tokens: G_t = Σ_{s >= t} r_s (padding adds 0)
    returns = token_rewards.flip(-1).cumsum(-1).flip(-1) + rewards[:, None]
    return torch.where(valid, returns, torch.zeros_like(returns))


def adaptive_kl_coef(beta: float, kl: float, target: float, horizon: float, n_steps: int) -> float:
    """One update of the adaptive KL controller (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", §2.2): e = clip(KL / KL_target − 1, −0.2, 0.2), β ← β·(1 + e·n_steps / horizon).

    Example: β = 0.1, target 6, horizon 10000, 512 sequences per step, KL = 12 → e = 0.2 (clipped),
    β ← 0.1·(1 + 0.2·0.0512) = 0.1010240.

    Args:
        beta: the current β > 0.
        kl: the step's measured KL to the reference (nats per sequence).
        target: KL_target > 0.
        horizon: the controller's horizon H > 0 (in sequences).
        n_steps: sequences in the step (the peers' n_steps: the batch size).

    Returns:
        The next β (float).

    Raises:
        ValueError: ``target`` or ``horizon`` not > 0.
    """
    if not (target > 0 and horizon > 0):
        raise ValueError(f"the adaptive KL controller needs target > 0 and horizon > 0, got {target}, {horizon}")
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


# ----------------------------------------------------------------------------------------------
# DAPO helpers
# ----------------------------------------------------------------------------------------------


def overlong_penalty(response_length: Tensor, max_response_length: int, buffer_length: int) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025), added to the task reward.

    With L_max = ``max_response_length``, L_buf = ``buffer_length``:
    0 for T ≤ L_max − L_buf; −(T − (L_max − L_buf)) / L_buf inside the buffer; −1 for T ≥ L_max.
    ``buffer_length = 0`` gives a hard penalty: −1 for T ≥ L_max, else 0.

    Args:
        response_length: integer or float [N], generated tokens per completion.
        max_response_length: L_max.
        buffer_length: L_buf, with 0 ≤ L_buf ≤ L_max.

    Returns:
        float32 [N] (or the input's floating dtype) in [−1, 0].

    Raises:
        ValueError: if ``buffer_length`` is outside [0, max_response_length].
    """
    if not 0 <= buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in [0, max_response_length={max_response_length}], got {buffer_length}"
        )
    length = _as_float(response_length)
    if buffer_length == 0:
        return -(length >= max_response_length).to(length.dtype)
    start = max_response_length - buffer_length
    return -((length - start) / buffer_length).clamp(0.0, 1.0)


def useful_group_probability(p: float, group_size: int) -> float:
    """Probability that a group of ``group_size`` Bernoulli(p) rewards is mixed: 1 − p^G − (1 − p)^G.

    Only mixed groups carry a GRPO/DAPO gradient (an all-equal group has zero advantages).

    Raises:
        ValueError: ``p`` outside [0, 1] or ``group_size`` < 1.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return 1.0 - p**group_size - (1.0 - p) ** group_size


def useful_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Which completions belong to a group with non-identical rewards (DAPO dynamic sampling keeps these).

    Args:
        rewards: float [N].
        group_ids: integer [N], the group (prompt) of each completion.

    Returns:
        bool [N]: True where the completion's group has at least two different rewards.

    Raises:
        ValueError: ``rewards`` not 1-D or a shape mismatch with ``group_ids``.
    """
    rewards = _as_float(rewards)
    _check_1d(rewards, "rewards")
    _check_same_shape(rewards, group_ids, "rewards", "group_ids")
    inverse, num_groups = _group_index(group_ids)
    valid = torch.ones_like(rewards, dtype=torch.bool)
    return _group_has_variance(rewards, valid, inverse, num_groups)[inverse]


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids [N] to contiguous indices in [0, num_groups)."""
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique_ids.numel()


def _group_has_variance(rewards: Tensor, valid: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """bool [num_groups]: True where the group's valid rewards are not all equal."""
    inf = torch.full_like(rewards, float("inf"))
    high = rewards.new_full((num_groups,), -float("inf"))
    low = rewards.new_full((num_groups,), float("inf"))
    high = high.scatter_reduce(0, inverse, torch.where(valid, rewards, -inf), reduce="amax")
    low = low.scatter_reduce(0, inverse, torch.where(valid, rewards, inf), reduce="amin")
    return high > low


def _broadcast_advantages(advantages: Tensor, logprobs: Tensor) -> Tensor:
    """[N] -> [N, 1]; [N, T] unchanged."""
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        return advantages.unsqueeze(-1)
    if advantages.shape == logprobs.shape:
        return advantages
    raise ValueError(
        f"advantages must be [N] or [N, T] for logprobs of shape {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
    )


def _token_advantages(advantages: Tensor, log_ratio: Tensor) -> Tensor:
    """Advantages [N] or [N, T] shaped to broadcast against per-candidate values [N, T, J]."""
    if log_ratio.dim() != 3:
        raise ValueError(f"log_ratio must be [N, T, J], got shape {tuple(log_ratio.shape)}")
    n, t = log_ratio.shape[:2]
    if advantages.dim() == 1 and advantages.shape[0] == n:
        return advantages.to(log_ratio.dtype)[:, None, None]
    if advantages.shape == (n, t):
        return advantages.to(log_ratio.dtype).unsqueeze(-1)
    raise ValueError(
        f"advantages must be [N] or [N, T] for log_ratio of shape {tuple(log_ratio.shape)}, "
        f"got {tuple(advantages.shape)}"
    )


def _safe_div(numerator: Tensor, denominator: Union[float, Tensor]) -> Tensor:
    """numerator / denominator, with a zero denominator read as 1 (the numerator is then 0)."""
    denominator = torch.as_tensor(denominator, dtype=numerator.dtype, device=numerator.device)
    return numerator / torch.where(denominator != 0, denominator, torch.ones_like(denominator))


def _as_float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def _check_1d(x: Tensor, name: str) -> None:
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(x.shape)}")


def _check_same_shape(a: Tensor, b: Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
