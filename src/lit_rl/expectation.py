"""Exact expected gradients of lit_rl's own update, on policies small enough to enumerate every sequence.

An estimator (a loss, a correction, an advantage) is right or wrong in expectation, and one sample cannot
tell. Here the policy is tabular: a logit row per prefix, over a vocabulary of V tokens and responses of
exactly L tokens, so the V^L sequences (and the groups of G of them) can all be listed and the expectation
of the update's gradient under a sampler μ is a finite, exact sum:

    E_μ[ĝ] = Σ_batches μ(batch) · ∇_θ loss(batch),   μ(batch) = Π_rows Π_t μ(y_t | y_<t).

The gradient is the one the trainer computes: ``RLModule.build_batch`` (advantages),
``snapshot`` where the algorithm has one, and ``accumulate_gradients`` (the log-probs of
``logprobs.response_logprobs``, ``policy_loss``, ``correct``, ``finish_loss``, ``reduce_loss``). Nothing is
re-implemented; the policy below only replaces the transformer, through the same interface
(``get_decoder()(...).last_hidden_state`` and ``get_output_embeddings()``).

Rules that read a statistic of the whole batch (M2PO's bound) cannot be enumerated over batches of 64:
``monte_carlo_gradient`` estimates their E[ĝ] from independent batches, with its standard error.

Used by tests/test_corrections_expectation.py (the identities every correction must satisfy) and by
benchmarks/corrections_in_expectation.py (drift, bias and variance per correction and mismatch size).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from .rollout.datamodule import ScoredRollouts
from .rollout.types import RolloutBatch, Rollouts


def num_prefixes(vocab_size: int, length: int) -> int:
    """S = Σ_{l<L} V^l: the prefixes that predict a token (the empty one included)."""
    return sum(vocab_size**n for n in range(length))


def prefix_index(prefix: Iterable[int], vocab_size: int) -> int:
    """The row of the table that holds π(· | prefix): prefixes ordered by length, then as base-V numbers."""
    prefix = list(prefix)
    offset = num_prefixes(vocab_size, len(prefix))
    return offset + sum(y * vocab_size ** (len(prefix) - 1 - j) for j, y in enumerate(prefix))


class _PrefixOneHot(nn.Module):
    """The 'backbone' of ``TabularPolicy``: position i of [prompt | y_1 .. y_T] -> one-hot of its prefix y_1..y_i."""

    def __init__(self, vocab_size: int, length: int):
        super().__init__()
        self.vocab_size, self.length = vocab_size, length
        self.num_states = num_prefixes(vocab_size, length)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        position_ids=None,
        use_cache: bool = False,
        **_,
    ):
        """input_ids [N, 1 + T] (one prompt token, then the response) -> last_hidden_state [N, 1 + T, S]."""
        response = input_ids[:, 1:]
        n, t = response.shape
        index = torch.zeros(n, t + 1, dtype=torch.long, device=input_ids.device)
        code = torch.zeros(n, dtype=torch.long, device=input_ids.device)
        for i in range(1, t + 1):
            code = code * self.vocab_size + response[:, i - 1].clamp(0, self.vocab_size - 1)
            # positions past L predict nothing a loss uses (padding): any valid row will do
            index[:, i] = num_prefixes(self.vocab_size, i) + code if i < self.length else 0
        hidden = nn.functional.one_hot(index, self.num_states).to(torch.float32)
        return SimpleNamespace(last_hidden_state=hidden)


class TabularPolicy(nn.Module):
    """An autoregressive policy with one logit row per prefix: π(y_t | y_<t) = softmax(θ[prefix]).

    θ is the weight of the output layer (``lm_head.weight``, float32 [V, S], i.e. θ^T), so the gradient the
    trainer writes into it is the gradient w.r.t. every logit of the table. Responses are exactly
    ``length`` tokens; the prompt is one token (its id is ignored).

    Args:
        vocab_size: V >= 2.
        length: L >= 1 tokens per response.
        logits: optional float [S, V] table (S = ``num_prefixes(V, L)``); default N(0, 1) from ``seed``.
        seed: seed of the default table.

    Raises:
        ValueError: a table of the wrong shape.
    """

    def __init__(self, vocab_size: int, length: int, logits: Optional[Tensor] = None, seed: int = 0):
        super().__init__()
        self.decoder = _PrefixOneHot(vocab_size, length)
        s = self.decoder.num_states
        if logits is None:
            logits = torch.randn(s, vocab_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        if tuple(logits.shape) != (s, vocab_size):
            raise ValueError(f"logits must be [S={s}, V={vocab_size}], got {tuple(logits.shape)}")
        self.lm_head = nn.Linear(s, vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(logits.T.to(torch.float32))
        self.config = SimpleNamespace(hidden_size=s, vocab_size=vocab_size)
        self.generation_config = None
        self.vocab_size, self.length = vocab_size, length

    def get_decoder(self) -> nn.Module:
        return self.decoder

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def table(self) -> Tensor:
        """float64 [S, V] logits (detached)."""
        return self.lm_head.weight.detach().T.double()

    def gradient(self) -> Tensor:
        """float64 [S, V]: the accumulated gradient w.r.t. the table's logits (zeros if none)."""
        g = self.lm_head.weight.grad
        return torch.zeros_like(self.table()) if g is None else g.detach().T.double().clone()


