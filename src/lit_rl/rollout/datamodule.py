"""RolloutDataModule: prompts -> engine -> rewards, as a LightningDataModule.

The training DataLoader yields one ``PromptBatch`` per RL step. Which prompts a step gets is a pure
function of (seed, step, round): each pass over the training split is a fresh seeded permutation. So a
resumed run draws exactly the prompts an uninterrupted one would, with no sampler state to save.
The LightningModule turns a ``PromptBatch`` into completions with ``collect`` and into a training batch.

With several data-parallel ranks (Lightning's DDP/FSDP), rank r gets the r-th contiguous share of the
step's P prompts (``shard``), so a prompt's whole group is sampled, scored and normalised on one rank and
the group advantages equal the single-device ones. Sampling seeds are keyed by a prompt's position in the
step's full list, not in the rank's share: 1 and 2 devices sample the same completions for a prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from ..tasks import Example, Task
from ..tasks.reward_functions import RewardFunctions
from .types import Rollouts, SamplingConfig


@dataclass
class PromptBatch:
    """The prompts of one RL step (``step``) or one eval batch (``step`` = -1) on this rank.

    ``offset`` is the position of ``examples[0]`` in the step's full prompt list (of the eval split for an
    eval batch): 0 on one device, r * P / world_size on rank r. Sampling seeds and group ids use it.
    """

    step: int
    examples: list[Example]
    offset: int = 0
    #: the eval set this batch belongs to (``RolloutDataModule.eval_sets``; 0: the task's own split)
    eval_set: int = 0


@dataclass
class EvalSet:
    """One evaluation set (``eval.sets``): its name (the tags' ``eval/<name>/...``; "main" is the task's own
    split, logged as ``eval/...``), the data module that encodes and scores its prompts with its own task
    (template, fields, verifier), its examples, and whether they all have a gold answer (maj@n needs one)."""

    name: str
    data: "RolloutDataModule"
    examples: list[Example]

    @property
    def has_answers(self) -> bool:
        return bool(self.examples) and all(str(ex.answer or "").strip() for ex in self.examples)


@dataclass
class ScoredRollouts:
    """Rollouts of G completions for each of P prompts, with their rewards.

    rollouts: the engine's output, N = P * G rows, the G completions of a prompt next to each other.
    rewards: [N] float32 task reward (before any shaping); group_ids: [N] int64, the prompt's index in the
    step (its id in the group statistics); examples: the P prompts; texts: N decoded completions; correct: [N]
    bool, the verifier's verdict (``reward.correct_from``; never a threshold on the weighted reward), None at
    construction: nothing verified, no completion correct.
    """

    rollouts: Rollouts
    rewards: torch.Tensor
    group_ids: torch.Tensor
    examples: list[Example]
    texts: list[str]
    reward_errors: int = 0
    #: name -> [N] float32 of each of ``reward.functions`` (nan: not applicable); empty with the task's verifier
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)
    correct: torch.Tensor | None = None
    #: name -> (completions whose call of it failed, completions it was called on) over every completion scored for
    #: the step (DAPO: every round's), which ``RewardFunctions.count_failed_step`` counts; empty: not tallied
    reward_failures: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: multi-turn tasks: the N episodes (``rollout.multiturn.Episode``: turns, per-turn rewards, tool counts);
    #: None for single-turn rollouts
    episodes: list | None = None

    def __post_init__(self) -> None:
        if self.correct is None:
            self.correct = torch.zeros(len(self.rewards), dtype=torch.bool)


def _pad_cols(x: torch.Tensor | None, width: int, value=0) -> torch.Tensor | None:
    if x is None or x.shape[1] == width:
        return x
    pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def concat_scored(parts: list[ScoredRollouts], pad_token_id: int) -> ScoredRollouts:
    """Stack several ``ScoredRollouts`` (e.g. DAPO's generation rounds) into one.

    Group ids must already be distinct across parts. Responses are right-padded to the widest part.
    """
    if len(parts) == 1:
        return parts[0]
    width = max(p.rollouts.response_ids.shape[1] for p in parts)

    def cat(name, value=0):
        first = getattr(parts[0].rollouts, name)
        if first is None:
            return None
        return torch.cat([_pad_cols(getattr(p.rollouts, name), width, value) for p in parts])

    rollouts = Rollouts(
        prompt_ids=[ids for p in parts for ids in p.rollouts.prompt_ids],
        response_ids=cat("response_ids", pad_token_id),
        response_mask=cat("response_mask", False),
        rollout_logprobs=cat("rollout_logprobs"),
        finish_reason=[f for p in parts for f in p.rollouts.finish_reason],
        policy_version=torch.cat([p.rollouts.policy_version for p in parts]),
        topk_ids=cat("topk_ids"),
        topk_logprobs=cat("topk_logprobs"),
        env_mask=_cat_env_masks(parts, width),
        carried=None if parts[0].rollouts.carried is None else torch.cat([p.rollouts.carried for p in parts]),
    )
    # padding holds the row's version (its oldest token's)
    rollouts.token_versions = torch.where(
        rollouts.response_mask, cat("token_versions"), rollouts.policy_version[:, None]
    )
    return ScoredRollouts(
        rollouts,
        torch.cat([p.rewards for p in parts]),
        torch.cat([p.group_ids for p in parts]),
        [e for p in parts for e in p.examples],
        [t for p in parts for t in p.texts],
        reward_errors=sum(p.reward_errors for p in parts),
        reward_parts={k: torch.cat([p.reward_parts[k] for p in parts]) for k in parts[0].reward_parts},
        correct=torch.cat([p.correct for p in parts]),
        reward_failures=add_failures(*(p.reward_failures for p in parts)),
        episodes=None if parts[0].episodes is None else [ep for p in parts for ep in p.episodes],
    )


def _cat_env_masks(parts: list[ScoredRollouts], width: int) -> torch.Tensor | None:
    """The parts' ``env_mask`` stacked (a part without one: no environment token), None when no part has one."""
    if all(p.rollouts.env_mask is None for p in parts):
        return None
    masks = [
        p.rollouts.env_mask if p.rollouts.env_mask is not None else torch.zeros_like(p.rollouts.response_mask)
        for p in parts
    ]
    return torch.cat([_pad_cols(m, width, False) for m in masks])


def add_failures(*tallies: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``ScoredRollouts.reward_failures`` of several batches, summed name by name."""
    out: dict[str, tuple[int, int]] = {}
    for tally in tallies:
        for name, (failed, called) in tally.items():
            a, b = out.get(name, (0, 0))
            out[name] = (a + failed, b + called)
    return out


def select_rows(scored: ScoredRollouts, rows: torch.Tensor) -> ScoredRollouts:
    """The completions at ``rows`` ([K] int64 indices); examples are kept whole (looked up by group id)."""
    r = scored.rollouts
    idx = rows.tolist()
    pick = lambda x: None if x is None else x[rows]  # noqa: E731
    rollouts = Rollouts(
        prompt_ids=[r.prompt_ids[i] for i in idx],
        response_ids=r.response_ids[rows],
        response_mask=r.response_mask[rows],
        rollout_logprobs=r.rollout_logprobs[rows],
        finish_reason=[r.finish_reason[i] for i in idx],
        policy_version=r.policy_version[rows],
        topk_ids=pick(r.topk_ids),
        topk_logprobs=pick(r.topk_logprobs),
        token_versions=r.token_versions[rows],
        env_mask=pick(r.env_mask),
        carried=pick(r.carried),
    )
    return ScoredRollouts(
        rollouts,
        scored.rewards[rows],
        scored.group_ids[rows],
        scored.examples,
        [scored.texts[i] for i in idx],
        reward_parts={k: v[rows] for k, v in scored.reward_parts.items()},
        correct=scored.correct[rows],
        episodes=None if scored.episodes is None else [scored.episodes[i] for i in idx],
    )


def shard(n: int, rank: int, world_size: int) -> slice:
    """The contiguous share of ``n`` items that rank ``rank`` of ``world_size`` takes.

    Shares are as equal as possible (the first ``n % world_size`` ranks take one more) and their
    concatenation in rank order is ``range(n)``. Raises ValueError unless 0 <= rank < world_size.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def sample_seed(*parts: int) -> int:
    """A 63-bit seed that depends only on the integers given (deterministic across processes)."""
    return hash(tuple(int(p) for p in parts)) & (2**63 - 1)


class _StepStream(IterableDataset):
    def __init__(self, dm: "RolloutDataModule", start_step: Callable[[], int]):
        self.dm, self.start_step = dm, start_step

    def __iter__(self) -> Iterator[PromptBatch]:
        step = self.start_step()  # read when iteration starts, i.e. after a checkpoint was restored
        while True:
            yield self.dm.batch_for(step)
            step += 1


def scored_rollouts(rollouts, scores, total, group_ids, examples, texts, episodes=None) -> ScoredRollouts:
    """``ScoredRollouts`` of an engine's ``rollouts`` and the reward functions' ``scores`` (errors, parts, the
    verifier's verdicts, failures), with ``total`` [N] the rewards trained on (the scores' total, or an episode's)."""
    return ScoredRollouts(
        rollouts,
        torch.tensor(total, dtype=torch.float32),
        torch.tensor(group_ids, dtype=torch.long),
        examples,
        texts,
        reward_errors=scores.errors,
        reward_parts={k: torch.tensor(v, dtype=torch.float32) for k, v in scores.parts.items()},
        correct=torch.tensor(scores.correct, dtype=torch.bool),
        reward_failures=scores.failures,
        episodes=episodes,
    )


class RolloutDataModule(L.LightningDataModule):
    """Owns the task, the tokenizer and the prompt schedule.

    Args:
        task: the prompt source and verifier.
        tokenizer: a transformers tokenizer with a chat template.
        prompts_per_step: P, prompts drawn per RL step; group_size: G completions per prompt.
        seed: drives the prompt order and every sampling seed.
        eval_examples: how many held-out examples each evaluation uses (0 = none).
        eval_batch_size: prompts per eval generation call.
        reward_timeout_s: the time limit of one reward call (used when ``rewards`` is None).
        rewards: the ``RewardFunctions`` that score completions; None: the task's own verifier in a pool of 2.
        train_examples: the training examples; None: ``task.train_examples()`` (an eval set gives its own).
        environment: a multi-turn task's ``Environment`` (``rollout.environments.task_environment``; its steps run
            in the rewards' verifier pool), None for single-turn rollouts; limits: its ``MultiTurnLimits``.
    """

    def __init__(
        self,
        task: Task,
        tokenizer,
        prompts_per_step: int,
        group_size: int,
        seed: int = 0,
        eval_examples: int = 64,
        eval_batch_size: int = 64,
        reward_timeout_s: float = 10.0,
        rewards: RewardFunctions | None = None,
        train_examples: list[Example] | None = None,
        environment=None,
        limits=None,
    ):
        super().__init__()
        self.task, self.tokenizer = task, tokenizer
        self.prompts_per_step, self.group_size, self.seed = prompts_per_step, group_size, seed
        self.eval_examples, self.eval_batch_size = eval_examples, eval_batch_size
        self.reward_timeout_s = reward_timeout_s
        self.rewards = rewards if rewards is not None else RewardFunctions(task, timeout_s=reward_timeout_s)
        self.environment, self.limits = environment, limits
        self._partial_examples: dict[tuple, Example] = {}  # rollout.partial: groups the engine still holds
        self._partial_done: set[tuple] = set()  # rollout.partial: keys delivered (a look-ahead one is offered again)
        self.chat_tools: list[dict] | None = None  # tool schemas the chat template renders itself (``tools=``)
        self._tool_text: str | None = None  # or the system text that states them
        if environment is not None:
            from .environments import chat_tools
            from .multiturn import MultiTurnLimits

            self.limits = limits if limits is not None else MultiTurnLimits(step_timeout_s=reward_timeout_s)
            self._tool_text, self.chat_tools = chat_tools(tokenizer, environment)
        self._train = list(task.train_examples() if train_examples is None else train_examples)
        self._eval = list(task.eval_examples())[:eval_examples]
        if not self._train:
            raise ValueError(f"task {task.name!r} has no training examples")
        self._encoded: dict[tuple[str, int], list[int]] = {}
        self._start_step: Callable[[], int] = lambda: 0
        #: prompts left out at start-up for not fitting the context (``task.overlong_prompts=drop``), per split
        self.dropped_prompts = {"train": 0, "eval": 0}
        #: further evaluation sets (``add_eval_set``), each with its own task; the task's own split comes first
        self.extra_eval_sets: list[EvalSet] = []

    @property
    def eval_sets(self) -> list[EvalSet]:
        """The sets each evaluation scores: the task's own split ("main", when it holds examples), then
        ``eval.sets`` in their order."""
        main = [EvalSet("main", self, self._eval)] if self._eval else []
        return main + self.extra_eval_sets

    def add_eval_set(self, name: str, task: Task, examples: list[Example], rewards: RewardFunctions) -> None:
        """Evaluate ``examples`` as set ``name`` too: encoded with ``task``'s template, scored by ``rewards``
        (the set's own verifier). Raises ValueError for a name already taken (or "main")."""
        if name == "main" or any(s.name == name for s in self.extra_eval_sets):
            raise ValueError(f"eval set name {name!r} is taken (names are unique; 'main' is the task's own split)")
        data = RolloutDataModule(
            task, self.tokenizer, 1, 1, seed=self.seed, eval_examples=0, train_examples=examples, rewards=rewards
        )
        self.extra_eval_sets.append(EvalSet(name, data, list(examples)))

    # -- ranks ---------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's global rank (0 without a trainer or on one device)."""
        return self.trainer.global_rank if self.trainer is not None else 0

    @property
    def world_size(self) -> int:
        """Data-parallel ranks (1 without a trainer or on one device)."""
        return self.trainer.world_size if self.trainer is not None else 1

    def shard(self, examples: list[Example]) -> tuple[int, list[Example]]:
        """(offset, this rank's contiguous share of ``examples``); offset = position of the share's first item."""
        part = shard(len(examples), self.rank, self.world_size)
        return part.start, examples[part]

    def batch_for(self, step: int) -> PromptBatch:
        """This rank's share of RL step ``step``'s P prompts.

        Raises ValueError if P is not divisible by the world size (each rank must train on as many whole
        groups as the others; ``config.validate`` reports it at start-up).
        """
        if self.prompts_per_step % self.world_size:
            raise ValueError(
                f"rollout.prompts_per_step={self.prompts_per_step} must be divisible by the "
                f"{self.world_size} data-parallel ranks"
            )
        offset, examples = self.shard(self.prompts_for(step))
        return PromptBatch(step, examples, offset)

    # -- prompts -------------------------------------------------------------------------------------
    def prompts_for(self, step: int, round: int = 0, count: int | None = None) -> list[Example]:
        """The ``count`` (default P) training prompts of RL step ``step``, generation round ``round``.

        Rounds > 0 (DAPO's extra sampling) draw ``count`` prompts at random from their own seeded stream,
        so they never take the prompts a later step is scheduled to see.
        """
        count = self.prompts_per_step if count is None else count
        n = len(self._train)
        if round:
            rng = random.Random(sample_seed(self.seed, step, round, 13))
            return [self._train[rng.randrange(n)] for _ in range(count)]
        first = step * count
        out = []
        for pos in range(first, first + count):
            epoch, offset = divmod(pos, n)
            out.append(self._train[self._permutation(epoch)[offset]])
        return out

    def _permutation(self, epoch: int) -> list[int]:
        cached = getattr(self, "_perm_cache", None)
        if cached is None or cached[0] != epoch:
            order = list(range(len(self._train)))
            random.Random(sample_seed(self.seed, epoch, 7)).shuffle(order)
            self._perm_cache = (epoch, order)
        return self._perm_cache[1]

    def messages(self, example: Example) -> list[dict]:
        """The prompt's chat messages: the task's, or a multi-turn environment's (``reset``), with the system text
        that states its tools where the chat template does not render them."""
        if self.environment is None:
            return self.task.messages(example)
        from .environments import with_system_text

        own = self.environment.reset(example)
        return with_system_text(self.task.messages(example) if own is None else own, self._tool_text)

    def _chat(self, messages: list[dict], tokenize: bool):
        extra = {"tools": self.chat_tools} if self.chat_tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize, **extra)

    def encode(self, example: Example, split: str = "train") -> list[int]:
        """Chat-formatted prompt token ids for ``example`` (cached)."""
        key = (split, example.id)
        if key not in self._encoded:
            ids = self._chat(self.messages(example), tokenize=True)
            if not isinstance(ids, list):
                ids = ids["input_ids"]
            self._encoded[key] = list(ids)
        return self._encoded[key]

    def prompt_lengths(self, split: str = "train") -> list[int]:
        """Token counts of the chat-formatted prompts of ``split`` ("train" or "eval"), in order: rendered with
        the chat template and tokenised in one batch (GSM8K's 7473 training prompts: about 2 s), the same ids
        ``encode`` gives one by one."""
        examples = self._train if split == "train" else self._eval
        if not examples:
            return []
        texts = [self._chat(self.messages(ex), tokenize=False) for ex in examples]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def drop_overlong(self, max_prompt_tokens: int, split: str = "train") -> int:
        """Leave out the prompts of ``split`` longer than ``max_prompt_tokens`` tokens; returns how many."""
        examples = self._train if split == "train" else self._eval
        lengths = self.prompt_lengths(split)
        kept = [ex for ex, n in zip(examples, lengths) if n <= max_prompt_tokens]
        if split == "train":
            self._train = kept
        else:
            self._eval = kept
        self._perm_cache = None
        return len(examples) - len(kept)

    def longest_prompt(self, split: str = "train") -> tuple[int, Example | None]:
        """(tokens, example) of the longest chat-formatted prompt of ``split``: "train" (every training
        example a step may draw) or "eval" (the ``eval_examples`` evaluated); (0, None) when it is empty.
        The prompts are rendered with the chat template and tokenised in one batch (GSM8K's 7473 training
        prompts: about 2 s), the same ids ``encode`` gives one by one."""
        examples = self._train if split == "train" else self._eval
        if not examples:
            return 0, None
        lengths = self.prompt_lengths(split)
        i = max(range(len(lengths)), key=lengths.__getitem__)
        return lengths[i], examples[i]

    # -- rollouts ------------------------------------------------------------------------------------
    def collect(
        self,
        engine,
        examples: list[Example],
        params: SamplingConfig,
        step: int,
        round: int = 0,
        group_size: int | None = None,
        split: str = "train",
        group_offset: int = 0,
        first_index: int = 0,
    ) -> ScoredRollouts:
        """Generate G completions per example with ``engine`` and score them with ``rewards`` (the task's
        verifier or ``reward.functions``, in the verifier pool: a call past ``reward_timeout_s`` scores 0), each
        with its correctness (``reward.correct_from``).

        Each completion has its own seed (from seed, step, round, prompt index and sample index), so the
        same step of the same run produces the same completions whatever else is in the batch. The prompt
        index is ``first_index + p`` for ``examples[p]``: its position in the step's full prompt list, so
        a prompt's seeds do not depend on which rank holds it. Group ids are ``group_offset + first_index + p``.

        An engine with ``partial`` set (``rollout.partial``) is handed these groups with ``generate_partial`` and
        returns as many complete groups, possibly started by earlier calls (each with its own example and seeds);
        ``examples[p]`` is then the p-th group returned. Multi-turn episodes never get here: ``rollout.mode=async``,
        the one mode partial rollouts run in, does not collect them (refused at start-up).
        """
        g = self.group_size if group_size is None else group_size
        prompts, seeds, group_ids = [], [], []
        for p, ex in enumerate(examples):
            ids = self.encode(ex, split)
            for j in range(g):
                prompts.append(ids)
                seeds.append(sample_seed(self.seed, step, round, first_index + p, j))
                group_ids.append(group_offset + first_index + p)
        if self.environment is not None:
            rows = [examples[gid - group_offset - first_index] for gid in group_ids]
            return self.collect_episodes(engine, rows, prompts, params, seeds, group_ids, examples, split)
        if getattr(engine, "partial", False) and split == "train":  # rollout.partial: groups may come from earlier
            rollouts, examples = self._collect_partial(
                engine, examples, prompts, params, seeds, step, round, first_index
            )
            group_ids = [group_offset + first_index + p for p in range(len(examples)) for _ in range(g)]
        else:
            rollouts = engine.generate(prompts, params, seeds)
        response_ids = [ids[m].tolist() for ids, m in zip(rollouts.response_ids, rollouts.response_mask)]
        texts = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        scores = self.rewards.score(
            [examples[gid - group_offset - first_index] for gid in group_ids],
            texts,
            response_ids,
            "eval" if split == "eval" else "train",
        )
        return scored_rollouts(rollouts, scores, scores.total, group_ids, examples, texts)

    def _collect_partial(self, engine, examples, prompts, params, seeds, step: int, round: int, first_index: int):
        """``collect``'s generation under ``rollout.partial``: this batch's groups (keys (step, round, index)) and,
        for round 0, the next step's groups of this rank as a look-ahead (the same keys, prompts and seeds that step
        will offer, so the engine skips them then): slots freed by this batch's short groups take them while a long
        group runs on, and the batch is due once ``len(examples)`` groups are complete, whichever they are (groups in
        the last batch their tokens allow first: ``PartialRollouts._commit_due``).
        Returns (the rollouts, the examples of the groups returned, in order)."""
        g = len(prompts) // max(len(examples), 1)
        keys = [(step, round, first_index + p) for p in range(len(examples))]
        ahead_keys, ahead_prompts, ahead_seeds = [], [], []
        if round == 0:
            offset, ahead = self.shard(self.prompts_for(step + 1))
            for p, ex in enumerate(ahead):
                ahead_keys.append((step + 1, 0, offset + p))
                self._partial_examples.setdefault(ahead_keys[-1], ex)
                ids = self.encode(ex, "train")
                ahead_prompts += [ids] * g
                ahead_seeds += [sample_seed(self.seed, step + 1, 0, offset + p, j) for j in range(g)]
        for key, ex in zip(keys, examples):
            self._partial_examples.setdefault(key, ex)
        rollouts, got, _ = engine.generate_partial(
            prompts + ahead_prompts, params, seeds + ahead_seeds, keys + ahead_keys, len(examples),
            ahead=len(ahead_keys),
        )  # fmt: skip
        examples = [self._partial_examples.pop(key) for key in got]
        self._partial_done.update(got)
        for key in [k for k in self._partial_examples if k in self._partial_done]:  # offered again after delivery
            del self._partial_examples[key]
        self._partial_done = {k for k in self._partial_done if k[0] >= step}  # a key is offered again one step on
        return rollouts, examples

    def collect_episodes(self, engine, rows, prompts, params, seeds, group_ids, examples, split) -> ScoredRollouts:
        """``collect`` of a multi-turn task: one episode per row (``rollout.multiturn.collect_episodes``), each
        scored by ``rollout.episode_reward`` (``Episode.score``) from its turns' rewards and the rewards (the task's
        verifier) on its last model turn; the verifier's verdict is its correctness either way."""
        from .multiturn import collect_episodes

        rollouts, episodes = collect_episodes(
            engine,
            self.tokenizer,
            self.environment,
            rows,
            prompts,
            [self.messages(ex) for ex in rows],
            params,
            seeds,
            self.limits,
            self.rewards.pool,
            f"environment-{id(self.environment)}",
            tools=self.chat_tools,
        )
        texts = [ep.last_turn_text for ep in episodes]
        model_ids = [ids[m].tolist() for ids, m in zip(rollouts.response_ids, rollouts.response_mask)]
        scores = self.rewards.score(rows, texts, model_ids, "eval" if split == "eval" else "train")
        total = [ep.score(s, self.limits.episode_reward) for s, ep in zip(scores.total, episodes)]
        return scored_rollouts(rollouts, scores, total, group_ids, examples, texts, episodes=episodes)

    # -- Lightning hooks -----------------------------------------------------------------------------
    def set_start_step(self, fn: Callable[[], int]) -> None:
        """Tell the stream where to start (the module's global step, read after a restore)."""
        self._start_step = fn

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_StepStream(self, lambda: self._start_step()), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        """This rank's contiguous share of each eval set's examples (``eval_sets``, one after the other) in
        batches of ``eval_batch_size``; a rank whose share of a set is empty gets one empty batch of it, so every
        rank takes part in the eval's reduction."""
        batches = []
        for index, eval_set in enumerate(self.eval_sets):
            offset, examples = self.shard(eval_set.examples)
            batches += [
                PromptBatch(-1, examples[i : i + self.eval_batch_size], offset + i, index)
                for i in range(0, len(examples), self.eval_batch_size)
            ] or [PromptBatch(-1, [], offset, index)]
        return DataLoader(batches, batch_size=None, num_workers=0, collate_fn=lambda b: b)
