"""Block hashes: SGLang's KV-event hash chain, so routers that check them find them equal.

Page ``i`` of a path has the digest ``SHA-256(digest[i-1] + tokens_i)``, where
``tokens_i`` are the page's token ids as ``uint32`` little-endian (the bytes of a tree
key, :mod:`hicache.tokens`) and ``digest[-1]`` is absent for shared pages, or
``SHA-256(b"sglang-cache-salt-v1\\0" + salt)`` for a tenant's (its ``cache_salt``).
The published hash is the digest's first 8 bytes as a big-endian signed integer.

This is SGLang's event hash (``compute_node_event_hash_values``), which smg's relay can
verify (``SMG_KV_EVENT_HASH_CHECK=sglang``). smg's router does not match on these
hashes: it recomputes a content hash per block from ``token_ids`` (XXH3, seeded by the
event's ``cache_salt``) and chains them by position; the block hash names a block for
``parent_block_hash`` and for removals, so it must be unique per instance (it is: one
tree path per prefix and tenant).
"""

from __future__ import annotations

import hashlib

__all__ = ["SALT_DOMAIN", "chain_digests", "event_hash", "salt_seed"]

SALT_DOMAIN = b"sglang-cache-salt-v1\0"
"""Prefix of a tenant's chain seed (SGLang's)."""


def salt_seed(cache_salt: str) -> bytes | None:
    """The 32-byte digest a tenant's chain starts from; ``None`` for ``""`` (shared)."""
    if not cache_salt:
        return None
    return hashlib.sha256(SALT_DOMAIN + cache_salt.encode("utf-8")).digest()


def chain_digests(prior: bytes | None, key: bytes, page_bytes: int) -> list[bytes]:
    """The digest of each whole page of ``key`` (encoded tokens, ``page_bytes`` per
    page), chained from ``prior`` (the digest before the first page, or ``None``)."""
    out: list[bytes] = []
    for start in range(0, len(key) - page_bytes + 1, page_bytes):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(key[start : start + page_bytes])
        prior = h.digest()
        out.append(prior)
    return out


def event_hash(digest: bytes) -> int:
    """The published block hash of a page digest: its first 8 bytes, big-endian, signed."""
    return int.from_bytes(digest[:8], "big", signed=True)
