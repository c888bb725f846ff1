"""Multi-turn episodes with exact tokens: the engine's sampled ids with the environment's ids appended between turns.

An episode's trained sequence is ``prompt_ids`` followed by model turn 1's ids (exactly as the engine sampled
them, its stop token included), the environment's ids (the rest of the chat template's end of turn, the
observation messages, the next generation prompt), model turn 2's ids, and so on. Nothing the model produced is
ever decoded and encoded again (re-tokenisation drift: the ids of a decoded text are not always the ids sampled).
The environment's ids are the chat template's rendering of the new messages, tokenised alone and appended: the
template must extend its own rendering as a text prefix when messages are added (``check_prefix_property``, at
start-up; a template that rewrites earlier turns, as Qwen3's strips earlier ``<think>`` blocks, is refused).

Each turn is one ``engine.generate`` call over the live episodes with their whole token ids as prompts (the
first turn's G rows of a group share their prompt, whose prefill the embedded engine shares), inside the
engine's ``kv_continuation()`` session where it has one: the embedded engine then prefills only each episode's
ids after the KV it kept from the previous turn (``kv_continuation``); other engines (vLLM) get the whole ids
every turn. Environment tokens
have ``response_mask`` False and ``env_mask`` True: the trainer attends to them but scores none of them, so they
take part in no ratio, correction, KL, entropy, reduction or denominator.

Limits: ``max_turns`` model turns; ``max_total_tokens`` for the whole episode (prompt, model and environment
tokens): a model turn is cut at what is left (finish "length") and an observation that does not fit ends the
episode (finish "length") rather than going over the context.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..tasks.base import Example
from .environments import Environment, EnvStep
from .types import Rollouts, SamplingConfig

#: ``rollout.episode_reward``: how an episode's per-turn rewards make its reward (``Episode.score``)
EPISODE_REWARDS = {
    "last": "the last turn's reward when the environment gave it one, else the verifier on the last turn",
    "sum": "the sum of every reward the environment gave, plus the verifier's when the last turn got none",
}

__all__ = ["Episode", "MultiTurnLimits", "check_prefix_property", "collect_episodes", "env_token_ids"]


@dataclass(frozen=True)
class MultiTurnLimits:
    """``rollout.max_turns`` (model turns per episode), ``rollout.max_total_tokens`` (prompt + every turn's and
    observation's tokens), ``rollout.max_tool_output_chars`` (a tool message longer than this is cut and marked),
    the environment step's time limit in seconds (``reward_timeout_s``) and ``rollout.episode_reward`` (how the
    per-turn rewards make the episode's: ``Episode.score``)."""

    max_turns: int = 4
    max_total_tokens: int = 1024
    max_tool_output_chars: int = 2000
    step_timeout_s: float = 10.0
    episode_reward: str = "last"

    def __post_init__(self):
        if self.episode_reward not in EPISODE_REWARDS:
            raise ValueError(f"rollout.episode_reward={self.episode_reward!r}: choose one of {list(EPISODE_REWARDS)}")
        for name in ("max_turns", "max_total_tokens", "max_tool_output_chars"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)!r} must be >= 1")
        if not self.step_timeout_s > 0:
            raise ValueError(f"the environment step timeout must be > 0 s, got {self.step_timeout_s!r}")


@dataclass
class Episode:
    """One episode as it grows. ``response_ids`` holds model and environment ids in order, ``is_model`` says
    which is which, ``logprobs`` the engine's log-probs (0 on environment ids); ``turns``: (start, end) of each
    model turn in ``response_ids``; ``messages``: the conversation as text (for the template and the logs);
    ``rewards``: per model turn, None where the environment gave none."""

    example: Example
    prompt_ids: list[int]
    messages: list[dict]
    seed: int
    state: dict
    response_ids: list[int] = field(default_factory=list)
    is_model: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[tuple[list[int], list[float]] | None] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    finish: str = ""
    tool_calls: int = 0
    tool_errors: int = 0
    solved: bool | None = None  # the environment's own verdict (its info's ``solved``), None: it gave none
    pending: list[dict] | None = None  # the last step's observation (None: the episode is over)

    def add_model_turn(self, ids: list[int], logprobs: list[float], head: list, tokenizer, turn: int) -> None:
        """Append a model turn: its sampled ``ids`` and their ``logprobs`` as the engine gave them, its top-k
        ``head`` (``(ids, logprobs)`` per token; [] without), its decoded text as an assistant message."""
        start = len(self.response_ids)
        self.response_ids += ids
        self.is_model += [True] * len(ids)
        self.logprobs += logprobs
        self.topk += head
        self.turns.append((start, start + len(ids)))
        self.messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        self.state["turn"] = turn

    def add_observation(self, observation: list[dict], env_ids: list[int]) -> None:
        """Append the environment's messages and their ids (``env_token_ids``): never scored, log-prob 0."""
        self.messages += observation
        self.response_ids += env_ids
        self.is_model += [False] * len(env_ids)
        self.logprobs += [0.0] * len(env_ids)
        if self.topk:
            self.topk += [None] * len(env_ids)

    @property
    def length(self) -> int:
        """Prompt plus response tokens so far."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def reward(self) -> float | None:
        """The last model turn's reward, None when the environment gave it none (the task's verifier decides)."""
        return self.rewards[-1] if self.rewards else None

    def score(self, verifier: float, mode: str = "last") -> float:
        """The episode's reward, ``verifier`` being the task's score of its last turn: ``rollout.episode_reward``
        ``last`` (the last turn's reward when the environment gave it one, else ``verifier``: an earlier turn's
        reward, a format reward for instance, never stands in for the final verdict) or ``sum`` (every reward
        given, plus ``verifier`` when the last turn got none): per-turn rewards then feed the advantage."""
        last = self.reward
        if mode == "sum":
            return sum(r for r in self.rewards if r is not None) + (verifier if last is None else 0.0)
        return verifier if last is None else last

    @property
    def last_turn_text(self) -> str:
        """The last model turn's text (what the task's verifier scores)."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


