"""Bad input fails at start-up with a message naming the field, the value and what is allowed."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, compose_config
from helpers.config import FAST
from omegaconf import OmegaConf

from lit_rl.config import ConfigError, validate
from lit_rl.run.train import run


def cfg_for(*overrides):
    return compose_config("model=tiny", *overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.clip.eps_low=0"], r"algo.clip.eps_low=0 is not allowed: must be > 0"),
        (["algo.clip.eps_low=1.0"], r"algo.clip.eps_low=1.0 is not allowed: must be < 1"),
        (["algo.clip.eps_high=-0.1"], r"algo.clip.eps_high=-0.1 is not allowed: must be > 0"),
        (["advantage.alpha=1.5"], r"advantage.alpha=1.5 is not allowed: must lie in \[0, 1\]"),
        (["advantage.alpha=-0.1"], r"advantage.alpha=-0.1 is not allowed"),
        (["rollout.group_size=1"], r"rollout.group_size=1 is not allowed: must be >= 2 for grpo"),
        (["algo=dapo", "rollout.group_size=1"], r"rollout.group_size=1 is not allowed: must be >= 2 for dapo"),
        (["sampling.max_new_tokens=0"], r"sampling.max_new_tokens=0 is not allowed: must be > 0"),
        (["sampling.temperature=0"], r"sampling.temperature=0 is not allowed: must be > 0"),
        (["trainer.devices=3"], r"rollout.prompts_per_step=8 is not allowed: must be divisible by trainer.devices=3"),
        (["loss.reduction=mean"], r"loss.reduction='mean' is not allowed: choose one of \['token_mean'"),
        (["task=gsm8k", "task.path=/no/such/dir"], r"task.path='/no/such/dir' is not allowed: must be a folder"),
        (["model.name_or_path=/no/such/model"], r"model.name_or_path='/no/such/model' is not allowed: no such folder"),
        (["correction.mis.low=2", "correction.mis.high=1"], r"correction.mis.low/high=\(2, 1\) is not allowed"),
        (["algo=dapo", "algo.overlong.buffer_length=100"], r"algo.overlong.buffer_length=100 is not allowed"),
        (["optim.grad_clip=-1"], r"optim.grad_clip=-1 is not allowed: must be >= 0 \(0 or null = no clipping\)"),
        (["model.dtype=bfloat16"], r"model.dtype='bfloat16' is not allowed: training keeps float32 weights"),
        (["checkpoint.every_n_steps=-1"], r"checkpoint.every_n_steps=-1 is not allowed: must be an integer >= 1"),
        (
            ["checkpoint.export_at_steps=[0,31]"],
            r"checkpoint.export_at_steps=\[0, 31\] is not allowed: steps <= trainer.max_steps=30",
        ),
        (
            ["checkpoint.export_at_steps=[0,-2]"],
            r"checkpoint.export_at_steps=\[0, -2\] is not allowed: a list of RL steps",
        ),
        (["eval.batch_size=0"], r"eval.batch_size=0 is not allowed: must be an integer >= 1"),
        (["eval.every_n_steps=0"], r"eval.every_n_steps=0 is not allowed: must be an integer >= 1"),
        (["eval.num_examples=-1"], r"eval.num_examples=-1 is not allowed: must be an integer >= 0"),
        (["logprob_chunk_tokens=0"], r"logprob_chunk_tokens=0 is not allowed: must be an integer >= 1"),
        (["optim.max_nonfinite_updates=abc"], r"optim.max_nonfinite_updates='abc' is not allowed: must be an integer"),
        (
            ["algo=reinforce", "algo.baseline=none", "rollout.group_size=0"],
            r"rollout.group_size=0 is not allowed: must be an integer >= 1",
        ),
        (["task.constant_reward=abc"], r"task.constant_reward='abc' is not allowed: must be null or a number"),
        (["reward_timeout_s=0"], r"reward_timeout_s=0 is not allowed: must be a number of seconds > 0"),
        (
            ["eval.n=4", "eval.k=5", "eval.temperature=1"],
            r"eval.k=5 is not allowed: must be an integer in \[1, eval.n=4\]",
        ),
        (["eval.n=4", "eval.k=2"], r"eval.temperature=0.0 is not allowed: must be > 0 with eval.n=4"),
        (["log.plain_lines=sometimes"], r"log.plain_lines='sometimes' is not allowed: auto, true or false"),
        (["reward.weights=[1.0]"], r"reward.weights=\[1.0\] is not allowed: needs reward.functions"),
        (["algo=ppo", "algo.gae.lam=2"], r"algo.gae.lam=2 is not allowed: must lie in \[0, 1\]"),
        (["algo=reinforce", "algo.num_minibatches=2"], r"must be 1 x 1 for reinforce: it has no importance ratio"),
        # REINFORCE's default baseline is rloo: the message names the field that allows groups of one
        (
            ["algo=reinforce", "rollout.group_size=1"],
            r"rollout.group_size=1 is not allowed: must be >= 2 for reinforce with algo.baseline=rloo "
            r".*for groups of one "
            r"choose algo.baseline=none or algo.baseline=batch_mean",
        ),
        (["engine.logit_noise=-0.5"], r"engine.logit_noise=-0.5 is not allowed: must be finite and >= 0"),
        # a fresh user's case: inf passed a ">= 0" check and the run finished with NaN metrics
        (["engine.logit_noise=inf"], r"engine.logit_noise=inf is not allowed: must be finite and >= 0"),
        (["engine.temperature_offset=nan"], r"engine.temperature_offset=nan is not allowed: must be a finite number"),
        (
            ["engine.temperature_offset=-1.0"],
            r"engine.temperature_offset=-1.0 is not allowed: must keep the sampler's "
            r"temperature positive: sampling.temperature=1.0 \+ -1.0 <= 0",
        ),
        (
            ["engine=vllm", "engine.logit_noise=0.5"],
            r"engine.logit_noise=0.5 is not allowed: is wired for the embedded engine only \(engine=torch\)",
        ),
        (["correction.sc.tail_samples=0"], r"correction.sc.tail_samples=0 is not allowed: must be an integer >= 1"),
        (["correction.sc.tail=exact"], r"correction.sc.tail='exact' is not allowed: choose 'rescaled' or 'sampled'"),
        (["sampling.logprobs_tail_samples=-1"], r"sampling.logprobs_tail_samples=-1 is not allowed: must be >= 0"),
        (
            ["engine=vllm", "correction=sc", "correction.sc.tail=sampled"],
            r"correction.sc.tail='sampled' is not allowed: rescaled with engine=vllm: the sampled tail needs tail "
            r"tokens drawn",
        ),
        (
            ["kernels.fp32_gemm=mkl"],
            r"kernels.fp32_gemm='mkl' is not allowed: choose one of \['auto', 'aten', 'onednn'\]",
        ),
        (["engine.fused_sampler=yes"], r"engine.fused_sampler='yes' is not allowed: choose auto, true or false"),
        (
            ["engine=torch", "kernels=batch_invariant", "engine.fused_sampler=true"],
            r"engine.fused_sampler=true is not allowed: kernels=batch_invariant samples with torch's calls",
        ),
        (
            ["engine=torch", "kernels=batch_invariant", "kernels.fp32_gemm=onednn"],
            r"kernels.fp32_gemm='onednn' is not allowed: kernels=batch_invariant runs every product through its own",
        ),
    ],
)
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(*overrides))


@pytest.mark.parametrize(
    "group, option",
    [
        ("algo", "ppo2"),
        ("correction", "sc+foo"),
        ("engine", "sglang"),
        ("task", "mmlu"),
        ("model", "llama-70b"),
        ("trainer", "tpu"),
    ],
)
def test_unknown_group_option_lists_the_choices(group, option):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as info:
        cfg_for(f"{group}={option}")
    assert f"Could not find '{group}/{option}'" in str(info.value)
    assert "Available options" in str(info.value)


def test_vllm_engine_without_vllm_says_how_to_install_it(monkeypatch):
    import lit_rl.rollout.engines as engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: False)  # as on a machine without vLLM
    with pytest.raises(
        ConfigError,
        match=r"engine=vllm needs vLLM, which is not installed: install it with "
        r"`LIT_RL_VLLM=1 bash scripts/setup.sh`",
    ):
        validate(cfg_for("engine=vllm"))
    validate(cfg_for("engine=auto"))  # auto falls back to the embedded engine instead
    validate(cfg_for("engine=auto", "trainer=ddp"))  # ... so nothing vLLM-only is refused
    validate(cfg_for("engine=auto", "kernels=batch_invariant"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["engine.sleep_mode=true"],
            r"engine.sleep_mode=true is not allowed: needs a CUDA device \(vLLM's CPU build "
            r"has no sleep mode and no CUDA graphs\); use auto or false",
        ),
        (["engine.cuda_graphs=true"], r"engine.cuda_graphs=true is not allowed: needs a CUDA device"),
        (["engine.sleep_mode=maybe"], r"engine.sleep_mode='maybe' is not allowed: choose auto, true or false"),
        (
            ["engine.tensor_parallel_size=2"],
            r"engine.tensor_parallel_size=2 is not allowed: > 1 needs "
            r"engine.in_process=false",
        ),
        (["engine.tensor_parallel_size=0", "engine.in_process=false"], r"engine.tensor_parallel_size=0 is not allowed"),
        (
            ["engine.gpu_memory_utilization=1.5"],
            r"engine.gpu_memory_utilization=1.5 is not allowed: must lie in \(0, 1\]",
        ),
        (["engine.kv_cache_gb=0"], r"engine.kv_cache_gb=0 is not allowed: must be null or a number of GiB > 0"),
        (
            ["engine.max_model_len=32"],
            r"engine.max_model_len=32 is not allowed: must be null or an integer > "
            r"sampling.max_new_tokens=64",
        ),
        (
            ["trainer=ddp", "engine.in_process=false"],
            r"engine.in_process=false is not allowed: engine=\w+ with trainer.strategy=ddp runs one in-process "
            r"engine per rank \(vLLM's external_launcher over the training world\): needs engine.in_process=true",
        ),
        (
            ["trainer=ddp", "trainer.strategy=ddp_spawn"],
            r"trainer.strategy='ddp_spawn' is not allowed: engine=\w+ runs one colocated vLLM engine per training "
            r"process under auto, single_device, ddp or fsdp",
        ),
        (
            ["kernels=batch_invariant"],
            r"kernels='batch_invariant' is not allowed: batch-invariant kernels are lit_rl's "
            r"own, for the embedded engine and the trainer; with engine=vllm",
        ),
    ],
)
@pytest.mark.parametrize("engine", ["vllm", "auto"])
def test_bad_vllm_engine_values_are_named(engine, overrides, message, monkeypatch):
    import torch

    import lit_rl.rollout.engines as engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: True)  # the checks hold with or without vLLM here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine
    with pytest.raises(ConfigError, match=message.replace("engine=vllm", f"engine={engine}")):
        validate(cfg_for(f"engine={engine}", *overrides))


@pytest.mark.parametrize(
    "override, message",
    [
        ("+algo.clip_ratioo=0.3", r"algo.clip_ratioo=0.3 is not allowed: algo has no field 'clip_ratioo' \(did you"),
        ("+model.bar=2", r"model.bar=2 is not allowed: model has no field 'bar' \(its fields: attn_implementation,"),
        ("+model.lora.q=1", r"model.lora.q=1 is not allowed: model.lora has no field 'q' \(its fields: alpha,"),
        (
            "+algo.clip.x=2",
            r"algo.clip.x=2 is not allowed: algo.clip has no field 'x' \(its fields: eps_high, eps_low\)",
        ),
        ("+task.baz=1", r"task.baz=1 is not allowed: task has no field 'baz' \(its fields: answer_format,"),
        ("+engine.nope=1", r"engine.nope=1 is not allowed: engine has no field 'nope'"),
        ("+sampling.top_kk=5", r"sampling.top_kk=5 is not allowed: .*did you mean sampling.top_k\?"),
        ("+foo=1", r"foo=1 is not allowed: the config has no top-level field 'foo' \(its fields: advantage,"),
    ],
)
def test_a_key_added_with_plus_to_a_typed_section_is_refused_by_name(override, message):
    """``+section.key=value`` passes Hydra's compose (``+`` adds keys); every typed section refuses it at
    start-up, naming the field, as Hydra does for ``section.key=value``. ``trainer`` stays open (Lightning's
    keyword arguments)."""
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(override))
    validate(cfg_for("+trainer.enable_model_summary=false"))


def test_group_size_one_is_fine_without_a_group_baseline():
    validate(cfg_for("algo=reinforce", "algo.baseline=batch_mean", "rollout.group_size=1"))


def test_bad_jsonl_names_file_and_line(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(ConfigError, match=r"train.jsonl line 2: not valid JSON"):
        run(cfg_for("task=gsm8k", f"task.path={tmp_path}"), tmp_path / "out")
    (tmp_path / "train.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(ConfigError, match=r"train.jsonl line 1: missing field 'answer'"):
        run(cfg_for("task=gsm8k", f"task.path={tmp_path}"), tmp_path / "out")
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"train.jsonl: file is empty"):
        run(cfg_for("task=gsm8k", f"task.path={tmp_path}"), tmp_path / "out")


def test_score_centering_top_k_larger_than_vocabulary(tmp_path):
    with pytest.raises(ConfigError, match=r"correction.sc.top_k=100000 is larger than the vocabulary \(49152"):
        run(cfg_for("correction=sc", "correction.sc.top_k=100000"), tmp_path / "out")


def test_keep_float32_naming_no_parameter_is_a_start_up_error_not_a_traceback(tmp_path):
    """Checked when the engine is built (the names need the model): a ConfigError, which the recipe prints as
    ``lit_rl: error: ...`` with exit 2, like the torch-free checks; a plain ValueError printed a traceback."""
    message = r"engine.keep_float32: \['dtbias'\] match no parameter of LlamaForCausalLM .*'dtbias': no close name"
    with pytest.raises(ConfigError, match=message):
        run(cfg_for("engine.keep_float32=[dtbias]"), tmp_path / "out")


def test_cli_prints_the_message_without_traceback(tmp_path):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "recipes", "train.py"),
        "model=tiny",
        "advantage.alpha=2",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "lit_rl: error: advantage.alpha=2 is not allowed: must lie in [0, 1]" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "run").exists()  # the refused start left no empty run folder (.hydra, train.log)
    # an unknown group option: Hydra's own message lists the choices
    cmd[3] = "algo=ppo2"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "Could not find 'algo/ppo2'" in res.stderr and "grpo" in res.stderr
    assert "Traceback" not in res.stderr


#: runs recipes/train.py (argv[1], with its arguments) as ``python recipes/train.py`` does, then prints which of
#: torch and Lightning had been imported when it exited, and exits with its status
RUN_RECIPE = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
    code = 0
except SystemExit as exit_:
    code = exit_.code
print("imported:", sorted(m for m in ("torch", "lightning") if m in sys.modules))
sys.exit(code)
"""


