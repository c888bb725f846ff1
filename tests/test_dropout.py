"""Dropout is off in the trainer's forward by default (``model.keep_dropout=false``; issue 33 item 4, TRL PRs
#3234 / #3500): the engine samples and the KL reference scores in eval mode, so a forward in training mode with
the checkpoint's attention / hidden dropout or ``model.lora.dropout`` trains a noisy copy of the sampled
distribution. The probabilities are set to 0 (the model stays in training mode, so gradient checkpointing still
recomputes), including attention dropout, which transformers passes to its attention functions as a float (no
``nn.Dropout``). ``model.keep_dropout=true`` keeps them, at a cost ``train/logprob_abs_diff`` shows."""

import json

import pytest
import torch
from helpers import fast_config
from helpers.families import FAMILIES, build_family

from lit_rl.logprobs import response_logprobs
from lit_rl.models import ModelConfig, load_policy
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars

#: transformers has no sdpa path for Gemma-2 (its attention soft-capping)
ATTN = {"gemma2": "eager"}
#: dropout a checkpoint's config may set, per family: every family has attention_dropout (a float the attention
#: function reads); Phi-3 also has residual and embedding dropout (nn.Dropout modules)
DROPOUT = {"attention_dropout": 0.3}
EXTRA = {"phi3": {"resid_pdrop": 0.2, "embd_pdrop": 0.1}}

#: the issue's run: a rank-8 adapter with lora.dropout 0.5, lr 1e-2, REINFORCE on a constant reward (no baseline:
#: A = 1, so the weights move; RLOO's A would be 0 and nothing would train), KL tracked
ISSUE = [
    "model.lora.r=8",
    "model.lora.alpha=16",
    "model.lora.dropout=0.5",
    "optim.lr=1e-2",
    "kl.track=true",
    "algo=reinforce",
    "algo.baseline=none",
    "task.constant_reward=1",
    "trainer.max_steps=3",
    "eval.num_examples=0",
]


def two_forwards(model, tok, steps: int = 2):
    """The response log-probs of two forward + backward passes on the same input, in training mode, and how
    often the first layer's MLP ran (a checkpointed layer runs again in backward)."""
    calls = []
    # a pre-hook: the recomputation stops (torch's early stop) once the saved tensors are back, inside the MLP
    hook = model.get_decoder().layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (2, 16), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    response = ids[:, -6:].clone()
    out = []
    for _ in range(steps):
        scores = response_logprobs(model, ids[:, :-6], mask[:, :-6], response, torch.ones_like(response).bool())
        scores.logprobs.sum().backward()
        out.append(scores.logprobs.detach())
    hook.remove()
    return out, len(calls)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """family -> its tiny model (``helpers.families``) saved with dropout in its config, built once."""
    built = {}

    def get(family):
        if family not in built:
            overrides = {**DROPOUT, **EXTRA.get(family, {})}
            built[family] = build_family(family, tmp_path_factory.mktemp(family), **overrides)
        return built[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("lora", [0, 2], ids=["full", "lora"])
def test_the_trainer_s_forward_is_deterministic_with_gradient_checkpointing_on(family_dir, family, lora):
    """A checkpoint with attention dropout 0.3 (Phi-3: residual 0.2 and embedding 0.1 too), LoRA with dropout 0.5,
    gradient checkpointing on: two forwards in training mode on the same input give bit-identical log-probs,
    and checkpointing still acts (the model is in training mode, each layer's flag is set, and the first layer's
    MLP runs again in backward)."""
    spec = ModelConfig(str(family_dir(family)), attn_implementation=ATTN.get(family, "sdpa"))
    spec.gradient_checkpointing = True
    spec.lora.r, spec.lora.dropout = lora, 0.5
    model, tok = load_policy(spec)
    (first, second), calls = two_forwards(model, tok)
    assert torch.equal(first, second), (first - second).abs().max()
    assert model.training and model.is_gradient_checkpointing
    assert all(layer.gradient_checkpointing and layer.training for layer in model.get_decoder().layers)
    assert calls == 4  # 2 forwards + 2 recomputations in backward

    from lit_rl.models import dropout_probabilities

    assert dropout_probabilities(model) == {}


@pytest.mark.parametrize("family", ["llama3", "phi3"])
def test_keep_dropout_keeps_the_checkpoint_s_dropout_attention_dropout_included(family_dir, family):
    """``model.keep_dropout=true`` keeps it: two forwards differ. Llama's only dropout is the attention
    dropout that its attention function takes as a float, so this also shows that the float is what default
    mode turns off (TRL's ``disable_dropout_in_model``, which zeroes nn.Dropout modules only, leaves it on)."""
    from lit_rl.models import dropout_probabilities

    spec = ModelConfig(str(family_dir(family)), keep_dropout=True, gradient_checkpointing=True)
    model, tok = load_policy(spec)
    (first, second), _ = two_forwards(model, tok)
    assert not torch.equal(first, second)
    assert (first - second).abs().max() > 1e-2
    kept = dropout_probabilities(model)
    attention = type(model.get_decoder().layers[0].self_attn).__name__  # LlamaAttention, Phi3Attention
    assert kept["attention_dropout"] == 0.3 and kept[f"{attention}.attention_dropout"] == 0.3
    if family == "phi3":
        assert kept["resid_pdrop"] == 0.2 and kept["resid_attn_dropout"] == 0.2


def test_a_model_that_reads_its_dropout_from_the_config_at_forward_time():
    """Falcon reads ``self.config.hidden_dropout`` / ``attention_dropout`` in its forward: the config's
    probabilities are zeroed too, and ``checkpoint_config`` puts them back for an export."""
    from transformers import FalconConfig, FalconForCausalLM

    from lit_rl.models import checkpoint_config, disable_dropout, dropout_probabilities

    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = FalconConfig(**sizes, hidden_dropout=0.3, attention_dropout=0.2)
    torch.manual_seed(0)
    model = FalconForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 12))
    noisy = [model(input_ids=ids).logits for _ in range(2)]
    assert not torch.equal(*noisy)
    assert disable_dropout(model) == {"hidden_dropout": 0.3, "attention_dropout": 0.2}
    assert model.training and dropout_probabilities(model) == {}
    assert torch.equal(*[model(input_ids=ids).logits for _ in range(2)])
    with checkpoint_config(model):
        assert (model.config.hidden_dropout, model.config.attention_dropout) == (0.3, 0.2)
    assert (model.config.hidden_dropout, model.config.attention_dropout) == (0.0, 0.0)


