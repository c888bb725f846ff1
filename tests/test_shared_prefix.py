"""``update.shared_prefix``: each prompt's forward runs once per micro-batch for the completions that share it
(Prefix Grouper, Liu et al. 2025, arXiv 2506.05433). The loss, the per-token log-probs, the entropies, the SC
head, PPO's values, the reference KL and the gradient equal the one-forward path's for every algorithm (float32,
rtol 1e-5, atol 1e-6 max|g|), with uneven prompt and completion lengths, left padding, micro-batches that split
a group, and groups of one; the prompt really is encoded once."""

import pytest
import torch
from faulty_tasks import UnevenPromptsTask
from helpers import compose_config

from lit_rl.algorithms import ALGORITHMS
from lit_rl.algorithms.module import group_micro_batches
from lit_rl.config import ConfigError, validate
from lit_rl.logprobs import resolve_shared_prefix, response_buckets, response_logprobs, shared_prefix_applies
from lit_rl.models import ModelConfig, load_policy
from lit_rl.rollout.datamodule import RolloutDataModule
from lit_rl.run.train import build_module

G = 4


def cfg_for(algo, *overrides):
    """Every term that reads the scores on: SC + TIS (the engine's top-4 head), the entropy bonus, a KL to the
    reference (PPO and REINFORCE++: in the reward, through the snapshot)."""
    return compose_config(
        "model=tiny",
        f"algo={algo}",
        "rollout.prompts_per_step=4",
        f"rollout.group_size={G}",
        "rollout.micro_batch_size=16",
        "sampling.max_new_tokens=8",
        "correction=sc+tis",
        "correction.sc.top_k=4",
        "loss.entropy_coef=0.01",
        "kl.beta=0.05",
        *(["algo.overlong.buffer_length=2"] if algo == "dapo" else []),
        *overrides,
    )


@pytest.fixture(scope="module")
def scored(tiny):
    """4 prompts of different lengths x G = 4 completions from the embedded engine; some completions cut short
    (uneven lengths), rewards that differ within each group."""
    policy, tok = tiny
    dm = RolloutDataModule(UnevenPromptsTask(), tok, 4, G, seed=1, eval_examples=0)
    module = build_module(cfg_for("grpo"), policy, tok)
    out = dm.collect(module.engine, dm.prompts_for(0), module.sampling, step=0)
    out.rollouts.response_mask[::3, 4:] = False
    out.rewards = torch.arange(16, dtype=torch.float32) % 3
    assert len({len(p) for p in out.rollouts.prompt_ids}) > 1  # left padding in every batch of prompts
    return out


def run_update(module, scored, shared, micro_batch_size):
    """(loss, gradient of the trainable parameters, TokenScores of the whole batch, the batch after start_update)."""
    module.shared_prefix, module.micro_batch_size = shared, micro_batch_size
    rb = module.build_batch(scored)
    params = module.trainable_parameters()
    for p in params:
        p.grad = None
    module.start_update(rb)  # pi_old (and PPO's values, GAE; the reference KL in the reward) when it runs
    _, loss = module.accumulate_gradients(rb)
    grad = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
    for p in params:
        p.grad = None
    with torch.no_grad():
        scores = module.logprobs_of(module.policy, rb, return_hidden=True)
    return loss, grad, scores, rb


