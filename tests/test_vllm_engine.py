"""The colocated vLLM engine, run for real (the vllm-cpu build here): log-probs, top-k, finish reasons,
weight sync after a training step, and a short GRPO run with ``engine=vllm``.

Without vLLM installed these tests skip, unless ``LIT_RL_VLLM=1`` (set by ``.ci/run``), which makes a
missing vLLM a failure rather than a silent skip.
"""

import copy
import importlib.util
import os

import pytest
import torch
from helpers import ROOT, chat_prompts, compose_config

from lit_rl.logprobs import response_logprobs
from lit_rl.rollout.types import SamplingConfig, left_pad
from lit_rl.run import hardware
from lit_rl.tools.compare import read_scalars

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LIT_RL_VLLM") == "1":
        pytest.fail("LIT_RL_VLLM=1 but vLLM is not installed (scripts/install_vllm_cpu.sh)", pytrace=False)
    pytest.skip("vLLM is not installed (LIT_RL_VLLM=1 bash scripts/setup.sh)", allow_module_level=True)

from lit_rl.rollout.vllm_engine import VLLMEngine  # noqa: E402

QUESTIONS = ["What is 1 + 2?", "What is 7 + 5? Think step by step.", "Hi", "Add 3 and 9, then explain."]
TOL = 1e-4  # float32 engine vs float32 trainer, nats


def start(model, tok, **kw):
    kw = {"dtype": "float32", "kv_cache_gb": 0.25, "max_model_len": 1024, "max_logprobs": 8, **kw}
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    engine = VLLMEngine(model, tok.pad_token_id, stops, **kw)
    engine.sync_weights(0)
    return engine


def trainer_scores(model, tok, r, params):
    """The trainer's log-probs of the engine's tokens, and of its top-k ids, for the sampled distribution."""
    pi, pm = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        s = response_logprobs(
            model,
            pi,
            pm,
            r.response_ids,
            r.response_mask,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            head_ids=r.topk_ids,
            with_entropy=False,
        )
    return s


def gap(model, tok, r, params) -> float:
    s = trainer_scores(model, tok, r, params)
    return (s.logprobs - r.rollout_logprobs).abs()[r.response_mask].max().item()


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    model, tok = tiny
    engine = start(model, tok)
    yield engine
    engine.close()


@pytest.mark.parametrize(
    "params",
    [
        SamplingConfig(1.0, 0, 1.0, 24, 5),
        SamplingConfig(0.7, 0, 1.0, 24, 5),
        SamplingConfig(1.0, 5, 1.0, 24, 5),
        SamplingConfig(1.0, 0, 0.9, 24, 5),
    ],
    ids=["t1", "t0.7", "topk5", "topp0.9"],
)
def test_tiny_float32_logprobs_and_topk_equal_the_trainer(tiny, tiny_engine, params):
    model, tok = tiny
    prompts = chat_prompts(tok, QUESTIONS) * 2  # different prompt lengths
    r = tiny_engine.generate(prompts, params, seeds=list(range(len(prompts))))
    assert r.response_mask.sum() > 0 and r.topk_ids.shape[-1] == 5
    s = trainer_scores(model, tok, r, params)
    m = r.response_mask
    assert (s.logprobs - r.rollout_logprobs).abs()[m].max().item() < TOL
    # the recorded head: the sampled distribution's 5 most likely tokens, with their log-probs, best first
    assert (s.head_logprobs - r.topk_logprobs).abs()[m].max().item() < TOL
    assert (r.topk_logprobs[m][:, :-1] >= r.topk_logprobs[m][:, 1:]).all()
    assert (r.rollout_logprobs[~m] == 0).all()
    assert r.policy_version.tolist() == [0] * len(prompts)


