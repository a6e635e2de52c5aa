"""A decode instance's role: :class:`DecodeRole`.

Each request comes with a room. Admitted like any request (its own L1/L2/L3 prefix
matched), it is parked with pages for its whole prompt (:meth:`DecodeRole.parks_admitted`);
once its matched prefix is in L1 its pages are registered with the prefill instance
(:meth:`DecodeRole.register`), which writes every page past that prefix. The receiver
(:mod:`hicache.disagg.receiver`) turns the room's end into a step input:
:class:`~hicache.engine.step_inputs.PagesArrived` (commit the prompt, decode),
:class:`~hicache.engine.step_inputs.RoomEnded` (fail, pages freed) or
:class:`~hicache.engine.step_inputs.RoomFailed` (fail now, pages fenced until
``RoomEnded``). A room is single use: a retracted request is not parked again and resumes
as on a plain instance; an aborted parked request is drained (:meth:`DecodeRole.abort`).
Every rank has this role and its own transport, with its pools registered; rank 0 alone
registers a room, naming every rank's pools (the page ids are the same on every rank), and
follows it (its receiver; None on the other ranks). A recurrent model's request also
holds a :class:`~hicache.engine.roles.state_slots.StateSlots` slot from its registration
on, where its state after the prompt lands; the runner resumes from it when the pages
arrive (:meth:`DecodeRole.arrived`). A registration that fails ends its
request through a :class:`~hicache.engine.step_inputs.RoomEnded` input, on every rank.
Its receiver and transport are built by :mod:`hicache.engine.roles.role_setup`. The
decode side's flow: docs/architecture.md, "Prefill/decode disaggregation".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hicache.cache import HiCache
from hicache.cache.held import held_pages
from hicache.disagg.config import Bootstrap, DisaggMode
from hicache.disagg.layout import (
    InstanceLayout,
    RankTarget,
    Registration,
    StoreTarget,
    prompt_hash,
)
from hicache.disagg.receiver import BootstrapRefused, DecodeReceiver
from hicache.disagg.transport import Transport
from hicache.engine.request import Request
from hicache.engine.role import Role
from hicache.engine.roles.state_slots import StateSlots
from hicache.engine.sampling import InvalidRequest
from hicache.engine.step_inputs import RoomEnded, StepInput
from hicache.extras import SequenceExtras

__all__ = ["DecodeRole"]

log = logging.getLogger(__name__)


class DecodeRole(Role):
    """See the module docstring. ``receiver``: rank 0's (None on the other ranks);
    ``layout``: this instance's, sent with each registration; ``ranks``: every rank's
    endpoint and pools; ``post``: rank 0's step inputs."""

    mode = DisaggMode.DECODE

    def __init__(
        self,
        cache: HiCache,
        receiver: DecodeReceiver | None,
        transport: Transport,
        layout: InstanceLayout,
        ranks: tuple[RankTarget, ...],
        post: Callable[[StepInput], None] | None = None,
        *,
        states: StateSlots | None = None,
    ) -> None:
        self.cache = cache
        self.states = states
        """A recurrent model's state slots: each registered request's holds the state the
        prefill side sends (None: no state to take)."""
        self.receiver = receiver
        self.transport = transport
        self.layout = layout
        self.ranks = ranks
        self._post = post
        self._unregistered: set[str] = set()
        """Parked requests whose pages are not registered yet (nothing promised)."""

    @property
    def polling(self) -> bool:
        return bool(self._unregistered)

    def claim(self, bootstrap: Bootstrap) -> str | None:
        """Refuse, before anything is sent, a bootstrap address this instance may not
        contact (:class:`InvalidRequest` naming ``bootstrap_host``) and a new one when
        every link is busy (:class:`~hicache.disagg.links.LinksFull`: 503, retry)."""
        if bootstrap.transfers and self.receiver is not None:
            try:
                self.receiver.check(bootstrap.host, bootstrap.port)
            except BootstrapRefused as exc:
                raise InvalidRequest(str(exc), param="bootstrap_host") from None
        return None

    def computes_prompt(self, req: Request) -> bool:
        return req.bootstrap is None or not req.bootstrap.transfers

    def parks_admitted(self, req: Request) -> bool:
        if req.bootstrap is None or not req.bootstrap.transfers:
            return False
        if req.output_ids:  # its pages arrived once (a retracted request admitted again):
            return False  # it resumes from what it holds, as on a plain instance
        self._unregistered.add(req.rid)
        return True

    def register(self, parked: list[Request]) -> list[Request]:
        failed: list[Request] = []
        for req in parked:
            if req.rid not in self._unregistered:
                continue
            handle = req.cache
            assert handle is not None and req.bootstrap is not None
            if handle.failed is not None:
                self._unregistered.discard(req.rid)
                failed.append(req)  # admitted again: nothing of the load is promised
                continue
            if handle.loading:
                continue  # its L2 hit is still coming into L1
            state = self._state_targets(req.rid)
            if state is None:
                continue  # no state slot free yet (every rank alike)
            self._unregistered.discard(req.rid)
            if self.receiver is None:
                continue  # rank 0 registers it
            registration = Registration(
                room=req.bootstrap.room,
                layout=self.layout,
                ranks=self.ranks,
                prompt_len=len(req.prompt_ids),
                prompt_hash=prompt_hash(req.prompt_ids),
                skip_pages=handle.prefix_pages,
                targets=tuple(
                    StoreTarget(h.name, h.first, tuple(h.pages))
                    for h in held_pages(self.cache, handle)
                )
                + state,
            )
            try:
                self.receiver.expect(req.rid, req.bootstrap.host, req.bootstrap.port, registration)
            except Exception as exc:  # nothing was promised: it ends at the next step
                log.exception("registering %s failed", req.rid)
                why = f"its pages could not be registered: {type(exc).__name__}: {exc}"
                assert self._post is not None
                self._post(RoomEnded(req.rid, why))
        return failed

    def _state_targets(self, rid: str) -> tuple[StoreTarget, ...] | None:
        """Where the state of ``rid`` lands: its slot, taken now (none without state);
        None when no slot is free."""
        if self.states is None:
            return ()
        slot = self.states.claim(rid)
        if slot is None:
            return None
        return tuple(StoreTarget(n, 0, (slot,)) for n in self.states.names)

    def arrived(self, req: Request) -> SequenceExtras | None:
        """The state after ``req``'s prompt, from its slot (freed now)."""
        if self.states is None:
            return None
        slot = self.states.slot(req.rid)
        assert slot is not None, "registered requests hold a slot"
        state = self.states.read(slot, len(req.prompt_ids))
        self.states.free(req.rid)
        return SequenceExtras((state,))

    def requeued(self, req: Request) -> None:
        self._unregistered.discard(req.rid)  # nothing was promised; parked again later

    def abort(self, req: Request, why: str) -> bool:
        if req.rid in self._unregistered:
            return True  # nothing promised: it ends now
        if self.receiver is not None:
            self.receiver.abort(req.rid, why)
        return False

    def ended(self, req: Request) -> None:
        if self.states is not None:
            self.states.free(req.rid)  # nothing can write it any more (fences end first)
        self._unregistered.discard(req.rid)
        if self.receiver is not None:
            self.receiver.forget(req.rid)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.transport.close()
