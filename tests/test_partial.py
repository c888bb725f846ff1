"""Partial rollouts (``rollout.partial``, ``decode_loop.PartialRollouts``): sequences unfinished when a batch is due
carry over to the next one with their tokens, versions and log-probs, the freed decode slots take new groups, a group
enters a batch only whole, and no held token is older than the bound the producer sets.

The forced case: the tiny random model decodes greedily by repeating its prompt's last token, so with stop token 11 a
prompt ending in 11 finishes at its first token (a short group) and one ending in 3 runs to ``max_new_tokens`` (6)."""

import pytest
import torch
from helpers import fast_config as cfg_for

from lit_rl.algorithms import RLModule
from lit_rl.config import ConfigError, validate
from lit_rl.rollout.datamodule import ScoredRollouts
from lit_rl.rollout.staleness import weights_snapshot
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.schema.rollout import SamplingConfig

LONG, SHORT, SHORT2, OTHER = [5, 9, 14, 3], [7, 2, 11], [8, 11], [10, 3]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6, logprobs_top_k=2)
G = 2


def moved(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in weights_snapshot(model).items()}


def groups(*prompts):
    """Rows of the groups of ``prompts`` (G each, next to each other) and their seeds."""
    rows = [list(p) for p in prompts for _ in range(G)]
    return rows, list(range(len(rows)))


def call(engine, keys, prompts, want, min_version=None):
    rows, seeds = groups(*prompts)
    return engine.generate_partial(rows, GREEDY, seeds, keys, want, min_version)


@pytest.fixture
def versions(tiny):
    model, _ = tiny
    return {0: weights_snapshot(model), 1: moved(model, 1), 2: moved(model, 2)}


def engine_at(model, tok, weights, version, stop=(11,)):
    engine = TorchEngine(model, tok.pad_token_id, list(stop), own_copy=True)
    engine.kv_on_update = "recompute"
    engine.sync_weights(version, weights)
    return engine


def test_carried_rows_keep_their_tokens_and_the_freed_slots_are_refilled(tiny, versions):
    """Call 1 (version 0, 4 decode slots): the short group is done at step 0 and due; the long one is carried with
    one token. Call 2 (version 1): the carried group and the new short one fill the 4 slots, the short one finishes
    at step 0 and the queued group takes its slots at step 1 (4 rows at every step, not 4, 2, 2, 2, 2); the long
    group is due after its 5 remaining tokens, its first token still version 0's with its log-prob and top-k head
    as call 1 left them. Under ``kernels=batch_invariant`` the carried tokens' log-probs are a fresh engine's: version
    0's for the first token, version 1's (given the same context) for the rest."""
    from lit_rl.kernels import BatchInvariantMode

    model, tok = tiny
    with BatchInvariantMode(model):
        engine = engine_at(model, tok, versions[0], 0)
        r1, keys1, carried1 = call(engine, ["short", "long"], [SHORT, LONG], want=1)
        state = engine.partial_state
        held = torch.tensor(state.held[0].rows)
        before = {
            "tokens": state.loop.tokens[held, :1].clone(), "logprobs": state.loop.logprobs[held, :1].clone(),
            "versions": state.loop.versions[held, :1].clone(), "topk": state.loop.topk_lp[held, :1].clone(),
        }  # fmt: skip
        assert state.decode_rows == [4]
        engine.sync_weights(1, versions[1])
        counts1 = state.totals()
        r2, keys2, carried2 = call(engine, ["short2", "other"], [SHORT2, OTHER], want=2)
        decode_rows2, counts2 = list(state.decode_rows), state.totals()
        fresh0 = engine_at(model, tok, versions[0], 0).generate([LONG] * G, GREEDY, [0, 1])
        rest = SamplingConfig(temperature=0.0, max_new_tokens=5, logprobs_top_k=2)
        context = LONG + r2.response_ids[2, :1].tolist()
        fresh1 = engine_at(model, tok, versions[1], 1).generate([context] * G, rest, [0, 1])
        held2 = [(g.key, state.loop.pos[g.rows].tolist()) for g in state.held]
        r3, keys3, carried3 = call(engine, ["short3"], [SHORT], want=2)
    assert keys1 == ["short"] and r1.response_mask.sum(-1).tolist() == [1, 1] and carried1.tolist() == [False] * 2
    assert r1.finish_reason == ["stop", "stop"]
    assert keys2 == ["short2", "long"] and carried2.tolist() == [False, False, True, True]
    assert r2.carried.tolist() == carried2.tolist()
    assert decode_rows2 == [4, 4, 4, 4, 4]  # the queued group refilled the short one's slots at step 1
    # call 1 prefilled SHORT and LONG (padded to 4): 8 positions; call 2 re-prefilled (newer weights, recompute)
    # SHORT2 and the long rows' context LONG + 1 token (padded to 5): 10, then at step 1 OTHER alone (2 ids) beside
    # the 4 live rows, none of whose positions was recomputed
    assert counts1["prefill_positions"] == 8 and counts1["joined_rows"] == 0
    assert counts2["prefill_positions"] == 8 + 10 + len(OTHER) and counts2["joined_rows"] == G
    long = slice(2, 4)
    assert r2.response_mask[long].sum(-1).tolist() == [6, 6] and r2.finish_reason[2:] == ["length"] * 2
    assert torch.equal(r2.response_ids[long, :1], before["tokens"])
    assert torch.equal(r2.rollout_logprobs[long, :1], before["logprobs"])
    assert torch.equal(r2.topk_logprobs[long, :1], before["topk"])
    assert r2.token_versions[long].tolist() == [[0, 1, 1, 1, 1, 1]] * 2 and r2.policy_version[long].tolist() == [0, 0]
    # bit for bit a fresh engine's, each token under the version that sampled it
    assert torch.equal(r2.rollout_logprobs[long, :1], fresh0.rollout_logprobs[:, :1])
    assert torch.equal(r2.response_ids[long, 1:], fresh1.response_ids)
    assert torch.equal(r2.rollout_logprobs[long, 1:], fresh1.rollout_logprobs)
    # the queued group is held with the 4 tokens of steps 1-4; it is due with one more step's, carried
    assert held2 == [("other", [4, 4])]
    assert keys3 == ["short3", "other"] and carried3.tolist() == [False, False, True, True]
    assert state.decode_rows == [4, 2] and r3.response_mask[2:].sum(-1).tolist() == [6, 6]


