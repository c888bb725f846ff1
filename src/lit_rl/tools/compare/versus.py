"""A tag against a swept value (``--x rollout.lag``): per run the mean of its last values (or of a window of
steps, optionally shifted by a staleness tag), averaged over the seeds of each (setting, value) cell."""

from __future__ import annotations

from .settings import setting_of, split_key


def final_mean(series: list[tuple[int, float]], last: int) -> float:
    """Mean of the last ``last`` (>= 1) values of a (step, value) series."""
    tail = [v for _, v in series[-last:]]
    return sum(tail) / len(tail)


def shifted(series: list[tuple[int, float]], shift: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``series`` with each step s moved to s - shift(s) (rounded), for the steps ``shift`` logged, in step order."""
    by_step = dict(shift)
    return sorted((step - round(by_step[step]), v) for step, v in series if step in by_step)


def versus(
    scalars: dict[str, dict],
    key: str,
    tag: str,
    last: int = 1,
    window: tuple[int, int] | None = None,
    shift_by: str | None = None,
) -> dict[str, list[tuple[float, float, int]]]:
    """{setting: [(x, value, runs), ...] sorted by x} of ``tag``: per run the mean of its last ``last``
    values, or of its values at steps in ``window`` (inclusive) when given, after ``shifted`` by the tag
    ``shift_by`` when given; averaged over the runs (seeds) that share the setting and x. Runs without
    ``key`` in their name, without the tag, or without values in the window are left out."""
    out: dict[str, list[tuple[float, float, int]]] = {}
    for (setting, x), vals in sorted(versus_cells(scalars, key, tag, last, window, shift_by).items()):
        out.setdefault(setting, []).append((x, sum(vals) / len(vals), len(vals)))
    return out


def versus_cells(
    scalars: dict[str, dict],
    key: str,
    tag: str,
    last: int = 1,
    window: tuple[int, int] | None = None,
    shift_by: str | None = None,
) -> dict[tuple[str, float], list[float]]:
    """{(setting, x): [each run's value]} behind ``versus`` (one value per seed), for the seed intervals."""
    cells: dict[tuple[str, float], list[float]] = {}
    for name, runs_scalars in scalars.items():
        setting, x = split_key(setting_of(name)[0], key)
        series = runs_scalars.get(tag)
        if shift_by is not None and series:
            series = shifted(series, runs_scalars.get(shift_by, []))
        if window is not None and series:
            series = [(step, v) for step, v in series if window[0] <= step <= window[1]]
            last = max(len(series), 1)
        if x is None or not series:
            continue
        cells.setdefault((setting, x), []).append(final_mean(series, last))
    return cells


def describe(last: int, window: tuple[int, int] | None, shift_by: str | None) -> str:
    """How a run's value was taken, for titles: ``mean of the last 4 values``, ``mean over steps 4-7 ...``."""
    what = (
        ("last value" if last == 1 else f"mean of the last {last} values")
        if window is None
        else f"mean over steps {window[0]}-{window[1]}"
    )
    return what + (f", steps shifted by -{shift_by}" if shift_by else "")
