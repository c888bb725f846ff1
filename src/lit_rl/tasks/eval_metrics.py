"""What n samples of one problem score, the way evaluations are read: mean@n, pass@k, maj@n, best@n, worst@n.

    problem_scores(correct, rewards, ks, answers) -> {"mean@n": ., "pass@1": ., ..., "maj@n": ., "best@n": ., ...}

An evaluation averages these over its problems (``algorithms.evaluation``). Correctness is the verifier's verdict
(``reward.correct_from``), never a threshold on the weighted reward; best@n / worst@n are the weighted reward's
(the total of ``reward.functions``), maximum and minimum over the n samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .reward_functions import pass_at_k
from .rewards import answers_match

__all__ = ["pass_ks", "majority_index", "problem_scores"]


def pass_ks(n: int, extra: int | None = None) -> list[int]:
    """The k of pass@k an evaluation with ``n`` samples per problem reports: every power of two k <= n, and
    ``extra`` (``eval.k``) when it is not one of them, ascending. Raises ValueError unless n >= 1 and
    1 <= extra <= n."""
    if n < 1:
        raise ValueError(f"n must be >= 1 samples per problem, got {n}")
    if extra is not None and not 1 <= extra <= n:
        raise ValueError(f"k must be in [1, n={n}], got {extra}")
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return sorted(set(ks) | ({extra} if extra is not None else set()))


def majority_index(answers: Sequence[str | None], same: Callable[[str, str], bool] = answers_match) -> int | None:
    """The index of the sample whose answer the majority gave, or None when no sample has an answer.

    Answers are grouped by the verifier's equivalence ``same`` (default ``rewards.answers_match``: exact as
    rationals, else math-verify, so "0.5" and "1/2" are one answer): a sample joins the first group whose first
    answer it matches. An unparseable answer (None) joins no group, so it never forms the majority. Tie-break:
    among the largest groups, the one whose first sample comes first (the lowest sample index). Returns that
    group's first sample.

    answers: the n parsed answers of one problem (``extract_answer`` of each completion; None: none found).
    """
    groups: list[list[int]] = []  # sample indices, grouped; a group's first member is its representative
    for i, a in enumerate(answers):
        if a is None:
            continue
        for group in groups:
            if same(a, answers[group[0]]):
                group.append(i)
                break
        else:
            groups.append([i])
    if not groups:
        return None
    # max keeps the first of equal sizes, and groups are in order of their first sample: the stated tie-break
    return max(groups, key=len)[0]


def problem_scores(
    correct: Sequence[bool],
    rewards: Sequence[float],
    ks: Sequence[int],
    answers: Sequence[str | None] | None = None,
    same: Callable[[str, str], bool] = answers_match,
) -> dict[str, float]:
    """One problem's scores from its n samples (each in [0, 1] except best/worst, in the reward's units).

    - ``mean@n``: the share of correct samples;
    - ``pass@k`` for each k of ``ks``: Chen et al. 2021's unbiased 1 - C(n-c, k) / C(n, k)
      (``reward_functions.pass_at_k``), c the correct samples;
    - ``maj@n`` (only when ``answers`` is given): 1 when the majority answer's sample (``majority_index``) is
      correct, else 0 (also 0 when no sample has an answer);
    - ``best@n`` / ``worst@n``: the largest / smallest reward among the n.

    correct: n verdicts; rewards: n floats; answers: n parsed answers (None: that sample has none), or None for a
    set with no gold answers to compare, which gets no maj@n. Raises ValueError when the lengths differ, n is 0
    or a k is outside [1, n].
    """
    n = len(correct)
    if n == 0 or len(rewards) != n or (answers is not None and len(answers) != n):
        raise ValueError(
            f"problem_scores needs n >= 1 samples with one reward (and answer) each, got {n} verdicts, "
            f"{len(rewards)} rewards" + ("" if answers is None else f", {len(answers)} answers")
        )
    c = sum(bool(x) for x in correct)
    scores = {"mean@n": c / n}
    for k in ks:
        scores[f"pass@{k}"] = pass_at_k(n, c, int(k))
    if answers is not None:
        i = majority_index(answers, same)
        scores["maj@n"] = float(i is not None and bool(correct[i]))
    scores["best@n"], scores["worst@n"] = float(max(rewards)), float(min(rewards))
    return scores