def test_sampled_partial_rollouts_equal_a_plain_generate_for_one_version(tiny):
    """Carry-over and refills change which rows share a decode batch, never what a row samples: with one version and
    batch-invariant kernels every group partial rollouts return equals the plain engine's for its seeds, bit for
    bit (tokens, log-probs, top-k), over three calls with stop tokens that end rows at different steps."""
    from lit_rl.kernels import BatchInvariantMode

    model, tok = tiny
    params = SamplingConfig(temperature=1.0, max_new_tokens=7, logprobs_top_k=2)
    stop = list(range(0, 49152, 5))  # a fifth of the vocabulary ends a row
    prompts = {f"p{i}": [3 + i, 9, 14 + i] for i in range(6)}
    seeds = {key: [100 * i + j for j in range(G)] for i, key in enumerate(prompts)}
    with BatchInvariantMode(model):
        engine = TorchEngine(model, tok.pad_token_id, stop)
        plain = {key: engine.generate([p] * G, params, seeds[key]) for key, p in prompts.items()}
        out, carried = {}, 0
        for keys in (["p0", "p1"], ["p2", "p3"], ["p4", "p5"]):
            rows = [prompts[k] for k in keys for _ in range(G)]
            r, got, c = engine.generate_partial(rows, params, [s for k in keys for s in seeds[k]], keys, want=2)
            carried += int(c.sum())
            for i, key in enumerate(got):
                out[key] = (r.response_ids[i * G : (i + 1) * G], r.rollout_logprobs[i * G : (i + 1) * G], r)
    assert len(out) == 6
    for key, (ids, logprobs, _) in out.items():
        width = plain[key].response_ids.shape[1]
        assert torch.equal(ids[:, :width], plain[key].response_ids), key
        assert torch.equal(logprobs[:, :width], plain[key].rollout_logprobs), key