def test_temperature_offset_dial_samples_and_reports_at_t_plus_delta(tiny, tiny_engine):
    """engine.temperature_offset with vLLM: the processed log-probs and top-k are those of T + delta, so the
    trainer matches them at T + delta, not at T (the gap the dial is for)."""
    model, tok = tiny
    params = SamplingConfig(0.8, 0, 1.0, 16, 5)
    tiny_engine.temperature_offset = 0.4
    try:
        r = tiny_engine.generate(chat_prompts(tok, QUESTIONS), params, seeds=[1, 2, 3, 4])
    finally:
        tiny_engine.temperature_offset = 0.0
    m = r.response_mask
    at_sampler = trainer_scores(model, tok, r, SamplingConfig(1.2, 0, 1.0, 16, 5))
    assert (at_sampler.logprobs - r.rollout_logprobs).abs()[m].max().item() < TOL
    assert (at_sampler.head_logprobs - r.topk_logprobs).abs()[m].max().item() < TOL
    assert (trainer_scores(model, tok, r, params).logprobs - r.rollout_logprobs).abs()[m].mean().item() > 1e-3


def test_per_request_seeds(tiny, tiny_engine):
    model, tok = tiny
    prompts = chat_prompts(tok, QUESTIONS)
    params = SamplingConfig(max_new_tokens=12)
    a = tiny_engine.generate(prompts, params, seeds=[11, 12, 13, 14])
    b = tiny_engine.generate(prompts, params, seeds=[11, 12, 13, 14])
    assert torch.equal(a.response_ids, b.response_ids)
    alone = tiny_engine.generate(prompts[1:2], params, seeds=[12])  # same prompt and seed, batch of one
    assert torch.equal(alone.response_ids[0], a.response_ids[1])
    c = tiny_engine.generate(prompts, params, seeds=[21, 22, 23, 24])
    assert not torch.equal(a.response_ids, c.response_ids)


def test_a_rollout_above_the_cpu_step_budget_keeps_per_request_seeds(tiny, tiny_engine):
    """48 prompts of 100 tokens (4800 prompt tokens, more than the 4096 tokens the CPU build schedules per step).
    With vLLM's chunked prefill a prompt was split over two steps and the rewind of its seeded generator
    stopped step 1 with ``RuntimeError: CPU Generator does not use offset``; with whole-prompt prefill the
    rollout completes, a prompt's completion is the one it gets alone with its seed, and the log-probs are
    the trainer's."""
    model, tok = tiny
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, len(tok) - 10, (100,), generator=g).tolist() for _ in range(48)]
    assert sum(map(len, prompts)) > 4096
    params = SamplingConfig(max_new_tokens=6)
    r = tiny_engine.generate(prompts, params, seeds=list(range(48)))
    assert r.response_mask.sum(-1).min() >= 1
    for i in (0, 47):  # the first and the last prompt of the batch, alone with the same seed
        alone = tiny_engine.generate(prompts[i : i + 1], params, seeds=[i])
        w = alone.response_ids.shape[1]
        assert torch.equal(alone.response_ids[0], r.response_ids[i, :w])
    assert gap(model, tok, r, params) < TOL


