"""The on-policy distillation teacher (``distill.teacher``): checked against the student's tokenizer and vocabulary
before any weight loads (``check_teacher``), then loaded like the policy (``load_teacher``), frozen by the module
(``algorithms.reference``)."""

from __future__ import annotations

import dataclasses

from ..config import ConfigError
from ..models import TINY_ID, load_model_config, load_policy, load_tokenizer
from ..schema import LoraConfig, TrainConfig


def vocabulary_rows(name_or_path: str, tokenizer, trust_remote_code: bool = False) -> int:
    """The rows of the output layer (the config's ``vocab_size``; ``tiny``: its tokenizer's length, as
    ``models.load_policy`` builds it) of ``name_or_path``, read without its weights."""
    if name_or_path == TINY_ID:
        return len(tokenizer)
    config = load_model_config(name_or_path, trust_remote_code)
    return int(getattr(getattr(config, "text_config", None) or config, "vocab_size"))


def check_teacher(cfg: TrainConfig, tokenizer) -> None:
    """Refuse a ``distill.teacher`` whose tokenizer or vocabulary is not the student's (``model.name_or_path``,
    whose ``tokenizer`` is loaded): the teacher must score the student's token ids. Reads tokenizers and configs
    only, no weights. A no-op with ``distill.teacher=null`` and under ``eval.only`` (no update: no teacher).

    Raises:
        ConfigError naming ``distill.teacher`` with both sizes: tokenizers of different lengths, the same length
        with other token ids, or output layers with different rows; or a teacher that cannot be found.
    """
    name = cfg.distill.teacher
    if name is None or cfg.eval.only:
        return
    spec = cfg.model
    where = f"distill.teacher={name!r}"
    try:
        teacher_tokenizer = load_tokenizer(name, spec.trust_remote_code)
        teacher_rows = vocabulary_rows(name, teacher_tokenizer, spec.trust_remote_code)
        student_rows = vocabulary_rows(spec.name_or_path, tokenizer, spec.trust_remote_code)
    except (FileNotFoundError, OSError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from err
    student = f"the student's (model.name_or_path={spec.name_or_path!r})"
    if len(teacher_tokenizer) != len(tokenizer):
        raise ConfigError(
            f"{where}: its tokenizer has {len(teacher_tokenizer)} tokens, {student} {len(tokenizer)}: the teacher "
            "must score the student's token ids (the same tokenizer)"
        )
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"{where}: its tokenizer has {len(teacher_tokenizer)} tokens like {student} ({len(tokenizer)}), with "
            "other ids: the teacher must score the student's token ids (the same tokenizer)"
        )
    if teacher_rows != student_rows:
        raise ConfigError(
            f"{where}: its vocabulary (output layer) has {teacher_rows} rows, {student} {student_rows}: the "
            "teacher's log-probs must be over the student's vocabulary"
        )


def load_teacher(cfg: TrainConfig, tokenizer):
    """The teacher model of ``distill.teacher`` (None when null), loaded by ``models.load_policy`` with the
    student's ``model`` settings (dtype, attention, remote code) but no LoRA, no gradient checkpointing and its
    dropout off; None under ``eval.only`` too (nothing is trained, so nothing is distilled). Call ``check_teacher``
    first. Raises ConfigError when its weights cannot be found."""
    if cfg.distill.teacher is None or cfg.eval.only:
        return None
    spec = dataclasses.replace(
        cfg.model,
        name_or_path=cfg.distill.teacher,
        lora=LoraConfig(r=0),
        gradient_checkpointing=False,
        keep_dropout=False,
    )
    try:
        teacher, _ = load_policy(spec, tokenizer)
    except FileNotFoundError as err:
        raise ConfigError(f"distill.teacher={cfg.distill.teacher!r}: {err}") from err
    return teacher
