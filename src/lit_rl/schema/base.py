"""What every schema module shares: the ``Number`` field type; ``config_of``, which turns a mapping into a
config dataclass; and the pieces of the start-up rules a dataclass states about its own fields (``problems``).

A section's ``problems(run)`` yields each value it refuses as (field, value, what is allowed), ``run`` being the
whole composed config (for the fields an option is bounded by); ``config.validate`` raises ConfigError for the
first, as ``"<field>=<value!r> is not allowed: <allowed>"``. Yielding instead of raising keeps the schema free
of ``lit_rl.config`` (which imports it) and of torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TypeVar, Union

C = TypeVar("C")

#: a number field: an int stays an int (``optim.grad_clip=1`` is logged and reported as written), a float a float
Number = Union[int, float]

#: what a section's ``problems`` yields: (field, value, what is allowed), one per refused value
Problems = Iterator[tuple[str, object, str]]


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def rule(ok: bool, field: str, value, allowed: str) -> Problems:
    """(field, value, allowed) once unless ``ok``: one problem of a section's ``problems``."""
    if not ok:
        yield field, value, allowed


def int_rule(value, field: str, minimum: int, meaning: str = "") -> Problems:
    """The problem unless ``value`` is an integer >= ``minimum`` (``meaning``: what the bound means, appended)."""
    yield from rule(is_int(value) and value >= minimum, field, value, f"must be an integer >= {minimum}{meaning}")


def plain_data(value):
    """A config dataclass instance as a plain dict (``dataclasses.asdict``); anything else as it is."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


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


def unknown_keys(node, prefix: str = ""):
    """(field, value, section prefix, the section's fields) for each key of ``node`` (an OmegaConf
    ``DictConfig``) and of its typed sub-sections that is not a field of its dataclass; nothing for an untyped
    node (``config.check_keys`` refuses the first: Hydra lets ``+section.key=...`` add any key)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    cls = OmegaConf.get_type(node)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in node.keys():
        child = node._get_node(key)
        if key not in fields:
            plain = isinstance(child, (DictConfig, ListConfig))
            yield f"{prefix}{key}", OmegaConf.to_container(child) if plain else child._value(), prefix, fields
        elif isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            yield from unknown_keys(child, f"{prefix}{key}.")