def _render(tokenizer, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)


def env_token_ids(
    tokenizer,
    messages: list[dict],
    model_text: str,
    stop_text: str,
    observation: list[dict],
    tools: list[dict] | None = None,
) -> list[int]:
    """The environment's token ids after a model turn: what the chat template writes after the model's stop
    (SmolLM2's newline after ``<|im_end|>``), then the observation messages and the next generation prompt,
    rendered as text and tokenised alone (the model's own ids are never re-encoded).

    messages: the conversation before the turn; model_text: the turn's decoded text; stop_text: the text of the
    stop token that ended it ("" when none); tools: the tool schemas the template renders itself (``tools=``),
    None when the system prompt states them. Raises ValueError when the template's rendering with the
    observation does not extend the rendering without it (no prefix property)."""
    turn = messages + [{"role": "assistant", "content": model_text}]
    before = _render(tokenizer, turn, False, tools)
    after = _render(tokenizer, turn + observation, True, tools)
    if not after.startswith(before):
        raise ValueError(
            "the chat template does not extend a conversation as a prefix when messages are added, so a multi-turn "
            "episode's tokens cannot stay exact; use a model whose template does"
        )
    end = before.rfind(model_text) + len(model_text) if model_text and model_text in before else len(before)
    if stop_text and before.find(stop_text, end) >= 0:
        end = before.find(stop_text, end) + len(stop_text)  # the model's own stop token is not the environment's
    text = before[end:] + after[len(before) :]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_prefix_property(tokenizer, system_prompt: str | None = None, tools: list[dict] | None = None) -> None:
    """Start-up check: render a real two-turn tool conversation with the model's chat template and verify that
    each rendering is a text prefix of the next (what ``env_token_ids`` relies on). Raises ValueError naming
    the turn where the template rewrites what came before."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": "What is 12 * 7 + 5?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "mul", "arguments": {"a": 12, "b": 7}}\n</tool_call>'},
        {"role": "tool", "name": "mul", "content": "84"},
        {"role": "assistant", "content": "<think>84 + 5</think>\n12 * 7 + 5 = 89"},
        {"role": "user", "content": "And plus 1?"},
        {"role": "assistant", "content": "90"},
    ]
    for k in range(2, len(messages)):
        if messages[k - 1]["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], False, tools)
        after = _render(tokenizer, messages[: k + 1], True, tools)
        if not after.startswith(before):
            raise ValueError(
                f"multi-turn rollouts need a chat template that extends a conversation as a prefix; this model's "
                f"template rewrites earlier turns once message {k} ({messages[k]['role']}) is added, so the trained "
                "ids could not be the sampled ones (re-tokenisation drift): use another model or a single-turn task"
            )


def _cap(messages: list[dict], max_chars: int) -> list[dict]:
    out = []
    for m in messages:
        content = str(m.get("content", ""))
        if m.get("role") == "tool" and len(content) > max_chars:
            m = {**m, "content": content[:max_chars] + f"... [cut: {len(content) - max_chars} more characters]"}
        out.append(m)
    return out


def _env_steps(pool, env: Environment, key: str, episodes: list[Episode], limits: MultiTurnLimits) -> None:
    """Run ``env.step`` for each episode's last turn in the verifier pool; append the observation or end it."""
    jobs = [(0, (ep.state, ep.last_turn_text), {}) for ep in episodes]
    outcomes = pool.run(key, [EnvStep.of(env)], jobs, limits.step_timeout_s)
    role = "tool" if env.tools else "user"
    for ep, out in zip(episodes, outcomes):
        if out.status == "ok":
            ep.state, obs, reward, info = out.value
            ep.tool_calls += int(info.get("tool_calls", 0))
            ep.tool_errors += int(info.get("tool_errors", 0))
            if "solved" in info:
                ep.solved = bool(ep.solved) or bool(info["solved"])
        else:  # a hanging or crashing step is an observation, counted
            what = f"timed out after {limits.step_timeout_s:g} s" if out.status == "timeout" else out.message
            obs, reward = [{"role": role, "content": f"error: the tool call failed: {what}"}], None
            ep.tool_errors += 1
        ep.rewards.append(None if reward is None else float(reward))
        ep.pending = None if obs is None else _cap(list(obs), limits.max_tool_output_chars)


