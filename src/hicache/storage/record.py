"""The L3 page record: a 64-byte header followed by the page payload.

Header (little-endian, :data:`HEADER_SIZE` = 64 bytes): magic ``b"HCR1"`` (4), record
version ``RECORD_VERSION`` (2), header size (2), the writer's namespace digest (32), the
page's token fingerprint (8), payload length in bytes (8), and an xxh3_64 checksum (8) of
header[0:56] followed by the payload. Checks, in order: total length, magic, header size,
payload length, checksum, version, namespace digest, token fingerprint; a failed check
is a miss (``corrupt`` up to the checksum, ``stale`` for another version, ``foreign`` for
another digest or fingerprint), never data. Payload: a full-KV page is
``HostPool.page_bytes`` bytes in the host layout's own order (kind slabs concatenated, K
then V), the namespace pinning the layout; under ``records="head"`` one record per group of
K/V heads (:mod:`hicache.storage.headio`); a ``"mamba"`` record is one snapshot slot
(:mod:`hicache.storage.slotio`). The format, per-layout byte orders and the checksum
choice: ``docs/l3-keys.md``, "Records".
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from hicache.keys import DIGEST_BYTES, FINGERPRINT_BYTES, KEY_SPEC_VERSION
from hicache.storage.stats import MissReason

__all__ = [
    "HEADER_SIZE",
    "RECORD_MAGIC",
    "RECORD_VERSION",
    "RecordCheck",
    "check_blob",
    "check_record",
    "encode_header",
    "encode_record",
    "payload_checksum",
    "record_size",
]

RECORD_MAGIC = b"HCR1"
RECORD_VERSION = KEY_SPEC_VERSION
"""The record version is the key spec's: a record of another spec version reads as
``stale``."""
HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHH32s8sQQ")
_CHECKED = 56  # header bytes covered by the checksum (all but the checksum itself)
assert _HEADER.size == HEADER_SIZE

Bytes = bytes | bytearray | memoryview
"""Anything exposing a contiguous byte buffer."""


@dataclass(frozen=True, slots=True)
class RecordCheck:
    """Outcome of checking one record: ``reason`` is None when the record is good."""

    reason: MissReason | None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is None


GOOD = RecordCheck(None)


def record_size(payload_len: int) -> int:
    """Bytes of a record whose payload is ``payload_len`` bytes."""
    return HEADER_SIZE + payload_len


def payload_checksum(head: Bytes, payload: Sequence[Bytes]) -> int:
    """xxh3_64 over ``head`` (the first 56 header bytes) and then each payload part."""
    h = xxhash.xxh3_64(head)
    for part in payload:
        h.update(part)
    return h.intdigest()


def encode_header(namespace_digest: bytes, fingerprint: bytes, payload: Sequence[Bytes]) -> bytes:
    """The 64-byte header of a record with ``payload`` (parts concatenated in order)."""
    if len(namespace_digest) != DIGEST_BYTES:
        raise ValueError(
            f"namespace digest must be {DIGEST_BYTES} bytes, got {len(namespace_digest)}"
        )
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    length = sum(memoryview(p).nbytes for p in payload)
    head = _HEADER.pack(
        RECORD_MAGIC, RECORD_VERSION, HEADER_SIZE, namespace_digest, fingerprint, length, 0
    )[:_CHECKED]
    return head + struct.pack("<Q", payload_checksum(head, payload))


def encode_record(namespace_digest: bytes, fingerprint: bytes, payload: Sequence[Bytes]) -> bytes:
    """Header and payload as one ``bytes`` object (one copy of the payload)."""
    return b"".join([encode_header(namespace_digest, fingerprint, payload), *payload])


def check_record(
    header: Bytes,
    payload: Sequence[Bytes],
    *,
    namespace_digest: bytes,
    fingerprint: bytes,
    payload_len: int,
) -> RecordCheck:
    """Check a record read as ``header`` (64 bytes) plus ``payload`` parts.

    ``payload_len`` is the length the reader expects (its pool's ``page_bytes``); the parts
    must add up to it. Returns :data:`GOOD` or a miss (``corrupt``, ``stale`` or
    ``foreign``) with a human-readable detail.
    """
    hv = memoryview(header).cast("B")
    if hv.nbytes != HEADER_SIZE:
        return RecordCheck(
            MissReason.CORRUPT, f"header is {hv.nbytes} bytes, expected {HEADER_SIZE}"
        )
    magic, version, hsize, digest, fp, length, checksum = _HEADER.unpack(hv)
    if magic != RECORD_MAGIC:
        return RecordCheck(MissReason.CORRUPT, f"bad magic {magic!r}")
    if hsize != HEADER_SIZE:
        return RecordCheck(MissReason.CORRUPT, f"header size {hsize}, expected {HEADER_SIZE}")
    if length != payload_len:
        return RecordCheck(MissReason.CORRUPT, f"payload length {length}, expected {payload_len}")
    got = sum(memoryview(p).nbytes for p in payload)
    if got != payload_len:
        return RecordCheck(MissReason.CORRUPT, f"read {got} payload bytes, expected {payload_len}")
    if payload_checksum(hv[:_CHECKED], payload) != checksum:
        return RecordCheck(MissReason.CORRUPT, "checksum mismatch")
    if version != RECORD_VERSION:  # intact, of another spec: never data
        return RecordCheck(MissReason.STALE, f"record version {version}, expected {RECORD_VERSION}")
    if digest != namespace_digest:
        return RecordCheck(MissReason.FOREIGN, "namespace digest differs")
    if fp != fingerprint:
        return RecordCheck(MissReason.FOREIGN, "token fingerprint differs")
    return GOOD


def check_blob(
    blob: Bytes, *, namespace_digest: bytes, fingerprint: bytes, payload_len: int
) -> RecordCheck:
    """:func:`check_record` of a whole record held in one buffer (length checked first)."""
    mv = memoryview(blob).cast("B")
    if mv.nbytes != record_size(payload_len):
        return RecordCheck(
            MissReason.CORRUPT,
            f"record is {mv.nbytes} bytes, expected {record_size(payload_len)}",
        )
    return check_record(
        mv[:HEADER_SIZE],
        [mv[HEADER_SIZE:]],
        namespace_digest=namespace_digest,
        fingerprint=fingerprint,
        payload_len=payload_len,
    )
