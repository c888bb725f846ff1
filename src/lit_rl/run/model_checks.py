"""What the configured model allows, checked at start-up before its weights load: its context against the run's
prompts (``check_context``), its attention implementation and sliding windows (``check_model_support``), its
head size as vLLM builds it (``vllm_head_dim``; ``vllm_refusal``, which ``engine=auto`` reads). Every refusal is
a ``ConfigError`` naming the field to change.
"""

from __future__ import annotations

from omegaconf import DictConfig

from ..config import ConfigError
from ..models import context_length, load_model_config
from ..rollout.datamodule import RolloutDataModule


def model_config(model_cfg: DictConfig):
    """The configured model's transformers config, read without its weights; None if it cannot be read (a bad
    name is reported where the model loads)."""
    try:
        return load_model_config(model_cfg.name_or_path, bool(model_cfg.trust_remote_code))
    except Exception:  # noqa: BLE001
        return None


#: architectures whose vLLM model (0.32, ``vllm/model_executor/models/<file>.py``: qwen2, qwen2_moe, olmoe,
#: stablelm, minicpm, internlm2, granitemoe, orion, jamba) builds its attention with head_dim =
#: hidden_size // num_attention_heads whatever the config's ``head_dim`` says; transformers (and vLLM's Llama,
#: Qwen3, Gemma, ...) take the config's ``head_dim`` when it is set
VLLM_DERIVED_HEAD_DIM = frozenset(
    {
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "OlmoeForCausalLM",
        "StableLmForCausalLM",
        "MiniCPMForCausalLM",
        "InternLM2ForCausalLM",
        "GraniteMoeForCausalLM",
        "OrionForCausalLM",
        "JambaForCausalLM",
    }
)
#: the smallest head_dim vLLM's CPU attention runs (``Unsupported CPU attention configuration`` below it)
VLLM_CPU_MIN_HEAD_DIM = 32


def architecture(config) -> str | None:
    """The architecture vLLM builds for ``config``: its ``architectures`` entry (what the engine's saved config
    carries), else the transformers causal-LM class ``AutoModelForCausalLM`` would build."""
    named = getattr(config, "architectures", None)
    if named:
        return named[0]
    cls = causal_lm_class(config)
    return cls.__name__ if cls is not None else None


def vllm_head_dim(config) -> int | None:
    """The attention head size vLLM builds for ``config``: hidden_size // num_attention_heads for the
    architectures of ``VLLM_DERIVED_HEAD_DIM``, else the config's ``head_dim`` when set, else that quotient;
    None without a config."""
    try:
        derived = config.hidden_size // config.num_attention_heads
    except Exception:  # noqa: BLE001 - no config (a bad name is reported where the model loads)
        return None
    if architecture(config) in VLLM_DERIVED_HEAD_DIM:
        return derived
    return getattr(config, "head_dim", None) or derived


def vllm_refusal(model_cfg: DictConfig, cuda: bool) -> str | None:
    """Why vLLM cannot serve the configured model, read from its config before any weight loads; None if it
    can (or the config cannot be read). Refused: an architecture of ``VLLM_DERIVED_HEAD_DIM`` whose config sets
    a ``head_dim`` other than hidden_size // num_attention_heads (transformers builds the config's, vLLM the
    quotient: the weights do not fit, on any device), and, on CPU, a head_dim below ``VLLM_CPU_MIN_HEAD_DIM``
    as vLLM builds it (``vllm_head_dim``) and a model with linear-attention layers (Gated DeltaNet hybrids: the
    installed CPU build cannot load them). ``engine=auto`` then picks torch, ``engine=vllm`` stops."""
    config = model_config(model_cfg)
    built = vllm_head_dim(config)
    if built is None:
        return None
    model = f"model.name_or_path={model_cfg.name_or_path!r}"
    declared = getattr(config, "head_dim", None)
    arch = architecture(config)
    if arch in VLLM_DERIVED_HEAD_DIM and declared and declared != built:
        return (
            f"vLLM's {arch} builds head_dim = hidden_size // num_attention_heads = {config.hidden_size} // "
            f"{config.num_attention_heads} = {built} and ignores the head_dim {declared} of {model}'s config "
            f"(transformers builds {declared}), so the weights do not fit; vLLM serves {arch} only with "
            f"head_dim unset or equal to {built}"
        )
    if not cuda and "linear_attention" in (getattr(config, "layer_types", None) or ()):
        return (
            f"vLLM's CPU build does not serve {arch} ({model}: linear-attention, Gated DeltaNet, layers) here: the "
            "installed vLLM 0.32 fails to load its model module on this CPU (it imports torchvision) and no parity "
            "test covers it (the embedded engine's cache holds the conv and recurrent states)"
        )
    if not cuda and built < VLLM_CPU_MIN_HEAD_DIM:
        return f"vLLM's CPU attention needs head_dim >= {VLLM_CPU_MIN_HEAD_DIM} and {model} has {built}"
    return None