def perturbed(model, scale=0.05, seed=0):
    """A copy of ``model`` with every tensor moved by ``scale`` x N(0, 1): the "newer version" of a swap."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return new


def vllm_prompt_scores(engine, r) -> torch.Tensor:
    """float32 [N, T]: each response token's log-prob under the weights ``engine`` holds now, from a fresh prefill
    of prompt + response (vLLM's ``prompt_logprobs``; prefix caching is off, so nothing of an earlier request's
    KV is reused). At temperature 1 without truncation these are the sampling distribution's log-probs."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    n = r.response_mask.sum(-1).tolist()
    contexts = [list(p) + r.response_ids[i, : n[i]].tolist() for i, p in enumerate(r.prompt_ids)]
    outputs = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=c) for c in contexts],
        VSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
        use_tqdm=False,
    )
    out = torch.zeros_like(r.rollout_logprobs)
    for i, (o, c) in enumerate(zip(outputs, contexts)):
        start = len(r.prompt_ids[i])
        for j in range(start, len(c)):
            out[i, j - start] = o.prompt_logprobs[j][c[j]].logprob
    return out


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_an_in_flight_swap_at_step_k_versions_tokens_from_k_on(tiny, tiny_engine, kv):
    """rollout.weight_update=in_flight with vLLM: a swap to version 1 before decode step k (``between_steps``) gives
    tokens 0..k-1 version 0 (vLLM's weight labels) and tokens >= k version 1; the first k are the tokens and log-probs
    of a run without the swap. ``recompute``: tokens >= k have the log-probs a fresh prefill with the new weights
    gives (vLLM's own prompt log-probs, and the trainer's), within the parity tests' TOL; ``keep``: they do not (the
    older weights' KV stays), while their first token still differs from the no-swap run's distribution."""
    model, tok = tiny
    new, k = perturbed(model), 6
    prompts, params, seeds = chat_prompts(tok, QUESTIONS), SamplingConfig(1.0, 0, 1.0, 14, 3), [5, 6, 7, 8]
    before = tiny_engine.generate(prompts, params, seeds)  # LLM.generate, no hook: version 0 throughout
    asked = []

    def swap_at_k(step):
        asked.append(step)
        if step != k:
            return False
        tiny_engine.sync_weights(1, new.state_dict())
        return True

    tiny_engine.between_steps, tiny_engine.kv_on_update = swap_at_k, kv
    try:
        r = tiny_engine.generate(prompts, params, seeds)
        fresh = vllm_prompt_scores(tiny_engine, r)  # the engine holds version 1 now
    finally:
        tiny_engine.between_steps, tiny_engine.kv_on_update = None, "keep"
        tiny_engine.sync_weights(0, model.state_dict())  # the module's engine back to the tiny weights
    m, n = r.response_mask, r.response_mask.sum(-1)
    assert asked[:k] == list(range(1, k + 1)) and tiny_engine.last.swaps == 1
    assert n.min() > k  # the random tiny model rarely stops: every row spans the swap
    expected = torch.zeros_like(r.token_versions)
    for i, t in enumerate(n.tolist()):
        expected[i, k:t] = 1
    assert torch.equal(r.token_versions, expected)
    assert r.policy_version.tolist() == [0, 0, 0, 0]  # a row's oldest token's version
    assert torch.equal(r.response_ids[:, :k], before.response_ids[:, :k])
    assert (r.rollout_logprobs[:, :k] - before.rollout_logprobs[:, :k]).abs().max().item() < TOL
    assert (trainer_scores(model, tok, r, params).logprobs - r.rollout_logprobs)[:, :k].abs().max().item() < TOL
    late = m.clone()
    late[:, :k] = False
    to_new = (trainer_scores(new, tok, r, params).logprobs - r.rollout_logprobs).abs()[late]
    to_fresh = (fresh - r.rollout_logprobs).abs()[late]
    if kv == "recompute":
        assert to_new.max().item() < TOL and to_fresh.max().item() < TOL
    else:  # the KV of positions < k is the old weights': off from a fresh prefill by more than kernel noise
        assert to_new.max().item() > 100 * TOL and to_fresh.max().item() > 100 * TOL


def test_a_stop_between_engine_steps_aborts_the_requests(tiny, tiny_engine):
    """The producer's stop (``cancel``) is looked at between vLLM's engine steps while the in-flight hook is set:
    ``GenerationCancelled``, the requests aborted in vLLM, and the engine's next rollout is the one it gives
    without the interruption."""
    import threading

    from lit_rl.rollout.torch_engine import GenerationCancelled

    _, tok = tiny
    prompts, params = chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=12)
    stop, stops = threading.Event(), []

    def stop_at_3(step):
        if step == 3 and not stops:  # the first call only
            stops.append(step)
            stop.set()
        return False

    tiny_engine.between_steps, tiny_engine.cancel = stop_at_3, stop
    try:
        with pytest.raises(GenerationCancelled):
            tiny_engine.generate(prompts, params, seeds=[0, 1])
        assert not tiny_engine.llm.llm_engine.has_unfinished_requests()
        stop.clear()
        r = tiny_engine.generate(prompts, params, seeds=[0, 1])
    finally:
        tiny_engine.between_steps, tiny_engine.cancel = None, None
    assert torch.equal(r.response_ids, tiny_engine.generate(prompts, params, seeds=[0, 1]).response_ids)
    assert tiny_engine.last.swaps == 0


