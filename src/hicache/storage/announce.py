"""Announcements: records saying a page's write is on its way (pure: no threads, no IO).

A writer that will put page ``k`` shortly (the decode instance at a request's end, whose
L1 -> L2 -> L3 write lands after the answer went out) first stores a small record under
:func:`announce_key` ``(k)``: ``sha256(k.digest || b"announce")``, the page's fingerprint
and namespace digest in its header, payload :data:`ANNOUNCE_PAYLOAD` bytes: ``<dd``, the
announcement's wall-clock time and the time it expires (``time.time()`` seconds). A
reader whose lookup stops at ``k`` may wait for it until then, within its own bound. An
announcement only ever delays a lookup, never serves bytes; an expired or unreadable one
is no announcement. Wall-clock times: writer and reader may be different hosts, so a
clock skew shifts the expiry by that much (the reader's bound still caps any wait).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from hicache.keys import KEY_PREFIX, PageKey
from hicache.storage.pageio import Payloads

__all__ = [
    "ANNOUNCE_PAYLOAD",
    "ANNOUNCE_TAG",
    "Announcements",
    "announce_key",
]

ANNOUNCE_TAG = b"announce"
"""Bytes after a page's chained hash in :func:`announce_key`'s input."""

_FORMAT = struct.Struct("<dd")
ANNOUNCE_PAYLOAD = _FORMAT.size
"""Payload bytes of an announcement record: announced-at and expires-at, float64 each."""


def announce_key(page: PageKey) -> PageKey:
    """The key of page ``page``'s announcement record: ``"hc3-" +
    hex(sha256(page.digest || b"announce"))``, with the page's fingerprint and namespace
    digest (a different hash from any page or head record's key)."""
    h = hashlib.sha256(page.digest + ANNOUNCE_TAG).digest()
    return PageKey(KEY_PREFIX + h.hex(), h, page.fingerprint, page.namespace_digest)


class Announcements(Payloads):
    """The payloads of a batch of announcement records: item ``i`` is ``(at, until)``
    (wall-clock seconds). For a set, built from the times; for a get, zeroed buffers that
    :meth:`until` reads once the get reported the item good."""

    def __init__(self, times: Sequence[tuple[float, float]]) -> None:
        self.payload_len = ANNOUNCE_PAYLOAD
        self.zero_copy = False
        self._items = [bytearray(_FORMAT.pack(at, until)) for at, until in times]

    @classmethod
    def empty(cls, n: int) -> Announcements:
        """``n`` zeroed items for a get."""
        return cls([(0.0, 0.0)] * n)

    def __len__(self) -> int:
        return len(self._items)

    def parts(self, i: int) -> list[memoryview]:
        return [memoryview(self._items[i])]

    def until(self, i: int) -> float:
        """When item ``i``'s announcement expires (wall-clock seconds)."""
        return float(_FORMAT.unpack(self._items[i])[1])
