"""A decode instance's links to prefill instances, pooled: :class:`LinkPool`.

A link (one per prefill bootstrap address ``host:port``) is a thread and an HTTP client
(:mod:`hicache.disagg.receiver`). Invariants: at most ``max_links`` link threads exist,
a leaving link (retired, replaced, failed) counting until its thread ended
(:meth:`LinkPool.left`); a new address past the bound replaces the oldest idle link, else
:class:`LinksFull` (503 with ``Retry-After``); a link idle for ``idle_timeout_s`` retires by
its own thread (:meth:`LinkPool.retire`); *idle* means it holds nothing (no item posted
and unhandled, no room followed, draining or fenced: :attr:`Link.busy`), and a busy link is
never retired or replaced; posting and retiring take the pool's lock, so an item never
goes to a leaving link. See ``docs/architecture.md``, "Bounds".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["Link", "LinkPool", "LinksFull"]


LEAVE_WAIT_S = 5.0
"""The longest :meth:`LinkPool.post` waits for the threads of links leaving the pool."""


class LinksFull(RuntimeError):
    """Every one of the ``max_links`` links holds rooms: a new prefill address is refused
    for now (retry later). ``retry_after_s``: when to try again."""

    retry_after_s = 1


class Link(Protocol):
    """What the pool needs of a link."""

    @property
    def busy(self) -> bool:
        """It holds an item not yet handled or a room (never retired then)."""
        ...

    def start(self) -> None: ...

    def post(self, item: object) -> None:
        """Hand ``item`` to the link's thread (called under the pool's lock)."""
        ...

    def stop(self) -> None:
        """Ask the thread to end (it ends every room it still follows)."""
        ...

    def join(self) -> None: ...


L = TypeVar("L", bound=Link)


class LinkPool(Generic[L]):
    """The links by address, bounded (see the module docstring). ``make(host, port)``
    builds a link, not started."""

    def __init__(
        self,
        make: Callable[[str, int], L],
        *,
        max_links: int,
        idle_timeout_s: float,
    ) -> None:
        if max_links < 1:
            raise ValueError(f"max_links={max_links!r} is invalid; must be an int >= 1")
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s={idle_timeout_s!r} is invalid; must be > 0")
        self._make = make
        self.max_links = max_links
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Condition()
        self._links: dict[str, L] = {}
        """address -> its link, oldest first."""
        self._leaving: set[int] = set()
        """``id()`` of the links out of the pool whose threads have not ended yet."""
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._links)

    def check(self, host: str, port: int) -> None:
        """Raise :class:`LinksFull` when :meth:`post` to ``host:port`` would be refused now
        (a hint for an early refusal: the pool may change before the post)."""
        with self._lock:
            self._room_for(f"{host}:{port}", dry_run=True)

    def post(self, host: str, port: int, item: object) -> None:
        """Hand ``item`` to the link of ``host:port``, made (and started) when there is
        none; :class:`LinksFull` when there is none and no place for one."""
        address = f"{host}:{port}"
        with self._lock:
            if self._closed:
                raise RuntimeError("the decode instance's links are closed")
            link = self._links.get(address)
            if link is None:
                self._room_for(address, dry_run=False)
                link = self._links[address] = self._make(host, port)
                link.start()
            link.post(item)

    def post_existing(self, host: str, port: int, item: object) -> bool:
        """Hand ``item`` to the link of ``host:port`` if there is one; whether there was."""
        with self._lock:
            link = self._links.get(f"{host}:{port}")
            if link is None:
                return False
            link.post(item)
            return True

    def retire(self, address: str, link: L) -> bool:
        """Called by ``link``'s own thread when it has been idle for ``idle_timeout_s``:
        True when it has left the pool (its thread then ends, and calls :meth:`left`),
        False when it is busy again or already gone."""
        with self._lock:
            if self._links.get(address) is not link or link.busy:
                return False
            self._leave(address)
            return True

    def discard(self, address: str, link: L) -> None:
        """``link`` is leaving whatever it holds (its thread is ending: stopped or failed);
        items posted from now on go to a new link. Its thread then calls :meth:`left`."""
        with self._lock:
            if self._links.get(address) is link:
                self._leave(address)

    def left(self, link: L) -> None:
        """``link``'s thread is ending (the last thing it does): its place is free."""
        with self._lock:
            self._leaving.discard(id(link))
            self._lock.notify_all()

    def close(self) -> None:
        """Stop every link and wait for their threads (no post is taken from now on)."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.stop()
        for link in links:
            link.join()

    def _leave(self, address: str) -> L:
        """Take ``address``'s link out of the pool; it counts until :meth:`left`."""
        link = self._links.pop(address)
        self._leaving.add(id(link))
        return link

    def _room_for(self, address: str, *, dry_run: bool) -> None:
        """Make a place for a new link of ``address`` (under the lock): replace the oldest
        idle link when the pool is full, and wait for the threads of links leaving
        (they hold nothing, so they end within moments); :class:`LinksFull` when no link
        is idle and none is leaving."""
        deadline = time.monotonic() + LEAVE_WAIT_S
        while address not in self._links:
            if len(self._links) + len(self._leaving) < self.max_links:
                return
            idle = next((a for a, k in self._links.items() if not k.busy), None)
            if idle is None and not self._leaving:
                raise LinksFull(
                    f"this decode instance already follows {len(self._links)} prefill"
                    f" instances (--disaggregation-max-links {self.max_links}), each with"
                    f" rooms in flight; a new bootstrap address ({address}) is refused until"
                    " one is free"
                )
            if dry_run:
                return
            if idle is not None:
                self._leave(idle).stop()  # idle: it follows no room, nothing ends in error
            left = deadline - time.monotonic()
            if left <= 0:
                raise LinksFull(
                    f"the links leaving this decode instance's pool did not end within"
                    f" {LEAVE_WAIT_S:g} s; a new bootstrap address ({address}) is refused for now"
                )
            self._lock.wait(left)
