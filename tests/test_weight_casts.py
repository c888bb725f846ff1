"""The engine casts its linear weights to the autocast dtype once per rollout: the same bits as autocast's per-step
casts, made again after a sync."""

import pytest
import torch
from helpers import chat_prompts
from helpers.casts import lightning_autocast, linear_weights

from lit_rl.kernels import BatchInvariantMode
from lit_rl.rollout.staleness import weights_snapshot
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.rollout.types import SamplingConfig
from lit_rl.rollout.weight_casts import WeightCasts

QUESTIONS = ["What is 1 + 2?", "What is 7 + 5? Think step by step.", "Hi", "Add 3 and 9, then explain."]


def moved(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in weights_snapshot(model).items()}


def both_ways(engine, prompts, params, seeds, before=lambda: None):
    """(rollouts with the casts made once, rollouts with autocast casting at every step), the first's cast count;
    ``before()`` runs before each."""
    engine.casts.enabled, engine.casts.made = True, 0
    before()
    once = engine.generate(prompts, params, seeds)
    made = engine.casts.made
    engine.casts.enabled = False
    before()
    per_step = engine.generate(prompts, params, seeds)
    engine.casts.enabled = True
    assert engine.casts.made == made  # the baseline made none
    return once, per_step, made


def assert_same(a, b):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert (a.topk_logprobs is None and b.topk_logprobs is None) or torch.equal(a.topk_logprobs, b.topk_logprobs)


@pytest.mark.parametrize("own_copy", [False, True])
def test_casting_once_samples_the_bits_of_autocast_casting_every_step(tiny, own_copy):
    """Shared module and own copy (whose weights do not require grad, so even a caching autocast re-cast them), under
    Lightning's autocast: the same tokens, log-probs and top-k head, bit for bit, with each linear weight cast once
    per rollout (12 decode steps: autocast cast each of them 12 times); left-padded prompts, top-k on."""
    model, tok = tiny
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], own_copy=own_copy)
    prompts = chat_prompts(tok, QUESTIONS) * 2
    params = SamplingConfig(max_new_tokens=12, logprobs_top_k=3)
    seeds = list(range(len(prompts)))
    with lightning_autocast():
        once, per_step, made = both_ways(engine, prompts, params, seeds)
    assert made == linear_weights(engine.model)  # one cast per weight, not per step
    assert_same(once, per_step)
    assert not any("forward" in vars(m) for m in engine.model.modules())  # the layers' own forward restored
    float32, _, made = both_ways(engine, prompts, params, seeds)  # no autocast: nothing to cast
    assert made == 0
    assert not torch.equal(float32.rollout_logprobs, once.rollout_logprobs)  # bf16 products did run above


def test_under_batch_invariant_kernels_the_casts_change_no_bit(tiny):
    """``kernels=batch_invariant`` replaces the products' CPU kernels; they receive the same bf16 tensors."""
    model, tok = tiny
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], own_copy=True)
    prompts = chat_prompts(tok, QUESTIONS)
    with BatchInvariantMode(model), lightning_autocast():
        once, per_step, made = both_ways(engine, prompts, SamplingConfig(max_new_tokens=8), [1, 2, 3, 4])
    assert made == linear_weights(engine.model)
    assert_same(once, per_step)


def test_a_sync_between_decode_steps_makes_the_casts_again(tiny):
    """An in-flight swap (``between_steps``) before decode step k loads version 1 into the own copy in place: the
    tokens from k on are those of autocast casting version 1 at every step (and of a fresh engine holding version 1,
    ``kv_on_update=recompute``), not of version 0's casts kept."""
    model, tok = tiny
    v0, v1, k = weights_snapshot(model), moved(model, 5), 3
    prompts = chat_prompts(tok, QUESTIONS[:3])
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=7)
    engine = TorchEngine(model, tok.pad_token_id, [], own_copy=True)
    engine.kv_on_update = "recompute"

    def swap_at_k(step):
        if step != k:
            return False
        engine.sync_weights(1, v1)
        return True

    with lightning_autocast():
        engine.sync_weights(0, v0)
        unswapped = engine.generate(prompts, greedy, [0, 1, 2])
        engine.between_steps = swap_at_k
        once, per_step, made = both_ways(engine, prompts, greedy, [0, 1, 2], before=lambda: engine.sync_weights(0, v0))
        engine.between_steps = None
        fresh = TorchEngine(model, tok.pad_token_id, [], own_copy=True)
        fresh.sync_weights(1, v1)
        contexts = [p + ids[:k].tolist() for p, ids in zip(prompts, once.response_ids)]
        f = fresh.generate(contexts, SamplingConfig(temperature=0.0, max_new_tokens=7 - k), [0, 1, 2])
    assert made == 2 * linear_weights(engine.model)  # version 0's casts, then version 1's
    assert_same(once, per_step)
    assert torch.equal(once.response_ids[:, k:], f.response_ids)
    assert torch.equal(once.rollout_logprobs[:, k:], f.rollout_logprobs)
    assert torch.equal(once.rollout_logprobs[:, :k], unswapped.rollout_logprobs[:, :k])
    assert not torch.equal(once.rollout_logprobs[:, k:], unswapped.rollout_logprobs[:, k:])