def collect_episodes(
    engine,
    tokenizer,
    env: Environment,
    examples: list[Example],
    prompt_ids: list[list[int]],
    first_messages: list[list[dict]],
    params: SamplingConfig,
    seeds: list[int],
    limits: MultiTurnLimits,
    pool,
    pool_key: str,
    tools: list[dict] | None = None,
) -> tuple[Rollouts, list[Episode]]:
    """Run one episode per row: N = len(examples) rows (a group's G rows repeat the example), each starting from
    ``prompt_ids[i]`` (the chat-formatted ``first_messages[i]``, generation prompt included) with seed
    ``seeds[i]`` (turn t > 0 samples with a seed derived from it and t); ``tools``: the tool schemas when the
    chat template renders them itself (``tools=``), None when the system prompt states them.

    Returns (``Rollouts`` over the whole episodes: ``response_ids`` [N, T] model and environment ids,
    ``response_mask`` True on model ids only, ``env_mask`` True on environment ids, ``rollout_logprobs`` 0 on
    environment ids, ``finish_reason`` "length" for an episode cut by a turn's ``max_new_tokens`` or by
    ``limits.max_total_tokens``; the episodes, with their turns, rewards and tool counts).
    Raises ValueError for a prompt already at ``max_total_tokens`` or lengths that do not match.
    """
    episodes = _start(examples, prompt_ids, first_messages, seeds, limits)
    k = params.logprobs_top_k + params.logprobs_tail_samples  # the entries the engine records per token
    live = list(range(len(episodes)))
    version = getattr(engine, "version", 0)
    session = getattr(engine, "kv_continuation", None)  # the embedded engine continues its KV across turns
    with session() if session is not None else contextlib.nullcontext():
        for turn in range(limits.max_turns):
            if not live:
                break
            rows = [episodes[i] for i in live]
            room = [limits.max_total_tokens - ep.length for ep in rows]
            turn_params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens, max(room))))
            turn_seeds = [ep.seed if turn == 0 else hash((ep.seed, turn)) & (2**63 - 1) for ep in rows]
            out = engine.generate([ep.prompt_ids + ep.response_ids for ep in rows], turn_params, turn_seeds)
            version = int(out.policy_version[0]) if len(out.policy_version) else version
            _add_model_turns(rows, out, room, k, tokenizer, turn)
            _end_turn(engine, tokenizer, env, rows, turn, limits, pool, pool_key, tools)
            live = [i for i in live if not episodes[i].finish]
    for i in live:  # (max_turns reached with turns still pending cannot happen: the last turn sets finish)
        episodes[i].finish = episodes[i].finish or "stop"
    return _as_rollouts(episodes, k, version, getattr(engine, "pad_token_id", 0)), episodes


def _add_model_turns(rows: list[Episode], out: Rollouts, room: list[int], k: int, tokenizer, turn: int) -> None:
    """Append each live episode's model turn from the engine's output ``out`` (row j = ``rows[j]``), cut at the
    room its episode has left (``room``); a cut or length-stopped turn ends the episode (finish "length")."""
    for j, ep in enumerate(rows):
        m = out.response_mask[j]
        ids = out.response_ids[j][m].tolist()[: room[j]]
        head = list(zip(out.topk_ids[j][m].tolist(), out.topk_logprobs[j][m].tolist()))[: room[j]] if k else []
        ep.add_model_turn(ids, out.rollout_logprobs[j][m].tolist()[: room[j]], head, tokenizer, turn)
        if out.finish_reason[j] == "length" or len(ids) < int(m.sum()):
            ep.finish = "length"


