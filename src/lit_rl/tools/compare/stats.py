"""Seeds and uncertainty: the t-interval of a seed mean, Welch's interval of a difference of two settings'
means, the window a run's *final* value averages over, and the runs that lack steps their seeds logged."""

from __future__ import annotations

import math
from dataclasses import dataclass

CONFIDENCE = 0.95  # of the seed intervals and --test


def t_quantile(df: float, confidence: float = CONFIDENCE) -> float:
    """The two-sided ``confidence`` quantile of Student's t with ``df`` > 0 degrees of freedom (scipy):
    t_{0.975, 2} = 4.3027 for 95% and df = 2."""
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, df))


@dataclass
class Interval:
    """mean ± half over n values: the t-interval of a mean (``half`` NaN for n < 2); ``sd`` the sample
    standard deviation (n − 1 in the denominator)."""

    mean: float
    half: float
    n: int
    sd: float

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half


def t_interval(values, confidence: float = CONFIDENCE) -> Interval:
    """The t-interval of the mean of ``values`` (n independent seeds): mean ± t_{(1+c)/2, n−1}·s/√n.

    Values 1, 2, 3: mean 2, s = 1, half = 4.3027/√3 = 2.4841. Raises ValueError for no values."""
    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        raise ValueError("t_interval of no values")
    mean = sum(vals) / n
    if n < 2:
        return Interval(mean, math.nan, n, math.nan)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    return Interval(mean, t_quantile(n - 1, confidence) * sd / math.sqrt(n), n, sd)


@dataclass
class WelchResult:
    """Welch's interval of mean_A − mean_B: ``diff`` ± ``half`` with ``df`` degrees of freedom, and the verdict."""

    a: Interval
    b: Interval
    diff: float
    half: float
    df: float
    verdict: str

    @property
    def lo(self) -> float:
        return self.diff - self.half

    @property
    def hi(self) -> float:
        return self.diff + self.half


def wald_difference(p1: float, n1: int, p2: float, n2: int) -> tuple[float, float]:
    """(d, half) of d = p2 − p1, two proportions over n1 and n2 trials, with the 95% Wald half-width
    1.96·√(p1(1−p1)/n1 + p2(1−p2)/n2) (an empty sample counts as one trial). 0.1 of 100 → 0.3 of 100:
    d 0.2, half 1.96·√(0.0009 + 0.0021) = 0.1074."""
    half = 1.96 * math.sqrt(p1 * (1 - p1) / max(n1, 1) + p2 * (1 - p2) / max(n2, 1))
    return p2 - p1, half


def welch_test(a, b, names: tuple[str, str] = ("A", "B"), confidence: float = CONFIDENCE) -> WelchResult:
    """Welch's t-interval of the difference of two means, from the two samples ``a`` and ``b`` (seeds).

    diff = mean_a − mean_b, se² = s_a²/n_a + s_b²/n_b, df = se⁴ / ((s_a²/n_a)²/(n_a−1) + (s_b²/n_b)²/(n_b−1))
    (Welch–Satterthwaite), half = t_{(1+c)/2, df}·se. Verdict: "A > B" when the interval lies above 0,
    "A < B" below it, else "indistinguishable at n_a, n_b seeds" (with ``names`` for A and B). Both samples
    constant: the interval has width 0. Raises ValueError unless both have >= 2 values."""
    ia, ib = t_interval(a, confidence), t_interval(b, confidence)
    if ia.n < 2 or ib.n < 2:
        raise ValueError(f"Welch's test needs >= 2 seeds per setting, got {ia.n} and {ib.n}")
    va, vb = ia.sd**2 / ia.n, ib.sd**2 / ib.n
    diff = ia.mean - ib.mean
    se2 = va + vb
    if se2 == 0:
        df, half = math.inf, 0.0
    else:
        df = se2**2 / (va**2 / (ia.n - 1) + vb**2 / (ib.n - 1))
        half = t_quantile(df, confidence) * math.sqrt(se2)
    if diff - half > 0:
        verdict = f"{names[0]} > {names[1]}"
    elif diff + half < 0:
        verdict = f"{names[0]} < {names[1]}"
    else:
        verdict = f"indistinguishable at {ia.n}, {ib.n} seeds"
    return WelchResult(ia, ib, diff, half, df, verdict)


def final_window(scalars: dict[str, dict], tag: str, k: int) -> list[int]:
    """The last ``k`` (>= 1) steps of ``tag`` that every run logging it logged (fewer when fewer are shared):
    the steps a run's *final* value averages over, the same for every run compared."""
    sets = [set(step for step, _ in s[tag]) for s in scalars.values() if s.get(tag)]
    if not sets:
        return []
    return sorted(set.intersection(*sets))[-k:]


def run_final(series: list[tuple[int, float]], window: list[int]) -> float:
    """Mean of a (step, value) series over the steps in ``window`` (NaN when it logged none of them)."""
    steps = set(window)
    vals = [v for step, v in series if step in steps]
    return sum(vals) / len(vals) if vals else math.nan


def missing_steps(groups: dict[str, list[str]], scalars: dict[str, dict], tag: str) -> dict[str, list[int]]:
    """{run: the steps of ``tag`` that another run of its setting logged and it did not}, for the runs that
    lack any (a run that stopped early, or skipped a step); such runs are flagged, not averaged silently."""
    out = {}
    for names in groups.values():
        logged = {n: {step for step, _ in scalars[n].get(tag, [])} for n in names if scalars[n].get(tag)}
        union = set().union(*logged.values()) if logged else set()
        for n, steps in logged.items():
            lacking = sorted(union - steps)
            if lacking:
                out[n] = lacking
    return out


def interval_bands(
    groups: dict[str, list[str]], scalars: dict[str, dict], tag: str, confidence: float = CONFIDENCE
) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """{setting: (steps, lo, hi)} of the seed mean's t-interval per step, for settings with >= 2 runs of
    ``tag``, at the steps every one of those runs logged with a finite value (elsewhere no band: a gap)."""
    out = {}
    for setting, names in groups.items():
        series = [dict(scalars[n][tag]) for n in names if scalars[n].get(tag)]
        if len(series) < 2:
            continue
        steps, lo, hi = [], [], []
        for step in sorted(set.intersection(*(set(s) for s in series))):
            vals = [s[step] for s in series]
            if not all(math.isfinite(v) for v in vals):
                continue
            iv = t_interval(vals, confidence)
            steps.append(step)
            lo.append(iv.lo)
            hi.append(iv.hi)
        out[setting] = (steps, lo, hi)
    return out


def seed_finals(groups: dict[str, list[str]], scalars: dict[str, dict], tag: str, k: int) -> dict[str, list[float]]:
    """{setting: [each run's final value of ``tag``]} (``run_final`` over ``final_window``); runs without the
    tag are left out."""
    window = final_window(scalars, tag, k)
    return {
        setting: [run_final(scalars[n][tag], window) for n in names if scalars[n].get(tag)]
        for setting, names in groups.items()
        if any(scalars[n].get(tag) for n in names)
    }
