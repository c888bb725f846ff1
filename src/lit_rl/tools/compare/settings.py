"""Run names to settings: a run's setting is its name without the ``seed=N`` item (seeds of one setting
are grouped), and without the ``key=value`` item of a swept value (``--x``)."""

from __future__ import annotations

import os
import re

from .runs import CompareError

DEFAULT_SETTING = "(default)"  # the setting of runs named only by their seed, e.g. ``seed=0``
_SEED_ITEM = re.compile(r"\+{0,2}seed=(-?\d+)")
_ITEM = re.compile(r"(^|[,/])([^,/]*)(?=,|/|$)")  # an item of a run name and what precedes it


def recorded_seed(run_dir) -> int | None:
    """The seed a run was started with on its command line, from Hydra's record of it
    (``<run>/.hydra/overrides.yaml``, kept when a run is continued), or None (no record, no ``seed=N`` in it).
    """
    import yaml

    try:
        with open(os.path.join(run_dir, ".hydra", "overrides.yaml")) as f:
            overrides = yaml.safe_load(f) or []
    except (OSError, yaml.YAMLError):
        return None
    for item in overrides if isinstance(overrides, list) else []:
        m = _SEED_ITEM.fullmatch(str(item))
        if m:
            return int(m.group(1))
    return None


def setting_of(name: str, seed: int | None = None) -> tuple[str, int | None]:
    """(setting, seed) of a run name: the name without its ``seed=N`` item, and N (None when there is none).

    Items are split on "," and "/": ``algo=dapo,seed=1`` -> (``algo=dapo``, 1); ``sweep/seed=3`` ->
    (``sweep``, 3); ``seed=0`` -> (``(default)``, 0); ``algo=grpo`` -> (``algo=grpo``, None). ``+seed=N`` and
    ``++seed=N`` count as seed items too; of several, the last is taken. A seed item anywhere counts, not
    only in the last path component, so the folders an older lit_rl made two levels deep for a swept value
    with "/" (``seed=0,task.path=data/a.jsonl``) group as ``seed`` last does. ``seed``: the run's recorded
    seed (``recorded_seed``): only the item ``seed=<seed>`` is taken then.
    """
    pattern = _SEED_ITEM if seed is None else re.compile(rf"\+{{0,2}}seed=({seed})")
    found = [m for m in _ITEM.finditer(name) if pattern.fullmatch(m.group(2))]
    if not found:
        return (name or DEFAULT_SETTING), None
    m = found[-1]
    before, after = name[: m.start()], name[m.end() :]
    if m.group(1) == ",":  # "a,seed=1[,b]" -> "a[,b]"
        setting = before + after
    else:  # at the start or after "/": "sweep/seed=3[,b]" -> "sweep/[b]"
        setting = before + m.group(1) + after[1:] if after else before
    return (setting.rstrip("/") or DEFAULT_SETTING), int(pattern.fullmatch(m.group(2)).group(1))


def group_runs(runs, group_by_seed: bool = True) -> dict[str, list[str]]:
    """{setting: [run names]}, settings sorted by name; each run its own setting when not grouping by seed.

    ``runs``: run names, or {run name: run folder} (``find_runs``), whose recorded seeds (``recorded_seed``)
    then pick the seed item of each name."""
    folders = runs if isinstance(runs, dict) else {}
    groups: dict[str, list[str]] = {}
    for name in sorted(runs):
        seed = recorded_seed(folders[name]) if name in folders else None
        groups.setdefault(setting_of(name, seed)[0] if group_by_seed else name, []).append(name)
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
