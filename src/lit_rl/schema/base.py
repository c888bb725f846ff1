"""What every schema module shares: the ``Number`` field type, and ``config_of``, which turns a mapping into a
config dataclass."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeVar, Union

C = TypeVar("C")

#: a number field: an int stays an int (``optim.grad_clip=1`` is logged and reported as written), a float a float
Number = Union[int, float]


def config_of(cls: type[C], values: Mapping | C | None, ignore_unknown: bool = False) -> C:
    """``values`` (a mapping, e.g. one group of the composed config as a plain dict, or a dataclass instance)
    as the dataclass ``cls``: what it leaves out takes the field's default, nested mappings become their
    dataclasses. An instance of ``cls`` is returned as is. Raises TypeError naming a key ``cls`` has no field
    for, unless ``ignore_unknown`` (then such keys are dropped)."""
    if isinstance(values, cls):
        return values
    if dataclasses.is_dataclass(values):
        values = dataclasses.asdict(values)
    values = dict(values or {})
    kinds = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(kinds))
    if ignore_unknown:
        values = {k: v for k, v in values.items() if k in kinds}
    elif unknown:
        raise TypeError(f"{cls.__name__} has no field {unknown[0]!r} (fields: {sorted(kinds)})")
    out = {}
    for name, value in values.items():
        default = kinds[name].default_factory() if kinds[name].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default) and isinstance(value, Mapping):
            value = config_of(type(default), value)
        out[name] = value
    return cls(**out)