def all_sequences(vocab_size: int, length: int) -> Tensor:
    """int64 [V^L, L], every response in lexicographic order."""
    return torch.tensor(list(itertools.product(range(vocab_size), repeat=length)), dtype=torch.long)


def sequence_logprobs(table: Tensor, sequences: Tensor) -> Tensor:
    """float64 [N, L] log π(y_t | y_<t) of each token under a logit table [S, V] (float64 log-softmax)."""
    logp = torch.log_softmax(table.double(), -1)
    rows = prefix_rows(sequences, table.shape[1])
    return logp[rows, sequences]


def prefix_rows(sequences: Tensor, vocab_size: int) -> Tensor:
    """int64 [N, L]: the table row (prefix index) that predicts each token of ``sequences`` [N, L]."""
    n, length = sequences.shape
    rows = torch.zeros(n, length, dtype=torch.long)
    code = torch.zeros(n, dtype=torch.long)
    for t in range(length):
        rows[:, t] = num_prefixes(vocab_size, t) + code
        code = code * vocab_size + sequences[:, t]
    return rows


def rollouts_from(
    sequences: Tensor, sampler_table: Tensor, head_size: int = 0, tail_ids: Optional[Tensor] = None
) -> Rollouts:
    """The ``Rollouts`` an engine sampling from the logit table ``sampler_table`` [S, V] would return for these
    ``sequences`` [N, L]: rollout_logprobs = log μ(y_t | y_<t), and with ``head_size`` = k > 0 the engine's top-k
    ids and log-probs per position (k = V: the whole vocabulary), followed by the tail samples ``tail_ids``
    [N, L, m] int64 when given (score centering's sampled tail; their log μ recorded beside them)."""
    n, length = sequences.shape
    vocab = sampler_table.shape[1]
    logmu = torch.log_softmax(sampler_table.double(), -1)
    rows = prefix_rows(sequences, vocab)
    topk_ids = topk_lp = None
    if head_size:
        lp_rows = logmu[rows]  # [N, L, V]
        topk_lp, topk_ids = lp_rows.topk(head_size, dim=-1)
        if tail_ids is not None:
            topk_ids = torch.cat([topk_ids, tail_ids], dim=-1)
            topk_lp = torch.cat([topk_lp, lp_rows.gather(-1, tail_ids)], dim=-1)
        topk_lp = topk_lp.float()
    return Rollouts(
        prompt_ids=[[0]] * n,
        response_ids=sequences.clone(),
        response_mask=torch.ones(n, length, dtype=torch.bool),
        rollout_logprobs=logmu[rows, sequences].float(),
        finish_reason=["length"] * n,
        policy_version=torch.zeros(n, dtype=torch.long),
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
    )


def scored_from(rollouts: Rollouts, rewards: Tensor, group_size: int) -> ScoredRollouts:
    """``ScoredRollouts`` with the given rewards [N]; consecutive rows in groups of ``group_size``."""
    n = len(rollouts.prompt_ids)
    return ScoredRollouts(
        rollouts=rollouts, rewards=rewards.float(), group_ids=torch.arange(n) // group_size, examples=[], texts=[""] * n
    )