def test_partial_rollouts_are_refused_for_a_vllm_engine_at_start_up(tiny):
    """engine=auto may become vllm after the config check: the source then refuses rollout.partial by name, where
    it would otherwise be dropped silently (the carried rows live in the embedded engine's decode loop)."""
    from lit_rl.rollout.sources import StaleSource

    model, tok = tiny
    engine = VLLMEngine(model, tok.pad_token_id, [0])  # not started: vLLM starts at the first sync
    rollout = {"mode": "async", "weight_update": "in_flight", "partial": True}
    with pytest.raises(ValueError, match="rollout.partial=true runs in the embedded engine only, not VLLMEngine"):
        StaleSource(engine, rollout)
    assert engine.llm is None


def test_stop_tokens_end_sequences(tiny):
    model, tok = tiny
    # every token stops: one token per sequence, reason "stop"; a cap of 3 tokens and no stop: "length"
    engine = VLLMEngine(
        model, tok.pad_token_id, list(range(len(tok))), dtype="float32", kv_cache_gb=0.25, max_model_len=512
    )
    try:
        engine.sync_weights(0)
        r = engine.generate(chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=8), seeds=[0, 1])
        assert r.finish_reason == ["stop", "stop"] and r.response_length.tolist() == [1, 1]
    finally:
        engine.close()
    with pytest.raises(
        ValueError,
        match=r"engine.max_model_len=20 is too small: a prompt of \d+ tokens plus "
        r"max_new_tokens=8 needs",
    ):  # checked before vLLM starts
        VLLMEngine(model, tok.pad_token_id, [0], max_model_len=20).generate(
            chat_prompts(tok, QUESTIONS[:1]), SamplingConfig(max_new_tokens=8), [0]
        )
    with pytest.raises(ValueError, match="max_new_tokens must be > 0"):
        VLLMEngine(model, tok.pad_token_id, [0]).generate([[1]], SamplingConfig(max_new_tokens=0), [0])


def test_only_the_listed_stop_tokens_end_a_sequence_as_in_the_embedded_engine(tiny):
    """vLLM adds the model's EOS to the stops unless told ``ignore_eos``; the embedded engine stops at
    ``stop_token_ids`` only. With EOS made likely (its output row scaled) and not listed, both decode to the cap
    (the fixed-length rollouts of benchmarks/rollout_throughput.py); listed, both stop early."""
    from lit_rl.rollout.torch_engine import TorchEngine

    model, tok = tiny
    model = copy.deepcopy(model)
    with torch.no_grad():  # tied: the EOS row is the pad's zero embedding; give it a scaled copy of another row
        model.lm_head.weight[tok.eos_token_id] = 30 * model.lm_head.weight[100]
    prompts = [[5 + i, 17 * i + 3, 100 + i] for i in range(8)]
    params, seeds = SamplingConfig(max_new_tokens=40), list(range(8))
    for stops in ([], [tok.eos_token_id]):
        embedded = TorchEngine(model, tok.pad_token_id, stops).generate(prompts, params, seeds)
        engine = VLLMEngine(model, tok.pad_token_id, stops, dtype="float32", kv_cache_gb=0.25, max_model_len=512)
        try:
            engine.sync_weights(0)
            r = engine.generate(prompts, params, seeds)
        finally:
            engine.close()
        for out in (embedded, r):
            lengths = out.response_length.tolist()
            if stops:
                assert min(lengths) < 40 and "stop" in out.finish_reason
            else:
                assert lengths == [40] * 8 and out.finish_reason == ["length"] * 8