@pytest.mark.parametrize(
    "override, message",
    [
        # Hydra's refusals while it composes the config: it prints them, naming the field
        (
            "rollout.group_size=abc",
            "Value 'abc' of type 'str' could not be converted to Integer\n    full_key: rollout.group_size",
        ),
        ("algo=nope", "Could not find 'algo/nope'"),
        # config.validate's
        ("algo.clip.eps_low=7", "lit_rl: error: algo.clip.eps_low=7 is not allowed: must be < 1"),
        ("algo.name=nope", "lit_rl: error: algo='nope' is not allowed: choose one of ['reinforce', 'ppo'"),
        # the form Hydra's own message suggests for an unknown key adds it: refused by name as well
        (
            "+algo.clip_ratioo=0.3",
            "lit_rl: error: algo.clip_ratioo=0.3 is not allowed: algo has no field 'clip_ratioo' "
            "(did you mean algo.clip_ratio_c? its fields: baseline, clip, clip_ratio_c,",
        ),
        ("+optim.foo=1", "lit_rl: error: optim.foo=1 is not allowed: optim has no field 'foo' (its fields: betas,"),
    ],
)
def test_a_bad_config_exits_2_naming_the_field_before_torch_is_imported(tmp_path, override, message):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-c", RUN_RECIPE, os.path.join(ROOT, "recipes", "train.py"), override]
    res = subprocess.run(cmd + [f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert "imported: []" in res.stdout  # neither torch nor Lightning: they load only to run
    assert not run_dir.exists()


def test_gsm8k_without_path_offline_is_refused_at_once_naming_task_path(tmp_path):
    """Offline (HF_HUB_OFFLINE=1, an empty cache), ``task=gsm8k`` without ``task.path`` used to build the model
    and then end in datasets' ConnectionError traceback (exit 1, 29 s without a network): now refused before
    torch loads, naming the hub and ``task.path``."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "h")}
    env.pop("HF_DATASETS_CACHE", None)
    cmd = [sys.executable, "-c", RUN_RECIPE, os.path.join(ROOT, "recipes", "train.py"), "task=gsm8k"]
    res = subprocess.run(cmd + [f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 2, res.stderr
    assert (
        "lit_rl: error: task.path=null is not allowed: task=gsm8k without task.path reads openai/gsm8k from the "
        "Hugging Face hub, which is not reachable (HF_HUB_OFFLINE=1), and the local cache has no copy of it: set "
        "task.path to a local folder holding train.jsonl and test.jsonl" in res.stderr
    )
    assert "Traceback" not in res.stderr + res.stdout
    assert "imported: []" in res.stdout
    assert not run_dir.exists()


def test_validation_imports_neither_torch_nor_lightning():
    """Every algorithm's default config passes ``validate`` in a process that never imports torch."""
    code = """
import sys
from hydra import compose, initialize_config_dir
from lit_rl.choices import ALGORITHMS
from lit_rl.config import validate
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    for name in ALGORITHMS:
        validate(compose("train", overrides=["model=tiny", f"algo={name}"]))
print("imported:", sorted(m for m in ("torch", "lightning") if m in sys.modules))
"""
    res = subprocess.run(
        [sys.executable, "-c", code, os.path.join(ROOT, "conf")], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert "imported: []" in res.stdout


def test_finished_run_folder_is_never_overwritten(tmp_path):
    (tmp_path / "finished.json").write_text(json.dumps({"global_step": 3}))
    with pytest.raises(ConfigError, match="already holds a finished run"):
        run(cfg_for(), tmp_path)
    assert json.loads((tmp_path / "finished.json").read_text()) == {"global_step": 3}


def test_a_folder_holding_an_unfinished_run_is_refused_without_ckpt_path(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step=6.ckpt").write_bytes(b"x")
    with pytest.raises(
        ConfigError,
        match=r"holds an unfinished run \(step=6.ckpt\); continue it with "
        r"ckpt_path=last",
    ):
        run(cfg_for(), tmp_path)
    assert (tmp_path / "checkpoints" / "step=6.ckpt").read_bytes() == b"x"


@pytest.mark.parametrize("sub", ["", "tensorboard"])  # event files in the run folder; in tensorboard/ (older runs)
def test_a_folder_whose_run_stopped_before_a_checkpoint_does_not_suggest_resuming(tmp_path, sub):
    (tmp_path / sub).mkdir(exist_ok=True)
    (tmp_path / sub / "events.out.tfevents.1").write_bytes(b"x")
    with pytest.raises(
        ConfigError,
        match=r"holds a run that stopped before its first checkpoint "
        r"\(events.out.tfevents.1\); choose another folder",
    ):
        run(cfg_for(), tmp_path)
    assert (tmp_path / sub / "events.out.tfevents.1").read_bytes() == b"x"


def test_a_tokenizer_without_chat_template_is_named(tmp_path, tiny):
    model, tok = tiny
    folder = tmp_path / "no_template"
    model.save_pretrained(folder, safe_serialization=True)
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    plain.save_pretrained(folder)
    assert not any(p.name.startswith("chat_template") for p in folder.iterdir())
    with pytest.raises(
        ConfigError,
        match=rf"model.name_or_path='{folder}': the tokenizer has no chat template, "
        r"and task=arithmetic formats prompts with it",
    ):
        run(cfg_for(f"model.name_or_path={folder}"), tmp_path / "out")


# -- context limits: checked at start-up, before the weights load -----------------------------------------------
def small_context_model(tmp_path, tiny, context):
    """The tiny model saved as a folder whose config declares a context of ``context`` tokens."""
    import copy

    model, tok = tiny
    folder = tmp_path / f"context{context}"
    small = copy.deepcopy(model)
    small.config.max_position_embeddings = context
    small.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if the policy's weights are loaded (the checks below must come first)."""
    import lit_rl.run.train as train_module

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the context check")

    monkeypatch.setattr(train_module, "load_policy", refuse)


def test_prompt_plus_new_tokens_beyond_the_model_context_is_named_at_start_up(tmp_path, tiny, no_model_load):
    folder = small_context_model(tmp_path, tiny, 128)
    # the arithmetic task's longest chat prompt is 49 tokens with SmolLM2's tokenizer: 49 + 100 > 128
    with pytest.raises(
        ConfigError,
        match=rf"task=arithmetic: the longest train prompt \(train example \d+\) has 49 "
        rf"tokens; with sampling.max_new_tokens=100 it needs 149, more than the "
        rf"context length of model.name_or_path='{folder}' \(128 tokens, "
        rf"max_position_embeddings in its config\): lower sampling.max_new_tokens "
        rf"to at most 79",
    ):
        run(cfg_for(f"model.name_or_path={folder}", "sampling.max_new_tokens=100"), tmp_path / "out")
    # the evaluated prompts with eval.max_new_tokens
    with pytest.raises(
        ConfigError,
        match=r"the longest eval prompt \(eval example \d+\) has \d+ tokens; with "
        r"eval.max_new_tokens=120 it needs",
    ):
        run(
            cfg_for(f"model.name_or_path={folder}", "sampling.max_new_tokens=8", "eval.max_new_tokens=120"),
            tmp_path / "out",
        )
    assert not (tmp_path / "out" / "config.yaml").exists() and not (tmp_path / "out" / "tensorboard").exists()


@pytest.mark.parametrize(
    "length, new_tokens, message",
    [
        (
            150,
            140,
            r"with sampling.max_new_tokens=140 it needs 189, more than engine.max_model_len=150: lower "
            r"sampling.max_new_tokens to at most 101, or raise engine.max_model_len to 189 or more "
            r"\(at most 2048\)",
        ),
        (
            4000,
            8,
            r"engine.max_model_len=4000 is more than the context length of model.name_or_path='tiny' \(2048 tokens",
        ),
    ],
)
def test_vllm_max_model_len_is_checked_before_the_engine_starts(
    tmp_path, monkeypatch, no_model_load, length, new_tokens, message
):
    import lit_rl.rollout.engines as engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: True)  # checked before vLLM would be imported
    with pytest.raises(ConfigError, match=message):
        run(
            cfg_for("engine=vllm", f"engine.max_model_len={length}", f"sampling.max_new_tokens={new_tokens}"),
            tmp_path / "out",
        )


def test_vllm_without_max_model_len_is_held_to_the_model_context(tmp_path, tiny, monkeypatch, no_model_load):
    import lit_rl.rollout.engines as engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    folder = small_context_model(tmp_path, tiny, 128)
    with pytest.raises(ConfigError, match=r"it needs 149, more than the context length of .*\(128 tokens"):
        run(cfg_for("engine=vllm", f"model.name_or_path={folder}", "sampling.max_new_tokens=100"), tmp_path / "out")


# -- output folders: writable at start-up ------------------------------------------------------------------------
UNWRITABLE = "/sys/kernel"  # a folder that even root cannot create files in (sysfs)


def unwritable_folder():
    try:
        with open(os.path.join(UNWRITABLE, "lit_rl_probe"), "wb"):
            pass
    except OSError:
        return UNWRITABLE
    pytest.skip(f"{UNWRITABLE} is writable here: no folder to test an unwritable output with")


@pytest.mark.parametrize("sub", ["checkpoints", "tensorboard", "policy", ""])
def test_an_output_folder_that_cannot_be_written_is_refused_at_start_up(tmp_path, sub, no_model_load):
    out = tmp_path / "run"
    if sub:
        out.mkdir()
        os.symlink(unwritable_folder(), out / sub)  # e.g. checkpoints/ on a read-only mount
    else:
        out = os.path.join(unwritable_folder(), "run")
    target = os.path.join(out, sub) if sub else out
    with pytest.raises(
        ConfigError,
        match=rf"output folder {target} cannot be written \(.*\); the run would fail at "
        r"its first checkpoint or at the end: choose another folder",
    ):
        run(cfg_for(), out)


def test_a_sweep_preset_without_m_is_refused_and_m_may_follow_the_overrides(tmp_path):
    """``experiment=alpha_sweep`` without ``-m`` used to run one job at the defaults, silently; ``-m`` after an
    override failed with Hydra's "unrecognized arguments"."""
    recipe = [sys.executable, "-c", RUN_RECIPE, os.path.join(ROOT, "recipes", "train.py")]
    run_dir = tmp_path / "run"
    res = subprocess.run(
        recipe + ["experiment=alpha_sweep", f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 2, res.stderr
    assert (
        "lit_rl: error: experiment=alpha_sweep is a sweep: add -m (it sweeps advantage.alpha=0,0.25,0.5,1), or give "
        "each of those keys one value to run one job"
    ) in res.stderr
    assert "imported: []" in res.stdout and not run_dir.exists()
    # -m after the overrides: the sweep starts (its jobs' configs are checked first: one is refused, no job runs)
    sweep = [f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    res = subprocess.run(recipe + ["advantage.alpha=7,0", "-m"] + sweep, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "unrecognized arguments" not in res.stderr
    assert "lit_rl: error: 1 of the sweep's 2 jobs have invalid configs; no job was started:" in res.stderr


def test_one_job_of_a_sweep_preset_runs_without_m_when_every_swept_key_has_a_value(tmp_path):
    """recipes/study.py starts a preset's jobs one command each, every swept key given (``experiment=X
    advantage.alpha=0``): the refusal of a sweep preset without -m stopped every such job with exit 2 (a study of
    experiment=constant_reward_drift_metric failed at its first job); such a command is one job, and runs."""
    recipe = [sys.executable, os.path.join(ROOT, "recipes", "train.py")]
    run_dir = tmp_path / "one_job"
    fast = [*FAST, "trainer.max_steps=1", "eval.num_examples=0", "log.plain_lines=true"]
    args = ["experiment=alpha_sweep", "advantage.alpha=0", *fast, f"hydra.run.dir={run_dir}"]
    res = subprocess.run(recipe + args, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (run_dir / "finished.json").exists()
    assert OmegaConf.load(run_dir / "config.yaml").advantage.alpha == 0
