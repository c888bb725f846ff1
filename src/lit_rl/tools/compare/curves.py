"""One tag's curves: per setting the seed mean and min–max band per step, TensorBoard's smoothing, the step
*final* is compared at, and which direction is *best*."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LOWER_IS_BETTER = ("loss", "kl", "time/", "length")


@dataclass
class Curve:
    """One setting's curve of one tag: per step the mean, min and max over the runs that logged the step."""

    steps: list[int] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    finals: list[float] = field(default_factory=list)  # each run's last value


def value_at(series: list[tuple[int, float]], step: int) -> float | None:
    """The value a (step, value) series held at ``step``: its last value logged at or before it (None if none)."""
    out = None
    for s, v in series:
        if s > step:
            break
        out = v
    return out


def seed_curve(series: list[list[tuple[int, float]]], final_step: int | None = None) -> Curve:
    """Mean and min–max band across runs per step, over the union of the runs' steps.

    A non-finite value makes that step's mean, min and max NaN (a gap in the plot). ``finals``: each run's
    last value, or its value at ``final_step`` (``value_at``) when given.
    """
    by_step: dict[int, list[float]] = {}
    for s in series:
        for step, value in s:
            by_step.setdefault(step, []).append(value)
    if final_step is None:
        c = Curve(finals=[s[-1][1] for s in series if s])
    else:
        c = Curve(finals=[v for v in (value_at(s, final_step) for s in series if s) if v is not None])
    for step in sorted(by_step):
        vals = by_step[step]
        finite = all(math.isfinite(v) for v in vals)
        c.steps.append(step)
        c.mean.append(sum(vals) / len(vals) if finite else math.nan)
        c.lo.append(min(vals) if finite else math.nan)
        c.hi.append(max(vals) if finite else math.nan)
        c.count.append(len(vals))
    return c


def tb_smooth(values, weight: float = 0.6) -> list[float]:
    """TensorBoard's scalar smoothing: a debiased exponential moving average with ``weight`` in [0, 1).

    ``last = weight * last + (1 - weight) * v`` from ``last = 0``, each point divided by
    ``1 - weight ** n`` (n = finite points so far); non-finite points pass through and do not update the
    average; a constant series is returned unchanged (TensorBoard's classicSmoothing).
    """
    values = [float(v) for v in values]
    if not values or all(v == values[0] for v in values):
        return values
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1.0 - weight) * v
        n += 1
        debias = 1.0 - weight**n if weight != 1 else 1.0
        out.append(last / debias)
    return out


def lower_is_better(tag: str) -> bool:
    """Whether ``best`` is the minimum for ``tag``: it contains loss, kl, time/ or length (any case), and is not an
    evaluation score (``eval/...``: accuracy, pass@k, maj@n, best@n, worst@n, reward_mean, whatever an eval set's
    name holds: ``eval/kl_test/accuracy`` is higher-is-better)."""
    t = tag.lower()
    return not t.startswith("eval/") and any(k in t for k in LOWER_IS_BETTER)


def curves_for(
    groups: dict[str, list[str]], scalars: dict[str, dict], tag: str, final_step: int | None = None
) -> dict[str, Curve]:
    """{setting: Curve} of ``tag`` for the settings with at least one run that logged it (finals at
    ``final_step`` when given, see ``seed_curve``)."""
    out = {}
    for setting, names in groups.items():
        series = [scalars[n][tag] for n in names if scalars[n].get(tag)]
        if series:
            out[setting] = seed_curve(series, final_step)
    return out


def last_steps(scalars: dict[str, dict], tag: str) -> dict[str, int]:
    """{run: the last step at which it logged ``tag``} for the runs that logged it."""
    return {name: s[tag][-1][0] for name, s in scalars.items() if s.get(tag)}


def common_step(scalars: dict[str, dict], tag: str) -> int | None:
    """The last step of ``tag`` that every run which logged it reached (the smallest of their last steps);
    ``final`` is compared there, so runs that stopped early are not compared with longer ones' ends."""
    ends = last_steps(scalars, tag)
    return min(ends.values()) if ends else None
