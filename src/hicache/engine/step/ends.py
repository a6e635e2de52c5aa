"""How a request ends, in one place: :class:`RequestEnds`.

A request ends by finishing (end-of-sequence, a stop id or string, ``max_tokens``, the
context length), by an abort (its client, the engine stopping) or by a failure of its own
(a forward, a sampled row, its report). Whatever the way, the acts are the same, all
here: its pending output is done first (:meth:`RequestEnds.emit_pending`), it leaves the
scheduler's queues and gives back what it holds (:meth:`RequestEnds.release`: its KV
committed first unless it must not be kept), and it gets its final report exactly once
and last (:meth:`RequestEnds.emit`). Token checks are immediate; text work and reports are
*pending* (:meth:`RequestEnds.took_token`) until :meth:`RequestEnds.flush`, so a stop
string ends its request one step late. Reports are data in :attr:`RequestEnds.outbox`
(rank 0's only), handed to the driver (:meth:`RequestEnds.take`), with the aborts for the
next step (:meth:`RequestEnds.abort_next`). Runs on the engine's thread. Flows:
docs/architecture.md, "Outputs and a request's end".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from hicache.cache import HiCache
from hicache.engine.request import FinishReason, Request, RequestOutput
from hicache.engine.role import Role
from hicache.engine.step.output import OutputProcessor
from hicache.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """What a step leaves for its driver: the ``reports`` for clients, in order (rank
    0's), and the ``aborts``: requests to abort on every rank at the next step (their
    ``error`` set), in order."""

    reports: tuple[RequestOutput, ...] = ()
    aborts: tuple[str, ...] = ()


class RequestEnds:
    """Ends requests; see the module docstring. ``waiting`` and ``running``: the
    scheduler's queues, which a request leaves here (never elsewhere, but for a
    retraction, which moves it from one to the other). ``role``: the instance's
    prefill/decode role. ``reports``: whether requests report (rank 0), into
    :attr:`outbox`."""

    def __init__(
        self,
        cache: HiCache,
        runner: ModelRunner,
        output: OutputProcessor,
        waiting: deque[Request],
        running: list[Request],
        *,
        role: Role,
        reports: bool = True,
    ) -> None:
        self.cache = cache
        self.runner = runner
        self.output = output
        self.waiting = waiting
        self.running = running
        self.reports = reports
        self.outbox: list[RequestOutput] = []
        """Reports made and not yet taken by the driver (:meth:`take`), oldest first."""
        self._aborts: list[str] = []
        self.pending: dict[Request, None] = {}
        """Requests with a token whose text work and report are still to do, oldest first
        (at most one token each); those already ended wait here for their final report."""
        self.parked: dict[str, Request] = {}
        """``rid ->`` each request parked by the instance's role (see the module
        docstring), in the order parked."""
        self.fenced: dict[str, Request] = {}
        """``rid ->`` each ended request whose pages are *fenced*: out of use because
        another instance may still write them (:meth:`fence`), until :meth:`unfence`."""
        self.role = role
        """The instance's prefill/decode role (plain: no parking)."""

    @property
    def in_flight(self) -> list[Request]:
        """Every request not yet given its final report: waiting, running, parked, and
        ended with that report pending."""
        held = [*self.waiting, *self.running, *self.parked.values()]
        return held + [r for r in self.pending if r.finished and not r.final_reported]

    def finish(
        self,
        req: Request,
        reason: FinishReason | None,
        *,
        commit_kv: bool = True,
        error: str | None = None,
    ) -> None:
        """End ``req`` now (``error``: why, when set) and send its final report. Its pending
        output goes first; if that ends it (a stop string), it ends so instead."""
        if self.emit_pending(req, commit_kv=commit_kv):
            return
        req.finish_reason = reason
        if error is not None:
            req.error = error
        self.release(req, commit_kv=commit_kv)
        self.emit(req)

    def fail(self, req: Request, why: str, *, direct: bool = False) -> None:
        """End ``req`` with ``error`` = ``why``: through the scheduler when it holds it
        (its next step aborts it and releases what it holds), else (or when ``direct``,
        its pages then left where they are) by telling its client directly."""
        if req.final_reported:
            return
        req.error = req.error or why
        if not direct and any(r is req for r in (*self.waiting, *self.running)):
            req.aborted = True
            return
        self.parked.pop(req.rid, None)
        req.leave_queue()
        req.finish_reason = FinishReason.ABORT
        req.final_reported = True
        if self.reports:
            self.outbox.append(self.output.report(req))

    def took_token(self, req: Request) -> None:
        """``req`` took a token (checked already): its text work and report are pending;
        when the token ended it, it is released now (before the next step is built), or,
        when the role hands its pages elsewhere first, parked until that ends
        (:meth:`end_parked`)."""
        if req.finished and self.role.hand_off(req):
            self.park(req)
            return
        self.pending[req] = None
        if req.finished:
            self.release(req)

    def park(self, req: Request) -> None:
        """Take ``req`` out of the queues, holding its pages (its carried state dropped)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.runner.drop_state(req.rid)
        self.parked[req.rid] = req

    def unpark(self, req: Request) -> None:
        """Parked ``req`` goes on (the caller puts it in a queue): no longer parked."""
        del self.parked[req.rid]

    def end_parked(self, rid: str, error: str | None) -> None:
        """Parked ``rid``, which had finished before it was parked (a prefill whose
        pages were being sent), ends now: with ``error`` (its report says why) or
        without; released, its KV kept, then its final report."""
        req = self.parked.get(rid)
        if req is None:
            return
        if error is not None:
            req.error = error
            req.finish_reason = FinishReason.ABORT
        self.output.update_text(req)
        self.release(req)
        self.emit(req)

    def fence(self, req: Request, why: str) -> None:
        """Parked ``req`` ends now with ``error`` = ``why`` (its final report), but its
        pages are *fenced*: neither freed nor committed, as another instance may still
        write them, until :meth:`unfence`."""
        self.parked.pop(req.rid, None)
        req.leave_queue()
        req.error = req.error or why
        req.finish_reason = FinishReason.ABORT
        self.fenced[req.rid] = req
        self.emit(req)

    def unfence(self, rid: str) -> None:
        """Fenced ``rid``'s pages can no longer be written from elsewhere: free them."""
        req = self.fenced.pop(rid, None)
        if req is not None:
            self.release(req, commit_kv=False)

    @property
    def fenced_pages(self) -> int:
        """The L1 pages of the full KV that fenced requests keep out of use (their own,
        past the prefix they share with the tree)."""
        return sum(
            len(r.cache.pages) - r.cache.prefix_pages
            for r in self.fenced.values()
            if r.cache is not None
        )

    def release(self, req: Request, *, commit_kv: bool = True) -> None:
        """Take ``req`` out of the queues and give back what it holds (its computed KV
        committed first, with ``commit_kv``). Idempotent."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.parked.pop(req.rid, None)
        req.leave_queue()
        self.runner.drop_state(req.rid)
        if req.cache is not None:
            self.cache.release(req.cache, req.all_ids[: req.kv_len], commit=commit_kv)
            if req.session is not None and commit_kv and req.error is None:
                self._keep_session(req)
        self.role.ended(req)

    def _keep_session(self, req: Request) -> None:
        """Keep ``req``'s sequence for its session's next turn, until its TTL (this rank's
        clock: only rank 0's decides when it ends)."""
        hint = req.session
        assert hint is not None
        ttl_ms = self.cache.context.config.session_ttl_ms if hint.ttl_ms is None else hint.ttl_ms
        self.cache.sessions.touch(
            hint.session_id,
            req.all_ids[: req.kv_len],
            tenant=req.cache_salt,
            deadline=time.monotonic() + ttl_ms / 1000,
            parent=hint.parent_session_id,
        )

    def emit_pending(self, req: Request, *, commit_kv: bool = True) -> bool:
        """Do ``req``'s pending output, if any: its text, then its report. Returns whether
        that ended it (a stop string, or a token that cannot be decoded): it is then
        released here (its KV committed with ``commit_kv``), its token in flight (if any) never
        to be sampled."""
        if req not in self.pending:
            return False
        ended = False
        if not req.final_reported:  # (the engine may have failed it directly)
            was_finished = req.finished
            self.output.update_text(req)
            ended = req.finished and not was_finished
            if ended:
                if req.finish_reason is FinishReason.STOP:
                    # it had stopped before any abort took effect: an abort's reason
                    # (set with it, the only error a running request carries) is void
                    req.error = None
                self.release(req, commit_kv=commit_kv)
            self.emit(req)
        del self.pending[req]
        return ended

    def flush(self) -> None:
        """Do every pending output, oldest first."""
        while self.pending:
            self.emit_pending(next(iter(self.pending)))

    def emit(self, req: Request) -> None:
        """Report ``req``'s progress; nothing after its final report."""
        if req.final_reported:
            return
        req.final_reported = req.finished
        if self.reports:
            self.outbox.append(self.output.report(req))

    def abort_next(self, req: Request, why: str) -> None:
        """Abort ``req`` with ``error`` = ``why`` at the next step, on every rank (rank 0
        alone knows why: its driver posts the abort)."""
        req.error = why
        self._aborts.append(req.rid)

    def take(self) -> StepOutputs:
        """What the driver hands on since the last call: the reports and the aborts."""
        out = StepOutputs(tuple(self.outbox), tuple(self._aborts))
        self.outbox.clear()
        self._aborts.clear()
        return out


__all__ = ["RequestEnds", "StepOutputs"]
