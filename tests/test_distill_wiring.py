"""On-policy distillation wired into training (issue 40, part 3): ``distill.teacher`` loaded frozen, checked against
the student's tokenizer and vocabulary before any weight loads, scoring the student's sampled tokens; the advantage
form adds exactly 0 with a teacher equal to the student; the loss form is a term of its own; GSPO refuses the
advantage form by name."""

from __future__ import annotations

import pytest
import torch
from helpers.config import MOVING, fast_config
from safetensors.torch import load_file

import lit_rl.run.train as train_module
from lit_rl import objectives as obj
from lit_rl.config import ConfigError, validate
from lit_rl.corrections import weight_function
from lit_rl.logprobs import TokenScores
from lit_rl.loss import LossSettings, assemble_loss
from lit_rl.models import load_policy, tiny_config
from lit_rl.rollout.types import RolloutBatch
from lit_rl.run.train import run
from lit_rl.schema import CorrectionConfig, ModelConfig
from lit_rl.tools.compare.runs import read_scalars

#: wall-clock tags and the rates derived from them: they differ between any two runs
TIMED = ("time/", "perf/")


@pytest.fixture(scope="module")
def student_copy(tmp_path_factory):
    """The tiny student (``model=tiny``, init_seed 0) saved to a folder with its tokenizer: a teacher equal to it."""
    folder = tmp_path_factory.mktemp("teacher")
    policy, tokenizer = load_policy(ModelConfig(name_or_path="tiny"))
    policy.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def untimed(scalars: dict) -> dict:
    return {k: v for k, v in scalars.items() if not k.startswith(TIMED)}


