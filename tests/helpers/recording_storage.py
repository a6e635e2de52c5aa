"""A memory backend that records the keys every read asks for (the prefetch thread's), so
cache-level L3 tests can count exactly which pages and component records were read."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hicache.keys import Namespace, PageKey
from hicache.storage.backends.memory import MemoryStorage, MemoryStore
from hicache.storage.base import Deadline
from hicache.storage.pageio import Payloads
from hicache.storage.stats import MissReason


class RecordingStorage(MemoryStorage):
    """``MemoryStorage`` over ``store`` under ``namespace``; :meth:`read` counts the keys
    read since the last call, split into full pages and ``component`` records."""

    def __init__(self, store: MemoryStore, namespace: Namespace, component: str) -> None:
        super().__init__(namespace, store=store)
        self.component_digest = namespace.with_component(component).digest
        self.gets: list[PageKey] = []
        self._lock = threading.Lock()

    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        with self._lock:
            self.gets.extend(keys)
        return super()._get(keys, pages, deadline)

    def read(self) -> tuple[int, int]:
        """(full pages, component records) read so far; resets."""
        with self._lock:
            got, self.gets = self.gets, []
        records = sum(k.namespace_digest == self.component_digest for k in got)
        return len(got) - records, records