def train_one_step(model, tok, r, lr=1e-2):
    """One AdamW step that raises the log-prob of the engine's tokens (a stand-in RL update)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    pi, pm = left_pad(r.prompt_ids, tok.pad_token_id)
    s = response_logprobs(model, pi, pm, r.response_ids, r.response_mask, with_entropy=False)
    loss = -(s.logprobs * r.response_mask).sum() / r.response_mask.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def check_sync_follows_training(model, tok, engine, prompts, tol=TOL):
    params = SamplingConfig(max_new_tokens=16)
    old = copy.deepcopy(model)
    before = engine.generate(prompts, params, seeds=list(range(len(prompts))))
    assert gap(model, tok, before, params) < tol
    train_one_step(model, tok, before)
    engine.sync_weights(1)
    after = engine.generate(prompts, params, seeds=list(range(len(prompts))))
    assert after.policy_version.tolist() == [1] * len(prompts)
    assert gap(model, tok, after, params) < tol  # the engine samples from the updated weights ...
    assert gap(old, tok, after, params) > 100 * tol  # ... not from the old ones


def test_sync_after_a_training_step(tiny):
    model, tok = tiny
    model = copy.deepcopy(model)  # the session fixture stays untouched
    engine = start(model, tok)
    try:
        check_sync_follows_training(model, tok, engine, chat_prompts(tok, QUESTIONS))
    finally:
        engine.close()


def test_untied_output_layer_is_synced_too(tiny):
    """An untied lm_head is a tensor of its own: a sync that left it out would keep a stale output layer."""
    from transformers import LlamaForCausalLM

    from lit_rl.models import tiny_config

    _, tok = tiny
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(len(tok), {"tie_word_embeddings": False})).eval()
    engine = start(model, tok)
    try:
        prompts, params = chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=12)
        with torch.no_grad():
            model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
        everything = engine.weights
        engine.weights = lambda source=None: [(n, v) for n, v in everything(source) if n != "lm_head.weight"]
        engine.sync_weights(1)
        r = engine.generate(prompts, params, seeds=[0, 1])
        assert gap(model, tok, r, params) > 0.1  # the omission shows, as the issue measured
        engine.weights = everything
        engine.sync_weights(2)
        r = engine.generate(prompts, params, seeds=[0, 1])
        assert gap(model, tok, r, params) < TOL
    finally:
        engine.close()


def test_sync_from_a_snapshot_that_names_tied_tensors_once(tiny):
    """Stale rollouts load older versions from snapshots that store each storage once (the tied output
    layer under the embedding's name only); the engine must still receive lm_head.weight."""
    from lit_rl.rollout.staleness import weights_snapshot

    model, tok = tiny
    model = copy.deepcopy(model)
    engine = start(model, tok)
    try:
        prompts, params = chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=12)
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(torch.randn_like(model.model.embed_tokens.weight))
        snapshot = weights_snapshot(model)
        assert "lm_head.weight" not in snapshot  # the case: tied, named once
        engine.sync_weights(1, snapshot)
        r = engine.generate(prompts, params, seeds=[0, 1])
        assert gap(model, tok, r, params) < TOL
    finally:
        engine.close()


@pytest.mark.slow  # 22 s: a second vLLM process; the in-process sync tests stay in the default suite
def test_worker_process_sync_through_a_file(tiny):
    """in_process=false (the tensor-parallel layout): weights reach the worker through a safetensors file."""
    model, tok = tiny
    model = copy.deepcopy(model)
    engine = start(model, tok, in_process=False)
    try:
        check_sync_follows_training(model, tok, engine, chat_prompts(tok, QUESTIONS[:2]))
    finally:
        engine.close()


def test_smollm2_float32_logprobs_topk_stops_and_sync(smollm2):
    model, tok = smollm2
    model = copy.deepcopy(model)
    engine = start(model, tok, max_logprobs=20)
    try:
        prompts = chat_prompts(
            tok, ["What is 2 + 3? Answer with a number.", "Say hi.", "What is 12 + 30?", "Name a colour."]
        )
        params = SamplingConfig(temperature=1.0, max_new_tokens=32, logprobs_top_k=20)
        r = engine.generate(prompts, params, seeds=[0, 1, 2, 3])
        s = trainer_scores(model, tok, r, params)
        m = r.response_mask
        assert (s.logprobs - r.rollout_logprobs).abs()[m].max().item() < TOL
        assert (s.head_logprobs - r.topk_logprobs).abs()[m].max().item() < TOL
        assert "stop" in r.finish_reason  # an instruct model ends its turn
        for i, reason in enumerate(r.finish_reason):
            last = r.response_ids[i, r.response_length[i] - 1].item()
            assert (last in engine.stop_token_ids) == (reason == "stop")
        check_sync_follows_training(model, tok, engine, prompts[:2])
    finally:
        engine.close()