@dataclass
class Moments:
    """Exact first and second moments of a per-batch gradient estimator ĝ over its sampling distribution.

    mean: float64 [S, V], E[ĝ]; second: float64, E[‖ĝ‖²] (so Var = second − ‖mean‖², the trace of the
    covariance of one batch's ĝ); mass: the total probability enumerated (1 up to rounding)."""

    mean: Tensor
    second: float
    mass: float

    @property
    def variance(self) -> float:
        """E‖ĝ − E ĝ‖² of one batch (≥ 0 up to rounding)."""
        return max(self.second - float((self.mean**2).sum()), 0.0)


def batch_gradient(
    module,
    policy: TabularPolicy,
    rb: RolloutBatch,
    advantages: Optional[Callable[[RolloutBatch], Tensor]] = None,
    before: Optional[Callable[[RolloutBatch], None]] = None,
) -> Tensor:
    """∇_θ of the module's loss on one rollout batch, float64 [S, V], through the trainer's own path of the
    first optimizer step: ``start_update`` (π_old and, for PPO, the critic's GAE advantages), then optionally
    the advantages replaced by ``advantages(rb)`` and a hook ``before(rb)`` (e.g. to move θ away from π_old),
    then ``accumulate_gradients``."""
    module.start_update(rb)
    if advantages is not None:
        rb.advantages = advantages(rb)
    if before is not None:
        before(rb)
    policy.zero_grad(set_to_none=True)
    module.accumulate_gradients(rb)
    return policy.gradient()


def expected_gradient(
    module,
    policy: TabularPolicy,
    sampler_table: Tensor,
    reward: Callable[[Tensor], Tensor],
    group_size: int = 1,
    head_size: int = 0,
    advantages: Optional[Callable[[RolloutBatch], Tensor]] = None,
    before: Optional[Callable[[RolloutBatch], None]] = None,
    per_batch: bool = False,
    tail_samples: int = 0,
) -> Moments:
    """Exact E_μ[ĝ] of one batch of ``group_size`` completions of one prompt, every completion drawn from the
    sampler ``sampler_table`` [S, V], through the module's real update path.

    Two ways to the same sum (the loss is linear in the advantages, every objective's coefficient is
    proportional to A at a fixed ratio, and every completion has the same length):
    - ``per_batch=True``: one gradient per enumerated group, weighted by its probability; also gives
      E‖ĝ‖² (``Moments.second``). One forward and backward per group.
    - ``per_batch=False`` (default, fast): all V^(L·G) groups in ONE rollout batch (a group id each, so group
      baselines see their own group), each row's advantage multiplied by its group's probability times the
      number of groups; the step's denominators count every row, which the factor undoes. One forward and
      backward in all. Batch-wide statistics (PPO's advantage whitening) then span all groups, which changes
      PPO's advantages but none of the identities tested with it. ``second`` is NaN.

    Args:
        module: an ``RLModule`` built around ``policy`` (``lit_rl.run.train.build_module``).
        policy: the ``TabularPolicy`` the module trains.
        sampler_table: float [S, V], the sampler μ's logit table (``policy.table()`` for on-policy).
        reward: maps sequences int64 [N, L] to rewards float [N].
        group_size: G; all V^(L·G) ordered groups are enumerated (keep V^L·G small).
        head_size: k, the top-k the engine records (needed by score centering; V = the full vocabulary).
        advantages: optional replacement of the algorithm's advantages (after ``start_update``), e.g.
            ``lambda rb: torch.ones(len(rb))`` for a constant advantage (group baselines would otherwise make
            a constant reward empty).
        before: optional hook run on each batch just before the gradient (see ``batch_gradient``).
        per_batch: see above.
        tail_samples: m > 0: the engine also records m tail samples per position after its top-k (score centering's
            sampled tail, ``correction.sc.tail=sampled``), and the expectation is over their draws too: every group
            comes once per draw of its rows' samples (``tail_draws``), weighted by the draw's probability.

    Returns:
        ``Moments`` of the per-batch gradient.
    """
    vocab, length = policy.vocab_size, policy.length
    seqs = all_sequences(vocab, length)
    seq_logmu = sequence_logprobs(sampler_table, seqs).sum(-1)
    groups = torch.tensor(list(itertools.product(range(len(seqs)), repeat=group_size)), dtype=torch.long)
    probs = seq_logmu[groups].sum(-1).exp()  # [num_groups]
    tails = None  # [num_groups, G, L, m]: the engine's tail samples of each group's rows, enumerated too
    if tail_samples:
        groups, tails, probs = _with_tail_draws(seqs, groups, probs, sampler_table, head_size, tail_samples)

    def rollouts(index: Tensor, tail: Optional[Tensor]) -> RolloutBatch:
        batch = seqs[index]
        tail_ids = None if tail is None else tail.reshape(-1, length, tail_samples)
        scored = scored_from(rollouts_from(batch, sampler_table, head_size, tail_ids), reward(batch), group_size)
        return module.build_batch(scored)

    if not per_batch:
        rb = rollouts(groups.reshape(-1), tails)
        scale = (probs * len(groups)).repeat_interleave(group_size).float()

        def weighted(rb: RolloutBatch) -> Tensor:
            adv = advantages(rb) if advantages is not None else rb.advantages
            return adv * (scale if adv.dim() == 1 else scale[:, None])

        g = batch_gradient(module, policy, rb, weighted, before)
        return Moments(g, float("nan"), float(probs.sum()))
    mean = torch.zeros_like(policy.table())
    second = 0.0
    for i, (index, prob) in enumerate(zip(groups, probs.tolist())):
        g = batch_gradient(module, policy, rollouts(index, None if tails is None else tails[i]), advantages, before)
        mean += prob * g
        second += prob * float((g**2).sum())
    return Moments(mean, second, float(probs.sum()))


