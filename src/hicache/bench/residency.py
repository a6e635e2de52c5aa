"""What a gRPC worker holds, as its KV event stream says: :class:`ResidencyWatch`.

One watch subscribes to one ``hicache serve --grpc-mode`` worker's ``SubscribeKvEvents``
from sequence 0 (a resync: ``AllBlocksCleared``, then every resident page) in a thread of
its own, and keeps the set of block hashes the worker reports resident (L1 or L2: a page
is removed only when it has left both), as smg's event-driven router sees them, without
smg. :func:`page_hashes` gives a prompt's block hashes (SGLang's event hash, unsalted), so
:meth:`ResidencyWatch.held_pages` is the worker's longest resident prefix of a prompt, in
pages. The routing tests and ``hicache bench routing``'s oracle read it. Start other
processes with :func:`hicache.services.process.popen_dying_with_parent` while a watch
runs: a child that runs Python before it execs can abort in gRPC's fork handlers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from hicache.kv_events.hashing import chain_digests, event_hash
from hicache.tokens import encode_tokens

__all__ = ["Residency", "ResidencyError", "ResidencyWatch", "page_hashes"]


def page_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """The event block hash of each whole page of ``tokens`` (shared, no salt), in order;
    the partial last page has none."""
    return [event_hash(d) for d in chain_digests(None, encode_tokens(list(tokens)), 4 * page_size)]


class ResidencyError(RuntimeError):
    """The watch's stream ended with an error, or a wait timed out (the message says)."""


@dataclass(frozen=True, slots=True)
class Residency:
    """A watch's state at one point.

    Attributes:
        resident: block hashes the worker reports resident.
        removed: every block hash it has reported removed since the watch began
            (a later store takes none out).
        sequence: the last batch's sequence number (0 before any).
        cleared: ``AllBlocksCleared`` events seen (the resync's first included).
    """

    resident: frozenset[int]
    removed: frozenset[int]
    sequence: int
    cleared: int


class ResidencyWatch:
    """One worker's resident pages, followed from its KV event stream.

    ``target``: the worker's gRPC address, ``host:port`` or ``grpc://host:port``.
    :meth:`start` subscribes and returns once the resync's first batch is in;
    :meth:`close` cancels the stream and joins the thread (also on ``with`` exit).
    The thread only applies events under the watch's lock; readers take
    :meth:`snapshot` or wait with :meth:`wait`.
    """

    def __init__(self, target: str, *, startup_timeout_s: float = 30.0) -> None:
        self.target = target.removeprefix("grpc://")
        self.startup_timeout_s = startup_timeout_s
        self._cond = threading.Condition()
        self._resident: set[int] = set()
        self._removed: set[int] = set()
        self._sequence = 0
        self._cleared = 0
        self._error: str | None = None
        self._ended = False
        self._channel: grpc.Channel | None = None
        self._call: Any = None  # grpc's streaming call: iterable, cancellable
        self._thread: threading.Thread | None = None

    def start(self) -> ResidencyWatch:
        """Subscribe from 0 and wait for the resync's first batch; :class:`ResidencyError`
        when it does not come within ``startup_timeout_s``."""
        self._channel = grpc.insecure_channel(self.target)
        stub = pb_grpc.SglangSchedulerStub(self._channel)
        self._call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        self._thread = threading.Thread(
            target=self._run, name=f"residency-{self.target}", daemon=True
        )
        self._thread.start()
        try:
            self.wait(lambda r: r.cleared > 0, self.startup_timeout_s, "the resync")
        except BaseException:
            self.close()
            raise
        return self

    def _run(self) -> None:
        assert self._call is not None
        try:
            for batch in self._call:
                with self._cond:
                    for event in batch.events:
                        self._apply(event)
                    self._sequence = batch.sequence_number
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:
                with self._cond:
                    self._error = f"{exc.code().name}: {exc.details()}"
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _apply(self, event: common_pb2.KvCacheEvent) -> None:
        kind = event.WhichOneof("data")
        if kind == "stored":
            self._resident.update(b.block_hash for b in event.stored.blocks)
        elif kind == "removed":
            self._resident.difference_update(event.removed.block_hashes)
            self._removed.update(event.removed.block_hashes)
        elif kind == "cleared":
            self._resident.clear()
            self._cleared += 1

    def snapshot(self) -> Residency:
        """The state now (:class:`ResidencyError` if the stream failed)."""
        with self._cond:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> Residency:
        if self._error is not None:
            raise ResidencyError(f"the KV event stream of {self.target} failed: {self._error}")
        return Residency(
            frozenset(self._resident), frozenset(self._removed), self._sequence, self._cleared
        )

    def held_pages(self, hashes: Sequence[int]) -> int:
        """How many leading pages of a prompt (its :func:`page_hashes`) are resident."""
        with self._cond:
            n = 0
            for h in hashes:
                if h not in self._resident:
                    break
                n += 1
            return n

    def wait(self, until: Callable[[Residency], bool], timeout_s: float, what: str) -> Residency:
        """Wait until ``until(state)`` holds after some batch; returns that state.
        :class:`ResidencyError` naming ``what`` when ``timeout_s`` passes or the stream
        ends first."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while True:
                state = self._snapshot_locked()
                if until(state):
                    return state
                left = end - time.monotonic()
                if self._ended or left <= 0:
                    why = "the stream ended" if self._ended else f"{timeout_s:g} s passed"
                    raise ResidencyError(
                        f"{self.target}: {why} before {what} (sequence {state.sequence},"
                        f" {len(state.resident)} pages resident)"
                    )
                self._cond.wait(left)

    def close(self) -> None:
        """Cancel the stream, join the thread, close the channel. Idempotent."""
        if self._call is not None:
            self._call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._call = None

    def __enter__(self) -> ResidencyWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
