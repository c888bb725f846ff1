"""Completions whose text the test chooses: the engine still generates (token ids, log-probs, lengths), but each
completion decodes to the test's text, so what a reward function sees is set by hand."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def script_completions(monkeypatch, texts_for: Callable[[int], Sequence[str]]) -> None:
    """Make every ``RolloutDataModule.collect`` of the tiny model's tokenizer decode its N completions to
    ``texts_for(N)`` (N texts, in the order of the rows: a prompt's G completions next to each other) until the
    test ends."""
    from lit_rl.models import TINY_ID, load_tokenizer

    def batch_decode(self, sequences, **kwargs):
        texts = list(texts_for(len(sequences)))
        assert len(texts) == len(sequences), (len(texts), len(sequences))
        return texts

    monkeypatch.setattr(type(load_tokenizer(TINY_ID)), "batch_decode", batch_decode)