def check_context(cfg: DictConfig, datamodule: RolloutDataModule, config) -> None:
    """ConfigError unless every prompt of the run plus its ``max_new_tokens`` fits the context: the engine's
    ``engine.max_model_len`` when set (vLLM), else the model's context length (``max_position_embeddings`` of
    its config; vLLM takes it for ``max_model_len: null``, and the embedded engine would generate past it
    into positions the model never saw). Training prompts count with ``sampling.max_new_tokens``, the
    evaluated ones with ``eval.max_new_tokens``. Runs at start-up, after the tokenizer and before the weights
    load; the message names the prompt, both numbers and the fields to change."""
    context = context_length(config) if config is not None else None
    model = f"model.name_or_path={cfg.model.name_or_path!r}"
    max_len = cfg.engine.max_model_len if cfg.engine.name == "vllm" else None
    if max_len is not None and context is not None and max_len > context:
        raise ConfigError(
            f"engine.max_model_len={max_len} is more than the context length of {model} "
            f"({context} tokens, max_position_embeddings in its config): at most {context}"
        )
    if max_len is not None:
        limit, where = max_len, f"engine.max_model_len={max_len}"
    elif context is not None:
        limit = context
        where = f"the context length of {model} ({context} tokens, max_position_embeddings in its config)"
    else:
        return
    checks = [("train", "sampling.max_new_tokens", cfg.sampling.max_new_tokens)]
    if cfg.eval.num_examples > 0:
        checks.append(("eval", "eval.max_new_tokens", cfg.eval.max_new_tokens))
    task = getattr(datamodule.task, "task", datamodule.task)  # ConstantReward wraps the task
    for split, field, new_tokens in checks:
        tokens, example = datamodule.longest_prompt(split)
        if example is None or tokens + new_tokens <= limit:
            continue
        if getattr(task, "overlong_prompts", "error") == "drop":
            total = len(datamodule._train if split == "train" else datamodule._eval)
            dropped = datamodule.drop_overlong(limit - new_tokens, split)
            print(
                f"lit_rl: task={cfg.task.name}: dropped {dropped} of {total} {split} prompts longer than "
                f"{limit - new_tokens} tokens ({where} minus {field}={new_tokens}; task.overlong_prompts=drop)",
                flush=True,
            )
            datamodule.dropped_prompts[split] = dropped
            if dropped < total:
                continue
        fix = (
            f"lower {field} to at most {limit - tokens}"
            if tokens < limit
            else "use shorter prompts (the prompt alone fills the context)"
        )
        if max_len is not None and context is not None and tokens + new_tokens <= context:
            fix += f", or raise engine.max_model_len to {tokens + new_tokens} or more (at most {context})"
        raise ConfigError(
            f"task={cfg.task.name}: the longest {split} prompt ({split} example {example.id}) has "
            f"{tokens} tokens; with {field}={new_tokens} it needs {tokens + new_tokens}, more than "
            f"{where}: {fix}"
        )


def check_episode_context(cfg: DictConfig, datamodule: RolloutDataModule, config) -> None:
    """A multi-turn task's episode limit against the context (ConfigError naming the fields):
    ``rollout.max_total_tokens`` at most the model's context length (or ``engine.max_model_len``), and more than
    the longest prompt; a no-op for a single-turn task. Runs at start-up, before the weights load."""
    if datamodule.environment is None:
        return
    total = cfg.rollout.max_total_tokens
    context = context_length(config) if config is not None else None
    limit = cfg.engine.max_model_len if cfg.engine.name == "vllm" and cfg.engine.max_model_len else context
    if limit is not None and total > limit:
        raise ConfigError(
            f"rollout.max_total_tokens={total} is more than the context of model.name_or_path="
            f"{cfg.model.name_or_path!r} ({limit} tokens): an episode would run past positions the model knows; "
            f"lower it to at most {limit}"
        )
    for split in ("train", "eval") if cfg.eval.num_examples > 0 else ("train",):
        tokens, example = datamodule.longest_prompt(split)
        if example is not None and tokens >= total:
            raise ConfigError(
                f"task={cfg.task.name}: the longest {split} prompt ({split} example {example.id}) has {tokens} "
                f"tokens, which leaves no room for an episode under rollout.max_total_tokens={total}: raise it"
            )


def check_model_support(cfg: DictConfig, datamodule: RolloutDataModule, config) -> None:
    """ConfigError, before the weights load, for a model the run cannot serve: its class does not implement
    ``model.attn_implementation`` (Gemma-2 has no sdpa path: its attention soft-capping needs eager), or, with
    ``kernels=batch_invariant``, a sliding-window layer shorter than the run's longest sequence
    (``batch_invariant.check_sliding_window``). Norm layers the kernels do not cover are refused when the mode
    is enabled (``batch_invariant.norm_kernels``), still before the first rollout."""
    if config is None:
        return
    model = f"model.name_or_path={cfg.model.name_or_path!r}"
    impl = cfg.model.attn_implementation
    cls = causal_lm_class(config)
    flag = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}.get(impl)
    if cls is not None and flag is not None and getattr(cls, flag, True) is False:
        import transformers

        raise ConfigError(
            f"model.attn_implementation={impl}: {cls.__name__} ({model}) has no {impl} attention in transformers "
            f"{transformers.__version__}; use model.attn_implementation=eager"
        )
    if cfg.kernels.name == "batch_invariant":
        from ..kernels.batch_invariant import check_sliding_window

        tokens = datamodule.longest_prompt("train")[0] + cfg.sampling.max_new_tokens
        if cfg.eval.num_examples > 0:
            tokens = max(tokens, datamodule.longest_prompt("eval")[0] + cfg.eval.max_new_tokens)
        try:
            check_sliding_window(config, tokens)
        except ValueError as err:
            raise ConfigError(f"{model}: {err}") from err


def causal_lm_class(config):
    """The transformers causal-LM class ``AutoModelForCausalLM`` builds for ``config``; None if unknown (e.g.
    remote code)."""
    try:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:  # noqa: BLE001
        return None
