"""The L3 record format: round trip, and every kind of damage read as the right miss."""

from __future__ import annotations

import os
import struct

import pytest

from hicache.keys import Namespace, page_keys
from hicache.storage.record import (
    HEADER_SIZE,
    RECORD_MAGIC,
    RECORD_VERSION,
    check_blob,
    check_record,
    encode_header,
    encode_record,
)
from hicache.storage.stats import MissReason

NS = Namespace(
    model="m", weights_fingerprint="w", kv_dtype="float16", layout="page_first", page_size=2
)
OTHER = NS.with_salt("other")
KEY, KEY2 = page_keys(NS, [1, 2, 3, 4])
PAYLOAD = os.urandom(1000)


def check(
    blob: bytes, *, digest: bytes = NS.digest, fp: bytes = KEY.fingerprint, n: int = len(PAYLOAD)
) -> MissReason | None:
    return check_blob(blob, namespace_digest=digest, fingerprint=fp, payload_len=n).reason


def test_round_trip_one_buffer_and_parts() -> None:
    parts = [PAYLOAD[:300], PAYLOAD[300:]]
    blob = encode_record(NS.digest, KEY.fingerprint, parts)
    assert len(blob) == HEADER_SIZE + len(PAYLOAD)
    assert blob[:4] == RECORD_MAGIC and blob[HEADER_SIZE:] == PAYLOAD
    assert check(blob) is None
    header = encode_header(NS.digest, KEY.fingerprint, [PAYLOAD])
    assert header == blob[:HEADER_SIZE]
    r = check_record(
        header,
        [memoryview(PAYLOAD)[:10], memoryview(PAYLOAD)[10:]],
        namespace_digest=NS.digest,
        fingerprint=KEY.fingerprint,
        payload_len=len(PAYLOAD),
    )
    assert r.ok and r.reason is None


# (offset, what) of every header field; a flip anywhere must be 'corrupt'.
HEADER_FIELDS = [(0, "magic"), (4, "version"), (6, "header size"), (8, "namespace digest"),
                 (39, "digest end"), (40, "token fingerprint"), (48, "payload length"),
                 (56, "checksum")]  # fmt: skip


@pytest.mark.parametrize(("offset", "what"), HEADER_FIELDS, ids=[w for _, w in HEADER_FIELDS])
def test_flipped_header_byte_is_corrupt(offset: int, what: str) -> None:
    blob = bytearray(encode_record(NS.digest, KEY.fingerprint, [PAYLOAD]))
    blob[offset] ^= 0x01
    assert check(bytes(blob)) is MissReason.CORRUPT, what


@pytest.mark.parametrize("offset", [0, 1, 499, len(PAYLOAD) - 1])
def test_flipped_payload_byte_is_corrupt(offset: int) -> None:
    blob = bytearray(encode_record(NS.digest, KEY.fingerprint, [PAYLOAD]))
    blob[HEADER_SIZE + offset] ^= 0x80
    assert check(bytes(blob)) is MissReason.CORRUPT


def test_length_damage_is_corrupt() -> None:
    blob = encode_record(NS.digest, KEY.fingerprint, [PAYLOAD])
    assert check(blob[:-1]) is MissReason.CORRUPT  # truncated
    assert check(blob + b"x") is MissReason.CORRUPT  # trailing garbage
    assert check(blob[:10]) is MissReason.CORRUPT  # torn header
    assert check(b"") is MissReason.CORRUPT
    # A consistent record of another payload size (reader expects a different page size).
    small = encode_record(NS.digest, KEY.fingerprint, [PAYLOAD[:999]])
    assert check(small) is MissReason.CORRUPT
    r = check_record(
        small[:HEADER_SIZE],
        [PAYLOAD],
        namespace_digest=NS.digest,
        fingerprint=KEY.fingerprint,
        payload_len=1000,
    )
    assert r.reason is MissReason.CORRUPT and "payload length" in r.detail


def test_forged_header_fields_with_valid_checksum() -> None:
    """A well-formed header with a wrong magic is corrupt even if its checksum fits; an
    intact record of another spec version (1, or a future 3) is stale: never data."""
    import xxhash

    for magic, version, want in (
        (b"XXXX", RECORD_VERSION, MissReason.CORRUPT),
        (RECORD_MAGIC, 1, MissReason.STALE),
        (RECORD_MAGIC, RECORD_VERSION + 1, MissReason.STALE),
    ):
        head = struct.pack(
            "<4sHH32s8sQ", magic, version, HEADER_SIZE, NS.digest, KEY.fingerprint, len(PAYLOAD)
        )
        cs = xxhash.xxh3_64(head)
        cs.update(PAYLOAD)
        blob = head + struct.pack("<Q", cs.intdigest()) + PAYLOAD
        assert check(blob) is want


def test_other_namespace_is_foreign() -> None:
    blob = encode_record(OTHER.digest, KEY.fingerprint, [PAYLOAD])
    r = check_blob(
        blob, namespace_digest=NS.digest, fingerprint=KEY.fingerprint, payload_len=len(PAYLOAD)
    )
    assert r.reason is MissReason.FOREIGN and "namespace" in r.detail


def test_other_tokens_is_foreign() -> None:
    blob = encode_record(NS.digest, KEY2.fingerprint, [PAYLOAD])
    r = check_blob(
        blob, namespace_digest=NS.digest, fingerprint=KEY.fingerprint, payload_len=len(PAYLOAD)
    )
    assert r.reason is MissReason.FOREIGN and "fingerprint" in r.detail


def test_encode_rejects_bad_digest_sizes() -> None:
    with pytest.raises(ValueError, match="digest"):
        encode_header(b"x" * 31, KEY.fingerprint, [PAYLOAD])
    with pytest.raises(ValueError, match="fingerprint"):
        encode_header(NS.digest, b"x" * 7, [PAYLOAD])
