"""Hold until final: what a worker may still write stays out of use until it is done.

A :class:`Quarantine` keeps items (pages, component ids), each with what it waits for
(an op id, a set of ops in flight, a retired backend); the owner lifts, at its own
points, those whose wait is over and frees them. Its users: the L2 tier (L1 pages of a
failed load that copies in flight may still use), the L3 prefetches (L2 pages and ids a
read not final yet may still fill) and the L3 slot (what a detached backend may still
write). Pure bookkeeping; the order of holding is kept, so every tensor-parallel rank
asks and lifts in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Quarantine"]

K = TypeVar("K")
T = TypeVar("T")


class Quarantine(Generic[K, T]):
    """Items ``T`` held, each until its wait ``K`` is over."""

    def __init__(self) -> None:
        self._held: list[tuple[K, T]] = []

    def hold(self, until: K, what: T) -> None:
        """Keep ``what`` out of use until ``until`` is over."""
        self._held.append((until, what))

    def lift(self, over: Callable[[K], bool]) -> list[T]:
        """Take out every item whose wait is ``over`` (asked of each wait, in the order
        held, whatever the answers); returns them in that order."""
        keep: list[tuple[K, T]] = []
        out: list[T] = []
        for until, what in self._held:
            if over(until):
                out.append(what)
            else:
                keep.append((until, what))
        self._held = keep
        return out

    def clear(self) -> list[T]:
        """Take out every item (their waits handed on elsewhere)."""
        out = [what for _, what in self._held]
        self._held = []
        return out

    def waits(self) -> list[K]:
        """What the items wait for, in the order held."""
        return [until for until, _ in self._held]

    def __iter__(self) -> Iterator[T]:
        return (what for _, what in self._held)

    def __len__(self) -> int:
        return len(self._held)
