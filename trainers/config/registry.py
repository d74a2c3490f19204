"""Name-keyed registries (models, losses, optimisers, schedulers): one per kind, no if-chains on strings."""
from __future__ import annotations

import contextlib
from typing import Callable, Generic, Iterator, TypeVar

from latentsweep.trainers.core.errors import ConfigError, closest

T = TypeVar("T")
_UNDO: list[list[Callable[[], None]]] = []  # per open transaction: how to take back each registration made in it


@contextlib.contextmanager
def transaction() -> Iterator[None]:
    """Registrations made in the block (into any Registry, or config sections added by
    latentsweep.trainers.config.knobs.add_section)
    are all taken back, newest first, when the block raises: a plugin whose import fails leaves nothing behind, so
    the fixed file loads in the same process."""
    undo: list[Callable[[], None]] = []
    _UNDO.append(undo)
    try:
        yield
    except BaseException:
        for action in reversed(undo):
            action()
        raise
    finally:
        _UNDO.pop()


def on_rollback(action: Callable[[], None]) -> None:
    """Record how to take back a registration just made, when a transaction is open."""
    if _UNDO:
        _UNDO[-1].append(action)


class Registry(Generic[T]):
    """A mapping from a name to a builder; unknown names fail naming the closest registered one."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            self._items[name] = obj
            on_rollback(lambda: self._items.pop(name, None))
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} '{name}'{closest(name, self._items)}; "
                f"valid: {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