def test_grpo_run_with_vllm_logs_the_gap_and_tis(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "recipes", "train.py"),
        "model=tiny",
        "engine=vllm",
        "correction=tis",
        "trainer.max_steps=3",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "sampling.max_new_tokens=16",
        "eval.num_examples=4",
        "eval.every_n_steps=2",
        "trainer.precision=bf16-mixed",
        f"hydra.run.dir={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scalars = read_scalars(out)
    for tag in (
        "train/logprob_abs_diff",
        "train/tis",
        "train/tis_abs",
        "train/tis_clipfrac",
        "train/r_num_abs",
        "rollout/reward_mean",
        "perf/rollout_tokens_per_s",
        "time/weight_sync_s",
        "eval/accuracy",
    ):
        assert tag in scalars, tag
    steps = [v for _, v in scalars["train/logprob_abs_diff"]]
    assert len(steps) == 3
    # bf16 engine vs bf16-autocast trainer: a small, nonzero gap, which the run measures
    assert all(0 < v < 0.05 for v in steps), steps
    assert (out / "finished.json").is_file()


def test_engine_for_a_model_with_small_heads(tmp_path):
    """vLLM's CPU attention needs head_dim >= 32: engine=auto falls back to the embedded engine, engine=vllm
    says why, before anything runs."""
    from transformers import LlamaForCausalLM

    from lit_rl.config import ConfigError
    from lit_rl.models import tiny_config
    from lit_rl.run.resolve import resolve_engine

    if torch.cuda.is_available():
        pytest.skip("the limit is the CPU build's")
    folder = tmp_path / "hd16"
    LlamaForCausalLM(
        tiny_config(100, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    ).config.save_pretrained(folder)
    for engine in ("auto", "vllm"):
        cfg = compose_config(f"model.name_or_path={folder}", f"engine={engine}")
        if engine == "auto":
            resolve_engine(cfg)
            assert cfg.engine.name == "torch"
        else:
            with pytest.raises(
                ConfigError,
                match="engine=vllm: vLLM's CPU attention needs head_dim >= 32 and "
                "model.name_or_path=.* has 16; use engine=torch",
            ):
                resolve_engine(cfg)


def test_engine_for_a_qwen2_whose_config_head_dim_vllm_ignores(tmp_path, capsys):
    """vLLM's Qwen2 builds head_dim = hidden_size // num_attention_heads whatever the config's head_dim says
    (transformers builds the config's): the check computes what vLLM builds, so a Qwen2 config with head_dim 32
    over hidden 64 / 4 heads (vLLM: 16, ``Unsupported CPU attention configuration: head_dim=16`` in step 1) and
    one with head_dim 32 over hidden 128 / 2 heads (vLLM: 64, its weights do not fit) are refused by name, and
    engine=auto picks the embedded engine; from config folders alone, no weights."""
    from helpers.families import family_config
    from transformers import LlamaConfig

    from lit_rl.config import ConfigError
    from lit_rl.models import load_model_config
    from lit_rl.run.model_checks import vllm_head_dim
    from lit_rl.run.resolve import resolve_engine

    # what the check computes for ordinary models: the config's head_dim where vLLM takes it (Llama, tiny)
    assert vllm_head_dim(load_model_config("tiny")) == 32
    assert vllm_head_dim(family_config("qwen2", 100)) == 32  # hidden 64 / 2 heads, head_dim 32: they agree
    assert vllm_head_dim(family_config("qwen3", 100, num_attention_heads=4, num_key_value_heads=2)) == 32
    assert vllm_head_dim(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)) == 32
    shapes = {"hd16": (64, 4, 16), "hd64": (128, 2, 64)}  # hidden, heads, what vLLM builds; the config says 32
    for name, (hidden, heads, built) in shapes.items():
        config = family_config("qwen2", 100, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=1)
        assert config.head_dim == 32 and vllm_head_dim(config) == built
        config.save_pretrained(tmp_path / name)
        cfg = compose_config(f"model.name_or_path={tmp_path / name}", "engine=auto")
        resolve_engine(cfg)
        assert cfg.engine.name == "torch"
        assert "engine=auto -> torch (vLLM's Qwen2ForCausalLM builds head_dim" in capsys.readouterr().out
        cfg = compose_config(f"model.name_or_path={tmp_path / name}", "engine=vllm")
        with pytest.raises(
            ConfigError,
            match=rf"engine=vllm: vLLM's Qwen2ForCausalLM builds head_dim = hidden_size // num_attention_heads = "
            rf"{hidden} // {heads} = {built} and ignores the head_dim 32 of model.name_or_path='.*{name}''s config "
            rf".*vLLM serves Qwen2ForCausalLM only with head_dim unset or equal to {built}; use engine=torch",
        ):
            resolve_engine(cfg)


