"""A prefill instance's role: :class:`PrefillRole`, on every rank.

Each request comes with a room (checked when it is validated: :meth:`PrefillRole.claim`),
is admitted once the decode side has registered the room's pages
(:meth:`PrefillRole.admissible`), and generates one token here; a request refused after
its claim (its ``max_tokens``, a full queue) closes its room (:meth:`PrefillRole.unclaim`),
so the decode side's half fails at once. Each computed chunk's whole pages and, once that
token is sampled, the rest (:meth:`PrefillRole.hand_off`: the request is parked) go to this
rank's sender as :class:`~hicache.disagg.sender.SendJob` s: every rank writes its own share
(:mod:`hicache.disagg.shares`); a recurrent model's state after the prompt goes with the
final job, from the request's :class:`~hicache.engine.roles.state_slots.StateSlots` slot.
The request is released, its KV committed to this
instance's cache by its write policy, on a :class:`~hicache.engine.step_inputs.RoomEnded`
input (whose error, if any, its client gets). A request that ends before its hand-off
(aborted, failed) ends its room's shares with the reason.

Only rank 0 holds the room table (:class:`RoomDesk`: the rooms and their bootstrap server).
Once per step while rooms are live, the ranks exchange what rank 0 learned of them
(:class:`~hicache.disagg.rank_rooms.RoomNews`) and the shares each sender ended
(:class:`~hicache.disagg.rank_rooms.ShareEnd`); rank 0 closes a room once every rank's share
has ended, and its sender reports the room's end once the decode side took the pages.
Built by :mod:`hicache.engine.roles.role_setup`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import cast

import torch

from hicache.cache import HiCache
from hicache.cache.held import held_pages
from hicache.disagg.bootstrap import BootstrapServer, PrefillRooms
from hicache.disagg.config import Bootstrap, DisaggMode
from hicache.disagg.layout import Registration, prompt_hash
from hicache.disagg.pages import PoolGeometry
from hicache.disagg.rank_rooms import RankRooms, RoomNews, ShareEnd
from hicache.disagg.rooms import RoomResult
from hicache.disagg.sender import PrefillSender, SendJob, SourcePages
from hicache.disagg.transport import Transport
from hicache.engine.request import Request
from hicache.engine.role import Role
from hicache.engine.roles.state_slots import StateSlots
from hicache.engine.sampling import generator_state
from hicache.runner.model_runner import ModelRunner

__all__ = ["Exchange", "PrefillRole", "RoomDesk", "local_exchange"]

Exchange = Callable[[object], list[object]]
"""Every rank's value, by rank, on every rank (a collective: every rank calls it at the
same point of the same step); with one rank, ``lambda v: [v]``."""


@dataclass
class RoomDesk:
    """Rank 0's rooms: the table and its bootstrap server, what every rank was told of
    each room (``told_registered``, ``told_armed``, ``told_stopped``), the shares ended so
    far (``shares``: room -> rank -> end), and the rooms closed ``SUCCESS`` whose taking
    rank 0's sender waits for (``closed_ok``). Rank 0's engine thread only."""

    rooms: PrefillRooms
    server: BootstrapServer
    tp_size: int
    told_registered: set[int] = field(default_factory=set)
    told_armed: set[int] = field(default_factory=set)
    told_stopped: set[int] = field(default_factory=set)
    shares: dict[int, dict[int, ShareEnd]] = field(default_factory=dict)
    closed_ok: set[int] = field(default_factory=set)
    settled: set[int] = field(default_factory=set)
    """Rooms closed once every share ended (nothing more is told of them but the close)."""
    closed: list[int] = field(default_factory=list)
    """Rooms closed since the last news (every rank forgets them once told)."""

    def news(self, live: set[int]) -> RoomNews:
        """What changed of the ``live`` rooms since the last news (rank 0, at a step)."""
        rooms = self.rooms
        registered: list[tuple[int, Registration | None, str | None]] = []
        armed: list[int] = []
        stopped: list[tuple[int, str]] = []
        for room in sorted(live):
            status = rooms.status([room])[0]
            closed = status is not None and status.state.closed
            if room not in self.told_registered:
                reg = None if closed else rooms.registration(room)
                if closed or reg is not None:
                    why = (status.error if status else None) or f"room {room} has closed"
                    registered.append((room, reg, why if closed else None))
                    self.told_registered.add(room)
                    if closed:
                        self.told_stopped.add(room)
                continue
            if room in self.told_stopped or room in self.settled:
                continue
            if closed or rooms.aborted(room):
                why = (
                    status.error if status else None
                ) or f"room {room}: the decode side aborted it"
                stopped.append((room, why))
                self.told_stopped.add(room)
            elif room not in self.told_armed and rooms.start(room) is not None:
                armed.append(room)
                self.told_armed.add(room)
        for room, ends in self.shares.items():
            failed = [e for e in ends.values() if e.error is not None]
            if failed and room not in self.told_stopped:
                stopped.append((room, failed[0].error or "failed"))
                self.told_stopped.add(room)
        done, self.closed = tuple(self.closed), []
        return RoomNews(tuple(registered), tuple(armed), tuple(stopped), closed=done)

    def tally(self, ends: list[ShareEnd], live: set[int]) -> None:
        """Count ``ends`` of the ``live`` rooms; close each room whose every share has
        ended: ``SUCCESS`` with rank 0's result when every share was written, else with
        the first error (by rank)."""
        for end in ends:
            if end.room in live:
                self.shares.setdefault(end.room, {})[end.rank] = end
        for room in [r for r, got in self.shares.items() if len(got) == self.tp_size]:
            got = self.shares.pop(room)
            errors = [got[r].error for r in sorted(got) if got[r].error is not None]
            if errors:
                self.rooms.close(room, error=errors[0])
            else:
                self.rooms.close(room, result=got[0].result)
                self.closed_ok.add(room)
            self.settled.add(room)
            self.closed.append(room)

    def takes(self) -> RoomNews:
        """Of the rooms closed ``SUCCESS``: those the decode side took, and those it gave
        up (for rank 0's sender alone)."""
        taken = tuple(r for r in self.closed_ok if self.rooms.taken(r))
        gave_up = tuple(
            (r, f"room {r}: the decode side gave it up")
            for r in self.closed_ok
            if r not in taken and self.rooms.aborted(r)
        )
        self.closed_ok.difference_update(taken)
        self.closed_ok.difference_update(r for r, _ in gave_up)
        return RoomNews(stopped=gave_up, taken=taken)

    def forget(self, room: int) -> None:
        for told in (
            self.told_registered,
            self.told_armed,
            self.told_stopped,
            self.closed_ok,
            self.settled,
        ):
            told.discard(room)
        self.shares.pop(room, None)


def local_exchange(value: object) -> list[object]:
    """The exchange of one rank, or of a rank stepping alone: its own value only."""
    return [value]


class PrefillRole(Role):
    """See the module docstring. ``rank_rooms``: this rank's view of its rooms;
    ``desk``: rank 0's rooms (None on the other ranks); ``exchange``: the ranks' per-step
    exchange; ``geometry``: each store's L1 pool as the sender describes it (by store
    name)."""

    mode = DisaggMode.PREFILL

    def __init__(
        self,
        cache: HiCache,
        rank_rooms: RankRooms,
        sender: PrefillSender,
        transport: Transport,
        geometry: dict[str, PoolGeometry],
        *,
        desk: RoomDesk | None,
        exchange: Exchange,
        carried: tuple[ModelRunner, StateSlots] | None = None,
    ) -> None:
        self.cache = cache
        self.carried = carried
        """A recurrent model's runner and state slots (None: no state to send)."""
        self.rank_rooms = rank_rooms
        self.desk = desk
        self.sender = sender
        self.transport = transport
        self.geometry = geometry
        self._exchange = exchange
        self._handed: set[str] = set()
        """Requests whose final job the sender has (their room is the sender's to close)."""
        self._sent: dict[str, int] = {}
        """Per request still computing: the whole pages its partial jobs cover so far."""
        self._hashes: dict[str, str] = {}
        """Per request with a job sent: its prompt's hash (computed once)."""
        self._live: dict[int, list[bool]] = {}
        """Rooms of requests queued here, each with ``[request ended, room closed]``: a
        room is forgotten once both (the same on every rank: the hooks and the news are)."""
        self._cuda = torch.device(cache.full.pages.device_pool.device).type == "cuda"

    @property
    def rooms(self) -> PrefillRooms:
        """Rank 0's room table."""
        assert self.desk is not None, "only rank 0 holds the rooms"
        return self.desk.rooms

    def claim(self, bootstrap: Bootstrap) -> str | None:
        """A request of ``bootstrap``'s room arrived (rank 0, any thread); None, or why it
        is refused (the room is in use, or was used)."""
        if not bootstrap.transfers:
            return None
        return self.rooms.claim(bootstrap.room)

    def unclaim(self, bootstrap: Bootstrap, why: str) -> None:
        if bootstrap.transfers:  # no job of it was sent: the room closes at once
            error = f"room {bootstrap.room}: the prefill side refused its request: {why}"
            self.rooms.close(bootstrap.room, error=error)

    @property
    def open_rooms(self) -> int:
        return 0 if self.desk is None else len(self.desk.rooms)

    @property
    def polling(self) -> bool:
        return bool(self._live)  # the rooms move at each step's exchange

    def queued(self, req: Request) -> None:
        b = req.bootstrap
        if b is not None and b.transfers:
            self._live[b.room] = [False, False]

    def admissible(self, req: Request) -> bool:
        """Only once the decode side has registered the room's pages (or the room has
        ended: the request then learns why at its hand-off). A prefill computed before
        would hold its pages until the decode side admits its half, which may wait for
        pages that parked decode requests hold, each waiting for a prefill that waits for
        memory: a cycle only timeouts break. Registered first, every request a prefill
        instance holds can be sent at once, and every page the decode side holds for a
        room is for a prefill that can run."""
        b = req.bootstrap
        return b is None or not b.transfers or self.rank_rooms.registered(b.room)

    def register(self, parked: list[Request]) -> list[Request]:
        """Once per step: rank 0's rooms expire; while rooms are live, the ranks exchange
        rank 0's news and the shares ended (see the module docstring)."""
        desk = self.desk
        if desk is not None:
            desk.rooms.expire()
        if not self._live:
            return []
        news = None if desk is None else desk.news(set(self._live))
        got = cast(
            list[tuple[RoomNews | None, list[ShareEnd]]],
            self._exchange((news, self.rank_rooms.ended_shares())),
        )
        told = got[0][0]  # None: a follower stepping alone hears no news
        if told is not None:
            self.rank_rooms.learn(told)
            for room in told.closed:
                self._settle(room, 1)
        if desk is not None:
            desk.tally([e for _, ends in got for e in ends], set(self._live))
            self.rank_rooms.learn(desk.takes())
        return []

    def _settle(self, room: int, what: int) -> None:
        """``room``'s request ended (``what`` 0) or it closed (1): forgotten once both."""
        state = self._live.get(room)
        if state is None:
            return
        state[what] = True
        if all(state):
            del self._live[room]
            self.rank_rooms.forget(room)
            if self.desk is not None:
                self.desk.forget(room)

    def hand_off(self, req: Request) -> bool:
        if req.bootstrap is None or not req.bootstrap.transfers or req.error is not None:
            return False
        if req.finish_reason is None or not req.output_ids or req.cache is None:
            return False
        if req.cache.failed is not None:
            return False  # its KV cannot be trusted: ended() fails the room
        why = self._stage_state(req)
        if why is not None:
            req.error = why  # ended() fails the room with it
            return False
        cached = req.cached
        result = RoomResult(
            first_token=req.output_ids[0],
            cached_device=cached.device,
            cached_host=cached.host,
            cached_storage=cached.storage,
        )
        if self.desk is not None:  # rank 0's result closes the room; it alone sampled
            result = replace(
                result,
                first_logprob=req.logprobs[0] if req.logprobs else None,
                prompt_logprobs=None if req.prompt_logprobs is None else tuple(req.prompt_logprobs),
                sampler_state=generator_state(req.generator),
            )
        self._sent.pop(req.rid, None)
        self._handed.add(req.rid)
        self.sender.submit(self._job(req, result=result))
        return True

    def _stage_state(self, req: Request) -> str | None:
        """Copy a recurrent model's state after ``req``'s prompt (its first token not fed
        yet) into its slot, sent with its final job; None, or why it cannot be."""
        if self.carried is None:
            return None
        runner, states = self.carried
        state = runner.carried_state(req.rid)
        n = len(req.prompt_ids)
        if state is None or state.tokens != n:
            have = "no state" if state is None else f"a state of {state.tokens} positions"
            return f"the prefill side holds {have} for the {n}-token prompt"
        slot = states.claim(req.rid)
        if slot is None:
            return "the prefill side has no free state slot"
        states.write(slot, state)
        return None

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
        if result is not None and self.carried is not None:  # the state: one slot, at the end
            states = self.carried[1]
            slot = states.slot(req.rid)
            assert slot is not None, "hand_off staged it"
            sources += tuple(
                SourcePages(n, self.geometry[n], 0, (slot,), stable=False) for n in states.names
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
        if self.carried is not None:
            self.carried[1].free(req.rid)  # the sender is done with it (RoomEnded)
        self._sent.pop(req.rid, None)
        self._hashes.pop(req.rid, None)
        b = req.bootstrap
        if req.rid in self._handed:
            self._handed.discard(req.rid)
            if b is not None:
                self._settle(b.room, 0)
            return
        if b is not None and b.transfers:
            why = req.error or "the prefill request ended before its pages were sent"
            if b.room not in self._live:  # never queued: nothing of it was sent
                if self.desk is not None:
                    self.desk.rooms.close(b.room, error=f"the prefill side failed: {why}")
                return
            # through the sender: after any partial write of the room, never under one
            self.sender.cancel(b.room, f"the prefill side failed: {why}")
            self._settle(b.room, 0)

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

    def alone(self) -> None:
        self._exchange = local_exchange

    def watch_health(self, problem: Callable[[], str | None]) -> None:
        if self.desk is not None:
            self.desk.rooms.health = problem

    def close(self) -> None:
        # the bootstrap server last: while it answers, the decode side holds the pages of
        # every room it follows; once its port is closed no write can follow
        self.sender.close()
        self.transport.close()
        if self.desk is not None:
            for end in self.rank_rooms.ended_shares():
                if end.error is not None:
                    self.desk.rooms.close(end.room, error=end.error)
            self.desk.server.close()
