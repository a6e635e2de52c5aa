"""The prefill side's sender: writes one rank's share of a prefill's pages into the pages
the decode side registered for its room, chunk by chunk as they are computed
(:class:`PrefillSender`, one thread per rank; its rooms are the rank's
:class:`~hicache.disagg.rank_rooms.RankRooms`, where "closing" a room ends this rank's share).

The engine hands over :class:`SendJob` s: a *partial* job after each prefill chunk (the
whole pages so far of the stores that hold every page until the end: full KV, indexer
keys) and, once the first token is sampled, the *final* job (every store's remaining pages
and the :class:`~hicache.disagg.rooms.RoomResult`). Jobs wait for the room's registration
and arming; each writes, per store, this rank's share of the pages the decode side lacks
(:func:`plan_spans`).
Invariants: the sender never touches the cache; ``done(rid, error)`` is reported once per
request; a requeued request's room restarts (:meth:`~PrefillSender.restart`); an abort is
seen between writes (at most ``BATCH_BYTES`` apart); a room closes only when no byte can
land (after a failed write, once :meth:`~hicache.disagg.transport.Transport.quiet`); success
is reported only once the decode side took the pages (within ``timeout_s``). Why:
``docs/architecture.md``, "When it moves" and "A page given away is never written".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hicache.disagg.layout import InstanceLayout, Registration
from hicache.disagg.pages import PoolGeometry, page_spans
from hicache.disagg.rank_rooms import RankRooms
from hicache.disagg.rooms import RoomResult
from hicache.disagg.shares import shares_of
from hicache.disagg.transport import Span, TransferFailed, Transport

log = logging.getLogger(__name__)

__all__ = ["PrefillSender", "SendJob", "SourcePages", "plan_spans"]

BATCH_BYTES = 64 << 20
"""Bytes written between two looks at the room's abort flag."""


@dataclass(frozen=True, slots=True)
class SourcePages:
    """One store's pages of a request on the prefill side: ``pages[i]`` of the pool
    ``geometry`` describes holds sequence page ``first + i``; ``stable``: held until the
    request ends (sent chunk by chunk), else only its last pages stay (sent at the end)."""

    name: str
    geometry: PoolGeometry
    first: int
    pages: tuple[int, ...]
    stable: bool = True


@dataclass(frozen=True, slots=True)
class SendJob:
    """Pages of request ``rid`` of ``room`` to send: its prompt's ``prompt_len`` and
    ``prompt_hash``, its pages per store (``sources``, the full KV first). A partial job
    (``upto`` set) covers the stable stores' sequence pages before ``upto`` (whole pages,
    computed); the final one (``result`` set) every page, and ends the room."""

    rid: str
    room: int
    prompt_len: int
    prompt_hash: str
    sources: tuple[SourcePages, ...]
    result: RoomResult | None = None
    upto: int | None = None

    def __post_init__(self) -> None:
        if (self.result is None) == (self.upto is None):
            raise ValueError("a send job is either partial (upto) or final (result)")

    @property
    def final(self) -> bool:
        return self.result is not None


def plan_spans(
    job: SendJob, reg: Registration, sent: int = 0, *, layout: InstanceLayout, rank: int = 0
) -> list[tuple[str, list[Span]]]:
    """The copies prefill rank ``rank`` (of an instance of ``layout``) makes to give the
    decode side, per store, the sequence pages it registered past its ``skip_pages``: of
    a partial job, the stable stores' pages in ``[sent, job.upto)``; of the final job,
    the stable stores' pages from ``sent`` on and the other stores' whole registered
    range (a ``state`` store's slot whatever the prefix); its share of each decode rank's
    rows (:func:`~hicache.disagg.shares.shares_of`).
    Returns ``(decode endpoint, spans)`` per decode rank it writes, in rank order.
    ValueError naming the room, store and pages when the pair cannot be served (another
    prompt, a store or page the prefill does not hold)."""
    if (reg.prompt_len, reg.prompt_hash) != (job.prompt_len, job.prompt_hash):
        raise ValueError(
            f"room {job.room}: the decode side's prompt ({reg.prompt_len} tokens) is not the"
            f" prefill side's ({job.prompt_len} tokens): both must tokenize the same prompt"
        )
    sources = {s.name: s for s in job.sources}
    whole = {s.name for s in reg.layout.stores if s.state}  # a slot, not sequence pages
    per_rank: dict[int, list[Span]] = {}
    for target in reg.targets:
        src = sources.get(target.name)
        if src is None:
            if job.final:
                raise ValueError(
                    f"room {job.room}: the prefill side holds no store {target.name!r}"
                )
            continue  # a partial job carries the stable stores only
        if not job.final and not src.stable:
            continue
        begin = target.first
        if target.name not in whole:
            begin = max(begin, reg.skip_pages, sent if src.stable else 0)
        end = target.first + len(target.pages)
        if job.upto is not None:
            end = min(end, job.upto)
        if begin >= end:
            continue
        if begin < src.first or end > src.first + len(src.pages):
            raise ValueError(
                f"room {job.room}: store {target.name!r} pages [{begin}, {end}) are wanted but"
                f" the prefill side holds [{src.first}, {src.first + len(src.pages)})"
            )
        for share in shares_of(layout, reg.layout, target.name, rank):
            dst = reg.ranks[share.decode_rank].geometry.get(target.name)
            if dst is None:
                raise ValueError(
                    f"room {job.room}: decode rank {share.decode_rank} names no pool of"
                    f" store {target.name!r}"
                )
            per_rank.setdefault(share.decode_rank, []).extend(
                page_spans(
                    src.geometry,
                    src.pages[begin - src.first : end - src.first],
                    PoolGeometry.from_dict(dst),
                    target.pages[begin - target.first : end - target.first],
                    share.columns,
                )
            )
    return [(reg.ranks[d].endpoint, spans) for d, spans in sorted(per_rank.items()) if spans]