def test_a_cast_is_made_again_when_its_tensor_changes():
    """In-place writes bump the version counter, re-assigned data moves the storage: either makes a new cast;
    ``clear`` (every engine sync) catches a write through ``.data``, which neither sees."""
    layer = torch.nn.Linear(4, 3)
    casts = WeightCasts()
    first = casts.cast(layer.weight, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and torch.equal(first, layer.weight.detach().to(torch.bfloat16))
    assert casts.cast(layer.weight, torch.bfloat16) is first and casts.made == 1
    with torch.no_grad():
        layer.state_dict()["weight"].copy_(torch.ones(3, 4))  # a sync's write: through a detached view
    assert torch.equal(casts.cast(layer.weight, torch.bfloat16), torch.ones(3, 4, dtype=torch.bfloat16))
    layer.weight.data = torch.full((3, 4), 2.0)
    assert torch.equal(casts.cast(layer.weight, torch.bfloat16), torch.full((3, 4), 2.0, dtype=torch.bfloat16))
    layer.weight.data.fill_(3.0)  # invisible to the counter: the old cast is returned until ``clear``
    assert casts.cast(layer.weight, torch.bfloat16)[0, 0].item() == 2.0
    casts.clear()
    assert casts.cast(layer.weight, torch.bfloat16)[0, 0].item() == 3.0 and casts.made == 4
    assert casts.cast(layer.weight.double(), torch.bfloat16).dtype == torch.float64  # autocast leaves float64
    assert casts.cast(None, torch.bfloat16) is None


def test_with_grad_tracked_the_layer_keeps_autocasts_cast_in_the_graph():
    """Grad mode on and a weight that requires grad: ``nn.Linear``'s own forward (the gradient reaches the float32
    weight); under ``no_grad`` the cast is made once and gives autocast's product."""
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    casts = WeightCasts()
    with casts.installed(layer), lightning_autocast():
        y = layer(x)
        y.float().sum().backward()
        assert casts.made == 0 and layer.weight.grad is not None
        with torch.no_grad():
            got = layer(x)
        assert casts.made == 2  # weight and bias
    with lightning_autocast(), torch.no_grad():
        expected = layer(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert "forward" not in vars(layer)


def test_tracked_casts_give_autocasts_values_and_gradients_with_one_cast_per_weight():
    """``track=True`` (the update's forwards): a layer used three times in one graph gets the cast made once, and the
    output and the float32 weight's gradient are autocast's own bit for bit (each use converts its gradient, summed
    in float32 as with autocast's cast at every use)."""
    layer = torch.nn.Linear(16, 8)
    xs = [torch.randn(3, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def run(casts):
        layer.zero_grad(set_to_none=True)
        block = casts.installed(layer) if casts is not None else torch.enable_grad()
        with block, lightning_autocast():
            out = torch.cat([layer(x) for x in xs])
            (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), layer.weight.grad.clone(), layer.bias.grad.clone()

    expected = run(None)
    casts = WeightCasts(track=True)
    got = run(casts)
    assert casts.made == 2  # weight and bias, once for the three uses
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("kernels", ["default", "batch_invariant"])
def test_the_update_casts_each_weight_once_with_the_loss_and_gradients_unchanged(tiny, monkeypatch, kernels):
    """``RLModule.accumulate_gradients`` under Lightning's autocast: the policy's linear weights are cast once for
    the whole update (``update_casts``), and the loss and every gradient equal those of autocast casting at every
    forward, bit for bit, under either kernel mode."""
    import contextlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from _common import as_rollout_batch, grpo_module

    from lit_rl.algorithms.module import RLModule

    model, tokenizer = tiny
    module = grpo_module(model, tokenizer, 8, 4)
    prompts = [p for p in chat_prompts(tokenizer, QUESTIONS[:2]) for _ in range(4)]
    rb = as_rollout_batch(module, module.engine.generate(prompts, module.sampling, list(range(8))), 4)

    def update():
        model.zero_grad(set_to_none=True)
        mode = BatchInvariantMode(model) if kernels == "batch_invariant" else contextlib.nullcontext()
        with mode, lightning_autocast():
            _, loss = module.accumulate_gradients(rb)
        return loss, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    made, uses = [], []
    real = WeightCasts.cast

    def counted(self, tensor, dtype):
        before = self.made
        out = real(self, tensor, dtype)
        uses.append(tensor is not None)
        made.extend([id(tensor)] * (self.made - before))
        return out

    monkeypatch.setattr(WeightCasts, "cast", counted)
    loss, grads = update()
    # every linear weight but the output layer's (it casts its own, once each way) cast once, though used more often
    assert len(made) == len(set(made)) == linear_weights(model) - 1 and sum(uses) >= 2 * len(made)
    monkeypatch.setattr(RLModule, "update_casts", lambda self: contextlib.nullcontext())
    loss_per_forward, grads_per_forward = update()
    assert loss == loss_per_forward
    assert len(grads) == len(grads_per_forward) and all(map(torch.equal, grads, grads_per_forward))