def test_a_held_group_with_a_token_older_than_the_bound_restarts(tiny, versions):
    """No trained token is older than the bound: the group carried with a version-0 token is restarted from its first
    token (same seeds) when the next call allows version 1 at the oldest, and returns with version-1 tokens only."""
    model, tok = tiny
    engine = engine_at(model, tok, versions[0], 0)
    call(engine, ["short", "long"], [SHORT, LONG], want=1)
    engine.sync_weights(1, versions[1])
    engine.partial_min_version = 1  # what the async producer sets: (step - max_staleness) * updates_per_step
    r, keys, carried = call(engine, ["short2", "other"], [SHORT2, OTHER], want=2)
    assert engine.partial_state.restarts == 1
    assert keys == ["short2", "long"] and carried.tolist() == [False] * 4  # restarted: started by this call
    assert r.token_versions[r.response_mask].min() == 1 and r.response_mask[2:].sum(-1).tolist() == [6, 6]


def test_partial_fraction_is_the_share_of_carried_rows(tiny, versions):
    """``rollout/partial_fraction`` by hand: call 2 of the forced case trains the new short group (2 rows) and the
    carried long one (2 rows): 2 / 4 = 0.5; a batch without partial rollouts logs none."""
    model, tok = tiny
    engine = engine_at(model, tok, versions[0], 0)
    call(engine, ["short", "long"], [SHORT, LONG], want=1)
    r, _, _ = call(engine, ["short2", "other"], [SHORT2, OTHER], want=2)
    module = RLModule(model, tok, sampling={}, eval_sampling={}, group_size=G, micro_batch_size=4)
    scored = ScoredRollouts(r, torch.zeros(4), torch.tensor([0, 0, 1, 1]), [], [""] * 4)
    assert module.rollout_metrics(scored)["rollout/partial_fraction"] == 0.5
    r.carried = None
    assert "rollout/partial_fraction" not in module.rollout_metrics(scored)


def test_weight_swaps_count_every_generate_call_of_a_batch(tiny):
    """``rollout/weight_swaps`` of a batch made of two generate calls (DAPO's rounds, partial rollouts' calls), each
    with one in-flight swap, is 2, not the last call's 1."""
    from lit_rl.rollout.staleness import RolloutProducer

    model, tok = tiny
    rollout = {"mode": "async", "producer": "thread", "weight_update": "in_flight", "kv_on_update": "recompute"}
    module = RLModule(model, tok, sampling={}, eval_sampling={}, group_size=2, micro_batch_size=2, rollout_mode=rollout)
    producer = RolloutProducer(module, 0, 1, "block", 1, in_flight=True)  # not started: its hooks only
    module.engine.sync_weights(0, weights_snapshot(model))
    before = list(module.engine.swap_totals)
    for version in (1, 2):
        producer.publish(version, moved(model, version))
        module.engine.generate([SHORT, LONG], SamplingConfig(max_new_tokens=3), [1, 2])
        assert module.engine.last.swaps == 1
    metrics = producer._swap_metrics(before)
    assert metrics["rollout/weight_swaps"] == 2.0 and metrics["time/weight_swap_s"] > 0


def test_the_producer_logs_the_ids_a_recompute_swap_prefilled(tiny):
    """``rollout/recompute_prefill_tokens`` beside ``rollout/recompute_context_tokens``: a batch of one group of G = 2
    sampled rows of LONG (4 ids) swaps to version 1 before decode step 1 with ``kv_on_update=recompute``; the rebuild
    prefills LONG once and each row's one token on top, 4 + 2 = 6 ids, where re-prefilling each row's context
    feeds 2 x 5 = 10."""
    from lit_rl.rollout.staleness import RolloutProducer

    model, tok = tiny
    rollout = {"mode": "async", "producer": "thread", "weight_update": "in_flight", "kv_on_update": "recompute"}
    module = RLModule(model, tok, sampling={}, eval_sampling={}, group_size=G, micro_batch_size=2, rollout_mode=rollout)
    producer = RolloutProducer(module, 0, 1, "block", 1, in_flight=True)  # not started: its hooks only
    engine = module.engine
    engine.sync_weights(0, weights_snapshot(model))
    engine.stop_token_ids = []  # every row decodes its 3 tokens
    before = producer._swap_marks()
    producer.publish(1, moved(model, 1))
    r = engine.generate([LONG] * G, SamplingConfig(temperature=1.0, max_new_tokens=3), [1, 2])
    metrics = producer._swap_metrics(before)
    assert engine.last.swaps == 1 and r.token_versions.tolist() == [[0, 1, 1]] * G
    assert r.response_ids[0, 0] != r.response_ids[1, 0]  # at the swap: two contexts sharing one prompt
    assert metrics["rollout/recompute_prefill_tokens"] == len(LONG) + G * 1 == 6
    assert metrics["rollout/recompute_context_tokens"] == G * (len(LONG) + 1) == 10


