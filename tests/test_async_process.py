"""``rollout.producer=process`` (``lit_rl.rollout.producer_process``), its weight store (``rollout.weight_store``) and
per-token versions (``Rollouts.token_versions``): the process samples what the in-process engine samples for the
same version and seeds, a hung or killed process is an error within ``rollout.producer_timeout_s``, and a sequence
written by two versions gets r_num and r_stale split per token."""

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import FAST, MOVING, ROOT, THREADS
from helpers import fast_config as cfg_for

from lit_rl.algorithms import RLModule
from lit_rl.config import ConfigError, validate
from lit_rl.corrections import mismatch_decomposition
from lit_rl.rollout.producer_process import ProcessEngine, ProducerDied
from lit_rl.rollout.staleness import StaleRollouts, load_weights, token_staleness, weights_snapshot
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.rollout.types import RolloutBatch, Rollouts, left_pad
from lit_rl.rollout.weight_store import WeightStore
from lit_rl.schema.rollout import SamplingConfig

PROMPTS = [[5, 9, 14, 3], [5, 9, 14, 3], [7, 2, 11]]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6, logprobs_top_k=3)


def moved(model, seed: int) -> dict[str, torch.Tensor]:
    """A new version of ``model``'s weights: every tensor plus seeded noise of size 1e-2 (a snapshot)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in weights_snapshot(model).items()}


@pytest.fixture(scope="module")
def engines(tiny):
    """(the process engine, the in-process engine): both sample with their own copy of the tiny model's weights;
    the process at the test process's thread count, as a thread producer would."""
    model, tok = tiny
    kwargs = dict(pad_token_id=tok.pad_token_id, stop_token_ids=[tok.eos_token_id], own_copy=True)
    process = ProcessEngine(TorchEngine(model, **kwargs), threads=THREADS, timeout_s=120)
    process.attach(WeightStore(model.state_dict(), slots=2))
    yield process, TorchEngine(model, **kwargs)
    process.close()


def test_the_store_writes_a_version_once_keeps_the_newest_and_shares_its_memory(tiny):
    model, _ = tiny
    store = WeightStore(model.state_dict(), slots=2)
    names = list(store.slots[0])
    assert "lm_head.weight" not in names or "model.embed_tokens.weight" not in names  # tied: stored once
    assert all(t.is_shared() for slot in store.slots for t in slot.values()) and store.table.is_shared()
    versions = {v: moved(model, v) for v in range(3)}
    for v in range(3):
        store.write(v, versions[v])
    assert sorted(store.versions) == [1, 2] and store.oldest() == 1 and store.newest() == 2  # the oldest went
    slot = store.write(2, versions[0])  # a version is written once: the second write changes nothing
    assert all(torch.equal(slot[k], versions[2][k]) for k in names)
    store.prune(2)
    assert sorted(store.versions) == [2] and 1 not in store
    assert store.load_into(1, lambda w: None) is False
    target = weights_snapshot(model)
    assert store.load_into(2, lambda w: load_weights(model, w))
    try:
        assert all(torch.equal(model.state_dict()[k], versions[2][k]) for k in names)
    finally:
        load_weights(model, target)


def test_the_cuda_transport_layout_is_dry_run_on_the_meta_device(tiny):
    """What a GPU store would move per version: the same slots and bytes as the CPU one, no memory here."""
    model, _ = tiny
    cpu = WeightStore(model.state_dict(), slots=3).describe()
    dry = WeightStore({k: v.to("meta") for k, v in model.state_dict().items()}, slots=3).describe()
    expected = sum(t.numel() * t.element_size() for t in weights_snapshot(model).values())
    assert cpu["transport"] == "cpu_shm" and dry["transport"] == "dry_run"
    assert cpu["bytes_per_version"] == expected and cpu["bytes"] == 3 * expected
    # the meta layout cannot see ties (no addresses): it counts the tied output embedding apart
    assert dry["bytes_per_version"] >= expected and dry["slots"] == 3
    with pytest.raises(ValueError, match="slot"):
        WeightStore(model.state_dict(), slots=0)


