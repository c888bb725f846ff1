"""Multi-turn episodes with exact tokens (issue 36, "Done when" (a), (b), (c), (f)) on the tiny model.

The random tiny model rarely stops on its own, so these tests' engines stop on half the vocabulary (a real
engine, a real stop rule): turns end after a few tokens and episodes run several turns against
``CountingEnvironment`` (it answers every turn until the last)."""

import pytest
import torch
from helpers import compose_config
from multiturn_tools import CountingEnvironment

from lit_rl.kernels import kernel_mode
from lit_rl.logprobs import response_logprobs
from lit_rl.models import ModelConfig, load_policy
from lit_rl.objectives import reduce_loss
from lit_rl.rollout.datamodule import ScoredRollouts
from lit_rl.rollout.multiturn import MultiTurnLimits, check_prefix_property, collect_episodes, episode_metrics
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.rollout.types import SamplingConfig, left_pad
from lit_rl.run.train import build_module
from lit_rl.tasks.base import Example
from lit_rl.tasks.verifier_pool import shared_pool

HALF_VOCAB = list(range(0, 49152, 2))  # every even id ends a turn


class Recording:
    """The real engine, with each ``generate``'s prompts and output kept (what the test compares against)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.stop_token_ids, self.pad_token_id = engine.stop_token_ids, engine.pad_token_id
        if hasattr(engine, "kv_continuation"):  # the embedded engine's session: later turns continue its KV
            self.kv_continuation = engine.kv_continuation

    @property
    def version(self):
        return self.engine.version

    def generate(self, prompts, params, seeds):
        out = self.engine.generate(prompts, params, seeds)
        self.calls.append(([list(p) for p in prompts], out))
        return out


def first_prompt(tok, question):
    messages = [{"role": "user", "content": question}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return (ids if isinstance(ids, list) else ids["input_ids"]), messages


def run_episodes(policy, tok, n=4, turns=3, max_new=6, max_total=400, top_k=0, seed=0, group=2, continue_kv=True,
                 longer=0):  # fmt: skip
    engine = Recording(TorchEngine(policy, tok.pad_token_id, HALF_VOCAB))
    engine.engine.continue_kv = continue_kv  # False: every turn re-prefills its whole episode
    # groups of ``group`` rows; ``longer`` > 0: the questions of groups 1, 2, ... grow by up to ``longer`` words
    words = [" and more" * (i // group % (longer + 1)) for i in range(n)]
    examples = [Example(i // group, f"question {i // group}{words[i]}", "1") for i in range(n)]
    prompts = [first_prompt(tok, ex.question) for ex in examples]
    rollouts, episodes = collect_episodes(
        engine,
        tok,
        CountingEnvironment(turns),
        examples,
        [p for p, _ in prompts],
        [m for _, m in prompts],
        SamplingConfig(max_new_tokens=max_new, temperature=1.0, logprobs_top_k=top_k),
        [seed * 100 + i for i in range(n)],
        MultiTurnLimits(max_turns=turns, max_total_tokens=max_total),
        shared_pool(2),
        f"test-multiturn-{turns}",  # (the pool keeps one environment per key)
    )
    return engine, rollouts, episodes


@pytest.fixture(scope="module")
def tiny_policy():
    return load_policy(ModelConfig("tiny"))


def test_smollm2_template_extends_conversations_as_a_prefix(tiny_policy):
    check_prefix_property(tiny_policy[1])

    class Rewriting:  # a template that drops earlier <think> blocks, as Qwen3's does
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
            parts = [m["content"].split("</think>")[-1] if i < last else m["content"] for i, m in enumerate(messages)]
            return "|".join(parts) + ("|A:" if add_generation_prompt else "")

    with pytest.raises(ValueError, match="rewrites earlier turns once message 4"):
        check_prefix_property(Rewriting())


def test_a_trained_ids_are_the_engines_sampled_ids_plus_the_environments(tiny_policy):
    policy, tok = tiny_policy
    engine, r, episodes = run_episodes(policy, tok)
    assert [len(ep.turns) for ep in episodes] == [3, 3, 3, 3]  # every episode ran its three turns
    n_calls = len(engine.calls)
    assert n_calls == 3
    for i, ep in enumerate(episodes):
        sequence = r.prompt_ids[i] + r.response_ids[i][r.response_mask[i] | r.env_mask[i]].tolist()
        model_ids, model_lps = [], []
        for t, (prompts, out) in enumerate(engine.calls):
            # turn t's prompt is exactly the sequence so far: no decode / encode in between
            start = ep.turns[t][0]
            assert prompts[i] == sequence[: len(r.prompt_ids[i]) + start]
            ids = out.response_ids[i][out.response_mask[i]].tolist()
            assert r.response_ids[i, ep.turns[t][0] : ep.turns[t][1]].tolist() == ids
            model_ids += ids
            model_lps += out.rollout_logprobs[i][out.response_mask[i]].tolist()
        assert r.response_ids[i][r.response_mask[i]].tolist() == model_ids
        assert r.rollout_logprobs[i][r.response_mask[i]].tolist() == model_lps
        assert (r.rollout_logprobs[i][r.env_mask[i]] == 0).all()
        # the environment's ids between turns 1-2 and 2-3: the template's end of turn (here its <|im_end|> too:
        # these turns stopped on an ordinary token), the observation, the next generation prompt
        for t in range(2):
            env_ids = r.response_ids[i, ep.turns[t][1] : ep.turns[t + 1][0]].tolist()
            assert r.env_mask[i, ep.turns[t][1] : ep.turns[t + 1][0]].all()
            expected = f"<|im_end|>\n<|im_start|>user\nturn {t} seen<|im_end|>\n<|im_start|>assistant\n"
            assert tok.decode(env_ids) == expected
    assert not (r.response_mask & r.env_mask).any()
    metrics = episode_metrics(episodes)
    assert metrics["rollout/num_turns_mean"] == 3.0 and metrics["rollout/tool_errors"] == 0.0
    env_tokens, model_tokens = int(r.env_mask.sum()), int(r.response_mask.sum())
    assert metrics["rollout/env_token_fraction"] == pytest.approx(env_tokens / (env_tokens + model_tokens))
    assert [ep.reward for ep in episodes] == [1.0] * 4 and r.finish_reason == ["stop"] * 4


def test_f_an_episode_over_max_total_tokens_is_cut_and_counted(tiny_policy):
    policy, tok = tiny_policy
    prompt_len = len(first_prompt(tok, "question 0")[0])
    # a model turn cut at what is left of the budget
    _, r, episodes = run_episodes(policy, tok, n=2, max_new=40, max_total=prompt_len + 1)
    assert r.finish_reason == ["length", "length"]
    assert [len(r.prompt_ids[i]) + int((r.response_mask[i] | r.env_mask[i]).sum()) for i in range(2)] == [
        prompt_len + 1
    ] * 2
    # an observation that does not fit ends the episode before it: never over the context
    budget = prompt_len + 12  # room for a short turn, not for the ~12-token observation after it
    _, r, episodes = run_episodes(policy, tok, n=4, max_new=3, max_total=budget)
    assert r.finish_reason == ["length"] * 4 and [len(ep.turns) for ep in episodes] == [1] * 4
    assert not r.env_mask.any() and all(ep.messages[-1]["role"] == "assistant" for ep in episodes)
    assert (r.response_mask.sum(-1) <= 3).all()


def test_b_environment_tokens_are_attended_but_never_scored(tiny_policy):
    policy, tok = tiny_policy
    _, r, _ = run_episodes(policy, tok, n=2)
    prompt = torch.tensor(r.prompt_ids)
    pmask = torch.ones_like(prompt, dtype=torch.bool)
    whole = r.response_mask | r.env_mask
    with_env = response_logprobs(policy, prompt, pmask, r.response_ids, r.response_mask, env_mask=r.env_mask)
    reference = response_logprobs(policy, prompt, pmask, r.response_ids, whole)  # every token scored
    m = r.response_mask
    torch.testing.assert_close(with_env.logprobs[m], reference.logprobs[m], rtol=0, atol=1e-5)
    assert (with_env.logprobs[r.env_mask] == 0).all() and (with_env.entropy[r.env_mask] == 0).all()
    shared = response_logprobs(
        policy, prompt, pmask, r.response_ids, r.response_mask, env_mask=r.env_mask, shared_prefix=True
    )
    torch.testing.assert_close(shared.logprobs, with_env.logprobs, rtol=0, atol=1e-5)


def module_gradient(policy, tok, scored, *overrides):
    cfg = compose_config(
        "model=tiny",
        "trainer.precision=32-true",
        "rollout.group_size=2",
        "sampling.max_new_tokens=6",
        "sampling.logprobs_top_k=4",
        "eval.num_examples=0",
        *overrides,
    )
    module = build_module(cfg, policy, tok)
    policy.zero_grad()
    stats, _ = module.accumulate_gradients(module.build_batch(scored))
    return torch.cat([p.grad.flatten() for p in policy.parameters()]).clone(), stats.means(), module


def scored_episodes(policy, tok):
    _, r, episodes = run_episodes(policy, tok, n=4, top_k=4)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    return ScoredRollouts(r, rewards, torch.tensor([0, 0, 1, 1]), [ep.example for ep in episodes], [""] * 4)


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"])
def test_b_loss_and_gradient_equal_those_of_the_sequence_with_env_tokens_masked_by_hand(tiny_policy, reduction):
    policy, tok = tiny_policy
    scored = scored_episodes(policy, tok)
    r = scored.rollouts
    grad, _, module = module_gradient(policy, tok, scored, f"loss.reduction={reduction}")

    # by hand: the whole sequence scored in one forward, the environment tokens' loss mask set to 0 by hand
    m = r.response_mask
    prompt = torch.tensor(r.prompt_ids)
    policy.zero_grad()
    lp = response_logprobs(policy, prompt, torch.ones_like(prompt, dtype=torch.bool), r.response_ids, m | r.env_mask)
    adv = module.build_batch(scored).advantages  # GRPO's group advantages, one per row
    token_loss = -adv[:, None] * torch.exp(lp.logprobs - lp.logprobs.detach())  # on-policy: ratio 1, no clip binds
    loss = reduce_loss(
        token_loss, m, reduction, num_tokens=m.sum(), num_seqs=(m.sum(-1) > 0).sum(), max_response_length=6
    )
    loss.backward()
    by_hand = torch.cat([p.grad.flatten() for p in policy.parameters()])
    assert by_hand.abs().max() > 0
    torch.testing.assert_close(grad, by_hand, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("correction", ["sc+tis", "mis"])
def test_b_corrections_see_no_environment_token(tiny_policy, correction):
    """Perturbing an environment token's rollout log-prob or head changes neither gradient nor metrics."""
    policy, tok = tiny_policy
    scored = scored_episodes(policy, tok)
    r = scored.rollouts
    settings = ("loss.reduction=token_mean", f"correction={correction}")
    base, base_stats, _ = module_gradient(policy, tok, scored, *settings)
    r.rollout_logprobs[r.env_mask] = -7.0
    r.topk_logprobs[r.env_mask] = -3.0
    moved, moved_stats, _ = module_gradient(policy, tok, scored, *settings)
    torch.testing.assert_close(moved, base, rtol=0, atol=0)
    assert moved_stats == base_stats
    # (while a model token's does: the comparison can fail)
    first = r.response_mask.nonzero()[0].tolist()
    r.rollout_logprobs[first[0], first[1]] -= 0.5
    model_moved, _, _ = module_gradient(policy, tok, scored, *settings)
    assert not torch.equal(model_moved, base)