def assert_same_update(module, scored, sizes=(16, 3)):
    loss, grad, scores, rb = run_update(module, scored, False, 16)
    assert grad.abs().max() > 0
    m = rb.response_mask
    for mbs in sizes:  # 16: four whole groups in one micro-batch; 3: groups split, one member alone
        s_loss, s_grad, s_scores, s_rb = run_update(module, scored, True, mbs)
        torch.testing.assert_close(s_loss, loss, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(s_grad, grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item())
        torch.testing.assert_close(s_scores.logprobs[m], scores.logprobs[m], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s_scores.entropy[m], scores.entropy[m], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s_scores.hidden[m], scores.hidden[m], rtol=1e-5, atol=1e-6)
        head = scores.head_logprobs[m]
        finite = head.isfinite()
        assert finite.any() and torch.equal(finite, s_scores.head_logprobs[m].isfinite())
        torch.testing.assert_close(s_scores.head_logprobs[m][finite], head[finite], rtol=1e-5, atol=1e-6)
        for name in ("old_logprobs", "advantages", "old_values", "returns"):
            if getattr(rb, name, None) is not None:
                torch.testing.assert_close(getattr(s_rb, name), getattr(rb, name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_every_algorithm_updates_the_same_with_the_prompt_shared(tiny, scored, algo):
    policy, tok = tiny
    module = build_module(cfg_for(algo), policy, tok)
    assert module.shared_prefix  # auto: on for the tiny Llama at G = 4
    assert module.has_reference
    # four prompts in one micro-batch for GRPO and PPO (the value head), the split groups for every algorithm
    assert_same_update(module, scored, sizes=(16, 3) if algo in ("grpo", "ppo") else (3,))


def test_lora_reference_with_the_adapter_disabled_is_shared_too(scored):
    policy, tok = load_policy(ModelConfig("tiny", lora={"r": 4, "alpha": 8}))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a random B, so that the adapted policy differs from the base (the reference)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    module = build_module(cfg_for("grpo", "model.lora.r=4", "model.lora.alpha=8"), policy, tok)
    assert module.lora and module.shared_prefix
    rb = module.build_batch(scored)
    refs = []
    for shared in (False, True):
        module.shared_prefix = shared
        refs.append(module.reference_logprobs(rb))
    m = rb.response_mask
    torch.testing.assert_close(refs[1][m], refs[0][m], rtol=1e-5, atol=1e-6)
    assert_same_update(module, scored)


def hand_batch(prompt_lengths, group_sizes, t=7, vocab=1000, seed=0):
    """Left-padded prompts (one per group, repeated G times) and right-padded responses of random lengths."""
    g = torch.Generator().manual_seed(seed)
    p = max(prompt_lengths)
    pids, pmask, rids, rmask = [], [], [], []
    for length, size in zip(prompt_lengths, group_sizes):
        prompt = torch.randint(5, vocab, (length,), generator=g)
        for _ in range(size):
            ids, mask = torch.zeros(p, dtype=torch.long), torch.zeros(p, dtype=torch.long)
            ids[p - length :], mask[p - length :] = prompt, 1
            n = int(torch.randint(1, t + 1, (1,), generator=g))
            resp, rm = torch.zeros(t, dtype=torch.long), torch.zeros(t, dtype=torch.bool)
            resp[:n], rm[:n] = torch.randint(5, vocab, (n,), generator=g), True
            pids.append(ids), pmask.append(mask), rids.append(resp), rmask.append(rm)
    return torch.stack(pids), torch.stack(pmask), torch.stack(rids), torch.stack(rmask)


def test_prompt_encoded_once_and_rows_whose_prompts_differ_are_still_exact(tiny):
    policy, _ = tiny
    pids, pmask, rids, rmask = hand_batch([5, 9, 3], [3, 2, 1])
    pids[1, -1] += 1  # a row that claims group 0 but whose prompt differs: encoded on its own
    tokens = []

    def count(module, args, kwargs):  # token positions entering the first decoder layer, per forward
        hidden = args[0] if args else kwargs["hidden_states"]
        tokens.append(hidden.shape[0] * hidden.shape[1])

    hook = policy.get_decoder().layers[0].register_forward_pre_hook(count, with_kwargs=True)
    try:
        out = {}
        for shared in (False, True):
            tokens.clear()
            policy.zero_grad()
            s = response_logprobs(policy, pids, pmask, rids, rmask, shared_prefix=shared, entropy_grad=True)
            (s.logprobs.sum() + s.entropy.sum()).backward()
            grad = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
            out[shared] = (s.logprobs, s.entropy, grad, list(tokens))
    finally:
        hook.remove()
        policy.zero_grad()
    (lp, ent, grad, n_plain), (s_lp, s_ent, s_grad, n_shared) = out[False], out[True]
    n, p, t = pids.shape[0], pids.shape[1], rids.shape[1]
    assert n_plain == [n * (p + t)]
    assert n_shared[0] == 4 * p  # 4 distinct prompts (group 0 split by the differing row), each once
    # then the completions, in forwards of similar length (response_buckets): no more than one padded forward
    assert int(rmask.sum()) <= sum(n_shared[1:]) <= n * t
    torch.testing.assert_close(s_lp, lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_ent, ent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_grad, grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item())


def test_groups_of_one_share_nothing_and_take_the_one_forward_path_bit_for_bit(tiny):
    policy, _ = tiny
    pids, pmask, rids, rmask = hand_batch([4, 6, 2], [1, 1, 1])
    assert not shared_prefix_applies(policy, pids, pmask)
    with torch.no_grad():
        a = response_logprobs(policy, pids, pmask, rids, rmask).logprobs
        b = response_logprobs(policy, pids, pmask, rids, rmask, shared_prefix=True).logprobs
    assert torch.equal(a, b)
    assert resolve_shared_prefix("auto", policy, 1) == (False, "rollout.group_size=1: no prompt is shared")
    assert resolve_shared_prefix(True, policy, 1) == (True, "")
    assert resolve_shared_prefix(False, policy, 8) == (False, "")


def test_completions_are_cut_where_a_split_saves_more_padding_than_a_forward_costs():
    assert response_buckets([64, 60, 10, 8], overhead=64) == [2, 4]  # (2 x 64 + 64) + (2 x 10 + 64) < 4 x 64 + 64
    assert response_buckets([64, 60, 50, 48], overhead=64) == [4]  # a split would save 28 positions only
    assert response_buckets([5, 5, 5], overhead=0) == [3]
    assert response_buckets([], overhead=64) == []


def test_micro_batches_keep_groups_whole_and_split_only_groups_larger_than_a_micro_batch():
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    lengths = torch.tensor([5, 9, 4, 20, 1, 1, 7, 7, 7, 3, 2, 1])
    parts = group_micro_batches(group_ids, lengths, 6)
    assert [p.tolist() for p in parts] == [[3, 4, 5, 1, 0, 2], [6, 7, 8, 9, 10, 11]]  # longest group first
    parts = group_micro_batches(group_ids, lengths, 2)  # G = 3 > 2: each group cut, every row once
    assert sorted(torch.cat(parts).tolist()) == list(range(12))
    assert all(len(p) <= 2 for p in parts)


def test_an_unsupported_family_is_refused_by_name_and_auto_turns_sharing_off():
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    on, why = resolve_shared_prefix("auto", model, 8)
    assert not on and "model family 'gpt2' (GPT2LMHeadModel)" in why
    with pytest.raises(ValueError, match=r"update.shared_prefix=true: model family 'gpt2'"):
        resolve_shared_prefix(True, model, 8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["update.shared_prefix=maybe"], r"update.shared_prefix='maybe' is not allowed: choose auto, true or false"),
        (
            ["update.shared_prefix=true", "model.gradient_checkpointing=true"],
            r"update.shared_prefix=true is not allowed: cannot be true with model.gradient_checkpointing=true",
        ),
    ],
)
def test_bad_settings_are_refused_before_the_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config("model=tiny", *overrides))