def test_the_exported_policy_keeps_the_checkpoint_s_config(family_dir, tmp_path):
    """The policy is trained without dropout, but ``policy/config.json`` says what the checkpoint said."""
    from lit_rl.run.train import export_policy

    model, _ = load_policy(ModelConfig(str(family_dir("phi3"))))
    export_policy(model, tmp_path / "policy")
    saved = json.loads((tmp_path / "policy" / "config.json").read_text())
    assert (saved["attention_dropout"], saved["resid_pdrop"], saved["embd_pdrop"]) == (0.3, 0.2, 0.1)
    assert model.config.attention_dropout == 0.0


@pytest.mark.parametrize("keep", [False, True], ids=["default", "keep_dropout"])
def test_the_issue_s_lora_dropout_run_logs_the_engine_s_log_probs(tmp_path, capsys, keep):
    """The issue's case: a LoRA adapter with dropout 0.5, three moving steps. With dropout off the trainer's
    log-probs are the engine's (float32 noise, < 1e-5; the issue measured 3.4e-7) at every step; with
    ``model.keep_dropout=true`` they differ by the dropout noise once the adapter's B is non-zero (the issue:
    0.0203, 0.0263 at steps 2 and 3)."""
    run(fast_config(*ISSUE, *(["model.keep_dropout=true"] if keep else [])), tmp_path / "run")
    gaps = [v for _, v in read_scalars(tmp_path / "run")["train/logprob_abs_diff"]]
    assert len(gaps) == 3 and gaps[0] < 1e-5, gaps  # step 1: B = 0, the adapter (and its dropout) adds nothing
    if keep:
        assert all(g > 1e-3 for g in gaps[1:]), gaps
        assert "model.keep_dropout=true: dropout stays on in the trainer's forward (lora_dropout=0.5)" in (
            capsys.readouterr().out
        )
    else:
        assert all(g < 1e-5 for g in gaps), gaps
        assert "dropout off in the trainer's forward, as in the engine's (model.lora.dropout=0.5)" in (
            capsys.readouterr().out
        )