@dataclass(slots=True)
class _Room:
    """The sender's state of one room: jobs not written yet (in order), the decode
    side's registration once taken, the stable stores' pages written so far (``sent``),
    and why a write failed (later jobs are not written; the final one reports it)."""

    jobs: list[SendJob] = field(default_factory=list)
    reg: Registration | None = None
    sent: int = 0
    error: str | None = None


class PrefillSender:
    """One thread that serves :class:`SendJob` s, each room's in order, as rooms become
    ready; see the module docstring. ``done(rid, error)`` is called on the sender's
    thread once per final job (``error`` None: the decode side has every page).
    ``timeout_s``: one job's bound."""

    def __init__(
        self,
        rooms: RankRooms,
        transport: Transport,
        done: Callable[[str, str | None], None],
        *,
        layout: InstanceLayout,
        timeout_s: float,
    ) -> None:
        self.rooms = rooms
        self.layout = layout
        self.transport = transport
        self._done = done
        self._timeout_s = timeout_s
        self._inbox: queue.Queue[SendJob | tuple[str, int, str]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-pd-sender", daemon=True)
        self._unclaimed: dict[int, tuple[SendJob, float]] = {}
        """Rooms closed ``SUCCESS`` whose ``done`` waits for the decode side to take the
        pages (or give the room up), each with its deadline (the sender's thread only)."""
        self.sent_bytes = 0
        """Bytes written so far (the sender thread writes it)."""
        self.partial_writes = 0
        """Partial jobs written so far (pages sent before the prefill was done)."""

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: SendJob) -> None:
        """Send ``job`` once its room is registered (any thread)."""
        self._inbox.put(job)
        self.rooms.poke()

    def cancel(self, room: int, why: str) -> None:
        """The prefill side gives ``room`` up (its request ended, or its client went
        away): nothing more is written, the room closes with ``why`` (after any write in
        flight), and its final job, if not written yet, ends with it."""
        self._inbox.put(("cancel", room, why))
        self.rooms.poke()

    def restart(self, room: int) -> None:
        """``room``'s request was requeued: its queued partial jobs are dropped (their
        pages may be freed) and nothing written counts as sent (the next jobs write it all
        again, after any write in flight: one thread, in order)."""
        self._inbox.put(("restart", room, ""))
        self.rooms.poke()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; final jobs not written end with an error (``done``)."""
        self._stop.set()
        self.rooms.poke()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        state: dict[int, _Room] = {}
        try:
            while not self._stop.is_set():
                self._take_inbox(state)
                self.rooms.expire()
                progressed = self._claims()
                for room, st in list(state.items()):
                    progressed |= self._serve(room, st, state)
                if not progressed:
                    self.rooms.wait(0.05)
        except BaseException:
            log.exception("the PD sender thread failed")
            raise
        finally:
            for job, _ in self._unclaimed.values():
                self._report(job, "the prefill instance is stopping")
            self._take_inbox(state)
            for room, st in state.items():
                for job in st.jobs:
                    if job.final:
                        self._end(job, error="the prefill instance is stopping")
                self.rooms.close(room, error="the prefill instance is stopping")

    def _claims(self) -> bool:
        """Report the rooms closed ``SUCCESS`` that the decode side took (success), gave
        up (its abort came after the last write), or did not take within the bound."""
        changed = False
        for room, (job, deadline) in list(self._unclaimed.items()):
            if self.rooms.taken(room):
                self._report(job, None)
            elif self.rooms.aborted(room):
                self._report(job, f"room {room}: the decode side gave it up")
            elif time.monotonic() >= deadline:
                self._report(job, f"room {room}: the decode side did not take its pages")
            else:
                continue
            del self._unclaimed[room]
            changed = True
        return changed

    def _report(self, job: SendJob, error: str | None) -> None:
        try:
            self._done(job.rid, error)
        except Exception:
            log.exception("reporting the end of room %d failed", job.room)

    def _take_inbox(self, state: dict[int, _Room]) -> None:
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, SendJob):
                state.setdefault(item.room, _Room()).jobs.append(item)
                continue
            what, room, why = item
            st = state.get(room)
            if what == "restart":
                if st is not None:
                    st.jobs = [j for j in st.jobs if j.final]
                    st.sent = 0
                continue
            # cancel: after any write of the room (this thread's), never under one
            for job in [] if st is None else st.jobs:
                if job.final:
                    self._end(job, error=why)
            self.rooms.close(room, error=why)
            state.pop(room, None)

    def _serve(self, room: int, st: _Room, state: dict[int, _Room]) -> bool:
        """Write what ``room`` has ready; whether anything changed."""
        if st.reg is not None and st.error is None and self.rooms.aborted(room):
            st.error = f"room {room}: the decode side aborted it"
            self.rooms.close(room, error=st.error)  # no write is in flight: acknowledged
            return True
        if not st.jobs:
            return False
        if st.reg is None and st.error is None:
            status = self.rooms.status([room])[0]
            if status is not None and status.state.closed:  # expired, aborted, failed
                st.error = status.error or f"room {room} {status.state.value}"
            else:
                st.reg = self.rooms.start(room)
                if st.reg is None:
                    return False  # not registered yet
        while st.jobs:
            job = st.jobs.pop(0)
            if st.error is None:
                st.error = self._write_job(job, st)
            if job.final:
                del state[room]
                if st.error is None:  # reported once the decode side took the pages
                    self.rooms.close(job.room, result=job.result)
                    self._unclaimed[room] = (job, time.monotonic() + self._timeout_s)
                else:
                    self._end(job, error=st.error)
        return True

    def _write_job(self, job: SendJob, st: _Room) -> str | None:
        """Write ``job``; None, or why the room failed (the room is closed then)."""
        assert st.reg is not None
        try:
            writes = plan_spans(job, st.reg, st.sent, layout=self.layout, rank=self.rooms.rank)
            for endpoint, spans in writes:
                self._write(job, endpoint, spans)
        except ValueError as exc:  # the pair cannot be served (names the room)
            why = str(exc)
        except TransferFailed as exc:
            why = f"room {job.room}: sending the pages to the decode instance failed: {exc}"
            for endpoint in {r.endpoint for r in st.reg.ranks}:
                self._quiesce(endpoint, job.room)
        else:
            if self.rooms.aborted(job.room):
                why = f"room {job.room}: the decode side aborted it"
            else:
                if job.upto is not None:
                    st.sent = max(st.sent, job.upto)
                    self.partial_writes += 1
                return None
        log.warning("%s", why)
        self.rooms.close(job.room, error=why)
        return why

    def _quiesce(self, endpoint: str, room: int) -> None:
        """Wait until no byte of a failed write to ``endpoint`` can land any more
        (:meth:`Transport.quiet`), before the room is closed: the decode side frees its
        pages once it reads the room closed. Gives up only when the sender stops."""
        while not self.transport.quiet(endpoint, 1.0):
            log.warning("room %d: a failed write's transfers are still running", room)
            if self._stop.is_set():
                return

    def _write(self, job: SendJob, endpoint: str, spans: Sequence[Span]) -> None:
        """Write ``spans`` in batches of about :data:`BATCH_BYTES`, looking at the room's
        abort flag between them; TransferFailed past the job's bound."""
        deadline = time.monotonic() + self._timeout_s
        batch: list[Span] = []
        size = 0
        for i, span in enumerate(spans):
            batch.append(span)
            size += span.nbytes
            if size < BATCH_BYTES and i + 1 < len(spans):
                continue
            if self.rooms.aborted(job.room):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferFailed(
                    f"room {job.room}: the transfer took over {self._timeout_s:g} s"
                )
            self.transport.write(endpoint, batch, left)
            self.sent_bytes += size
            batch, size = [], 0

    def _end(
        self, job: SendJob, *, result: RoomResult | None = None, error: str | None = None
    ) -> None:
        self.rooms.close(job.room, result=result, error=error)
        try:
            self._done(job.rid, None if result is not None else error or "failed")
        except Exception:
            log.exception("reporting the end of room %d failed", job.room)