def test_gradient_checkpointing_turns_auto_off_and_the_forward_back_to_one_pass():
    spec = ModelConfig("tiny")
    spec.gradient_checkpointing = True
    policy, _ = load_policy(spec)
    on, why = resolve_shared_prefix("auto", policy, 8)
    assert not on and "gradient_checkpointing" in why
    pids, pmask, rids, rmask = hand_batch([5, 3], [2, 2])
    policy.train()
    assert not shared_prefix_applies(policy, pids, pmask)  # checkpointed layers would drop the cache
    with torch.no_grad():  # no backward to replay: the cache is kept, sharing applies
        assert shared_prefix_applies(policy, pids, pmask)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_micro_batch_of_empty_responses_is_scored_and_updated(tiny, scored, algo):
    """A micro-batch whose rows all have empty responses (each one's first sampled token ended it: zero response
    columns once trimmed) is scored, snapshotted (pi_old: two epochs) and updated like any other: the loss and
    the gradient equal those of micro-batches that mix the empty rows with others. (Its scoring raised on a
    reshape of 0 elements.)"""
    import copy

    policy, tok = tiny
    empty = copy.deepcopy(scored)
    empty.rollouts.response_mask[:2] = False
    module = build_module(cfg_for(algo, "algo.ppo_epochs=2"), policy, tok)
    loss, grad, _, rb = run_update(module, empty, False, 16)
    assert rb.select(slice(0, 2)).response_ids.shape[1] == 0 and grad.abs().max() > 0
    for shared in (False, True):
        s_loss, s_grad, _, _ = run_update(module, empty, shared, 2)
        torch.testing.assert_close(s_loss, loss, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(s_grad, grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item())


def test_the_shared_prompts_gradient_has_the_same_bits_at_every_backward(tiny):
    """Each prompt's keys and values reach its rows through ``state_cache.gather_rows``: the backward adds the rows'
    gradients one after another. ``tensor[rows]``'s CPU backward added them from two threads in a varying order (16
    rows on 2 prompts, keys of 2 x 80 positions x 32: the add is split across threads), so two updates of one batch
    differed in their last bits, and two runs of the main job apart after step 1."""
    policy, _ = tiny
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 200, (2, 80), generator=gen).repeat_interleave(8, 0)
    pmask = torch.ones_like(prompts)
    rids = torch.randint(5, 200, (16, 6), generator=gen)
    lengths = torch.randint(1, 7, (16,), generator=gen)  # sorted by length, the two prompts' rows interleave
    rmask = (torch.arange(6)[None] < lengths[:, None]).long()
    grads = set()
    for _ in range(12):
        policy.zero_grad()
        s = response_logprobs(policy, prompts, pmask, rids, rmask, shared_prefix=True)
        s.logprobs.sum().backward()
        grads.add(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]).numpy().tobytes())
    policy.zero_grad()
    assert len(grads) == 1


