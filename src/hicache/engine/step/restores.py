"""The restores of one rank's step: records applied, cache restores moved on, holds given
back; :class:`StepRestores`.

Every rank applies the same :class:`~hicache.engine.step_inputs.StartRestore` and
:class:`~hicache.engine.step_inputs.EndRestore` records in the same order, and moves its
cache restores on (:meth:`StepRestores.advance`) right after the step's agreed
``cache.sync()``, so every rank holds and releases the same prefixes at the same step.
A hold is given back when a request of its session leaves the waiting queue (admitted,
or ended before: :meth:`StepRestores.watch` then :meth:`StepRestores.left`), at its TTL
(rank 0 posts the ``EndRestore``), at a ``DELETE``, when its session is closed, or at a
flush. The book
(:class:`~hicache.engine.restore_book.RestoreBook`) says each operation's state; rank
0's is what the API reads. Runs on the thread that drives the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hicache.cache import HiCache
from hicache.cache.restores import Restore, RestoreStage
from hicache.engine.request import Request
from hicache.engine.restore_book import RestoreBook, RestoreOp, RestoreState
from hicache.engine.step_inputs import EndRestore, StartRestore

__all__ = ["StepRestores", "restore_page_bytes"]


def restore_page_bytes(cache: HiCache) -> int:
    """L2 bytes of one page of the full KV on this rank (what a restore holds per page)."""
    return cache.context.spec.token_bytes * cache.context.page_size


class StepRestores:
    """This rank's restores over ``cache``, recorded in ``book``."""

    def __init__(self, cache: HiCache, book: RestoreBook) -> None:
        self.cache = cache
        self.book = book
        self._open: dict[str, Restore] = {}
        """``operation_id ->`` its cache restore, until it ends."""

    @property
    def loading(self) -> bool:
        """Whether some restore waits for L3 (the loop then polls)."""
        return any(r.stage is RestoreStage.LOADING for r in self._open.values())

    def start(self, item: StartRestore) -> RestoreOp | None:
        """Apply ``item``: its cache restore starts (LOADING; FAILED at once without L3)."""
        self.book.put(
            RestoreOp(
                operation_id=item.operation_id,
                session_id=item.session_id,
                state=RestoreState.QUEUED,
                tokens=len(item.prompt_ids),
                ttl_ms=item.ttl_ms,
                nbytes=item.nbytes,
                deadline=float("inf"),
            )
        )
        try:
            r = self.cache.restores.start(item.prompt_ids, item.tenant)
        except Exception as exc:  # never left queued: it ends, saying why
            why = f"the restore could not start: {type(exc).__name__}: {exc}"
            self.book.change(item.operation_id, state=RestoreState.FAILED, error=why)
            raise
        if r.stage is RestoreStage.FAILED:
            return self.book.change(item.operation_id, state=RestoreState.FAILED, error=r.error)
        self._open[item.operation_id] = r
        return self.book.change(item.operation_id, state=RestoreState.LOADING)

    def end(self, item: EndRestore) -> RestoreOp | None:
        """Apply ``item``: give the operation's hold back, and record it ended in
        ``item.state`` (an operation ended already keeps its state)."""
        self._release(item.operation_id, RestoreState(item.state))
        return self.book.get(item.operation_id)

    def advance(self, spare_l1_pages: Callable[[], int]) -> None:
        """After the step's sync: move each loading restore on (READY with what is now
        resident, or FAILED), and refresh what a held one has resident. A restore turning
        READY has its prefix copied on into L1 when it fits in ``spare_l1_pages()`` (free
        L1 pages no request queued or running may need; the same on every rank)."""
        for op_id, r in list(self._open.items()):
            if self.cache.restores.advance(r):
                if r.stage is RestoreStage.FAILED:
                    self.cache.restores.release(r)
                    del self._open[op_id]
                    self.book.change(op_id, state=RestoreState.FAILED, error=r.error)
                    continue
                self.cache.restores.load_to_l1(r, spare_l1_pages())
                brought = r.storage_tokens // self.cache.context.page_size
                self.book.change(  # its bound counts what it brought into L2 from now on
                    op_id,
                    state=RestoreState.READY,
                    resident=self.cache.restores.resident(r),
                    nbytes=brought * restore_page_bytes(self.cache),
                )
            elif r.stage is RestoreStage.HELD:
                resident = self.cache.restores.resident(r)
                op = self.book.get(op_id)
                if op is not None and op.resident != resident:
                    self.book.change(op_id, resident=resident)

    def watch(self, waiting: Iterable[Request]) -> list[tuple[Request, str]]:
        """The waiting requests of a session with an open restore (before the scheduler
        step; :meth:`left` after it)."""
        if not self._open:
            return []
        sessions = {self.book.get(i) for i in self._open}
        ids = {op.session_id for op in sessions if op is not None}
        return [
            (r, r.session.session_id) for r in waiting if r.session and r.session.session_id in ids
        ]

    def left(self, watched: list[tuple[Request, str]], waiting: Iterable[Request]) -> None:
        """Release the restores of the sessions whose ``watched`` requests are no longer
        ``waiting`` (admitted, or ended)."""
        if not watched:
            return
        still = {id(r) for r in waiting}
        sessions = {sid for r, sid in watched if id(r) not in still}
        for op_id in list(self._open):
            op = self.book.get(op_id)
            if op is not None and op.session_id in sessions:
                self._release(op_id, RestoreState.RELEASED)

    def end_session(self, session_id: str, why: str) -> bool:
        """Cancel every open restore of ``session_id`` (the session was closed); returns
        whether there was one."""
        ended = False
        for op_id in list(self._open):
            op = self.book.get(op_id)
            if op is not None and op.session_id == session_id:
                self._release(op_id, RestoreState.CANCELLED, why)
                ended = True
        return ended

    def end_all(self, state: RestoreState, why: str | None = None) -> None:
        """Give every hold back (a flush of the cache, the engine stopping)."""
        for op_id in list(self._open):
            self._release(op_id, state, why)

    def _release(self, op_id: str, state: RestoreState, why: str | None = None) -> None:
        r = self._open.pop(op_id, None)
        op = self.book.get(op_id)
        resident = None if op is None else op.resident
        if r is not None:
            if r.stage is RestoreStage.HELD:
                resident = self.cache.restores.resident(r)  # as it was at the release
            self.cache.restores.release(r)
        if op is not None and not op.state.ended:
            self.book.change(op_id, state=state, error=why, resident=resident)
