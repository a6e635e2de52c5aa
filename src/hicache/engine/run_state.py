"""The engine's one lifecycle state, shared by its front and rank 0's driver.

One enum under one lock (:class:`RunState`) replaces the flags the front and the loop used
to read across each other. The states, in order::

    NEW --start--> RUNNING --close() or a rank failure--> STOPPING
    RUNNING | STOPPING --the loop ends--> ENDING --in-flight work failed--> ENDED
    ENDED --close()--> CLOSED                    (close() closes the cache)
    STOPPING | ENDING --close() gives up waiting--> ABANDONED --the loop is done--> CLOSED
                                                  (the engine thread closes the cache)

Only ``RUNNING`` takes new work. The cache is closed exactly once, by whichever of
``close()`` and the ending thread comes second (:meth:`RunState.loop_done` and
:meth:`RunState.hand_over` decide it under the lock). ``exit_reason`` says why the loop
ended (set at ``ENDING``, also while ``ABANDONED``); it stays until the next start.
"""

from __future__ import annotations

import enum
import threading


class EngineState(enum.Enum):
    NEW = "new"
    """Built, never started (or its start failed)."""
    RUNNING = "running"
    """The loop runs and new requests and calls are taken."""
    STOPPING = "stopping"
    """Told to stop (``close()``, or a rank failed): new work is refused; the loop ends
    its round, then fails what is queued or in flight."""
    ENDING = "ending"
    """The loop has ended (``exit_reason``); it is failing what was queued or in flight."""
    ENDED = "ended"
    """The engine thread has finished every use of the cache; ``close()`` closes it."""
    ABANDONED = "abandoned"
    """``close()`` gave up waiting for the engine thread: that thread closes the cache
    when its loop is done."""
    CLOSED = "closed"
    """The cache is closed (or being closed by the one who moved here)."""


class RunState:
    """:class:`EngineState` with its lock and ``exit_reason``; see the module docstring.

    ``lock`` also orders posting into the engine's inbox against the loop's end: a post
    checks :meth:`refusal` and enqueues under it, and the loop takes the inbox one last
    time after moving to ``ENDING`` under it, so nothing posted is ever left unanswered."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state = EngineState.NEW
        self.exit_reason: str | None = None

    def refusal(self, rank_failure: str | None) -> str | None:
        """Why new work is refused now (None: taken). Call under :attr:`lock`."""
        state = self.state
        if state is EngineState.RUNNING:
            return None
        if self.exit_reason is not None:
            return self.exit_reason
        if state in (EngineState.STOPPING, EngineState.ABANDONED):
            return rank_failure or "the engine is closing"
        return "the engine is not running"

    def started(self) -> None:
        """``NEW`` or ``CLOSED`` -> ``RUNNING``."""
        with self.lock:
            if self.state not in (EngineState.NEW, EngineState.CLOSED):
                raise RuntimeError(f"cannot start an engine that is {self.state.value}")
            self.state = EngineState.RUNNING
            self.exit_reason = None

    def stop(self) -> None:
        """``RUNNING`` -> ``STOPPING`` (nothing in any other state)."""
        with self.lock:
            if self.state is EngineState.RUNNING:
                self.state = EngineState.STOPPING

    @property
    def stopping(self) -> bool:
        """Whether the loop must end its round now (any state but ``RUNNING``)."""
        return self.state is not EngineState.RUNNING

    def ending(self, reason: str) -> None:
        """The loop has ended for ``reason``: ``ENDING`` (``ABANDONED`` stays so)."""
        with self.lock:
            self.exit_reason = reason
            if self.state is not EngineState.ABANDONED:
                self.state = EngineState.ENDING

    def loop_done(self) -> bool:
        """The engine thread has finished with the cache. Returns whether it must close
        the cache itself (``close()`` gave up on it: ``ABANDONED`` -> ``CLOSED``);
        otherwise ``ENDED``."""
        with self.lock:
            if self.state is EngineState.ABANDONED:
                self.state = EngineState.CLOSED
                return True
            self.state = EngineState.ENDED
            return False

    def hand_over(self) -> bool:
        """``close()`` after its wait: returns whether it closes the cache itself (the
        loop is done: ``ENDED`` -> ``CLOSED``); otherwise the thread will (``ABANDONED``)."""
        with self.lock:
            if self.state is EngineState.ENDED:
                self.state = EngineState.CLOSED
                return True
            if self.state is not EngineState.CLOSED:
                self.state = EngineState.ABANDONED
            return False

    @property
    def loop_ended(self) -> bool:
        """Whether the loop has ended (``exit_reason`` set)."""
        return self.exit_reason is not None


__all__ = ["EngineState", "RunState"]