def test_a_continuation_cache_sums_each_prompts_rows_in_one_order():
    """``state_cache.continuation_cache`` (the hybrid models' shared prefix) takes its rows by ``gather_rows`` too:
    300 backwards of one gather, rows of two prompts interleaved, give one gradient."""
    from transformers import DynamicCache

    from lit_rl.rollout.state_cache import continuation_cache

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 1, 86, 32, generator=gen).requires_grad_()
    rows = torch.arange(2).repeat_interleave(8)[torch.randperm(16, generator=gen)]
    grad = torch.randn(16, 1, 86, 32, generator=gen)
    seen = set()
    for _ in range(300):
        keys.grad = None
        layer = continuation_cache(DynamicCache(ddp_cache_data=[(keys, keys.detach())]), rows).layers[0]
        layer.keys.backward(grad)
        seen.add(keys.grad.numpy().tobytes())
    assert len(seen) == 1
    torch.testing.assert_close(keys.grad, torch.zeros_like(keys).index_add_(0, rows, grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_gives_the_bits_of_torchs_deterministic_indexing(dtype):
    """``gather_rows``'s backward equals ``x[rows]``'s under ``torch.use_deterministic_algorithms`` bit for bit (each
    source's rows summed in order in x's dtype: what the batch-invariant runs compared against 752006f used), for
    contiguous and strided gradients; ``index_select``'s backward sums bf16 rows otherwise."""
    from lit_rl.rollout.state_cache import gather_rows

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, 40, 64, generator=gen).to(dtype).requires_grad_()
    rows = torch.randint(0, 3, (16,), generator=gen)
    grads = [torch.randn(16, 3, 40, 64, generator=gen).to(dtype)]
    grads.append(grads[0].transpose(1, 2).contiguous().transpose(1, 2))
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        x.grad = None
        x[rows].backward(grads[0])
        want = x.grad.clone()
    finally:
        torch.use_deterministic_algorithms(before)
    for grad in grads:
        x.grad = None
        out = gather_rows(x, rows)
        assert torch.equal(out, x[rows])
        out.backward(grad)
        assert torch.equal(x.grad, want)