def tail_draws(sequence: Tensor, sampler_table: Tensor, head_size: int, m: int) -> tuple[Tensor, Tensor]:
    """Every way an engine could draw score centering's ``m`` tail samples at each position of ``sequence`` [L]
    (i.i.d. from μ without its top-``head_size``, renormalised; ``torch_engine.sample_tail``): (ids [A, L, m]
    int64, log-probabilities [A] float64), A = (V − k)^(L·m). Raises ValueError when the head leaves no tail."""
    vocab = sampler_table.shape[1]
    if not 0 <= head_size < vocab:
        raise ValueError(f"the tail samples need a head smaller than the vocabulary: head_size={head_size}, V={vocab}")
    logmu = torch.log_softmax(sampler_table.double(), -1)[prefix_rows(sequence[None], vocab)[0]]  # [L, V]
    head = logmu.topk(head_size, dim=-1).indices if head_size else logmu.new_zeros((len(logmu), 0), dtype=torch.long)
    per_position = []
    for t in range(len(logmu)):
        tail = [v for v in range(vocab) if v not in set(head[t].tolist())]
        log_tail = logmu[t, tail] - torch.logsumexp(logmu[t, tail], 0)
        per_position.append([(u, float(log_tail[j])) for j, u in enumerate(tail)])
    draws = list(itertools.product(*[list(itertools.product(p, repeat=m)) for p in per_position]))
    ids = torch.tensor([[[u for u, _ in pos] for pos in draw] for draw in draws], dtype=torch.long)
    logp = torch.tensor([sum(lp for pos in draw for _, lp in pos) for draw in draws], dtype=torch.float64)
    return ids, logp


def _with_tail_draws(seqs, groups, probs, sampler_table, head_size, m) -> tuple[Tensor, Tensor, Tensor]:
    """The groups [num, G] and their probabilities [num] expanded by every draw of their rows' tail samples:
    (groups [num', G], tails [num', G, L, m], probabilities [num'])."""
    draws = {}
    out_groups, out_tails, out_probs = [], [], []
    for index, prob in zip(groups.tolist(), probs.tolist()):
        for i in index:
            if i not in draws:
                draws[i] = tail_draws(seqs[i], sampler_table, head_size, m)
        per_row = [draws[i] for i in index]
        for combo in itertools.product(*(range(len(lp)) for _, lp in per_row)):
            out_groups.append(index)
            out_tails.append(torch.stack([ids[a] for (ids, _), a in zip(per_row, combo)]))
            out_probs.append(prob * math.exp(sum(float(lp[a]) for (_, lp), a in zip(per_row, combo))))
    return (
        torch.tensor(out_groups, dtype=torch.long),
        torch.stack(out_tails),
        torch.tensor(out_probs, dtype=torch.float64),
    )