def test_bad_partial_calls_are_named(tiny, versions):
    model, tok = tiny
    engine = engine_at(model, tok, versions[0], 0)
    with pytest.raises(ValueError, match="same number of prompts in every group"):
        engine.generate_partial([SHORT] * 3, GREEDY, [0, 1, 2], ["a", "b"], want=1)
    with pytest.raises(ValueError, match="want 3 groups but only 2 are held"):
        call(engine, ["a", "b"], [SHORT, LONG], want=3)
    call(engine, ["a", "b"], [SHORT, LONG], want=1)
    with pytest.raises(ValueError, match="sampling settings must stay"):
        engine.generate_partial([SHORT] * G, SamplingConfig(max_new_tokens=3), [0, 1], ["c"], want=1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.partial=true"], "rollout.partial=true is not allowed: carries unfinished sequences"),
        (["rollout.mode=async", "rollout.partial=true"], "rollout.weight_update=between_batches"),
    ],
)
def test_partial_outside_async_in_flight_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(cfg_for(*overrides))
    assert message in str(err.value), str(err.value)


def test_async_in_flight_with_partial_rollouts_validates():
    validate(cfg_for("rollout.mode=async", "rollout.weight_update=in_flight", "rollout.partial=true"))


@pytest.mark.slow
@pytest.mark.parametrize("producer", ["thread", "process"])
def test_the_recipe_trains_with_partial_rollouts_within_max_staleness(tmp_path, producer):
    """async in flight with partial rollouts through the recipe, with either producer: every step logs
    ``rollout/partial_fraction`` in [0, 1] and no trained token older than ``max_staleness`` (timing decides
    which rows carry over: the tiny model rarely stops before its 8 tokens, so the fraction is often 0)."""
    from helpers import MOVING

    from lit_rl.run.train import run
    from lit_rl.tools.compare import read_scalars

    overrides = ["trainer.max_steps=4", "rollout.mode=async", "rollout.max_staleness=1"]
    overrides += ["rollout.weight_update=in_flight", "rollout.partial=true", f"rollout.producer={producer}"]
    run(cfg_for(*overrides, *MOVING), tmp_path / "a")
    s = read_scalars(tmp_path / "a")
    fractions = [v for _, v in s["rollout/partial_fraction"]]
    assert len(fractions) == 4 and all(0.0 <= v <= 1.0 for v in fractions), fractions
    assert all(v <= 1 for _, v in s["rollout/staleness_max"]), s["rollout/staleness_max"]
    for tag in ("rollout/partial_held_back", "rollout/recompute_prefill_tokens", "rollout/recompute_context_tokens"):
        assert len(s[tag]) == 4 and all(v >= 0 for _, v in s[tag]), tag  # the counters travel from either producer
    assert all(
        a <= b for (_, a), (_, b) in zip(s["rollout/recompute_prefill_tokens"], s["rollout/recompute_context_tokens"])
    )


def test_look_ahead_groups_take_the_slots_a_batch_frees_and_are_skipped_when_offered_again(tiny, versions):
    """``ahead``: call 1 offers its batch (short, long) and the next batch's short2 as a look-ahead. The batch is 4
    decode slots (the look-ahead does not widen it); short is done at step 0, short2 takes its slots at step 1 and
    is done there, so the batch is due with two complete groups (short, short2) while long is carried. Call 2
    offers short2 again (its own batch) with other: short2 is skipped (already delivered), other takes the free
    slots and long finishes its 6 tokens first."""
    model, tok = tiny
    engine = engine_at(model, tok, versions[0], 0)
    rows, seeds = groups(SHORT, LONG, SHORT2)
    r1, keys1, carried1 = engine.generate_partial(rows, GREEDY, seeds, ["short", "long", "short2"], 2, ahead=1)
    state = engine.partial_state
    assert keys1 == ["short", "short2"] and carried1.tolist() == [False] * 4
    assert state.decode_rows == [4, 4] and state.slots == 4
    assert [(g.key, state.loop.pos[g.rows].tolist()) for g in state.held] == [("long", [2, 2])]
    r2, keys2, carried2 = call(engine, ["short2", "other"], [SHORT2, OTHER], want=2)
    assert keys2 == ["long", "other"] and carried2.tolist() == [True, True, False, False]
    assert r2.response_mask.sum(-1).tolist() == [6, 6, 6, 6]
    assert state.decode_rows == [4, 4, 4, 4, 2, 2] and state.held == [] and state.queue == []