def test_engine_auto_picks_vllm_where_it_is_installed():
    from lit_rl.run.resolve import resolve_engine

    cfg = compose_config("model=tiny", "engine=auto")
    resolve_engine(cfg)
    assert cfg.engine.name == "vllm"
    # the default precision is auto: bf16-mixed, so a bfloat16 engine, where the CPU multiplies bf16 natively
    bf16 = hardware.resolve_precision("auto", cfg.trainer.accelerator)[0] == "bf16-mixed"
    assert cfg.engine.dtype == ("bfloat16" if bf16 else "float32")
    assert cfg.engine.kv_cache_gb == (None if torch.cuda.is_available() else 1.0)


def test_engine_auto_picks_the_embedded_engine_for_the_sampled_tail(capsys):
    # a bug report: engine=auto chose vLLM for correction.sc.tail=sampled, which only the embedded engine records,
    # and the run failed at its first rollout instead of at start-up
    from lit_rl.run.resolve import resolve_engine

    cfg = compose_config("model=tiny", "engine=auto", "correction=sc", "correction.sc.tail=sampled")
    resolve_engine(cfg)
    assert cfg.engine.name == "torch"
    assert "engine=auto -> torch (correction.sc.tail=sampled draws tail tokens" in capsys.readouterr().out
    cfg = compose_config("model=tiny", "engine=auto", "correction=sc")  # the rescaled tail: vLLM serves it
    resolve_engine(cfg)
    assert cfg.engine.name == "vllm"