def _end_turn(engine, tokenizer, env, rows: list[Episode], turn: int, limits, pool, pool_key, tools) -> None:
    """After a model turn: the environment steps the episodes still going and their observations' ids are
    appended (an episode the environment ends, at its last turn, or whose observation does not fit, finishes)."""
    stepping = [ep for ep in rows if not ep.finish]
    for ep in rows:
        if ep.finish:
            ep.rewards.append(None)
    if stepping:
        _env_steps(pool, env, pool_key, stepping, limits)
    for ep in stepping:
        ep.state["rewards"] = list(ep.rewards)
        if ep.pending is None or turn == limits.max_turns - 1:
            ep.finish = "stop"
            continue
        last_id = ep.response_ids[-1] if ep.response_ids else None
        special = last_id in getattr(engine, "stop_token_ids", ()) and last_id in tokenizer.all_special_ids
        stop_text = tokenizer.decode([last_id]) if special else ""  # (a special stop is not in the decoded text)
        last = ep.messages[-1]["content"]
        env_ids = env_token_ids(tokenizer, ep.messages[:-1], last, stop_text, ep.pending, tools)
        if ep.length + len(env_ids) >= limits.max_total_tokens:
            ep.finish = "length"  # the observation does not fit: the episode is cut here, counted
            continue
        ep.add_observation(ep.pending, env_ids)


def _start(examples, prompt_ids, first_messages, seeds, limits: MultiTurnLimits) -> list[Episode]:
    """The episodes before their first turn (``collect_episodes``' arguments checked)."""
    if not (len(prompt_ids) == len(first_messages) == len(seeds) == len(examples)):
        raise ValueError("collect_episodes: examples, prompt_ids, first_messages and seeds must have equal lengths")
    episodes = [
        Episode(ex, list(p), [dict(m) for m in msgs], int(s), {"example": ex.as_dict(), "turn": 0, "rewards": []})
        for ex, p, msgs, s in zip(examples, prompt_ids, first_messages, seeds)
    ]
    for ep in episodes:
        if ep.length >= limits.max_total_tokens:
            raise ValueError(
                f"a prompt of {ep.length} tokens leaves no room under "
                f"rollout.max_total_tokens={limits.max_total_tokens}"
            )
    return episodes


def _as_rollouts(episodes: list[Episode], k: int, version: int, pad_id: int) -> Rollouts:
    n = len(episodes)
    width = max((len(ep.response_ids) for ep in episodes), default=0)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    model = torch.zeros((n, width), dtype=torch.bool)
    env = torch.zeros((n, width), dtype=torch.bool)
    lps = torch.zeros((n, width), dtype=torch.float32)
    topk_ids = torch.zeros((n, width, k), dtype=torch.long) if k else None
    topk_lp = torch.zeros((n, width, k), dtype=torch.float32) if k else None
    for i, ep in enumerate(episodes):
        t = len(ep.response_ids)
        ids[i, :t] = torch.tensor(ep.response_ids, dtype=torch.long)
        model[i, :t] = torch.tensor(ep.is_model, dtype=torch.bool)
        env[i, :t] = ~model[i, :t]
        lps[i, :t] = torch.tensor(ep.logprobs, dtype=torch.float32)
        if k:
            for j, head in enumerate(ep.topk):
                if head is not None:
                    topk_ids[i, j], topk_lp[i, j] = torch.tensor(head[0]), torch.tensor(head[1])
    return Rollouts(
        prompt_ids=[list(ep.prompt_ids) for ep in episodes],
        response_ids=ids,
        response_mask=model,
        rollout_logprobs=lps,
        finish_reason=[ep.finish for ep in episodes],
        policy_version=torch.full((n,), version, dtype=torch.long),
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        env_mask=env,
    )


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """``rollout/num_turns_mean``, ``rollout/tool_calls_mean`` (per episode), ``rollout/tool_errors`` (summed) and
    ``rollout/env_token_fraction`` (environment tokens over all response tokens) of a batch of episodes; and
    ``rollout/solved_rate``, the share of episodes whose environment said ``solved`` (an episode it never
    stepped, or that it never said solved, counts as not solved), when any of the batch's steps said either."""
    n = max(len(episodes), 1)
    env_tokens = sum(len(ep.is_model) - sum(ep.is_model) for ep in episodes)
    total = sum(len(ep.is_model) for ep in episodes)
    metrics = {
        "rollout/num_turns_mean": sum(len(ep.turns) for ep in episodes) / n,
        "rollout/tool_calls_mean": sum(ep.tool_calls for ep in episodes) / n,
        "rollout/tool_errors": float(sum(ep.tool_errors for ep in episodes)),
        "rollout/env_token_fraction": env_tokens / total if total else 0.0,
    }
    if any(ep.solved is not None for ep in episodes):
        metrics["rollout/solved_rate"] = sum(bool(ep.solved) for ep in episodes) / n
    return metrics


def episode_record(ep: Episode) -> dict[str, Any]:
    """An episode as samples.jsonl shows it: the messages with their turn boundaries, rewards and finish."""
    return {
        "messages": ep.messages,
        "turns": [list(t) for t in ep.turns],
        "turn_rewards": ep.rewards,
        "finish": ep.finish,
        "tool_calls": ep.tool_calls,
        "tool_errors": ep.tool_errors,
        **({"solved": ep.solved} if ep.solved is not None else {}),
    }
