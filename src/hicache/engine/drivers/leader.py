"""Rank 0's driver: the engine thread's loop over the one step body.

Other threads post :class:`Task` s into the inbox (:meth:`Leader.post`). Each round the
loop turns the inbox into this step's :class:`~hicache.engine.step_inputs.StepInputs`
(broadcast to the followers first, also when empty), runs :meth:`EngineCore.step
<hicache.engine.step.core.EngineCore.step>` over them (each task's caller answered as its
record is applied, rank 0's calls in posting order), hands the reports to their clients'
callbacks (kept here from post to final report), posts the step's aborts for the next
step, publishes stats and, when idle, waits to be woken. A callback that raises aborts its
request at the next step, on every rank. Error policy: one rank, a step that raises
aborts the requests in flight and the loop goes on (``failed_steps``); several ranks, it
ends the loop and *breaks* the ranks; a stop broadcasts a
:class:`~hicache.engine.step_inputs.Stop`. The loop's last act (:meth:`Leader._end`) fails
what is still queued or in flight.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

from hicache.engine.ranks import (
    RankProcesses,
    StepChannel,
    leave_group,
)
from hicache.engine.request import OutputCallback, Request
from hicache.engine.restore_book import RestoreState
from hicache.engine.run_state import RunState
from hicache.engine.step.core import Applied, EngineCore, StepFailed
from hicache.engine.step.ends import StepOutputs
from hicache.engine.step_inputs import (
    Abort,
    CloseSession,
    EndRestore,
    NewRequest,
    StepInput,
    StepInputs,
    Stop,
)
from hicache.failures import Failure, FailureKind

log = logging.getLogger(__name__)
T = TypeVar("T")


EXPIRY_PERIOD_S = 0.1
"""How often rank 0 looks for restores and sessions past their TTL (s): a TTL ends
within it."""


def _ignore(_: object) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Task:
    """One item of the inbox: a step input (``record``, applied by every rank, its
    outcome handed to ``done`` on rank 0) or a call for rank 0 alone (``run``); ``drop(why)``
    runs instead (on whatever thread ends the loop) when the loop will never run it."""

    record: StepInput | None = None
    done: Callable[[Applied], None] | None = None
    run: Callable[[], object] | None = None
    drop: Callable[[str], None] = _ignore


class RankFailure:
    """Why the ranks stopped on their own, naming the rank (:attr:`why`: a follower that
    died, or rank 0's loop that failed and made every follower leave; None while they run),
    and who is told when they do (:meth:`listen`)."""

    def __init__(self) -> None:
        self.why: str | None = None
        self._listeners: list[Callable[[str], None]] = []

    def listen(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(why)`` when the ranks stop (at once if they have)."""
        self._listeners.append(listener)
        if self.why is not None:
            listener(self.why)

    def report(self, why: str) -> None:
        """The ranks stopped for ``why``: record it, tell every listener."""
        self.why = why
        for listener in list(self._listeners):
            try:
                listener(why)
            except Exception:
                log.exception("a rank failure listener failed")


class Leader:
    """Rank 0's loop (:meth:`run`, the engine thread's target); see the module docstring.

    ``state``: the engine's :class:`RunState`, shared with the front. ``ranks``: the
    follower processes (None with one rank), watched from here on. ``failure``: where a
    rank failure is recorded. ``publish``: called at the end of every round (stats)."""

    def __init__(
        self,
        core: EngineCore,
        state: RunState,
        *,
        ranks: RankProcesses | None,
        failure: RankFailure,
        publish: Callable[[], None],
    ) -> None:
        self.core = core
        self.state = state
        self.ranks = ranks
        self.failure = failure
        self._publish = publish
        self._inbox: queue.Queue[Task] = queue.Queue()
        self._wake = threading.Event()
        self._callbacks: dict[str, OutputCallback] = {}
        """``rid ->`` the output callback of each of rank 0's requests, from its post to
        its final report (the posting thread puts it before the post)."""
        self.last_loop: float | None = time.monotonic()
        """``time.monotonic()`` of the last round (health's stall check)."""
        self.failed_steps = 0
        """Scheduler steps that raised in a row (one rank; 0 once one succeeds)."""
        self.ranks_broken = False
        """A collective of the step exchange failed, or rank 0 stopped on its own: the
        followers are closed as broken."""
        self.thread: threading.Thread | None = None
        """The engine thread, once started."""
        self.failing: str | None = None
        """Why the loop failed, from the moment it did (before it stops the followers
        and reports a rank failure): ``/health`` is 503 from then on."""
        self._expiry_due = 0.0
        """``time.monotonic()`` of the next look for sessions past their TTL."""
        if ranks is not None:
            ranks.watch(self.ranks_failed)

    def start(self) -> None:
        """Start the engine thread (:meth:`run`)."""
        self.thread = threading.Thread(target=self.run, name="hicache-engine", daemon=True)
        self.thread.start()

    def stop(self, deadline: float) -> bool:
        """Tell the loop to stop and wait for the engine thread until ``deadline``
        (``time.monotonic()``); returns whether the caller now closes the cache (the
        thread is done with it). When the thread has not stopped by then (stuck in a
        forward or a call), it keeps the cache and closes it itself when its loop ends."""
        thread = self.thread
        self.state.stop()  # the loop ends its round, then fails what is queued or in flight
        self._wake.set()
        if thread is not None:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if not self.state.hand_over():
            log.error(
                "the engine thread did not stop in time; the cache stays open until the"
                " thread ends, and the thread closes it then"
            )
            return False
        if thread is not None:
            thread.join(timeout=max(1.0, deadline - time.monotonic()))  # past its last use
        return True

    def close_ranks(self, deadline: float) -> None:
        """Join the followers (told to stop by the loop's last broadcast), kill stragglers
        (closed as broken when the ranks failed or an exchange did)."""
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            broken = self.failure.why is not None or self.ranks_broken
            ranks.close(timeout=max(5.0, deadline - time.monotonic()), broken=broken)

    def ranks_failed(self, why: str) -> None:
        """The ranks stopped (a watcher's thread, or the engine thread): stop the loop,
        record why and tell the listeners."""
        self.state.stop()
        self._wake.set()
        self.failure.report(why)

    def post(self, task: Task) -> None:
        """Queue ``task`` for the next round. RuntimeError (why) when new work is refused."""
        with self.state.lock:
            why = self.state.refusal(self.failure.why)
            if why is not None:
                raise RuntimeError(why)
            self._inbox.put(task)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def post_request(self, req: Request, on_output: OutputCallback | None) -> None:
        """Post the :class:`NewRequest` of rank 0's request ``req`` (its queue place;
        ``req`` is kept in the core's map until the record is applied), whose reports go
        to ``on_output``; when the loop ends first, the client is told all the same.
        RuntimeError (why) when refused: nothing is kept then."""
        core = self.core

        def drop(why: str) -> None:  # the record never reaches the core: forget it
            core.clients.pop(req.rid, None)
            core.fail(req, why)

        core.clients[req.rid] = req
        if on_output is not None:
            self._callbacks[req.rid] = on_output
        try:
            self.post(Task(record=NewRequest.of_request(req), drop=drop))
        except BaseException:
            core.clients.pop(req.rid, None)
            self._callbacks.pop(req.rid, None)
            raise

    def abort_later(self, rid: str) -> None:
        """Abort ``rid`` at the next step on every rank (a report that failed on rank 0:
        no rank ends a request alone); nothing once new work is refused (all ends then)."""
        with contextlib.suppress(RuntimeError):
            self.post(Task(record=Abort(rid)))

    def command(self, record: StepInput) -> Future[object]:
        """Post the control ``record`` (applied by every rank); rank 0's result, or its
        exception, comes in the future (RuntimeError when the loop ends first)."""
        fut: Future[object] = Future()

        def done(outcome: Applied) -> None:
            if outcome.error is not None:
                fut.set_exception(outcome.error)
            else:
                fut.set_result(outcome.value)

        self.post(Task(record=record, done=done, drop=_failer(fut)))
        return fut

    def call(
        self, fn: Callable[[], T], guard: Callable[[], AbstractContextManager[object]]
    ) -> Future[T]:
        """Run ``fn`` on the engine thread, within ``guard()``, for rank 0 alone; its result
        or exception comes in the future (RuntimeError when the loop ends first)."""
        fut: Future[T] = Future()

        def run() -> None:
            try:
                with guard():
                    fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self.post(Task(run=run, drop=_failer(fut)))
        return fut

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        reason = "the engine was closed"
        channel = self.core.channel
        try:
            while not self.state.stopping:
                self.last_loop = time.monotonic()
                busy = self._round(channel)
                self._publish()
                if not busy:  # idle, or only waiting for L3 prefetches or for copies to
                    # L2 (whose sync issues their L3 writes): poll those often (else at
                    # most 50 ms: the followers wait in the next broadcast meanwhile)
                    core = self.core
                    polling = (
                        core.scheduler.polling or core.restores.loading or core.cache.backing_up
                    )
                    self._wake.wait(timeout=0.002 if polling else 0.05)
                    self._wake.clear()
            if channel is not None:
                reason = self._stop_ranks(channel, reason)
        except BaseException as exc:
            failed = exc.error if isinstance(exc, StepFailed) else exc
            reason = f"the engine loop died: {type(failed).__name__}: {failed}"
            # unhealthy from now on, while it looks for a dead follower and stops the
            # others (seconds); a follower found dead is named instead once reported
            own = f"rank 0 stopped: {type(failed).__name__}: {failed}"
            seen = None if self.ranks is None else self.ranks.dead_rank()  # already known?
            self.failing = reason if channel is None else f"{seen or own}; stopping the ranks"
            failure = self._failed_rank()
            if failure is not None:
                reason = f"{failure}; the engine stopped"
            log.critical("%s", reason, exc_info=failure is None)
            if failure is None and channel is not None:
                why = own
                self._break_ranks(why)
                reason = f"{why}; the engine stopped"
        finally:
            self._end(reason)

    def _round(self, channel: StepChannel | None) -> bool:
        """One round: this step's inputs from the inbox, the step; returns whether a
        forward ran. A failed step ends the requests in flight (one rank)."""
        tasks = self._take_inbox() + self._expiries()
        if not tasks and channel is None:  # nothing to apply (most rounds): the step alone
            return self._step(StepInputs(self.core.step_no), None, channel)
        records = [t for t in tasks if t.record is not None]
        inputs = StepInputs(
            self.core.step_no, tuple(t.record for t in records if t.record is not None)
        )
        if channel is not None:
            self._broadcast(channel, inputs, tasks)
        calls = _calls_after(tasks, len(records))  # each runs where it was posted
        if calls[0]:
            _run_calls(calls[0])

        def applied(i: int, outcome: Applied) -> None:
            done = records[i].done
            if done is not None:
                try:
                    done(outcome)
                except Exception:
                    log.exception("answering an engine task failed")
            if calls[i + 1]:
                _run_calls(calls[i + 1])

        return self._step(inputs, applied, channel)

    def _expiries(self) -> list[Task]:
        """The records ending what rank 0's clock alone says has expired (looked for every
        :data:`EXPIRY_PERIOD_S`): restores past their ``ttl_ms`` and sessions past their
        TTL. Every rank applies them at this step, whatever its own clock says."""
        now = time.monotonic()
        if now < self._expiry_due:
            return []
        self._expiry_due = now + EXPIRY_PERIOD_S
        records: list[StepInput] = [
            EndRestore(op_id, RestoreState.EXPIRED.value)
            for op_id in self.core.restores.book.due(now)
        ]
        records += [CloseSession(s, expired=True) for s in self.core.cache.sessions.expired(now)]
        return [Task(record=r) for r in records]

    def _step(
        self,
        inputs: StepInputs,
        applied: Callable[[int, Applied], None] | None,
        channel: StepChannel | None,
    ) -> bool:
        """The step over ``inputs``, with rank 0's error policy (see the module docstring)."""
        try:
            result = self.core.step(inputs, applied)
        except StepFailed as failed:
            if channel is not None:  # no rank may recover alone: the ranks stop
                self.ranks_broken = True
                raise
            exc = failed.error
            log.error("scheduler step failed; aborting in-flight requests", exc_info=exc)
            self.failed_steps += 1
            self.core.abort_all(f"scheduler step failed: {type(exc).__name__}: {exc}")
            self.core.memory_trimmer.after_round(not self.core.scheduler.idle)
            self._hand_on(self.core.take())
            return False
        self.failed_steps = 0
        self._hand_on(result.outputs)
        return result.forward

    def _hand_on(self, outputs: StepOutputs, *, last: bool = False) -> None:
        """Hand the reports to their clients and post the aborts for the next step. A
        callback that raises aborts its request (on every rank, at the next step); the
        ``last`` time (the loop is ending) nothing a callback raises stops the rest."""
        for rid in outputs.aborts:
            self.abort_later(rid)
        for out in outputs.reports:
            callbacks = self._callbacks
            callback = callbacks.pop(out.rid, None) if out.finished else callbacks.get(out.rid)
            if callback is None:
                continue
            try:
                callback(out)
            except Exception:  # a broken consumer must not stop the engine
                log.exception("output callback of %s failed", out.rid)
                if not out.finished:
                    self.abort_later(out.rid)
            except BaseException:
                if not last:
                    raise
                log.exception("output callback of %s failed", out.rid)

    def _broadcast(self, channel: StepChannel, inputs: StepInputs, tasks: list[Task]) -> None:
        """Send this step's inputs to every follower; when that fails, fail ``tasks``."""
        try:
            channel.inputs(inputs)
        except BaseException as exc:
            self.ranks_broken = True
            why = f"the ranks could not exchange a step's inputs: {type(exc).__name__}: {exc}"
            _drop(tasks, why)
            raise

    def _take_inbox(self) -> list[Task]:
        """Every task posted so far, oldest first (the inbox left empty)."""
        tasks: list[Task] = []
        while True:
            try:
                tasks.append(self._inbox.get_nowait())
            except queue.Empty:
                return tasks

    # ------------------------------------------------------------------ ranks

    def _break_ranks(self, why: str) -> None:
        """Rank 0's loop failed on its own: stop every follower now (one waiting in a
        collective with rank 0 would wait for its timeout), leave the group, and stop as
        for a dead rank (``why`` becomes the rank failure; the server exits)."""
        self.ranks_broken = True
        if self.ranks is not None:
            self.ranks.terminate()
        leave_group()
        self.ranks_failed(why)

    def _failed_rank(self) -> str | None:
        """Why a follower died, if one did (waiting a moment for its exit to be seen)."""
        if self.failure.why is not None:
            return self.failure.why
        return None if self.ranks is None else self.ranks.dead_rank(wait_s=1.0)

    def _stop_ranks(self, channel: StepChannel, reason: str) -> str:
        """The loop was told to stop: broadcast a :class:`Stop` (unless a follower died,
        which is then the reason returned)."""
        if self.failure.why is not None:
            return f"{self.failure.why}; the engine stopped"
        try:
            channel.inputs(StepInputs(self.core.step_no, (Stop(reason),)))
        except Exception as exc:
            self.ranks_broken = True
            log.error("telling the ranks to stop failed: %s: %s", type(exc).__name__, exc)
        return reason

    # ------------------------------------------------------------------ the end

    def _end(self, reason: str) -> None:
        """The loop's last act: refuse new work, fail what is queued or in flight, and
        close the cache if ``close()`` has handed that over. What it fails gets a
        :attr:`~hicache.failures.FailureKind.STOPPING` error: the request was fine, this
        server is going (HTTP 503, which a router retries elsewhere)."""
        reason = Failure(reason, FailureKind.STOPPING)
        self.state.ending(reason)
        _drop(self._take_inbox(), reason)
        self.core.fail_in_flight(reason)
        self._hand_on(self.core.take(), last=True)
        if self.state.loop_done():
            try:
                self.core.close_cache()
            except BaseException:
                log.exception("closing the cache after the engine thread ended")


def _calls_after(tasks: list[Task], records: int) -> list[list[Task]]:
    """Rank 0's calls among ``tasks`` grouped by the record they follow: ``[0]`` before
    the first record, ``[i + 1]`` after record ``i``."""
    calls: list[list[Task]] = [[] for _ in range(records + 1)]
    seen = 0
    for task in tasks:
        if task.record is not None:
            seen += 1
        else:
            calls[seen].append(task)
    return calls


def _run_calls(tasks: list[Task]) -> None:
    """Run rank 0's calls in order; one that raises is logged and the rest still run."""
    for task in tasks:
        if task.run is None:
            continue
        try:
            task.run()
        except Exception:
            log.exception("an engine task failed")


def _failer(fut: Future[Any]) -> Callable[[str], None]:
    """A task's ``drop``: fail ``fut`` with RuntimeError(why) unless it is done."""

    def drop(why: str) -> None:
        if not fut.done():
            fut.set_exception(RuntimeError(why))

    return drop


def _drop(tasks: list[Task], why: str) -> None:
    """Tell each of ``tasks`` it will never run."""
    for task in tasks:
        try:
            task.drop(why)
        except BaseException:
            log.exception("failing a queued engine task")


__all__ = ["Leader", "RankFailure", "Task"]
