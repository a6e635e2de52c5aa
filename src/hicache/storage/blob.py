"""Record encode/decode for backends that move whole records as ``bytes`` (memory, redis).

Such a backend checks a record before copying it, so a page whose record fails a check is
never written into the host pool.
"""

from __future__ import annotations

from hicache.keys import PageKey
from hicache.storage.pageio import Payloads
from hicache.storage.record import HEADER_SIZE, check_blob, encode_record
from hicache.storage.stats import MissReason

__all__ = ["decode_page", "encode_page"]


def encode_page(namespace_digest: bytes, key: PageKey, pages: Payloads, i: int) -> bytes:
    """The record (header + payload) of page ``i`` of ``pages`` under ``key``."""
    return encode_record(namespace_digest, key.fingerprint, pages.parts(i))


def decode_page(
    blob: bytes | bytearray | memoryview | None,
    namespace_digest: bytes,
    key: PageKey,
    pages: Payloads,
    i: int,
) -> MissReason | None:
    """Check ``blob`` (None: absent) and, when good, copy its payload into page ``i``."""
    if blob is None:
        return MissReason.ABSENT
    check = check_blob(
        blob,
        namespace_digest=namespace_digest,
        fingerprint=key.fingerprint,
        payload_len=pages.payload_len,
    )
    if not check.ok:
        return check.reason
    pages.fill(i, memoryview(blob).cast("B")[HEADER_SIZE:])
    return None
