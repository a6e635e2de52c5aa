"""The one token-id codec: token ids as unsigned 32-bit little-endian bytes.

Radix-tree keys, L3 page keys and fingerprints all hash or compare these bytes, so every
module encodes token ids here and nowhere else. Encoding is 4 bytes per id, ids in
``[0, 2**32)``; a page of ``page_size`` tokens is ``4 * page_size`` bytes.

This module is pure: no torch, no threads, no IO; it imports nothing from hicache.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "TOKEN_BYTES",
    "TOKEN_ID_LIMIT",
    "TokenIds",
    "decode_tokens",
    "encode_tokens",
    "num_tokens",
]

TOKEN_BYTES = 4
"""Bytes per encoded token id (uint32 little-endian)."""

TOKEN_ID_LIMIT = 2**32
"""Token ids must lie in ``[0, TOKEN_ID_LIMIT)``."""

TokenIds = Sequence[int] | bytes
"""Token ids: a sequence of ints (list, ``array('I')``, 1-D integer numpy array or CPU
tensor), or ``bytes`` already encoded by :func:`encode_tokens`."""

_NATIVE_U32 = array("I").itemsize == 4 and array("I", [1]).tobytes()[0] == 1
"""Whether ``array('I')`` is uint32 little-endian here (the fast path)."""


def encode_tokens(tokens: TokenIds | Any, *, strict: bool = False) -> bytes:
    """``tokens`` as uint32 little-endian bytes (4 per id).

    ``bytes`` are taken as already encoded (their length must be a multiple of 4). Raises
    ValueError naming the first id that is not an integer in ``[0, 2**32)``, or for an
    array that is not 1-D. A list, tuple or range of ints takes a fast path that accepts
    Python ``bool`` items as 0 and 1 (``bool`` is an ``int``); ``strict`` rejects them there
    too, at about four times the cost (arrays of dtype bool are always rejected).
    """
    if isinstance(tokens, bytes):
        if len(tokens) % TOKEN_BYTES:
            raise ValueError(
                f"encoded tokens have {len(tokens)} bytes, not a multiple of {TOKEN_BYTES}"
            )
        return tokens
    if isinstance(tokens, array) and tokens.typecode == "I" and _NATIVE_U32:
        return tokens.tobytes()
    if _NATIVE_U32 and isinstance(tokens, (list, tuple, range)):
        if strict and not isinstance(tokens, range) and bool in set(map(type, tokens)):
            raise _bad_token(tokens)
        packed = array("I")
        try:
            if isinstance(tokens, list):
                packed.fromlist(tokens)  # the fastest path from a list
            else:
                packed.extend(tokens)
        except (OverflowError, TypeError):
            return _encode_array(tokens)  # raises, naming the first bad id or the shape
        return packed.tobytes()
    return _encode_array(tokens)


def _encode_array(tokens: Any) -> bytes:
    """The general path: anything numpy can view as a 1-D integer array."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D; got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise _bad_token(arr.tolist())
    if int(arr.min()) < 0 or int(arr.max()) >= TOKEN_ID_LIMIT:
        raise _bad_token(arr.tolist())
    data: bytes = arr.astype("<u4", copy=False).tobytes()
    return data


def _bad_token(values: Sequence[Any]) -> ValueError:
    """The error naming the first bad id of ``values``."""
    for i, v in enumerate(values):
        try:
            if isinstance(v, bool):
                raise TypeError("a bool is not a token id")
            iv = operator.index(v)
        except TypeError:
            return ValueError(f"token id at position {i} is {v!r}; token ids must be integers")
        if not 0 <= iv < TOKEN_ID_LIMIT:
            return ValueError(
                f"token id at position {i} is {iv}; token ids must lie in [0, 2**32) "
                "(they are encoded as u32 little-endian)"
            )
    return ValueError("token ids must be integers in [0, 2**32)")


def decode_tokens(data: bytes) -> list[int]:
    """Inverse of :func:`encode_tokens`: the ids of ``data`` (a multiple of 4 bytes)."""
    if len(data) % TOKEN_BYTES:
        raise ValueError(f"encoded tokens have {len(data)} bytes, not a multiple of {TOKEN_BYTES}")
    if _NATIVE_U32:
        packed = array("I")
        packed.frombytes(data)
        return packed.tolist()
    return [int(v) for v in np.frombuffer(data, dtype="<u4")]  # pragma: no cover


def num_tokens(data: bytes) -> int:
    """How many token ids ``data`` encodes."""
    return len(data) // TOKEN_BYTES