@pytest.mark.parametrize("hold", [False, True])
def test_a_look_ahead_group_waits_for_weights_its_own_batch_may_train_on(tiny, versions, hold):
    """The layout that threw decoded tokens away: call 1 (version 0, bound 0) brings short and long and, as a
    look-ahead, long2 (OTHER, which runs its 6 tokens), whose own batch (call 2) allows version 1 at the oldest.
    Without the look-ahead's bound (``hold`` False) long2 takes short's slots at step 1 with version 0, is carried
    with 5 tokens when long completes, and call 2 restarts it: 1 restart, 2 x 5 tokens thrown away. With it, long2
    waits in the queue (the decode batch runs on with long's 2 rows), call 2 starts it with version 1 and nothing is
    thrown away."""
    model, tok = tiny
    engine = engine_at(model, tok, versions[0], 0)
    rows, seeds = groups(SHORT, LONG, OTHER)
    bound = 1 if hold else None
    r1, keys1, _ = engine.generate_partial(rows, GREEDY, seeds, ["short", "long", "long2"], 2, 0, 1, bound)
    state = engine.partial_state
    decode_rows1 = list(state.decode_rows)
    engine.sync_weights(1, versions[1])
    r2, keys2, carried2 = call(engine, ["long2", "short2"], [OTHER, SHORT2], want=2, min_version=1)
    totals = state.totals()
    assert keys1 == ["short", "long"] and keys2 == ["short2", "long2"]
    assert r2.token_versions[r2.response_mask].unique().tolist() == [1]  # no trained token older than the bound
    if hold:
        assert decode_rows1 == [4, 2, 2, 2, 2, 2] and totals["held_back"] == 1
        assert totals["restarts"] == 0 and totals["discarded_tokens"] == 0
    else:
        assert decode_rows1 == [4, 4, 4, 4, 4, 4] and totals["held_back"] == 0
        assert totals["restarts"] == 1 and totals["discarded_tokens"] == 2 * 5
    assert carried2.tolist() == [False] * 4


def test_a_held_back_look_ahead_group_starts_after_a_swap_to_weights_its_batch_allows(tiny, versions):
    """The same layout with version 1 swapped in before decode step 3 of call 1: long2 waits at steps 1-2 and
    starts at step 3 with version 1, which its own batch allows, so call 2 carries it on (not restarted): its 3
    tokens of call 1 are kept, carried, all version 1's."""
    model, tok = tiny
    engine = engine_at(model, tok, versions[0], 0)
    engine.between_steps = lambda step: step == 3 and engine.sync_weights(1, versions[1]) is None
    rows, seeds = groups(SHORT, LONG, OTHER)
    r1, keys1, _ = engine.generate_partial(rows, GREEDY, seeds, ["short", "long", "long2"], 2, 0, 1, 1)
    state = engine.partial_state
    decode_rows1 = list(state.decode_rows)
    engine.between_steps = None
    r2, keys2, carried2 = call(engine, ["long2", "short2"], [OTHER, SHORT2], want=2, min_version=1)
    totals = state.totals()
    assert keys1 == ["short", "long"] and decode_rows1 == [4, 2, 2, 4, 4, 4]
    assert keys2 == ["short2", "long2"] and carried2.tolist() == [False, False, True, True]
    assert totals["held_back"] == 1 and totals["restarts"] == 0 and totals["discarded_tokens"] == 0
    assert r2.token_versions[2:].tolist() == [[1] * 6] * 2


def test_a_look_ahead_group_the_batch_cannot_do_without_starts_and_is_trained_in_it(tiny, versions):
    """A batch that wants 2 groups but brings 1 (the other was delivered early) takes the look-ahead group though
    its own batch would not allow the engine's version: it is committed to this batch, which waits for it, so it is
    never carried (and never thrown away)."""
    model, tok = tiny
    engine = engine_at(model, tok, versions[0], 0)
    rows, seeds = groups(SHORT, SHORT2)
    r, keys, carried = engine.generate_partial(rows, GREEDY, seeds, ["short", "short2"], 2, 0, 1, 1)
    totals = engine.partial_state.totals()
    assert keys == ["short", "short2"]  # both committed (started with version 0, which the next batch does not
    # allow: short as one of this batch's own groups, short2 as the look-ahead the batch needs), in completion order
    assert engine.partial_state.decode_rows == [2, 2] and totals["held_back"] == 0 and totals["restarts"] == 0
    assert engine.partial_state.held == [] and engine.partial_state.queue == []


