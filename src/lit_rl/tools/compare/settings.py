"""Run names to settings: a run's setting is its name without the ``seed=N`` item (seeds of one setting
are grouped), and without the ``key=value`` item of a swept value (``--x``)."""

from __future__ import annotations

import re

from .runs import CompareError

DEFAULT_SETTING = "(default)"  # the setting of runs named only by their seed, e.g. ``seed=0``
_SEED_ITEM = re.compile(r"\+{0,2}seed=(-?\d+)")


def setting_of(name: str) -> tuple[str, int | None]:
    """(setting, seed) of a run name: the name without its ``seed=N`` item, and N (None when there is none).

    Only the last path component is searched, its items split on ",": ``algo=dapo,seed=1`` ->
    (``algo=dapo``, 1); ``sweep/seed=3`` -> (``sweep``, 3); ``seed=0`` -> (``(default)``, 0);
    ``algo=grpo`` -> (``algo=grpo``, None). ``+seed=N`` and ``++seed=N`` count as seed items too.
    """
    head, _, last = name.rpartition("/")
    seed: int | None = None
    kept = []
    for item in last.split(","):
        m = _SEED_ITEM.fullmatch(item)
        if m and seed is None:
            seed = int(m.group(1))
        else:
            kept.append(item)
    setting = ",".join(kept)
    if head:
        setting = f"{head}/{setting}" if setting else head
    return (setting or DEFAULT_SETTING), seed


def group_runs(names, group_by_seed: bool = True) -> dict[str, list[str]]:
    """{setting: [run names]}, settings sorted by name; each run its own setting when not grouping by seed."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        groups.setdefault(setting_of(name)[0] if group_by_seed else name, []).append(name)
    return dict(sorted(groups.items()))


def split_key(name: str, key: str) -> tuple[str, float | None]:
    """(setting without the ``key=value`` item, the value as a float) of a run name; the seed item is left in
    (``setting_of`` takes it out). ``correction=tis,rollout.lag=4`` with key ``rollout.lag`` ->
    (``correction=tis``, 4.0); None when the name has no such item. Raises CompareError for a value that is
    not a number."""
    head, _, last = name.rpartition("/")
    value, kept = None, []
    for item in last.split(","):
        k, eq, v = item.partition("=")
        if eq and k.lstrip("+~") == key and value is None:
            try:
                value = float(v)
            except ValueError as err:
                raise CompareError(f"--x {key}: run {name!r} has {item!r}, not a number") from err
        else:
            kept.append(item)
    setting = ",".join(kept)
    if head:
        setting = f"{head}/{setting}" if setting else head
    return (setting or DEFAULT_SETTING), value
