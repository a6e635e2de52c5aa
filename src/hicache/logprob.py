"""One token's log probability record, :class:`TokenLogprob`, and its wire form.

The engine makes these (:mod:`hicache.engine.logits`); a prefill instance sends the ones
it computed for a request to its decode instance inside the room's result
(:class:`~hicache.disagg.rooms.RoomResult`), so the record lives below both. Wire form
(:meth:`TokenLogprob.to_wire`): ``[token_id, logprob, top_ids, top_logprobs]``, the
last two base64 of the packed little-endian int32 / float32 alternatives; lossless (a
JSON float round-trips a Python float, the alternatives are fp32 already).

This module is pure: no torch, no threads, no IO.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TokenLogprob", "logprobs_from_wire", "logprobs_to_wire"]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log probability under the model, and the most likely alternatives.

    ``token_id``: the token (generated, or the prompt token at that position).
    ``logprob``: its natural-log probability (<= 0) under the raw ``log_softmax`` of the
    logits at the position before it. :attr:`top`: the ``k`` most likely tokens there as
    ``(token_id, logprob)``, most likely first (it may or may not hold ``token_id``);
    empty for ``k = 0``.

    The alternatives are kept packed, as the fp32 log-softmax gave them: ``top_id_bytes``
    ``k`` native int32, ``top_logprob_bytes`` ``k`` native float32 (lossless: the values are
    fp32). A record with ``k = 20`` takes about 330 bytes instead of the 2.5 kB of a tuple
    of 20 ``(int, float)`` pairs: ``n`` copies times ``max_tokens`` of them are what a
    ``logprobs`` request holds until it ends. Build one from pairs with :meth:`of`.
    """

    token_id: int
    logprob: float
    top_id_bytes: bytes = b""
    top_logprob_bytes: bytes = b""

    def __post_init__(self) -> None:
        if len(self.top_id_bytes) % 4 or len(self.top_id_bytes) != len(self.top_logprob_bytes):
            raise ValueError(
                f"top_id_bytes ({len(self.top_id_bytes)} bytes) and top_logprob_bytes"
                f" ({len(self.top_logprob_bytes)} bytes) must both hold k 4-byte values"
            )

    @classmethod
    def of(
        cls, token_id: int, logprob: float, top: Sequence[tuple[int, float]] = ()
    ) -> TokenLogprob:
        """A record from ``top`` as ``(token_id, logprob)`` pairs (logprobs rounded to fp32)."""
        return cls(
            token_id,
            logprob,
            array("i", [t for t, _ in top]).tobytes(),
            array("f", [v for _, v in top]).tobytes(),
        )

    @property
    def k(self) -> int:
        """How many alternatives :attr:`top` holds."""
        return len(self.top_id_bytes) // 4

    @property
    def top(self) -> tuple[tuple[int, float], ...]:
        """The alternatives as ``(token_id, logprob)`` pairs, most likely first."""
        if not self.top_id_bytes:
            return ()
        ids = memoryview(self.top_id_bytes).cast("i").tolist()
        values = memoryview(self.top_logprob_bytes).cast("f").tolist()
        return tuple(zip(ids, values, strict=True))

    def cut(self, k: int) -> TokenLogprob:
        """This record with its first ``k`` alternatives only (itself when it holds no
        more than ``k``)."""
        if k >= self.k:
            return self
        return TokenLogprob(
            self.token_id, self.logprob, self.top_id_bytes[: 4 * k], self.top_logprob_bytes[: 4 * k]
        )

    def to_wire(self) -> list[object]:
        """This record as JSON values (see the module docstring)."""
        return [
            self.token_id,
            self.logprob,
            _b64(_little(self.top_id_bytes, "i")),
            _b64(_little(self.top_logprob_bytes, "f")),
        ]

    @classmethod
    def from_wire(cls, raw: object) -> TokenLogprob:
        """The record :meth:`to_wire` wrote; ValueError on anything else."""
        if not isinstance(raw, list) or len(raw) != 4:
            raise ValueError(f"a token logprob must be [id, logprob, ids, logprobs], got {raw!r}")
        token_id, logprob, ids, values = raw
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(f"a token logprob's id must be an int, got {token_id!r}")
        if isinstance(logprob, bool) or not isinstance(logprob, int | float):
            raise ValueError(f"a token logprob's logprob must be a number, got {logprob!r}")
        if not isinstance(ids, str) or not isinstance(values, str):
            raise ValueError("a token logprob's alternatives must be base64 strings")
        try:
            id_bytes = _little(base64.b64decode(ids, validate=True), "i")
            value_bytes = _little(base64.b64decode(values, validate=True), "f")
        except ValueError as exc:
            raise ValueError(f"a token logprob's alternatives are not base64: {exc}") from None
        return cls(token_id, float(logprob), id_bytes, value_bytes)


def logprobs_to_wire(records: Sequence[TokenLogprob | None]) -> list[object]:
    """``records`` as JSON values, a missing one (None) as null."""
    return [None if r is None else r.to_wire() for r in records]


def logprobs_from_wire(raw: object) -> tuple[TokenLogprob | None, ...]:
    """The records :func:`logprobs_to_wire` wrote; ValueError on anything else."""
    if not isinstance(raw, list):
        raise ValueError(f"token logprobs must be a list, got {type(raw).__name__}")
    return tuple(None if r is None else TokenLogprob.from_wire(r) for r in raw)


def _little(data: bytes, code: str) -> bytes:
    """``data`` (packed 4-byte ``code`` values) between native and little-endian order
    (the same swap both ways; nothing on a little-endian host)."""
    if sys.byteorder == "little" or not data:
        return data
    values = array(code, data)
    values.byteswap()
    return values.tobytes()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