def noisy_table(table: Tensor, sigma: float, seed: int = 0) -> Tensor:
    """A sampler's logit table: ``table`` plus N(0, σ²) noise per logit (float64, seeded)."""
    noise = torch.randn(table.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return table.double() + sigma * noise


def mean_kl(p_table: Tensor, q_table: Tensor) -> float:
    """KL(p ‖ q) in nats, averaged over the table's rows (prefixes) uniformly."""
    logp, logq = torch.log_softmax(p_table.double(), -1), torch.log_softmax(q_table.double(), -1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


def sampler_at_kl(table: Tensor, target_kl: float, seed: int = 0) -> tuple[Tensor, float]:
    """(a noisy sampler table whose mean KL(π ‖ μ) equals ``target_kl`` to 1e-6 relative, its noise σ):
    the logit-noise scale found by bisection for a fixed noise draw."""
    lo, hi = 0.0, 1.0
    while mean_kl(table, noisy_table(table, hi, seed)) < target_kl:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if mean_kl(table, noisy_table(table, mid, seed)) < target_kl:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-9 * hi:
            break
    return noisy_table(table, hi, seed), hi


@dataclass
class MonteCarlo:
    """A Monte Carlo estimate of E[ĝ] over independent batches, for the rules no enumeration reaches (a statistic
    of the whole batch, e.g. M2PO's bound): mean float64 [S, V]; stderr float64 [S, V], the standard error of each
    entry of the mean (sample std / √B); second: the mean of ‖ĝ‖² over the batches; batches: B."""

    mean: Tensor
    stderr: Tensor
    second: float
    batches: int

    @property
    def variance(self) -> float:
        """E‖ĝ − E ĝ‖² of one batch, estimated (≥ 0)."""
        return max(self.second - float((self.mean**2).sum()), 0.0)

    @property
    def norm_stderr(self) -> float:
        """The standard error of ‖mean‖ to first order, √(Σ stderr²) (an upper bound on it)."""
        return float(self.stderr.pow(2).sum().sqrt())


def monte_carlo_gradient(
    module,
    policy: TabularPolicy,
    sampler_table: Tensor,
    reward: Callable[[Tensor], Tensor],
    batch_size: int,
    num_batches: int,
    seed: int = 0,
    head_size: int = 0,
    advantages: Optional[Callable[[RolloutBatch], Tensor]] = None,
) -> MonteCarlo:
    """E_μ[ĝ] of batches of ``batch_size`` sequences drawn i.i.d. from the sampler ``sampler_table`` [S, V] (one
    group of ``batch_size``), estimated from ``num_batches`` independent batches (seeded), each through the module's
    real update path (``batch_gradient``). Raises ValueError for fewer than 2 batches."""
    if num_batches < 2:
        raise ValueError(f"num_batches must be >= 2 for a standard error, got {num_batches}")
    vocab, length = policy.vocab_size, policy.length
    seqs = all_sequences(vocab, length)
    probs = sequence_logprobs(sampler_table, seqs).sum(-1).exp()
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros_like(policy.table())
    total_sq = torch.zeros_like(total)
    second = 0.0
    for _ in range(num_batches):
        batch = seqs[torch.multinomial(probs, batch_size, replacement=True, generator=gen)]
        rb = module.build_batch(scored_from(rollouts_from(batch, sampler_table, head_size), reward(batch), batch_size))
        g = batch_gradient(module, policy, rb, advantages)
        total += g
        total_sq += g**2
        second += float((g**2).sum())
    mean = total / num_batches
    var = (total_sq / num_batches - mean**2).clamp(min=0) * num_batches / (num_batches - 1)
    return MonteCarlo(mean, (var / num_batches).sqrt(), second / num_batches, num_batches)
