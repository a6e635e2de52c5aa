"""Moving bytes between two instances' registered memory: :class:`Transport`.

A prefill instance writes a request's KV pages straight into the L1 pages a decode
instance allocated for it: both register their L1 pools' buffers once at start
(:meth:`Transport.register`), the decode side tells the prefill side its
:attr:`Transport.endpoint` and its pages' addresses, and the prefill side writes
(:meth:`Transport.write`) a list of :class:`Span` s, each a contiguous copy from one of its
registered addresses to one of the peer's; only the pages' bytes go on the wire.
Implementations: :mod:`hicache.disagg.mooncake_transport`, :mod:`hicache.disagg.nixl_transport`
(:func:`hicache.disagg.backends.make_transport` picks one). Thread safety: :meth:`write`
from one transfer thread while the owner does nothing else with the transport;
:meth:`register` and :meth:`close` are the owner's, before and after every write.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Region", "Span", "TransferFailed", "Transport", "TransportUnavailable"]


class TransportUnavailable(RuntimeError):
    """The backend's package cannot be imported or its engine cannot start; the message
    says what to install or what failed."""


class TransferFailed(RuntimeError):
    """A write did not complete: the peer is gone, refused it, or the deadline passed.
    What landed at the peer is undefined; the peer must not use those pages."""


@dataclass(frozen=True, slots=True)
class Region:
    """A buffer to register: ``addr`` (its first byte), ``nbytes``, and where it lives
    (``cuda``: device memory of CUDA device ``device``; else host RAM)."""

    addr: int
    nbytes: int
    cuda: bool = False
    device: int = 0


@dataclass(frozen=True, slots=True)
class Span:
    """One contiguous copy: ``nbytes`` from local address ``src`` to the peer's ``dst``
    (both inside registered regions)."""

    src: int
    dst: int
    nbytes: int


class Transport(ABC):
    """One instance's end of the page transfers; see the module docstring."""

    name: str
    """The backend's name (``mooncake``, ``nixl``)."""

    @abstractmethod
    def register(self, regions: Sequence[Region]) -> None:
        """Register ``regions`` for transfers (peers may then write into them, and this
        instance may write from them). Called once, before any write."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """How a peer reaches this instance: an opaque ASCII string it passes to
        :meth:`write`."""

    @abstractmethod
    def write(self, peer: str, spans: Sequence[Span], timeout_s: float) -> None:
        """Copy every span to ``peer`` (another instance's :attr:`endpoint`); returns once
        every byte has landed there. :class:`TransferFailed` when it cannot be done within
        ``timeout_s`` seconds (a peer that is gone fails, never hangs)."""

    def quiet(self, peer: str, timeout_s: float) -> bool:
        """Whether no byte of an earlier :meth:`write` to ``peer`` can land any more:
        after a write that failed (its deadline passed, one transfer failed) the others
        it had submitted may still be running; this waits up to ``timeout_s`` for each to
        end (done, failed or cancelled). Only then may the peer be told that the pages
        are free (the sender closes the room after it). The base: writes never outlive
        their call."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Deregister everything and stop; idempotent."""
