"""Named choices, each defined once: the config checks, the error messages and the tests read them from here.

A ``Registry`` maps the names a config field accepts (``algo``, ``task``, ``engine``, ``correction``,
``kernels``, ``rollout.mode``) to what each name builds. The owning module fills it where the thing is
defined, e.g. an algorithm class::

    @ALGORITHMS.register("grpo")
    class GRPO(Algorithm): ...

and ``config.validate``, ``run.train.build_module`` and the tests (every ``conf/<group>/*.yaml`` must name a
registered choice and every registered choice must have its file) look names up here. Adding an algorithm,
a task or an engine is then one file plus one ``register`` line (and its ``conf/<group>/<name>.yaml``).

An entry whose module imports torch can be registered lazily, as ``"module:attribute"``
(``register_lazy``, or ``lazy=`` of the constructor): its name is known at once, and the module is imported
on the first lookup of that name. ``config.validate`` checks names (``in``, iteration) and so runs before
torch loads; ``run.train.build_module`` looks the class up and imports it.

This module imports nothing heavy. The registries of choices whose owners import torch (algorithms,
corrections, kernels, rollout modes) are in ``lit_rl.choices``, torch-free, and each owner re-exports its own
(``lit_rl.algorithms.ALGORITHMS``, ``lit_rl.corrections.CORRECTIONS``, ``lit_rl.kernels.KERNELS``,
``lit_rl.rollout.staleness.ROLLOUT_MODES``); ``lit_rl.tasks.TASKS`` and ``lit_rl.rollout.engines.ENGINES``
live beside what they hold.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownChoice(KeyError, ValueError):
    """A name no entry of the registry carries; the message names the field and lists the choices."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class _Lazy:
    """A registered entry not imported yet: ``target`` is ``"module:attribute"``, resolved on first lookup."""

    __slots__ = ("target",)

    def __init__(self, target: str):
        module, sep, attribute = target.partition(":")
        if not (module and sep and attribute):
            raise ValueError(f"a lazy entry is 'module:attribute', not {target!r}")
        self.target = target

    def resolve(self):
        """Import the module and return the attribute (an ImportError or AttributeError names the target)."""
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


class Registry(Mapping[str, T], Generic[T]):
    """An ordered, read-only mapping name -> entry for the config field ``field``, filled by ``register``.

    Args:
        field: the config field whose values the names are (e.g. ``"algo"``, ``"rollout.mode"``); it is
            named in lookup errors.
        entries: optional initial ``name -> entry`` pairs, in order.
        lazy: optional initial ``name -> "module:attribute"`` pairs, after ``entries``: each entry is imported on
            the first lookup of its name (``register_lazy``).
    """

    def __init__(self, field: str, entries: Mapping[str, T] | None = None, lazy: Mapping[str, str] | None = None):
        self.field = field
        self._entries: dict[str, T | _Lazy] = {}
        for name, entry in (entries or {}).items():
            self.register(name, entry)
        for name, target in (lazy or {}).items():
            self.register_lazy(name, target)

    def register(self, name: str, entry: T | None = None):
        """Add ``entry`` under ``name``; without ``entry`` a decorator that registers what it decorates.
        Raises ValueError when ``name`` is taken (two definitions of one choice)."""
        if entry is None:

            def decorate(obj: T) -> T:
                self.register(name, obj)
                return obj

            return decorate
        if name in self._entries:
            raise ValueError(f"{self.field}={name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def register_lazy(self, name: str, target: str) -> None:
        """Add the entry ``target`` (``"module:attribute"``) under ``name`` without importing it: the module is
        imported on the first lookup of ``name``, so listing and checking names never imports it. Raises
        ValueError when ``name`` is taken or ``target`` is not of that form."""
        if name in self._entries:
            raise ValueError(f"{self.field}={name!r} is registered twice")
        self._entries[name] = _Lazy(target)

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a choice registered for a while, e.g. by a test or a plugin it unloads).
        Raises ``UnknownChoice`` for a name that is not registered."""
        self[name]  # the error of an unknown name
        del self._entries[name]

    @property
    def choices(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def __getitem__(self, name: str) -> T:
        try:
            entry = self._entries[name]
        except (KeyError, TypeError):
            raise UnknownChoice(f"{self.field}={name!r} is not allowed: choose one of {self.choices}") from None
        if isinstance(entry, _Lazy):
            entry = self._entries[name] = entry.resolve()
        return entry

    def __contains__(self, name: object) -> bool:  # by name only: Mapping's would look the entry up (an import)
        try:
            return name in self._entries
        except TypeError:  # an unhashable value (a list from the command line) is no name
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.field!r}, {self.choices})"

    def names_where(self, predicate: Callable[[T], bool]) -> list[str]:
        """The names whose entry satisfies ``predicate``, in registration order."""
        return [name for name in self._entries if predicate(self[name])]
