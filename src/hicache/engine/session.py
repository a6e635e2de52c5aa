"""A request's agent-session hint: which session it belongs to, and a subagent's parent.

:class:`SessionHint` is a frozen value, validated when made: ``session_id`` is a non-empty
string of at most :data:`MAX_SESSION_ID_CHARS` printable characters (``str.isprintable``:
no control, format or separator characters but the space); ``parent_session_id`` (a
subagent's parent) is None or such a string, different from ``session_id``; ``ttl_ms``
(how long the session's KV is kept idle after this request, overriding the server's
``--hicache-session-ttl-ms``) is None or an int in ``[0, MAX_SESSION_TTL_MS]``. A parent or
a TTL without a session is refused (:func:`session_hint`). A bad value raises
:class:`~hicache.engine.sampling.InvalidRequest` naming the field. A request without a
hint carries None and is served as any other; the cache keeps a hinted request's
sequence for its session's next turn (:mod:`hicache.cache.sessions`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from hicache.config import MAX_SESSION_TTL_MS
from hicache.engine.sampling import InvalidRequest

MAX_SESSION_ID_CHARS = 256
"""Longest ``session_id`` / ``parent_session_id`` accepted (each live session may become
state the cache keeps, so its key is bounded)."""


class SessionKind(str, enum.Enum):
    """What a request's hint makes it, the one label ``/metrics`` counts sessions by (no
    label carries an id)."""

    NONE = "none"
    """No hint: an anonymous request."""
    SESSION = "session"
    """A ``session_id`` alone."""
    SUBAGENT = "subagent"
    """A ``session_id`` and its ``parent_session_id``."""


def check_session_id(value: Any, param: str) -> str:
    """``value`` when it is a valid session id, else :class:`InvalidRequest` naming
    ``param`` and the rule."""
    if not isinstance(value, str):
        why = f"a {type(value).__name__}"
    elif not value:
        why = "empty"
    elif len(value) > MAX_SESSION_ID_CHARS:
        why = f"{len(value)} characters long"
    elif not value.isprintable():
        bad = next(i for i, ch in enumerate(value) if not ch.isprintable())
        why = f"has a non-printable character at position {bad}"
    else:
        return value
    raise InvalidRequest(
        f"{param} is invalid ({why}); must be a non-empty string of at most"
        f" {MAX_SESSION_ID_CHARS} printable characters",
        param=param,
    )


def check_ttl_ms(value: Any, param: str) -> int | None:
    """``value`` when it is None or a TTL in ms (an int in ``[0, MAX_SESSION_TTL_MS]``),
    else :class:`InvalidRequest` naming ``param``."""
    if value is None or (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SESSION_TTL_MS
    ):
        return value
    raise InvalidRequest(
        f"{param}={value!r} is invalid; must be an int of ms in [0, {MAX_SESSION_TTL_MS}] (24 h)",
        param=param,
    )


@dataclass(frozen=True, slots=True)
class SessionHint:
    """The session a request belongs to, and its parent's for a subagent (validated)."""

    session_id: str
    parent_session_id: str | None = None
    ttl_ms: int | None = None

    def __post_init__(self) -> None:
        check_session_id(self.session_id, "session_id")
        check_ttl_ms(self.ttl_ms, "session_ttl_ms")
        if self.parent_session_id is not None:
            check_session_id(self.parent_session_id, "parent_session_id")
            if self.parent_session_id == self.session_id:
                raise InvalidRequest(
                    "parent_session_id is the request's own session_id; a subagent's"
                    " session names a different parent",
                    param="parent_session_id",
                )

    @property
    def kind(self) -> SessionKind:
        return SessionKind.SESSION if self.parent_session_id is None else SessionKind.SUBAGENT


def session_hint(session_id: Any, parent_session_id: Any, ttl_ms: Any = None) -> SessionHint | None:
    """The hint of a request's fields (None for none); :class:`InvalidRequest` naming the
    field for a bad value, or for ``parent_session_id`` or ``session_ttl_ms`` without
    ``session_id``."""
    if session_id is None:
        if ttl_ms is not None:
            raise InvalidRequest(
                "session_ttl_ms needs session_id: it says how long that session is kept",
                param="session_ttl_ms",
            )
        if parent_session_id is not None:
            raise InvalidRequest(
                "parent_session_id needs session_id: a subagent's request names its own"
                " session and its parent's",
                param="parent_session_id",
            )
        return None
    return SessionHint(session_id, parent_session_id, ttl_ms)


def session_kind(hint: SessionHint | None) -> SessionKind:
    """The kind ``/metrics`` counts a request with ``hint`` under."""
    return SessionKind.NONE if hint is None else hint.kind


__all__ = [
    "MAX_SESSION_ID_CHARS",
    "SessionHint",
    "SessionKind",
    "check_session_id",
    "check_ttl_ms",
    "session_hint",
    "session_kind",
]