def test_c_batch_invariant_trainer_logprobs_equal_every_turns_rollout_logprobs(tiny_policy):
    policy, tok = tiny_policy
    with kernel_mode("batch_invariant", policy):
        _, r, episodes = run_episodes(policy, tok, n=6, seed=3)
        prompt, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
        for shared in (False, True):
            scores = response_logprobs(
                policy, prompt, pmask, r.response_ids, r.response_mask, env_mask=r.env_mask, shared_prefix=shared
            ).logprobs
            for i, ep in enumerate(episodes):
                assert len(ep.turns) == 3
                for a, b in ep.turns:  # train/logprob_abs_diff is exactly 0 on every turn's model tokens
                    assert b > a
                    assert torch.equal(scores[i, a:b], r.rollout_logprobs[i, a:b])
        # the update's own metrics, the first turn and the later ones apart
        scored = ScoredRollouts(r, torch.tensor([1.0, 0, 0, 1, 1, 0]), torch.arange(6) // 2, [], [""] * 6)
        _, stats, _ = module_gradient(policy, tok, scored, "kernels=batch_invariant")
    for name in ("logprob_abs_diff", "logprob_abs_diff_first_turn", "logprob_abs_diff_later_turns"):
        assert stats[f"train/{name}"] == 0.0
    _, stats, _ = module_gradient(policy, tok, scored)  # torch's kernels: a gap on the later turns, measured
    assert stats["train/logprob_abs_diff_later_turns"] > 0


def test_continued_episodes_equal_re_prefilled_ones_bit_for_bit_under_batch_invariant(tiny_policy):
    """Issue 36: with the engine continuing each episode's KV across turns, every turn's tokens, log-probs and
    top-k head are those of the full re-prefill of each turn's episode, bit for bit (batch-invariant kernels):
    9 episodes in groups of 3 with prompts of three lengths, 4 turns of different lengths
    (the engine's rows finish at different steps)."""
    policy, tok = tiny_policy
    with kernel_mode("batch_invariant", policy):
        out = {}
        for continued in (True, False):
            engine, r, episodes = run_episodes(
                policy, tok, n=9, turns=4, max_new=10, top_k=2, seed=5, group=3, longer=2, continue_kv=continued
            )
            out[continued] = (r, episodes, [p for p, _ in engine.calls])
            assert engine.engine.kept is None  # the kept KV went with the collection
    (a, eps_a, prompts_a), (b, eps_b, prompts_b) = out[True], out[False]
    assert prompts_a == prompts_b  # every turn asked the same of both engines
    assert len({len(p) for p in prompts_a[0]}) == 3 and len({len(p) for p in prompts_a[1]}) > 3
    assert [len(ep.turns) for ep in eps_a] == [4] * 9
    for name in ("response_ids", "response_mask", "env_mask", "rollout_logprobs", "topk_ids", "topk_logprobs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert [ep.turns for ep in eps_a] == [ep.turns for ep in eps_b] and a.finish_reason == b.finish_reason


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_each_turn_as_a_request_with_the_episodes_whole_ids(tiny_policy):
    """engine=vllm: every turn one request per live episode with its full token ids; the ids stay the sampled
    ones and the float32 trainer scores the model tokens of every turn within 1e-4 nats of the engine."""
    pytest.importorskip("vllm")
    from lit_rl.rollout.vllm_engine import VLLMEngine

    policy, tok = tiny_policy
    engine = VLLMEngine(policy, tok.pad_token_id, HALF_VOCAB, dtype="float32", kv_cache_gb=0.25, max_model_len=1024)
    try:
        engine.sync_weights(0)
        recording = Recording(engine)
        examples = [Example(i // 2, f"question {i // 2}", "1") for i in range(4)]
        prompts = [first_prompt(tok, ex.question) for ex in examples]
        r, episodes = three_turns(recording, tok, examples, prompts, 400, "test-multiturn-vllm")
    finally:
        engine.close()
    assert [len(ep.turns) for ep in episodes] == [3] * 4 and len(recording.calls) == 3
    for t, (turn_prompts, _) in enumerate(recording.calls):
        for i, ep in enumerate(episodes):
            sequence = r.prompt_ids[i] + r.response_ids[i][r.response_mask[i] | r.env_mask[i]].tolist()
            assert turn_prompts[i] == sequence[: len(r.prompt_ids[i]) + ep.turns[t][0]]
    prompt, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        scores = response_logprobs(policy, prompt, pmask, r.response_ids, r.response_mask, env_mask=r.env_mask)
    assert (scores.logprobs - r.rollout_logprobs).abs()[r.response_mask].max() < 1e-4


def three_turns(engine, tok, examples, prompts, max_total_tokens: int, pool_key: str):
    """(rollouts, episodes) of ``examples`` against a 3-turn CountingEnvironment with ``engine`` (6 tokens a turn,
    temperature 1, seeds 0..3), the vLLM tests' collection."""
    return collect_episodes(
        engine,
        tok,
        CountingEnvironment(3),
        examples,
        [p for p, _ in prompts],
        [m for _, m in prompts],
        SamplingConfig(max_new_tokens=6, temperature=1.0),
        list(range(len(examples))),
        MultiTurnLimits(max_turns=3, max_total_tokens=max_total_tokens),
        shared_pool(2),
        pool_key,
    )


class CountingCache:
    """The vLLM engine, with the prompt tokens each ``generate`` took from vLLM's prefix cache kept."""

    def __init__(self, engine):
        self.engine, self.cached = engine, []
        self.stop_token_ids, self.pad_token_id = engine.stop_token_ids, engine.pad_token_id

    def generate(self, prompts, params, seeds):
        out = self.engine.generate(prompts, params, seeds)
        self.cached.append(self.engine.last_cached_tokens)
        return out


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_prefix_caching_serves_later_turns_from_the_cache_and_a_weight_sync_empties_it(tiny_policy):
    """engine.prefix_caching (on for multi-turn runs): a later turn's request, the episode's whole ids, takes the
    prompt's full blocks (128 tokens on CPU) from the cache, its tokens still scored by the float32 trainer within
    1e-4 nats; after a weight sync nothing cached under the older weights is reused."""
    pytest.importorskip("vllm")
    from lit_rl.rollout.vllm_engine import VLLMEngine

    policy, tok = tiny_policy
    engine = VLLMEngine(
        policy, tok.pad_token_id, HALF_VOCAB, dtype="float32", kv_cache_gb=0.25, max_model_len=1024,
        prefix_caching=True,
    )  # fmt: skip
    examples = [Example(i // 2, f"question {i // 2}: " + "tell me more " * 60, "1") for i in range(4)]
    prompts = [first_prompt(tok, ex.question) for ex in examples]
    assert all(len(p) > 128 for p, _ in prompts)
    try:
        engine.sync_weights(0)
        counting = CountingCache(engine)
        r, episodes = three_turns(counting, tok, examples, prompts, 600, "test-multiturn-vllm-cache")
        engine.sync_weights(1)  # the same weights, a new version: the cache is emptied all the same
        # one row per prompt (two rows of one prompt in one call may share the first one's blocks)
        engine.generate([prompts[0][0], prompts[2][0]], SamplingConfig(max_new_tokens=2), [0, 2])
        after_sync = engine.last_cached_tokens
    finally:
        engine.close()
    assert [len(ep.turns) for ep in episodes] == [3] * 4
    assert all(cached >= 4 * 128 for cached in counting.cached[1:]), counting.cached  # every row: >= one block
    assert after_sync == 0
    prompt, pmask = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        scores = response_logprobs(policy, prompt, pmask, r.response_ids, r.response_mask, env_mask=r.env_mask)
    assert (scores.logprobs - r.rollout_logprobs).abs()[r.response_mask].max() < 1e-4


def test_vllm_prefix_caching_is_on_for_multi_turn_runs_only():
    """engine.prefix_caching=auto resolves at start-up: on for a multi-turn task, off for a single-turn one; an
    explicit value is kept; anything but auto / true / false is refused naming the field."""
    from lit_rl.config import ConfigError, check_vllm_engine
    from lit_rl.run.resolve import resolve_engine

    for task, expected in (("calculator", True), ("guess_number", True), ("arithmetic", False)):
        cfg = compose_config("engine=vllm", f"task={task}")
        resolve_engine(cfg)
        assert cfg.engine.prefix_caching is expected, task
    cfg = compose_config("engine=vllm", "task=calculator", "engine.prefix_caching=false")
    resolve_engine(cfg)
    assert cfg.engine.prefix_caching is False
    with pytest.raises(ConfigError, match=r"engine.prefix_caching='yes' is not allowed: choose auto, true or false"):
        check_vllm_engine(compose_config("engine=vllm", "engine.prefix_caching=yes"))


def test_ppo_puts_an_episodes_reward_on_its_last_model_token(tiny_policy):
    """PPO's token rewards: the episode's reward on its last model token (not at index "model tokens - 1", which
    lies inside an episode whose environment tokens sit between turns); with γ = λ = 1, a zero critic (its head
    starts at 0) and no whitening, every model token's advantage is then the episode's reward."""
    policy, tok = tiny_policy
    scored = scored_episodes(policy, tok)
    r = scored.rollouts
    assert r.env_mask.any()
    cfg = compose_config(
        "model=tiny", "algo=ppo", "algo.gae.lam=1.0", "algo.whiten_advantages=false", "rollout.group_size=2"
    )
    module = build_module(cfg, policy, tok)
    rb = module.build_batch(scored)
    expected = scored.rewards[:, None].expand_as(rb.advantages)
    torch.testing.assert_close(rb.advantages[rb.response_mask], expected[rb.response_mask])
    assert (rb.advantages[~rb.response_mask] == 0).all()