def test_collect_offers_the_next_steps_groups_as_a_look_ahead(tiny, versions):
    """Through ``RolloutDataModule.collect``: with ``rollout.partial`` the engine gets this step's groups and the next
    step's (their keys, prompts and seeds those of the next step's own call), and a look-ahead group delivered early
    is not delivered again: over three steps every trained group is a distinct (step, index) of steps 0-3."""
    from lit_rl.rollout.datamodule import RolloutDataModule
    from lit_rl.tasks.arithmetic import ArithmeticTask

    model, tok = tiny
    dm = RolloutDataModule(ArithmeticTask(), tok, 2, 2, seed=0, eval_examples=0)
    engine = engine_at(model, tok, versions[0], 0)
    engine.partial = True
    params = SamplingConfig(temperature=1.0, max_new_tokens=4)
    delivered = []
    for step in range(3):
        batch = dm.batch_for(step)
        offered = []
        real = engine.generate_partial

        def spy(prompts, p, seeds, keys, want, min_version=None, ahead=0):
            offered.append((list(keys), ahead))
            return real(prompts, p, seeds, keys, want, min_version, ahead)

        engine.generate_partial = spy
        scored = dm.collect(engine, batch.examples, params, step=step, first_index=batch.offset)
        engine.generate_partial = real
        assert offered == [([(step, 0, 0), (step, 0, 1), (step + 1, 0, 0), (step + 1, 0, 1)], 2)]
        delivered += scored.examples
        assert len(scored.examples) == 2
    assert len(delivered) == 6 and dm._partial_examples.keys() <= {(s, 0, i) for s in range(4) for i in range(2)}


def test_carried_rows_keep_their_cache_across_calls_and_refills_recompute_no_live_position(tiny):
    """With the weights unchanged between calls the carried rows keep their KV: call 2 prefills only the prompts of
    the groups that join (SHORT2 at step 0, OTHER once SHORT2's slots are free), never a carried context again, and
    the carried long group's tokens and log-probs are bit for bit a plain ``generate``'s (``kernels=batch_invariant``).
    By hand: call 1 prefills SHORT and LONG left-padded to 4 (8 positions) and decodes the 4 rows once; call 2 joins
    SHORT2 (2 ids) beside the 2 live rows at step 0 and OTHER (2 ids) at step 1: 8 + 2 + 2 = 12 positions."""
    from lit_rl.kernels import BatchInvariantMode

    model, tok = tiny
    with BatchInvariantMode(model):
        engine = engine_at(model, tok, weights_snapshot(model), 0)
        plain = engine_at(model, tok, weights_snapshot(model), 0).generate([LONG] * G, GREEDY, [2, 3])
        call(engine, ["short", "long"], [SHORT, LONG], want=1)
        state = engine.partial_state
        assert state.totals()["prefill_positions"] == 8 and state.loop.active.numel() == 2
        r2, keys2, carried2 = call(engine, ["short2", "other"], [SHORT2, OTHER], want=2)
        counts = state.totals()
    assert keys2 == ["short2", "long"] and carried2.tolist() == [False, False, True, True]
    assert counts["prefill_positions"] == 8 + len(SHORT2) + len(OTHER) and counts["joined_rows"] == 2 * G
    assert state.decode_rows == [4, 4, 4, 4, 4]
    assert torch.equal(r2.response_ids[2:], plain.response_ids)
    assert torch.equal(r2.rollout_logprobs[2:], plain.rollout_logprobs)
    assert torch.equal(r2.topk_logprobs[2:], plain.topk_logprobs)
    assert r2.token_versions[2:].unique().tolist() == [0]