def test_process_and_thread_producers_give_identical_rollouts_for_identical_versions(tiny, engines):
    process, local = engines
    model, _ = tiny
    seeds = [11, 12, 13]
    for version, weights in [(0, weights_snapshot(model)), (1, moved(model, 1))]:
        process.sync_weights(version, weights)
        local.sync_weights(version, weights)
        a, b = process.generate(PROMPTS, SAMPLING, seeds), local.generate(PROMPTS, SAMPLING, seeds)
        assert a.policy_version.tolist() == b.policy_version.tolist() == [version] * 3
        for name in ("response_ids", "response_mask", "rollout_logprobs", "topk_ids", "topk_logprobs"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (version, name)
        assert torch.equal(a.token_versions, torch.full_like(a.response_ids, version))
    assert process.last.tokens == int(a.response_mask.sum()) and process.last.seconds > 0
    assert not torch.equal(a.rollout_logprobs, process.generate(PROMPTS, SAMPLING, [1, 2, 3]).rollout_logprobs)


def test_a_hung_then_a_killed_rollout_process_is_an_error_within_the_timeout(engines):
    process, _ = engines
    process.generate(PROMPTS[:1], SAMPLING, [1])  # started and answering
    timeout, process.timeout_s = process.timeout_s, 2.0
    try:
        os.kill(process.pid, signal.SIGSTOP)  # hung: alive, silent
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rollout.producer_timeout_s=2 s"):
            process.generate(PROMPTS[:1], SAMPLING, [1])
        assert 2.0 <= time.monotonic() - t0 < 2.0 + 2.0
        os.kill(process.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ProducerDied, match=r"died with exit code -9"):
            process.generate(PROMPTS[:1], SAMPLING, [1])
        assert time.monotonic() - t0 < 2.0  # at the next look, not at the timeout
    finally:
        process.timeout_s = timeout
        process.close()  # the next user of the fixture starts a fresh process
    assert process.pid is None


def test_tokens_are_staled_and_scored_by_the_version_that_sampled_them(tiny):
    """A hand-made sequence of 6 tokens: the first 3 sampled by version 0, the rest by version 1, trained at
    version 1. Its behaviour log-probs are version 0's forward on the first 3 and NaN (= old_logprobs) on the
    rest, so log r_stale is exactly 0 on version 1's tokens and log pi_1/pi_0 on version 0's."""
    model, tok = tiny

    class AtVersion1(RLModule):  # the learner at optimizer step 1 (no Trainer drives it here)
        policy_version = 1

    module = AtVersion1(model, tok, sampling={}, eval_sampling={}, group_size=2, micro_batch_size=2)
    v0, v1 = weights_snapshot(model), moved(model, 7)
    out = TorchEngine(model, tok.pad_token_id, [], own_copy=True)
    out.sync_weights(0, v0)
    r = out.generate(PROMPTS[:2], SamplingConfig(max_new_tokens=6), [3, 4])
    versions = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    rollouts = Rollouts(**{**r.__dict__, "token_versions": versions, "policy_version": torch.tensor([0, 1])})
    assert token_staleness(rollouts, 1) == {
        "rollout/staleness_mean": 3 / 12,
        "rollout/staleness_max": 1.0,
        "rollout/version_span_max": 2.0,
    }
    prompt_ids, prompt_mask = left_pad(r.prompt_ids, tok.pad_token_id)
    rb = RolloutBatch(
        prompt_ids, prompt_mask, r.response_ids, r.response_mask, r.rollout_logprobs, torch.zeros(2), None,
        torch.zeros(2, dtype=torch.long), torch.tensor([0, 1]), token_versions=versions,
    )  # fmt: skip
    rows = torch.arange(2)
    try:
        load_weights(model, v0)
        pi_0 = module.score_rows(rb, rows)
        load_weights(model, v1)
        pi_1 = module.score_rows(rb, rows)  # old_logprobs: the trained version's forward
        stale = StaleRollouts("lagged", lag=1)
        stale.history.versions = {0: v0, 1: weights_snapshot(model)}
        stale.score_behaviour(module, rb)
        assert all(torch.equal(model.state_dict()[k], v1[k]) for k in v1)  # the trained weights came back
    finally:
        load_weights(model, v0)
    old_tokens = versions == 0
    assert torch.isnan(rb.behaviour_logprobs[~old_tokens]).all()
    assert torch.equal(rb.behaviour_logprobs[old_tokens], pi_0[old_tokens])
    p_o = torch.where(torch.isnan(rb.behaviour_logprobs), pi_1, rb.behaviour_logprobs)  # loss.assemble_loss's rule
    log_r_stale = pi_1 - p_o
    assert torch.equal(log_r_stale[~old_tokens], torch.zeros(9))
    assert torch.equal(log_r_stale[old_tokens], (pi_1 - pi_0)[old_tokens]) and log_r_stale[old_tokens].abs().min() > 0
    parts = mismatch_decomposition(r.rollout_logprobs, p_o, pi_1, ~old_tokens)
    assert float(parts["r_stale_abs"]) == 0.0
    parts = mismatch_decomposition(r.rollout_logprobs, p_o, pi_1, old_tokens)
    assert math.isclose(float(parts["r_stale_abs"]), float((pi_1 - pi_0)[old_tokens].abs().mean()), rel_tol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.producer=fork"], "rollout.producer='fork' is not allowed: choose one of ['auto', 'thread'"),
        (["rollout.producer=process", "engine=vllm"], "runs the embedded engine (engine=torch), not engine=vllm"),
        (["rollout.producer=process", "model.lora.r=4"], "loads plain weights into the rollout process"),
        (["rollout.producer_threads=0"], "rollout.producer_threads=0 is not allowed: must be null or an integer >= 1"),
        (["kernels=batch_invariant", "rollout.trainer_threads=1"], "must stay null under kernels=batch_invariant"),
        (["rollout.producer_timeout_s=0"], "rollout.producer_timeout_s=0 is not allowed: must be a number of seconds"),
        (["rollout.weight_update=sometimes"], "rollout.weight_update='sometimes' is not allowed: choose one of"),
        (["rollout.kv_on_update=drop"], "rollout.kv_on_update='drop' is not allowed: choose one of ['recompute'"),
        # vLLM takes in-flight updates between the steps of an in-process engine core only, and carries nothing
        (
            ["rollout.weight_update=in_flight", "engine=vllm", "engine.in_process=false"],
            "rollout.weight_update='in_flight' is not allowed: needs vLLM's engine core in this process",
        ),
        (
            ["rollout.weight_update=in_flight", "engine=vllm", "rollout.partial=true"],
            "rollout.partial=true is not allowed: carries unfinished sequences in the embedded engine's decode loop",
        ),
        (["rollout.weight_update=in_flight", "rollout.mode=lagged"], "is read by rollout.mode=async only"),
        (["rollout.producer=process", "rollout.mode=sync"], "rollout.producer='process' is not allowed: is read by"),
        (["rollout.producer=thread", "rollout.mode=lagged"], "async only (rollout.mode=lagged)"),
        # keep acts on a swap between decode steps: without in_flight there is none, so it would be dropped silently
        (["rollout.kv_on_update=keep"], "rollout.kv_on_update='keep' is not allowed: is read by rollout.mode=async wi"),
        (["rollout.kv_on_update=keep", "rollout.mode=lagged"], "(what an update between decode steps does with the"),
        (["loss.drop_older_tokens=true"], "loss.drop_older_tokens=true is not allowed: leaves out the tokens written"),
        (["loss.drop_older_tokens=true", "rollout.mode=sync"], "(rollout.mode=sync, rollout.weight_update=between_b"),
    ],
)
def test_bad_producer_fields_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(cfg_for("rollout.mode=async", *overrides))
    assert message in str(err.value), str(err.value)


@pytest.mark.slow
def test_a_rollout_process_killed_mid_run_fails_the_run_within_the_timeout(tmp_path, monkeypatch):
    from lit_rl.run.train import run

    original, seen = RLModule.update, {}

    def killing(self, rb):
        if self.global_step == 1:
            seen["pid"], seen["t"] = self.engine.pid, time.monotonic()
            os.kill(self.engine.pid, signal.SIGKILL)
        return original(self, rb)

    monkeypatch.setattr(RLModule, "update", killing)
    overrides = ["trainer.max_steps=6", "rollout.mode=async", "rollout.producer=process", "eval.num_examples=0"]
    with pytest.raises(RuntimeError, match=r"rollout process \(pid \d+\) died with exit code -9") as err:
        run(cfg_for(*overrides, "rollout.producer_timeout_s=60", *MOVING), tmp_path / "x")
    assert time.monotonic() - seen["t"] < 60, err.value
    assert "rollout.producer=process" in str(err.value)


@pytest.mark.slow
def test_sigterm_checkpoints_and_stops_the_trainer_and_its_rollout_process(tmp_path):
    """The rollout process ignores SIGTERM (the trainer owns its life): the trainer checkpoints its last step, exits
    143 and stops the process on its way out."""
    script = os.path.join(ROOT, "tests", "helpers", "fault_injection.py")
    out = tmp_path / "run"
    overrides = [*FAST, *MOVING, "eval.num_examples=0", "trainer.max_steps=4", "checkpoint.every_n_steps=10"]
    res = subprocess.run(
        [sys.executable, script, "sigterm_between", "2", str(out), *overrides, "rollout.mode=async"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 128 + signal.SIGTERM, (res.returncode, res.stderr[-3000:])
    assert "lit_rl: stopped by SIGTERM after RL step 2" in res.stdout, res.stdout[-2000:]
    pid = int(re.search(r"rollout producer in process (\d+)", res.stdout).group(1))
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


def batch_of(r: Rollouts, pad_token_id: int) -> RolloutBatch:
    """The ``RolloutBatch`` the trainer would score for rollouts ``r`` (rewards and groups unused here)."""
    prompt_ids, prompt_mask = left_pad(r.prompt_ids, pad_token_id)
    n = len(r.prompt_ids)
    return RolloutBatch(
        prompt_ids, prompt_mask, r.response_ids, r.response_mask, r.rollout_logprobs, torch.zeros(n), None,
        torch.zeros(n, dtype=torch.long), r.policy_version, token_versions=r.token_versions,
    )  # fmt: skip


@pytest.mark.parametrize("kv_on_update", ["recompute", "keep"])
def test_a_weight_swap_at_decode_step_k_samples_the_rest_with_the_new_version(tiny, kv_on_update):
    """Weights swapped before decode step k = 3 (``TorchEngine.between_steps``): tokens 0..2 are version 0's and
    3.. version 1's. With ``recompute`` their log-probs are bit for bit those of a fresh engine holding version 1
    given the same context (greedy: the same tokens), and the trainer's forward under version 1 (batch-invariant
    kernels); with ``keep`` the cache written by version 0 leaves a gap to it, which is measured."""
    from lit_rl.kernels import BatchInvariantMode

    model, tok = tiny
    v0, v1, k = weights_snapshot(model), moved(model, 5), 3
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=7)
    module = RLModule(model, tok, sampling={}, eval_sampling={}, group_size=2, micro_batch_size=4)
    with BatchInvariantMode(model):
        engine = TorchEngine(model, tok.pad_token_id, [], own_copy=True)
        engine.sync_weights(0, v0)
        engine.between_steps = lambda step: step == k and engine.sync_weights(1, v1) is None
        engine.kv_on_update = kv_on_update
        r = engine.generate(PROMPTS, greedy, [0, 1, 2])
        fresh = TorchEngine(model, tok.pad_token_id, [], own_copy=True)
        fresh.sync_weights(1, v1)
        contexts = [p + ids[:k].tolist() for p, ids in zip(PROMPTS, r.response_ids)]
        f = fresh.generate(contexts, SamplingConfig(temperature=0.0, max_new_tokens=7 - k), [0, 1, 2])
        try:
            load_weights(model, v1)
            trainer = module.score_rows(batch_of(r, tok.pad_token_id), torch.arange(3))
        finally:
            load_weights(model, v0)
    assert r.token_versions[:, :k].eq(0).all() and r.token_versions[:, k:].eq(1).all()
    assert r.policy_version.tolist() == [0, 0, 0] and token_staleness(r, 1)["rollout/version_span_max"] == 2.0
    assert engine.last.swaps == 1 and engine.last.swap_seconds >= 0
    gap = (r.rollout_logprobs[:, k:] - trainer[:, k:]).abs().max()
    if kv_on_update == "recompute":
        assert torch.equal(r.response_ids[:, k:], f.response_ids) and torch.equal(
            r.rollout_logprobs[:, k:], f.rollout_logprobs
        )
        assert gap == 0
    else:
        assert gap > 1e-4, gap  # the older keys and values of version 0 under version 1's queries
    assert torch.equal(r.rollout_logprobs[:, :k], trainer[:, :k]) is False  # version 0's tokens, scored under 1


def test_a_recompute_swap_prefills_a_shared_prompt_once_and_each_rows_tail_on_top(tiny):
    """A group of G = 2 sampled rows of prompt X decodes 4 tokens beside a group of prompt Y (4 tokens each), a
    second group of X (a refill: another group of the same prompt joining beside them at step 3) 1 token; then
    version 1 is swapped in with ``kv_on_update=recompute``. The rebuild prefills X and Y once and every row's tail
    on top: |X| + |Y| + sum t_i = 4 + 3 + (4 + 4 + 4 + 4 + 1 + 1) = 25 ids, not the rows' contexts' sum(|prompt| + t_i)
    = 2 x 8 + 2 x 7 + 2 x 5 = 40, and every token after the swap has, bit for bit (``kernels=batch_invariant``), the
    token, log-prob and top-k head a fresh engine holding version 1 samples from the same context with the row's
    generator in the same state."""
    from lit_rl.kernels import BatchInvariantMode
    from lit_rl.rollout.decode_loop import DecodeLoop

    model, tok = tiny
    x, y, steps, after_swap = [5, 9, 14, 3], [7, 2, 11], 8, 3
    params = SamplingConfig(temperature=1.0, max_new_tokens=steps, logprobs_top_k=2)
    v0, v1 = weights_snapshot(model), moved(model, 5)

    def step(loop, k):
        loop.advance(loop.sample(loop.forward(k)))

    with BatchInvariantMode(model):
        engine = TorchEngine(model, tok.pad_token_id, [], own_copy=True)
        engine.sync_weights(0, v0)
        engine.kv_on_update = "recompute"
        loop = DecodeLoop(engine, params)
        loop.add([x, x, y, y], [10, 11, 12, 13])
        for k in range(3):
            step(loop, k)
        loop.add([x, x], [14, 15], beside=True)  # the refill: prefilled alone, its KV placed beside
        step(loop, 3)
        for r, t in zip(range(6), [4, 4, 4, 4, 1, 1]):
            assert int(loop.pos[r]) == t
        before = dict(engine.recompute_totals)
        engine.between_steps = lambda k: k == 4 and engine.sync_weights(1, v1) is None
        for k in range(4, 4 + after_swap):  # the swap comes before step 4
            step(loop, k)
        after = engine.recompute_totals
        tails = loop.pos.tolist()
        out = loop.rollouts()
        fresh = TorchEngine(model, tok.pad_token_id, [], own_copy=True)
        fresh.sync_weights(1, v1)
        prompts = [x, x, y, y, x, x]
        at_swap = [4, 4, 4, 4, 1, 1]
        contexts = [p + out.response_ids[r, :t].tolist() for r, (p, t) in enumerate(zip(prompts, at_swap))]
        replay = DecodeLoop(fresh, params)
        replay.add(contexts, [10, 11, 12, 13, 14, 15])
        for gen, t in zip(replay.generators, at_swap):  # the row's generator as it was at the swap
            for _ in range(t):
                torch.rand((), generator=gen)
        for k in range(after_swap):
            step(replay, k)
    assert after["prefills"] - before["prefills"] == 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(x) + len(y) + sum(at_swap) == 25
    assert after["context_tokens"] - before["context_tokens"] == sum(len(p) + t for p, t in zip(prompts, at_swap)) == 40
    assert out.token_versions[0, :4].eq(0).all() and out.token_versions[4, :1].eq(0).all()
    for r, t in enumerate(at_swap):
        n = tails[r] - t  # tokens sampled after the swap: version 1's, a fresh engine's bit for bit
        assert n == after_swap and out.token_versions[r, t : t + n].eq(1).all()
        assert torch.equal(out.response_ids[r, t : t + n], replay.tokens[r, :n])
        assert torch.equal(out.rollout_logprobs[r, t : t + n], replay.logprobs[r, :n])
        assert torch.equal(out.topk_logprobs[r, t : t + n], replay.topk_lp[r, :n])


def test_in_flight_the_thread_producer_takes_a_version_published_during_a_generate(tiny):
    """``rollout.weight_update=in_flight`` wired into the thread producer: version 1 is published while the engine
    samples with version 0, so from the first decode step after it every token is version 1's."""
    from lit_rl.rollout.staleness import RolloutProducer

    model, tok = tiny
    rollout = {"mode": "async", "producer": "thread", "weight_update": "in_flight", "kv_on_update": "recompute"}
    module = RLModule(model, tok, sampling={}, eval_sampling={}, group_size=2, micro_batch_size=2, rollout_mode=rollout)
    assert module.engine.own_copy and module.engine.kv_on_update == "recompute"
    producer = RolloutProducer(module, 0, 1, "block", 1, in_flight=True)  # not started: its hook only
    module.engine.sync_weights(0, weights_snapshot(model))
    producer.publish(1, moved(model, 3))
    r = module.engine.generate(PROMPTS, SamplingConfig(max_new_tokens=5), [1, 2, 3])
    assert r.token_versions.tolist() == [[0, 1, 1, 1, 1]] * 3 and r.policy_version.tolist() == [0, 0, 0]
    assert module.engine.last.swaps == 1 and module.engine.version == 1
    r = module.engine.generate(PROMPTS, SamplingConfig(max_new_tokens=5), [1, 2, 3])  # nothing newer: no swap
    assert r.token_versions.eq(1).all() and module.engine.last.swaps == 0


def test_no_trained_token_is_older_than_max_staleness_when_a_sequence_spans_versions(tiny):
    """``rollout.max_staleness`` bounds a batch's oldest token, not its rows' newest: a batch whose first tokens
    version 0 sampled and the rest version 1 (an in-flight swap) is dropped at version 2 with max_staleness=1 though
    most of its tokens are 1 step old; the next batch, version 1's alone, is the one trained (staleness 1 on every
    token); at version 1 the spanning batch itself is taken (its oldest tokens 1 step old)."""
    from lit_rl.rollout.datamodule import ScoredRollouts
    from lit_rl.rollout.staleness import RolloutProducer, _Item

    model, tok = tiny
    rollout = {"mode": "async", "producer": "thread", "weight_update": "in_flight", "kv_on_update": "recompute"}
    module = RLModule(model, tok, sampling={}, eval_sampling={}, group_size=2, micro_batch_size=2, rollout_mode=rollout)
    producer = RolloutProducer(module, 0, 1, "drop", 4, in_flight=True)  # not started: its hook and buffer only
    module.engine.sync_weights(0, weights_snapshot(model))
    producer.publish(1, moved(model, 3))
    spanning = module.engine.generate(PROMPTS, SamplingConfig(max_new_tokens=5), [1, 2, 3])
    fresh = module.engine.generate(PROMPTS, SamplingConfig(max_new_tokens=5), [4, 5, 6])
    assert spanning.token_versions.tolist() == [[0, 1, 1, 1, 1]] * 3 and fresh.token_versions.eq(1).all()

    def item(step, r):
        scored = ScoredRollouts(r, torch.zeros(3), torch.tensor([0, 0, 1]), [], [""] * 3)
        return _Item.of(step, scored, {}, 0.0, module.engine.version)

    producer.buffer.extend([item(0, spanning), item(1, fresh)])
    taken, dropped = producer.take(version_now=2)
    assert (taken.step, taken.version, dropped) == (1, 1, 3)
    assert token_staleness(taken.scored.rollouts, 2)["rollout/staleness_max"] == 1.0
    assert token_staleness(spanning, 2)["rollout/staleness_max"] == 2.0  # what training it would have meant
    producer.buffer.append(item(2, spanning))
    taken, dropped = producer.take(version_now=1)
    assert (taken.step, taken.version, dropped) == (2, 0, 0)
    assert token_staleness(taken.scored.rollouts, 1) == {
        "rollout/staleness_mean": 0.2,  # 1 of each row's 5 tokens is 1 step old
        "rollout/staleness_max": 1.0,
        "rollout/version_span_max": 2.0,
    }


@pytest.mark.slow
def test_in_flight_the_rollout_process_takes_a_version_written_to_the_store_during_a_generate(tiny):
    """The rollout process looks at its store between decode steps: a version written while it samples a long
    batch is loaded at some step k, every row's tokens from k on record it, the swap is counted."""
    import threading

    model, tok = tiny
    kwargs = dict(pad_token_id=tok.pad_token_id, stop_token_ids=[], own_copy=True)
    process = ProcessEngine(TorchEngine(model, **kwargs), threads=THREADS, timeout_s=120, in_flight=True)
    process.attach(WeightStore(model.state_dict(), slots=2))
    try:
        process.sync_weights(0, weights_snapshot(model))
        process.generate(PROMPTS, SamplingConfig(max_new_tokens=2), [1, 2, 3])  # started
        later = threading.Timer(0.3, process.store.write, (1, moved(model, 4)))
        later.start()
        r = process.generate(PROMPTS, SamplingConfig(max_new_tokens=400), [1, 2, 3])
        later.join()
    finally:
        process.close()
    first = int(r.token_versions[0].eq(1).nonzero()[0])
    assert 0 < first < 400 and process.last.swaps == 1
    assert r.token_versions[:, :first].eq(0).all() and r.token_versions[:, first:].eq(1).all()


def test_a_store_lock_left_held_is_an_error_not_a_hang(tiny, monkeypatch):
    """A reader killed while it copies a version leaves the lock held: the trainer's next write says so."""
    from lit_rl.rollout import weight_store

    model, _ = tiny
    monkeypatch.setattr(weight_store, "LOCK_TIMEOUT_S", 0.2)
    store = WeightStore(model.state_dict(), slots=1)
    store.lock.acquire()  # what a reader that died mid-copy leaves behind
    with pytest.raises(RuntimeError, match="the weight store's lock was not released within 0.2 s"):
        store.write(0, model.state_dict())