def test_a_teacher_equal_to_the_student_leaves_the_run_bitwise_the_plain_run(student_copy, tmp_path):
    """distill.mode=advantage, coef 1, teacher = the student saved: every logged value and the final weights equal
    the plain run's bit for bit (one step of REINFORCE on a constant reward: the weights move), train/opd_kl 0.0."""
    args = (*MOVING, "trainer.max_steps=1", "eval.num_examples=0", "log.samples_every_n_steps=0")
    run(fast_config(*args), tmp_path / "plain")
    run(fast_config(*args, f"distill.teacher={student_copy}", "distill.coef=1.0"), tmp_path / "distill")
    plain, distill = (read_scalars(tmp_path / name) for name in ("plain", "distill"))
    assert distill.pop("train/opd_kl") == [(1, 0.0)]  # RL steps are logged from 1
    assert "train/loss" in plain and untimed(distill) == untimed(plain)
    assert float(plain["train/grad_norm"][0][1]) > 0  # a real update, not two idle runs
    before = load_file(student_copy / "model.safetensors")
    weights = [load_file(tmp_path / name / "policy" / "model.safetensors") for name in ("plain", "distill")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert any(not torch.equal(weights[0][k], before[k]) for k in weights[0])  # the student moved


@pytest.mark.slow
def test_over_two_steps_the_term_is_zero_then_live(student_copy, tmp_path):
    """Two steps: step 1 equals the plain run bit for bit, and so do step 2's weight-dependent values before its
    update (the entropy of the student after step 1 on its samples); the student has then moved from its copy, so
    step 2's train/opd_kl is not 0 and its update differs."""
    args = (*MOVING, "trainer.max_steps=2", "eval.num_examples=0", "log.samples_every_n_steps=0")
    run(fast_config(*args), tmp_path / "plain")
    run(fast_config(*args, f"distill.teacher={student_copy}"), tmp_path / "distill")
    plain, distill = (untimed(read_scalars(tmp_path / name)) for name in ("plain", "distill"))
    kl = distill.pop("train/opd_kl")
    assert kl[0] == (1, 0.0) and kl[1][1] != 0.0
    assert {k: v[0] for k, v in distill.items()} == {k: v[0] for k, v in plain.items()}
    assert distill["train/entropy"] == plain["train/entropy"]
    assert distill["train/loss"][1] != plain["train/loss"][1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    [
        ("algo=ppo", "correction=tis", "task.constant_reward=1"),  # per-token GAE advantages, 2 x 2 updates, TIS
        (*MOVING, "distill.mode=loss"),  # its own loss term: 0 where the trainer's and the teacher's forwards agree
    ],
    ids=["ppo+tis advantage", "reinforce loss"],
)
def test_a_teacher_equal_to_the_student_composes_with_other_algorithms_corrections_and_the_loss_form(
    student_copy, tmp_path, setting
):
    """One step with the student's copy as teacher: PPO's per-token advantages (whitened GAE, several optimizer steps
    against pi_old) with TIS in the advantage form equal the plain run bit for bit, logged values and weights. The
    loss form (on this CPU, float32: the update's forward and the teacher's agree bit for bit, every d_t is 0) logs
    the plain run's values bit for bit; its weights agree to float32 rounding only (measured: at most 1e-6 apart):
    its zero term adds nodes to the backward graph, which changes the order in which the tied embedding's gradient
    contributions are summed."""
    plain_setting = [o for o in setting if not o.startswith("distill.")]
    args = ("trainer.max_steps=1", "eval.num_examples=0", "log.samples_every_n_steps=0")
    run(fast_config(*args, *plain_setting), tmp_path / "plain")
    run(fast_config(*args, *setting, f"distill.teacher={student_copy}"), tmp_path / "distill")
    plain, distill = (untimed(read_scalars(tmp_path / name)) for name in ("plain", "distill"))
    assert distill.pop("train/opd_kl") == [(1, 0.0)]  # RL steps are logged from 1
    assert "train/loss" in plain and distill == plain
    weights = [load_file(tmp_path / name / "policy" / "model.safetensors") for name in ("plain", "distill")]
    if "distill.mode=loss" in setting:
        assert all(torch.allclose(weights[0][k], weights[1][k], rtol=0, atol=1e-6) for k in weights[0])
    else:
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def save_tiny(folder, tokenizer, vocab: int) -> None:
    """A tiny Llama of ``vocab`` output rows and ``tokenizer``, saved to ``folder``."""
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(tiny_config(vocab)).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def test_a_teacher_on_another_vocabulary_is_refused_with_both_sizes_before_any_weight_loads(tmp_path, monkeypatch):
    """A teacher of 100 output rows (the student: 49152) stops the run at start-up, naming distill.teacher and both
    sizes, before the policy's weights load."""
    from lit_rl.models import load_tokenizer

    save_tiny(tmp_path / "teacher", load_tokenizer("tiny"), 100)

    def no_weights(*args, **kwargs):
        raise AssertionError("the policy's weights were loaded before the teacher was checked")

    monkeypatch.setattr(train_module, "load_checked_policy", no_weights)
    message = r"distill.teacher='.*': its vocabulary \(output layer\) has 100 rows, the student's "
    message += r"\(model.name_or_path='tiny'\) 49152"
    with pytest.raises(ConfigError, match=message):
        run(fast_config("trainer.max_steps=1", f"distill.teacher={tmp_path / 'teacher'}"), tmp_path / "run")


def test_a_teacher_with_another_tokenizer_is_refused_with_both_sizes(tmp_path):
    """One token more in the teacher's tokenizer (its output rows the same), or the same count with other ids."""
    from lit_rl.models import load_tokenizer
    from lit_rl.run.teacher import check_teacher
    from lit_rl.schema import train_config

    tokenizer = load_tokenizer("tiny")
    extra = load_tokenizer("tiny")
    extra.add_tokens(["<teacher_only>"])
    save_tiny(tmp_path / "teacher", extra, len(tokenizer))
    cfg = train_config(fast_config(f"distill.teacher={tmp_path / 'teacher'}"))
    with pytest.raises(
        ConfigError, match=r"its tokenizer has 49153 tokens, the student's \(model.name_or_path='tiny'\) 49152"
    ):
        check_teacher(cfg, tokenizer)
    renamed = load_tokenizer("tiny")
    renamed.add_tokens(["<student_only>"])
    with pytest.raises(ConfigError, match=r"its tokenizer has 49153 tokens like the student's .* with other ids"):
        check_teacher(cfg, renamed)
    check_teacher(train_config(fast_config()), tokenizer)  # distill.teacher=null: nothing to check


def test_distill_config_values_and_gspo_refuse_by_name():
    with pytest.raises(ConfigError, match=r"distill.mode='kl' is not allowed: choose one of \('advantage', 'loss'\)"):
        validate(fast_config("distill.mode=kl"))
    with pytest.raises(ConfigError, match=r"distill.coef=-1.* must be a number >= 0"):
        validate(fast_config("distill.coef=-1"))
    with pytest.raises(ConfigError, match=r"distill.mode='advantage'.*algo=gspo's objective takes one advantage per"):
        validate(fast_config("algo=gspo", "distill.teacher=tiny"))
    validate(fast_config("algo=gspo", "distill.teacher=tiny", "distill.mode=loss"))
    validate(fast_config("algo=gspo", "distill.mode=advantage"))  # no teacher: nothing to refuse


def test_the_loss_form_is_a_term_of_its_own_over_the_step_s_tokens():
    """assemble_loss with teacher log-probs adds coef * sum(sg(gap) * logp) / (the step's tokens), whatever
    loss.reduction, on top of the objective's loss; train/opd_kl is the micro-batch's mean gap."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    teacher = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, 0.0, 0.0]])
    zeros = torch.zeros(2, 3)
    mb = RolloutBatch(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.bool),
        response_ids=torch.zeros(2, 3, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=logp.detach(),
        rewards=torch.zeros(2),
        advantages=torch.zeros(2),
        group_ids=torch.zeros(2, dtype=torch.long),
        policy_version=torch.zeros(2, dtype=torch.long),
    )
    settings = LossSettings("seq_mean_token_mean", 3, weight_function(CorrectionConfig()))
    scores = TokenScores(logprobs=logp, entropy=zeros)
    kwargs = dict(num_tokens=torch.tensor(8), num_seqs=torch.tensor(4))
    plain, _ = assemble_loss(zeros, scores, logp.detach(), mb, settings, **kwargs)
    loss, metrics = assemble_loss(
        zeros, scores, logp.detach(), mb, settings, teacher_logprobs=teacher, distill_coef=0.5, **kwargs
    )
    # gaps 0.5, -1, 0 | 0.5 times logp -1, -2, -3 | -0.5: (-0.5 + 2 + 0 - 0.25) = 1.25; * 0.5 / 8 step tokens
    assert plain.item() == 0.0 and loss.item() == pytest.approx(0.5 * 1.25 / 8)
    ((name, values, m, _),) = [e for e in metrics if e[0] == "train/opd_kl"]
    assert obj.masked_mean(values, m).item() == pytest.approx((0.5 - 1.0 + 0.0 + 0.5) / 4)
    loss.backward()
    want = torch.tensor([[0.5 * 0.5, 0.5 * -1.0, 0.0], [0.5 * 0.5, 0.0, 0.0]]) / 8  # coef * sg(gap) / step tokens
    assert torch.allclose(logp.grad, want), logp.grad


def test_the_teacher_scores_under_the_sampler_s_temperature_and_truncation():
    """module.teacher_logprobs is the teacher's log-probs of the sampled tokens at sampling.temperature=0.7 with
    top_k=5 (the pass that scores the reference), not its raw distribution; the teacher is frozen and in eval mode,
    outside the optimizer's parameters and the checkpoint's keys."""
    from lit_rl.logprobs import response_logprobs
    from lit_rl.run.train import build_module

    cfg = fast_config("sampling.temperature=0.7", "sampling.top_k=5", "distill.teacher=tiny", "distill.mode=loss")
    policy, tokenizer = load_policy(ModelConfig(name_or_path="tiny"))
    teacher, _ = load_policy(ModelConfig(name_or_path="tiny", init_seed=1), tokenizer)
    module = build_module(cfg, policy, tokenizer, teacher)
    prompt = torch.tensor([[5, 6, 7], [5, 6, 7]])
    response = torch.empty(2, 0, dtype=torch.long)
    with torch.no_grad():
        for _ in range(3):  # the teacher's two most likely tokens: inside its top-5 at every position
            logits = teacher(input_ids=torch.cat([prompt, response], -1)).logits[:, -1]
            response = torch.cat([response, logits.topk(2).indices[torch.arange(2), torch.arange(2)][:, None]], -1)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mb = RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones_like(prompt, dtype=torch.bool),
        response_ids=response,
        response_mask=mask,
        rollout_logprobs=torch.zeros(2, 3),
        rewards=torch.zeros(2),
        advantages=torch.zeros(2),
        group_ids=torch.zeros(2, dtype=torch.long),
        policy_version=torch.zeros(2, dtype=torch.long),
    )
    got = module.teacher_logprobs(mb)
    kwargs = dict(with_entropy=False, shared_prefix=module.teacher_shared_prefix)
    want = response_logprobs(teacher, prompt, mb.prompt_mask, response, mask, temperature=0.7, top_k=5, **kwargs)
    raw = response_logprobs(teacher, prompt, mb.prompt_mask, response, mask, **kwargs)
    assert torch.equal(got, want.logprobs) and torch.isfinite(got).all()
    assert not torch.allclose(got, raw.logprobs)
    assert not module.teacher.training and not any(p.requires_grad for p in module.teacher.parameters())
    assert not any(p is q for p in module.trainable_parameters() for q in module.teacher.parameters())
    assert not any(k.startswith("teacher.") for k in module.state_dict())
