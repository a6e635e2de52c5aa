"""A prefill instance's role: :class:`PrefillRole`.

Each request comes with a room (checked when it is validated: :meth:`PrefillRole.claim`),
is admitted once the decode side has registered the room's pages
(:meth:`PrefillRole.admissible`), and generates one token here; a request refused after its claim (its ``max_tokens``, a
full queue) closes its room (:meth:`PrefillRole.unclaim`), so the decode side's half
fails at once. When that token is sampled the request is parked
(:meth:`PrefillRole.hand_off`): its pages of every store (:func:`~hicache.cache.held.held_pages`)
go to the sender as a :class:`~hicache.disagg.sender.SendJob`, and the request is released,
its KV committed to this instance's cache by its write policy, once the sender reports
(a :class:`~hicache.engine.step_inputs.RoomEnded` input, whose error, if any, its client
gets). A request that ends before its hand-off (aborted, failed) closes its room with the
reason, which the decode side then reads.

Its bootstrap server, rooms and sender are built by :mod:`hicache.engine.roles.role_setup`.
"""

from __future__ import annotations

import torch

from hicache.cache import HiCache
from hicache.cache.held import held_pages
from hicache.disagg.bootstrap import BootstrapServer, PrefillRooms
from hicache.disagg.config import Bootstrap, DisaggMode
from hicache.disagg.layout import prompt_hash
from hicache.disagg.pages import PoolGeometry
from hicache.disagg.rooms import RoomResult
from hicache.disagg.sender import PrefillSender, SendJob, SourcePages
from hicache.disagg.transport import Transport
from hicache.engine.request import Request
from hicache.engine.role import Role

__all__ = ["PrefillRole"]


class PrefillRole(Role):
    """See the module docstring. ``geometry``: each store's L1 pool as the sender
    describes it (by store name)."""

    mode = DisaggMode.PREFILL

    def __init__(
        self,
        cache: HiCache,
        rooms: PrefillRooms,
        server: BootstrapServer,
        sender: PrefillSender,
        transport: Transport,
        geometry: dict[str, PoolGeometry],
    ) -> None:
        self.cache = cache
        self.rooms = rooms
        self.server = server
        self.sender = sender
        self.transport = transport
        self.geometry = geometry
        self._handed: set[str] = set()
        """Requests whose final job the sender has (their room is the sender's to close)."""
        self._sent: dict[str, int] = {}
        """Per request still computing: the whole pages its partial jobs cover so far."""
        self._hashes: dict[str, str] = {}
        """Per request with a job sent: its prompt's hash (computed once)."""
        self._cuda = torch.device(cache.full.pages.device_pool.device).type == "cuda"

    def claim(self, bootstrap: Bootstrap) -> str | None:
        """A request of ``bootstrap``'s room arrived (any thread); None, or why it is
        refused (the room is in use, or was used)."""
        if not bootstrap.transfers:
            return None
        return self.rooms.claim(bootstrap.room)

    def unclaim(self, bootstrap: Bootstrap, why: str) -> None:
        if bootstrap.transfers:  # no job of it was sent: the room closes at once
            error = f"room {bootstrap.room}: the prefill side refused its request: {why}"
            self.rooms.close(bootstrap.room, error=error)

    @property
    def open_rooms(self) -> int:
        return len(self.rooms)

    def admissible(self, req: Request) -> bool:
        """Only once the decode side has registered the room's pages (or the room has
        ended: the request then learns why at its hand-off). A prefill computed before
        would hold its pages until the decode side admits its half, which may wait for
        pages that parked decode requests hold, each waiting for a prefill that waits for
        memory: a cycle only timeouts break. Registered first, every request a prefill
        instance holds can be sent at once, and every page the decode side holds for a
        room is for a prefill that can run."""
        b = req.bootstrap
        return b is None or not b.transfers or self.rooms.registered(b.room)

    def hand_off(self, req: Request) -> bool:
        if req.bootstrap is None or not req.bootstrap.transfers or req.error is not None:
            return False
        if req.finish_reason is None or not req.output_ids or req.cache is None:
            return False
        if req.cache.failed is not None:
            return False  # its KV cannot be trusted: ended() fails the room
        cached = req.cached
        result = RoomResult(
            first_token=req.output_ids[0],
            cached_device=cached.device,
            cached_host=cached.host,
            cached_storage=cached.storage,
        )
        self._sent.pop(req.rid, None)
        self._handed.add(req.rid)
        self.sender.submit(self._job(req, result=result))
        return True

    def _job(
        self, req: Request, *, upto: int | None = None, result: RoomResult | None = None
    ) -> SendJob:
        """``req``'s pages as they are now: a partial job (the stable stores' pages before
        ``upto``) or the final one (``result``)."""
        assert req.bootstrap is not None and req.cache is not None
        if self._cuda:
            torch.cuda.current_stream().synchronize()  # the forward's pages are written
        sources = tuple(
            SourcePages(h.name, self.geometry[h.name], h.first, tuple(h.pages), h.stable)
            for h in held_pages(self.cache, req.cache)
            if result is not None or h.stable
        )
        return SendJob(
            rid=req.rid,
            room=req.bootstrap.room,
            prompt_len=len(req.prompt_ids),
            prompt_hash=self._prompt_hash(req),
            sources=sources,
            result=result,
            upto=upto,
        )

    def _prompt_hash(self, req: Request) -> str:
        """``req``'s prompt hash, computed at its first job only."""
        h = self._hashes.get(req.rid)
        if h is None:
            h = self._hashes[req.rid] = prompt_hash(req.prompt_ids)
        return h

    def abort(self, req: Request, why: str) -> bool:
        if req.rid in self._handed and req.bootstrap is not None:
            self.sender.cancel(req.bootstrap.room, why)
            return False  # the sender reports (RoomEnded)
        return True

    def ended(self, req: Request) -> None:
        self._sent.pop(req.rid, None)
        self._hashes.pop(req.rid, None)
        if req.rid in self._handed:
            self._handed.discard(req.rid)
            return
        if req.bootstrap is not None and req.bootstrap.transfers:
            why = req.error or "the prefill request ended before its pages were sent"
            # through the sender: after any partial write of the room, never under one
            self.sender.cancel(req.bootstrap.room, f"the prefill side failed: {why}")

    def computed(self, req: Request) -> None:
        if req.bootstrap is None or not req.bootstrap.transfers or req.cache is None:
            return
        upto = req.kv_len // self.cache.context.page_size
        if upto <= self._sent.get(req.rid, 0):
            return
        self._sent[req.rid] = upto
        self.sender.submit(self._job(req, upto=upto))

    def requeued(self, req: Request) -> None:
        if req.bootstrap is not None and req.bootstrap.transfers:
            self._sent.pop(req.rid, None)
            self.sender.restart(req.bootstrap.room)

    def close(self) -> None:
        # the bootstrap server last: while it answers, the decode side holds the pages of
        # every room it follows; once its port is closed no write can follow
        self.sender.close()
        self.transport.close()
        self.server.close()