@pytest.mark.slow  # 19 s: the lagged split is covered with the embedded engine in test_staleness
def test_lagged_rollouts_with_vllm_keep_the_engine_gap_apart_from_staleness(tmp_path):
    """rollout.mode=lagged loads older versions into vLLM: staleness 0, 1, 2, 2; the version gap shows in
    r_stale while r_num, the same-weights engine gap, stays at the bf16 kernel level at every step."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "recipes", "train.py"),
        "model=tiny",
        "engine=vllm",
        "correction=tis",
        "rollout.mode=lagged",
        "rollout.lag=2",
        "algo=reinforce",
        "algo.baseline=none",
        "task.constant_reward=1",
        "optim.lr=1e-3",
        "trainer.max_steps=4",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "sampling.max_new_tokens=12",
        "eval.num_examples=0",
        "threads=1",
        f"hydra.run.dir={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = {k: [v for _, v in vals] for k, vals in read_scalars(out).items()}
    assert s["rollout/staleness_max"] == [0.0, 1.0, 2.0, 2.0]
    assert all(v < 0.01 for v in s["train/r_num_abs"]), s["train/r_num_abs"]
    assert s["train/r_stale_abs"][0] == 0.0 and all(v > 0.01 for v in s["train/r_stale_abs"][1:]), s[
        "train/r_stale_abs"
    ]


@pytest.mark.slow  # 50 s a run: a vLLM engine in a training run of its own
@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_async_in_flight_run_with_vllm_swaps_mid_sequence(tmp_path, kv):
    """rollout.mode=async rollout.weight_update=in_flight with engine=vllm through the recipe. A barrier in the
    producer's hook (``helpers/in_flight_barrier.py``) makes every batch after the first wait before decode step 4
    for the version the trainer publishes next, so batch s (s >= 1) starts with version s - 1 and takes version s
    there: one swap, 4 of its 12 tokens one step old (staleness_mean 4/12), 2 versions in a sequence. The
    decomposition keeps the two gaps apart: r_stale carries the version gap with either cache policy, r_num (same
    weights, two engines) stays at float32 noise with ``recompute`` and carries the kept cache's gap with ``keep``."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "tests", "helpers", "in_flight_barrier.py"),
        "4",
        str(out),
        "model=tiny",
        "trainer.precision=32-true",
        "engine=vllm",
        "rollout.mode=async",
        "rollout.on_stale=block",
        "rollout.max_staleness=1",
        "rollout.weight_update=in_flight",
        f"rollout.kv_on_update={kv}",
        "correction=tis",
        "algo=reinforce",
        "algo.baseline=none",
        "task.constant_reward=1",
        "optim.lr=1e-3",
        "trainer.max_steps=4",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "sampling.max_new_tokens=12",
        "eval.num_examples=0",
        "threads=1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = {k: [v for _, v in vals] for k, vals in read_scalars(out).items()}
    assert s["rollout/weight_swaps"] == [0.0, 1.0, 1.0, 1.0]
    assert s["rollout/version_span_max"] == [1.0, 2.0, 2.0, 2.0]
    assert s["rollout/staleness_max"] == [0.0, 1.0, 1.0, 1.0]
    assert s["rollout/response_length_mean"] == [12.0] * 4  # the random tiny model does not stop: 12 tokens a row
    assert s["rollout/staleness_mean"] == pytest.approx([0.0, 4 / 12, 4 / 12, 4 / 12], abs=1e-6)
    assert s["train/r_stale_abs"][0] == 0.0 and all(v > 0.005 for v in s["train/r_stale_abs"][1:])
    if kv == "recompute":
        assert all(v < 1e-4 for v in s["train/r_num_abs"]), s["train/r_num_abs"]
    else:
        assert s["train/r_num_abs"][0] < 1e-4 and all(v > 0.005 for v in s["train/r_num_abs"][1:])
    assert (out / "finished.json").is_file()


@pytest.mark.slow
def test_a_lora_policy_syncs_its_merged_weights(tmp_path):
    """model.lora: vLLM holds the base model's layers; each sync pushes W0 + (alpha / r) B A. After an update of
    the adapter the engine's log-probs equal the trainer's (the adapted model's) within 1e-4, not the old ones;
    then a 3-step GRPO run with engine=vllm and a moving adapter keeps the gap under 1e-4 at every step."""
    import subprocess
    import sys

    from lit_rl.models import ModelConfig, load_policy

    model, tok = load_policy(ModelConfig("tiny", lora={"r": 8, "alpha": 16}))
    engine = start(model, tok)
    try:
        check_sync_follows_training(model, tok, engine, chat_prompts(tok, QUESTIONS))
    finally:
        engine.close()
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "recipes", "train.py"),
        "model=tiny",
        "model.lora.r=8",
        "model.lora.alpha=16",
        "engine=vllm",
        "trainer.precision=32-true",
        "algo=reinforce",
        "algo.baseline=none",
        "task.constant_reward=1",
        "optim.lr=1e-2",
        "trainer.max_steps=3",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "sampling.max_new_tokens=16",
        "eval.num_examples=0",
        f"hydra.run.dir={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_scalars(out)
    gaps = [v for _, v in s["train/logprob_abs_diff"]]
    assert len(gaps) == 3 and all(v < TOL for v in gaps), gaps
    assert len({v for _, v in s["train/grad_norm"]}) == 3  # the adapter moved between steps
