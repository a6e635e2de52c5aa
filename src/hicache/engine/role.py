"""What an instance's prefill/decode role changes in how its requests go: :class:`Role`.

A plain instance's requests run from admission to their last token and are released. On
a PD instance some requests are *parked* between the two
(:attr:`RequestEnds.parked <hicache.engine.step.ends.RequestEnds.parked>`): they hold
their L1 pages but run no forward while the other instance of their room does its half:
a prefill instance (:class:`~hicache.engine.roles.prefill.PrefillRole`) admits a request
once its room's pages are registered, parks it after its first token and releases it on
:class:`~hicache.engine.step_inputs.RoomEnded`; a decode instance
(:class:`~hicache.engine.roles.decode.DecodeRole`) parks it once admitted and runs it from
:class:`~hicache.engine.step_inputs.PagesArrived` on. The scheduler and
:class:`~hicache.engine.step.ends.RequestEnds` call the hooks below at those points; this
base class is the plain instance (every hook does nothing). Runs on the engine's thread.
The pair's flow: docs/architecture.md, "Prefill/decode disaggregation".
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.disagg.config import Bootstrap, DisaggMode
from hicache.engine.request import Request
from hicache.extras import SequenceExtras

__all__ = ["Role"]


class Role:
    """A plain instance's role: no request is parked; see the module docstring."""

    mode = DisaggMode.NULL

    def claim(self, bootstrap: Bootstrap) -> str | None:
        """A request of ``bootstrap``'s room is validated (any thread); None, or why its
        room is refused (a prefill instance's rooms are single-use)."""
        return None

    def unclaim(self, bootstrap: Bootstrap, why: str) -> None:
        """A request whose room :meth:`claim` took is refused before it is queued (any
        thread): its room ends with ``why`` (the other side's half fails with it, not
        at a timeout)."""

    @property
    def open_rooms(self) -> int:
        """Rooms not closed yet that this side keeps (a prefill instance's table); 0 here."""
        return 0

    @property
    def polling(self) -> bool:
        """Whether parked requests wait on this side (not on the other instance): the
        engine then steps again soon, without an input."""
        return False

    def queued(self, req: Request) -> None:
        """``req`` joined the queue (every rank, in the same order)."""

    def admissible(self, req: Request) -> bool:
        """Whether waiting ``req`` may be admitted now (a prefill instance's waits for
        its room's decode side, which then holds pages for it: see
        :class:`~hicache.engine.roles.prefill.PrefillRole`); one that may not is passed over."""
        return True

    def computes_prompt(self, req: Request) -> bool:
        """Whether this instance computes ``req``'s prompt (a decode instance's come
        computed with their room): only then do its prompt logprobs bound the cached
        prefix it may use (:attr:`~hicache.engine.sampling.SamplingParams.max_prefix`)."""
        return True

    def parks_admitted(self, req: Request) -> bool:
        """Whether admitted ``req`` waits, parked, for its pages from elsewhere (decode)."""
        return False

    def hand_off(self, req: Request) -> bool:
        """``req`` took its last token: True when its pages must go elsewhere first
        (prefill); it is parked then, and released when the transfer ends."""
        return False

    def register(self, parked: list[Request]) -> list[Request]:
        """Once per step: do what parked requests wait for on this side (decode: register
        those whose prefix is in L1); returns those that must be admitted again (their
        prefix load failed)."""
        return []

    def arrived(self, req: Request) -> SequenceExtras | None:
        """Parked ``req``'s pages arrived (decode): what the runner resumes it from (a
        recurrent model's state after the prompt), or None."""
        return None

    def computed(self, req: Request) -> None:
        """A prefill chunk of ``req`` was computed and committed (``req.kv_len``
        positions done): a prefill instance sends the whole pages done so far."""

    def requeued(self, req: Request) -> None:
        """``req`` was requeued (retracted, or its prefix load failed): what was handed
        of its pages may be freed now."""

    def abort(self, req: Request, why: str) -> bool:
        """Parked ``req`` is aborted: tell the other side. Returns whether it ends now
        (nothing was promised to the other side); else it stays parked until its room ends
        (a :class:`~hicache.engine.step_inputs.RoomEnded` input)."""
        return True

    def ended(self, req: Request) -> None:
        """``req`` has ended (released, whatever the way)."""

    def alone(self) -> None:
        """From now on this rank steps alone (its requests are being ended: the ranks no
        longer step together), so the role exchanges nothing with other ranks."""

    def watch_health(self, problem: Callable[[], str | None]) -> None:
        """Rank 0 of several, once the engine has started: ``problem()`` names a rank that
        is frozen or gone (None: every rank answers), from any thread; a prefill
        instance's bootstrap server answers its decode sides with it."""

    def close(self) -> None:
        """Stop the role's threads and servers (after the engine loop has ended)."""
