"""The trainer's no-gradient passes (pi_old, the frozen reference, the distillation teacher, a stale source's
behaviour scores) cast each linear weight to the autocast dtype once (``RLModule.scoring_pass``): the log-probs are
autocast's per-forward casts' bit for bit, under the default kernels and the batch-invariant ones."""

import copy

import pytest
import torch
from helpers.casts import lightning_autocast, linear_weights

from lit_rl.algorithms import RLModule
from lit_rl.algorithms import module as module_py
from lit_rl.kernels import BatchInvariantMode
from lit_rl.rollout.types import RolloutBatch
from lit_rl.rollout.weight_casts import WeightCasts

RESPONSE_LENGTHS = [3, 7, 1, 5, 6, 2]  # two groups of 3 rows, each group's prompt shared
MICRO_BATCH = 2


def make_batch(vocab: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(7)
    n, t = len(RESPONSE_LENGTHS), max(RESPONSE_LENGTHS)
    prompt_ids = torch.randint(0, vocab, (2, 5), generator=g).repeat_interleave(3, 0)
    prompt_mask = torch.ones(n, 5, dtype=torch.bool)
    prompt_mask[3:, :2] = False  # the second group's prompt left-padded
    response_mask = torch.arange(t)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    response_ids = torch.randint(0, vocab, (n, t), generator=g) * response_mask
    return RolloutBatch(
        prompt_ids=prompt_ids * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logprobs=torch.zeros(n, t),
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
        group_ids=torch.arange(n) // 3,
        policy_version=torch.zeros(n, dtype=torch.long),
    )


def make_module(tiny, top_k: int = 0) -> RLModule:
    """GRPO with a KL reference and a distillation teacher (the policy's weights moved), float32 weights."""
    model, tok = tiny
    policy = copy.deepcopy(model)
    teacher = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=g))
    return RLModule(
        policy=policy,
        tokenizer=tok,
        sampling={"max_new_tokens": max(RESPONSE_LENGTHS), "top_k": top_k},
        eval_sampling={},
        group_size=3,
        micro_batch_size=MICRO_BATCH,
        algo={"name": "grpo"},
        kl={"beta": 0.1},
        distill={"teacher": "moved-copy", "mode": "advantage"},
        teacher=teacher,
    )


class Counted(WeightCasts):
    """A ``WeightCasts`` that lists every instance made (the policy's passes make their own)."""

    made_instances: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Counted.made_instances.append(self)


def per_forward(module: RLModule, model, rb: RolloutBatch) -> torch.Tensor:
    """[N, T] log-probs of ``model`` one micro-batch at a time, autocast casting at every forward (no casts held)."""
    out = torch.zeros(rb.response_ids.shape)
    with torch.no_grad():
        for i in range(0, len(rb), MICRO_BATCH):
            lp = module.logprobs_of(model, rb.select(slice(i, i + MICRO_BATCH)), with_entropy=False).logprobs
            out[i : i + MICRO_BATCH, : lp.shape[1]] = lp
    return out


def reference_pass(module: RLModule, rb: RolloutBatch) -> torch.Tensor:
    out = torch.zeros(rb.response_ids.shape)
    for i in range(0, len(rb), MICRO_BATCH):
        lp = module.reference_logprobs(rb.select(slice(i, i + MICRO_BATCH)))
        out[i : i + MICRO_BATCH, : lp.shape[1]] = lp
    return out


def check_passes(module: RLModule, rb: RolloutBatch, monkeypatch) -> None:
    Counted.made_instances = []
    monkeypatch.setattr(module_py, "WeightCasts", Counted)
    policy, ref, teacher = module.policy, module.ref_policy, module.teacher
    weights = linear_weights(policy)
    expected = {m: per_forward(module, m, rb) for m in (policy, ref, teacher)}

    module.snapshot(rb)  # pi_old: the policy's casts for the pass
    assert torch.equal(rb.old_logprobs, expected[policy])
    assert [c.made for c in Counted.made_instances] == [weights]  # once per weight over 3 micro-batches
    assert not Counted.made_instances[0]._casts  # dropped after the pass
    assert torch.equal(module.score_rows(rb, torch.arange(len(rb))), expected[policy])  # a stale source's p_o

    assert torch.equal(reference_pass(module, rb), expected[ref])
    assert torch.equal(reference_pass(module, rb), expected[ref])  # again, with the casts kept
    assert module.frozen_casts[id(ref)].made == weights  # made once for the run
    student_minus_teacher = module.distill_advantages(rb, torch.zeros(len(rb)))  # coef 1: -(student - teacher)
    mask = rb.response_mask
    assert torch.equal(student_minus_teacher, torch.where(mask, expected[teacher] - expected[policy], 0.0))
    assert module.frozen_casts[id(teacher)].made == weights
    assert not any("forward" in vars(m) for m in (*policy.modules(), *ref.modules(), *teacher.modules()))
    assert not torch.equal(expected[policy], per_forward_float32(module, rb))  # bf16 products did run


def per_forward_float32(module: RLModule, rb: RolloutBatch) -> torch.Tensor:
    with torch.autocast("cpu", enabled=False):
        return per_forward(module, module.policy, rb)


@pytest.mark.parametrize("top_k", [0, 5])
def test_scoring_passes_cast_once_and_give_autocasts_bits(tiny, monkeypatch, top_k):
    """Under Lightning's autocast, default kernels: pi_old, score_rows, the reference (twice) and the teacher equal
    the per-forward path bit for bit (top-k 0: the plain head; 5: the truncated one), with each policy weight cast
    once per pass and each frozen model's once for the run."""
    module = make_module(tiny, top_k)
    rb = make_batch(tiny[0].config.vocab_size)
    with lightning_autocast():
        check_passes(module, rb, monkeypatch)


def test_under_batch_invariant_kernels_the_scoring_casts_change_no_bit(tiny, monkeypatch):
    """``kernels=batch_invariant``: the products' kernels receive the same bf16 tensors either way."""
    module = make_module(tiny)
    rb = make_batch(tiny[0].config.vocab_size)
    with BatchInvariantMode(module.policy), lightning_autocast():
        check_passes(module, rb, monkeypatch)


def test_the_update_forward_keeps_autocasts_cast_in_the_graph(tiny):
    """Inside a scoring pass with gradients on, the policy's layers take ``nn.Linear``'s own forward: the
    gradient reaches the float32 weights and no cast is made."""
    module = make_module(tiny)
    rb = make_batch(tiny[0].config.vocab_size)
    mb = rb.select(slice(0, MICRO_BATCH))
    with lightning_autocast():
        expected = module.logprobs_of(module.policy, mb, with_entropy=False).logprobs
        casts = WeightCasts()
        with casts.installed(module.policy):
            got = module.logprobs_of(module.policy, mb, with_entropy=False).logprobs
            got.sum().backward()
    assert casts.made == 0 and torch.equal(got, expected)
    assert module.policy.get_output_embeddings().weight.grad is not None