def test_the_producer_logs_a_batchs_partial_counters(tiny):
    """``rollout/partial_*`` of a batch are the engine's running totals since the batch began: the forced case's call 2
    (same weights) prefills SHORT2 and OTHER beside the carried rows, 2 + 2 positions, joins 2 groups of G rows and
    restarts none; its seconds come as ``time/partial_prefill_s`` / ``time/partial_decode_s``."""
    from lit_rl.rollout.staleness import RolloutProducer

    model, tok = tiny
    rollout = {"mode": "async", "producer": "thread", "weight_update": "in_flight", "kv_on_update": "recompute"}
    module = RLModule(model, tok, sampling={}, eval_sampling={}, group_size=G, micro_batch_size=4, rollout_mode=rollout)
    producer = RolloutProducer(module, 0, 1, "block", 1, in_flight=True)  # not started: its hooks only
    engine = module.engine
    engine.between_steps, engine.stop_token_ids = None, [11]  # nothing to swap; the forced case's stop token
    call(engine, ["short", "long"], [SHORT, LONG], want=1)
    before = [*engine.swap_totals, dict(engine.partial_totals)]
    call(engine, ["short2", "other"], [SHORT2, OTHER], want=2)
    metrics = producer._swap_metrics(before)
    assert metrics["rollout/partial_prefill_positions"] == len(SHORT2) + len(OTHER)
    assert metrics["rollout/partial_joined_rows"] == 2 * G and metrics["rollout/partial_restarts"] == 0
    assert metrics["rollout/partial_decode_rows"] == 4 * 5 - 4  # 5 steps of 4 rows; the 4 joined rows prefilled
    assert metrics["time/partial_prefill_s"] > 0 and metrics["time/partial_decode_s"] > 0


def test_a_carried_group_in_its_last_allowed_batch_is_trained_in_it_not_restarted(tiny, versions):
    """The long tail's starvation: call 1 (version 0, no bounds) carries long with one version-0 token. Call 2
    (version 1) allows version 0 (``min_version`` 0) but its look-ahead's batch, the next, does not
    (``ahead_min_version`` 1): long is committed, so the batch waits for its 5 remaining tokens and takes it (though
    short2 is done first), instead of carrying it into call 3, which would restart it and throw its tokens away
    (as a run whose long answers never fit the bound restarted them at every batch and trained short groups only).
    Call 3 then delivers short2 with no restart."""
    model, tok = tiny
    engine = engine_at(model, tok, versions[0], 0)
    call(engine, ["short", "long"], [SHORT, LONG], want=1)
    engine.sync_weights(1, versions[1])
    rows, seeds = groups(SHORT2)
    r2, keys2, carried2 = engine.generate_partial(rows, GREEDY, seeds, ["short2"], 1, 0, 0, 1)
    state = engine.partial_state
    assert keys2 == ["long"] and carried2.tolist() == [True, True]
    assert r2.response_mask.sum(-1).tolist() == [6, 6] and r2.token_versions[:, 0].tolist() == [0, 0]
    assert r2.token_versions[:, 1:].unique().tolist() == [1]
    r3, keys3, _ = call(engine, ["other"], [OTHER], want=1, min_version=1)
    assert keys3 == ["short2"] and state.totals()["restarts"] == 0 and state.totals()["discarded_tokens"] == 0


def test_a_group_started_in_its_last_allowed_batch_is_waited_for_and_one_past_the_batch_is_not_started(tiny, versions):
    """Version 0 held, the next batch allows version 1 at the oldest: long, admitted first, is due in this batch and
    committed, so the batch (want 1) waits its 6 tokens though short would be done at step 0; short, due as well but
    past the batch's one group, is not started (started, it could only be restarted at the next call): the decode
    batch runs long's 2 rows alone. The next call (version 1) starts short with version 1 and delivers it; nothing is
    restarted."""
    model, tok = tiny
    engine = engine_at(model, tok, versions[0], 0)
    rows, seeds = groups(LONG, SHORT)
    r1, keys1, _ = engine.generate_partial(rows, GREEDY, seeds, ["long", "short"], 1, 0, 0, 1)
    state = engine.partial_state
    assert keys1 == ["long"] and r1.response_mask.sum(-1).tolist() == [6, 6]
    assert state.decode_rows == [2] * 6 and [g.key for g in state.queue] == ["short"]
    engine.sync_weights(1, versions[1])
    r2, keys2, carried2 = call(engine, ["other"], [OTHER], want=1, min_version=1)
    assert keys2 == ["short"] and carried2.tolist() == [False, False]
    assert r2.token_versions[r2.response_mask].unique().tolist() == [1]
    assert state.totals()["restarts"] == 0 and state.totals()["discarded_tokens"] == 0
