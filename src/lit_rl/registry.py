"""Named choices, each defined once: the config checks, the error messages and the tests read them from here.

A ``Registry`` maps the names a config field accepts (``algo``, ``task``, ``engine``, ``correction``,
``kernels``, ``rollout.mode``) to what each name builds. The owning module fills it where the thing is
defined, e.g. an algorithm class::

    @ALGORITHMS.register("grpo")
    class GRPO(Algorithm): ...

and ``config.validate``, ``train.build_module`` and the tests (every ``conf/<group>/*.yaml`` must name a
registered choice and every registered choice must have its file) look names up here. Adding an algorithm,
a task or an engine is then one file plus one ``register`` line (and its ``conf/<group>/<name>.yaml``).

This module imports nothing heavy: the registries themselves live beside what they hold
(``lit_rl.algorithms.ALGORITHMS``, ``lit_rl.tasks.TASKS``, ``lit_rl.rollout.engines.ENGINES``,
``lit_rl.corrections.CORRECTIONS``, ``lit_rl.kernels.KERNELS``, ``lit_rl.rollout.staleness.ROLLOUT_MODES``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownChoice(KeyError, ValueError):
    """A name no entry of the registry carries; the message names the field and lists the choices."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class Registry(Mapping[str, T], Generic[T]):
    """An ordered, read-only mapping name -> entry for the config field ``field``, filled by ``register``.

    Args:
        field: the config field whose values the names are (e.g. ``"algo"``, ``"rollout.mode"``); it is
            named in lookup errors.
        entries: optional initial ``name -> entry`` pairs, in order.
    """

    def __init__(self, field: str, entries: Mapping[str, T] | None = None):
        self.field = field
        self._entries: dict[str, T] = {}
        for name, entry in (entries or {}).items():
            self.register(name, entry)

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
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownChoice(f"{self.field}={name!r} is not allowed: choose one of {self.choices}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.field!r}, {self.choices})"

    def names_where(self, predicate: Callable[[T], bool]) -> list[str]:
        """The names whose entry satisfies ``predicate``, in registration order."""
        return [name for name, entry in self._entries.items() if predicate(entry)]
