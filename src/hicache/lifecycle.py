"""The one lifecycle every thread owner follows: ``start()``, ``close()``, ``with``; and
how a process that has closed its owners exits (:func:`skip_final_collection`)."""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod
from typing import Any, TypeVar

_T = TypeVar("_T", bound="Lifecycle")


class Lifecycle(ABC):
    """An owner of threads or connections. Nothing starts in ``__init__``: ``start()`` does
    (idempotent), ``close()`` stops and releases (idempotent); ``with x:`` does both."""

    @abstractmethod
    def start(self) -> Any: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self: _T) -> _T:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def skip_final_collection() -> None:
    """Call as a process is about to exit, its owners closed: the interpreter's last
    garbage collection is skipped. That collection walks every object torch and
    transformers made (about a second of CPU on two cores, each time a server, rank or
    peer stops, while whoever stopped it waits); frozen, the objects are left to the OS.
    atexit handlers and stream flushes still run."""
    gc.freeze()
