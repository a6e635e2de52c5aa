"""The one lifecycle every thread owner follows: ``start()``, ``close()``, ``with``."""

from __future__ import annotations

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
