"""Why a request failed, as a kind the HTTP server turns into a status: :class:`Failure`.

A request's error is text (``Request.error``, ``RequestOutput.error``) that crosses threads
and layers (the receiver's links, step inputs, the scheduler's ends). A :class:`Failure`
is that text with a :class:`FailureKind` attached: a ``str`` everywhere it is used as one,
so every layer passes it on unchanged, and the server reads its kind
(:func:`failure_kind`) to choose the status (``hicache.server.http_base.FAILURE_STATUS``,
the one table). Text built from it (an f-string) is a plain ``str`` again: a failure whose
kind was not said is :attr:`FailureKind.INTERNAL`.
"""

from __future__ import annotations

import enum

__all__ = ["Failure", "FailureKind", "failure_kind"]


class FailureKind(str, enum.Enum):
    """What went wrong, from the client's point of view."""

    INTERNAL = "internal"
    """This server failed (a bug, a failed step or forward): HTTP 500."""
    REFUSED = "refused"
    """The request as sent can never be served: its room is in use or was used, its
    prefill/decode pair's layouts differ, its ``bootstrap_host`` does not resolve (400,
    the same on both instances of a pair, whichever comes first)."""
    PEER_TIMEOUT = "peer_timeout"
    """The other instance of its pair did not answer within the bound (a decode
    instance's ``health_interval_s x health_failures``, 3 s): 504, retryable."""
    PEER_FAILED = "peer_failed"
    """The other instance of its pair answered but failed the room (its request failed
    or was aborted, a transfer failed, it is stopping): 502, retryable."""
    STOPPING = "stopping"
    """This server is stopping (closed, or its ranks failed): 503, retryable elsewhere."""


class Failure(str):
    """An error text that knows its :class:`FailureKind` (see the module docstring)."""

    kind: FailureKind

    def __new__(cls, text: str, kind: FailureKind) -> Failure:
        self = super().__new__(cls, text)
        self.kind = kind
        return self

    def __reduce__(self) -> tuple[type[Failure], tuple[str, FailureKind]]:
        return (Failure, (str(self), self.kind))


def failure_kind(error: str | None) -> FailureKind:
    """The kind of ``error`` (a plain text: :attr:`FailureKind.INTERNAL`)."""
    return error.kind if isinstance(error, Failure) else FailureKind.INTERNAL
