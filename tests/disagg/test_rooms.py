"""The room table of a prefill instance, exact states on hand-made sequences, and a
hypothesis machine that checks its rules against a model: a room is single-use, a closed
room stays closed, an abort while transferring closes only when the sender stops, the
timeouts fail only rooms missing a side within ``timeout_s``, and every state ends on its
own (a transfer by an abort the sender acknowledges)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache.disagg.layout import (
    InstanceLayout,
    LayoutMismatch,
    RankTarget,
    Registration,
    StoreLayout,
    StoreTarget,
    check_pair,
)
from hicache.disagg.rooms import RoomResult, RoomState, RoomStatus, RoomTable
from hicache.logprob import TokenLogprob

LAYOUT = InstanceLayout(
    model="m",
    fingerprint="f",
    page_size=4,
    tp_size=1,
    mla=False,
    transfer_backend="mooncake",
    stores=(StoreLayout("full", 2, 3, 64, "float32"),),
)


def reg(room: int) -> Registration:
    return Registration(
        room=room,
        layout=LAYOUT,
        ranks=(RankTarget("127.0.0.1:1", {"full": {"addr": 0}}),),
        prompt_len=9,
        prompt_hash="h",
        skip_pages=1,
        targets=(StoreTarget("full", 0, (5, 6, 7)),),
    )


def state(t: RoomTable, room: int) -> RoomState | None:
    s = t.status(room)
    return None if s is None else s.state


def test_either_side_first_then_transfer_and_success() -> None:
    for first in ("claim", "register"):
        t = RoomTable(timeout_s=10, closed_ttl_s=100)
        if first == "claim":
            assert t.claim(1, 0.0) is None
        else:
            assert t.register(reg(1), 0.0) is None
        assert state(t, 1) is RoomState.BOOTSTRAPPING
        assert t.start(1, 0.1) is None  # one side only
        if first == "claim":
            assert t.register(reg(1), 0.2) is None
        else:
            assert t.claim(1, 0.2) is None
        assert state(t, 1) is RoomState.WAITING_FOR_INPUT
        assert t.start(1, 0.3) is None  # not armed: the decode side has not polled it
        assert t.arm(1) is True and t.arm(1) is False
        assert t.start(1, 0.3) == reg(1)
        assert state(t, 1) is RoomState.TRANSFERRING
        assert t.start(1, 0.3) is None  # handed once
        t.close(1, 0.4, result=RoomResult(first_token=7, cached_device=4))
        assert t.status(1) == RoomStatus(1, RoomState.SUCCESS, RoomResult(7, 4, 0, 0), None, True)
        assert len(t) == 0


def test_a_room_is_single_use() -> None:
    t = RoomTable(timeout_s=10, closed_ttl_s=100)
    assert t.claim(1, 0.0) is None
    assert t.claim(1, 0.0) == "bootstrap room 1 is in use by another request"
    assert t.register(reg(1), 0.0) is None
    assert t.register(reg(1), 0.0) == "bootstrap room 1 is in use by another request"
    t.close(1, 1.0, error="boom")
    why = t.claim(1, 1.0)
    assert why is not None and "has failed (boom)" in why
    # forgotten after the ttl: the number may come again
    assert t.expire(102.0) == []
    assert t.status(1) is None
    assert t.claim(1, 102.0) is None


def test_abort_while_transferring_closes_when_the_sender_stops() -> None:
    t = RoomTable(timeout_s=10, closed_ttl_s=100)
    t.claim(1, 0.0)
    t.register(reg(1), 0.0)
    t.arm(1)
    assert t.start(1, 0.0) == reg(1)
    assert t.abort(1, "client gone", 0.1) is False
    assert state(t, 1) is RoomState.TRANSFERRING and t.aborted(1)
    t.close(1, 0.2, result=RoomResult(3))  # the sender's last write was done: still aborted
    assert t.status(1) == RoomStatus(1, RoomState.ABORTED, None, "client gone", written=True)
    # an abort before any transfer closes at once; the prefill's request is refused
    assert t.abort(2, "gone early", 0.3) is True
    why = t.claim(2, 0.4)
    assert why is not None and "aborted by the decode side (gone early)" in why


def test_a_registration_never_armed_is_never_written_and_an_abort_ends_it() -> None:
    """The registration a paused prefill instance reads after the decode side gave up on
    it: the decode side never polls it, so the sender never gets it; its abort (sent
    before or after the registration is read) closes the room, and the prefill's request
    is refused."""
    for abort_first in (False, True):
        t = RoomTable(timeout_s=10, closed_ttl_s=100)
        if abort_first:
            assert t.abort(1, "given up", 0.0) is True
            assert t.register(reg(1), 0.1) is not None  # refused: no page is promised
        else:
            assert t.register(reg(1), 0.0) is None
            assert t.claim(1, 0.0) is None
            assert t.start(1, 0.1) is None  # waits for an arm that never comes
            assert t.abort(1, "given up", 0.2) is True
        assert t.arm(1) is False and t.start(1, 0.3) is None
        assert state(t, 1) is RoomState.ABORTED
        why = t.claim(1, 0.4)  # a request of it (again, when it came first) is refused
        assert why is not None and "was aborted by the decode side (given up)" in why


def test_success_is_taken_by_the_decode_side_or_given_up_after_the_last_write() -> None:
    for taken in (True, False):
        t = RoomTable(timeout_s=10, closed_ttl_s=100)
        t.claim(1, 0.0)
        t.register(reg(1), 0.0)
        t.arm(1)
        t.start(1, 0.1)
        t.close(1, 0.2, result=RoomResult(3))
        assert not t.taken(1) and not t.aborted(1)
        if taken:
            t.take(1)
            assert t.abort(1, "late", 0.3) is True  # taken already: the abort changes nothing
            assert t.taken(1) and not t.aborted(1)
        else:  # the decode side failed the request after the last write: no success
            assert t.abort(1, "given up", 0.3) is True
            t.take(1)
            assert t.aborted(1) and not t.taken(1)
        assert state(t, 1) is RoomState.SUCCESS  # every byte landed: the decode may free


def test_expire_fails_rooms_missing_a_side_naming_it() -> None:
    t = RoomTable(timeout_s=5, closed_ttl_s=100)
    t.claim(1, 0.0)
    t.register(reg(2), 0.0)
    t.claim(3, 0.0)
    t.register(reg(3), 0.0)  # both sides: not expired, however long the prefill takes
    assert t.expire(4.0) == []
    assert sorted(t.expire(6.0)) == [1, 2]
    assert not any(t.status(r).written for r in (1, 2, 3))  # type: ignore[union-attr]
    s1, s2 = t.status(1), t.status(2)
    assert s1 is not None and s1.error is not None and "the decode side's request" in s1.error
    assert s2 is not None and s2.error is not None and "the prefill side's request" in s2.error
    assert state(t, 3) is RoomState.WAITING_FOR_INPUT


def test_every_state_ends_on_its_own() -> None:
    """Both sides known, a room waiting for its prefill fails after ``work_timeout_s``; one
    transferring past it is aborted (the sender stops and closes it, never under a write);
    a closed room is forgotten after ``closed_ttl_s``."""
    t = RoomTable(timeout_s=5, closed_ttl_s=100, work_timeout_s=30)
    for room in (1, 2):
        t.claim(room, 0.0)
        t.register(reg(room), 0.0)
    t.arm(2)  # the decode side polled it
    assert t.start(2, 10.0) is not None  # transferring since 10 s
    assert t.expire(30.0) == []
    assert t.expire(31.0) == [1]
    s1 = t.status(1)
    assert s1 is not None and s1.state is RoomState.FAILED and not s1.written
    assert (
        s1.error == "room 1: the prefill did not start sending within 30 s of both sides' requests"
    )
    assert t.expire(40.5) == [2]
    assert state(t, 2) is RoomState.TRANSFERRING and t.aborted(2)  # the sender's to close
    assert t.expire(80.0) == []  # asked once
    t.close(2, 80.5, error="the sender stopped")
    s2 = t.status(2)
    assert s2 is not None and s2.state is RoomState.ABORTED
    assert s2.error == "room 2: the transfer did not end within 30 s"
    t.expire(140.0)
    assert t.status(1) is None and t.status(2) is not None
    t.expire(181.0)
    assert t.status(2) is None


def test_registered_tells_whether_the_prefill_may_start() -> None:
    t = RoomTable(timeout_s=5, closed_ttl_s=100)
    t.claim(1, 0.0)
    assert not t.registered(1) and not t.registered(2)
    t.register(reg(1), 0.1)
    assert t.registered(1)
    t.claim(3, 0.0)
    t.expire(6.0)  # room 3 fails: nothing more will come for it
    assert t.registered(3)


def test_status_json_round_trip_and_bad_input() -> None:
    s = RoomStatus(9, RoomState.SUCCESS, RoomResult(1, 2, 3, 4))
    assert RoomStatus.from_json(s.to_json()) == s
    assert Registration.from_json(reg(4).to_json()) == reg(4)
    with pytest.raises(ValueError, match="cannot be read"):
        RoomStatus.from_json({"room": 1, "state": "nope"})
    with pytest.raises(ValueError, match="registration that cannot be read"):
        Registration.from_json({"room": 1})


def test_a_result_carries_the_prefills_logprobs_and_sampler_state_losslessly() -> None:
    """Through JSON, as the decode side's status poll reads it: the first token's
    logprob, the prompt's (None where not scored) and the generator's state, bit for bit;
    dropped from the room once the decode side took them."""
    first = TokenLogprob.of(7, -0.1234567890123, [(7, -0.12345679), (3, -2.5)])
    prompt = (None, None, TokenLogprob.of(5, -11.9, [(1, -4.25)]), TokenLogprob(6, -3.0))
    result = RoomResult(7, 1, 0, 0, first, prompt, bytes(range(256)) * 3)
    s = RoomStatus(9, RoomState.SUCCESS, result)
    back = RoomStatus.from_json(json.loads(json.dumps(s.to_json())))
    assert back == s and back.result is not None
    assert back.result.first_logprob is not None and back.result.first_logprob.top == first.top
    # taken, the closed room keeps only what is still read of it (for closed_ttl_s)
    t = RoomTable(timeout_s=10, closed_ttl_s=100)
    t.claim(1, 0.0)
    t.register(reg(1), 0.0)
    t.arm(1)
    t.start(1, 0.1)
    t.close(1, 0.2, result=result)
    assert t.status(1) == RoomStatus(1, RoomState.SUCCESS, result, written=True)
    t.take(1)
    assert t.status(1) == RoomStatus(1, RoomState.SUCCESS, RoomResult(7, 1), written=True)
    with pytest.raises(ValueError, match="cannot be read"):
        RoomStatus.from_json({**s.to_json(), "result": {"first_token": 1, "first_logprob": [1]}})
    with pytest.raises(ValueError, match="cannot be read"):
        RoomStatus.from_json({**s.to_json(), "result": {"first_token": 1, "sampler_state": "@"}})


def test_check_pair_names_the_field_and_both_values() -> None:
    other = replace(LAYOUT, page_size=8)
    with pytest.raises(
        LayoutMismatch, match="page_size differs: the prefill instance has 4, the decode instance 8"
    ):
        check_pair(LAYOUT, other)
    check_pair(LAYOUT, replace(LAYOUT, tp_size=4))  # whole rows: every rank holds them
    mla = replace(LAYOUT, mla=True)
    check_pair(mla, replace(mla, tp_size=4))  # a latent is whole on every rank
    half = replace(LAYOUT, stores=(StoreLayout("full", 2, 3, 32, "float32"),))
    with pytest.raises(LayoutMismatch, match="store 'full' row_bytes differs"):
        check_pair(LAYOUT, half)


def split(tp: int, row_bytes: int, num_heads: int = 8) -> InstanceLayout:
    """A layout whose 4 K/V heads of 16 bytes are split across ``tp`` ranks."""
    store = StoreLayout("full", 2, 3, row_bytes, "float32", kv_heads=4)
    return replace(LAYOUT, tp_size=tp, stores=(store,), num_heads=num_heads)


def test_split_rows_pair_across_tp_sizes_by_bytes_per_head() -> None:
    one, two, eight = split(1, 64), split(2, 32), split(8, 16)  # 8 ranks: heads replicated
    for p in (one, two, eight):
        for d in (one, two, eight):
            check_pair(p, d)
    with pytest.raises(
        LayoutMismatch,
        match="store 'full' bytes per head differs: the prefill instance has 16, the decode instance 32",
    ):
        check_pair(one, split(2, 64))
    with pytest.raises(
        LayoutMismatch,
        match="num_heads differs: the prefill instance has 8, the decode instance 16",
    ):
        check_pair(one, split(2, 32, num_heads=16))
    whole = replace(two, stores=(replace(two.stores[0], kv_heads=0),))
    with pytest.raises(LayoutMismatch, match="store 'full' kv_heads differs"):
        check_pair(two, whole)


class RoomMachine(RuleBasedStateMachine):
    """Random claims, registrations, starts, aborts, closes and expiries of a few rooms
    against a model of the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.t = RoomTable(timeout_s=5, closed_ttl_s=50, work_timeout_s=20)
        self.now = 0.0
        self.closed: dict[int, RoomState] = {}
        self.sides: dict[int, set[str]] = {}
        self.armed: set[int] = set()

    rooms = st.integers(0, 3)

    @rule(dt=st.floats(0, 7))
    def tick(self, dt: float) -> None:
        self.now += dt
        for room in self.t.expire(self.now):
            if state(self.t, room) is RoomState.TRANSFERRING:
                assert self.t.aborted(room)  # past work_timeout_s: the sender closes it
                continue
            assert state(self.t, room) is RoomState.FAILED
            self.closed[room] = RoomState.FAILED
        for room in [r for r in self.closed if self.t.status(r) is None]:
            del self.closed[room]  # forgotten after the ttl
            self.sides.pop(room, None)
            self.armed.discard(room)

    @rule(room=rooms)
    def claim(self, room: int) -> None:
        why = self.t.claim(room, self.now)
        fresh = room not in self.closed and "claim" not in self.sides.get(room, set())
        assert (why is None) == fresh
        if why is None:
            self.sides.setdefault(room, set()).add("claim")

    @rule(room=rooms)
    def register(self, room: int) -> None:
        why = self.t.register(reg(room), self.now)
        fresh = room not in self.closed and "register" not in self.sides.get(room, set())
        assert (why is None) == fresh
        if why is None:
            self.sides.setdefault(room, set()).add("register")

    @rule(room=rooms)
    def arm(self, room: int) -> None:
        if self.t.arm(room):
            self.armed.add(room)

    @rule(room=rooms)
    def start(self, room: int) -> None:
        before = state(self.t, room)
        got = self.t.start(room, self.now)
        if got is not None:
            assert before is RoomState.WAITING_FOR_INPUT and room in self.armed
            assert state(self.t, room) is RoomState.TRANSFERRING

    @rule(room=rooms)
    def abort(self, room: int) -> None:
        before = state(self.t, room)
        closed = self.t.abort(room, "x", self.now)
        assert closed == (before is not RoomState.TRANSFERRING)
        if closed and room not in self.closed:
            self.closed[room] = state(self.t, room)  # type: ignore[assignment]

    @rule(room=rooms, ok=st.booleans())
    def close(self, room: int, ok: bool) -> None:
        was_aborted = self.t.aborted(room)
        self.t.close(room, self.now, result=RoomResult(1) if ok else None, error="e")
        if room not in self.closed:
            want = (
                RoomState.ABORTED if was_aborted else RoomState.SUCCESS if ok else RoomState.FAILED
            )
            assert state(self.t, room) is want
            self.closed[room] = want

    @invariant()
    def closed_rooms_stay_closed(self) -> None:
        for room, st_ in self.closed.items():
            s = self.t.status(room)
            assert s is None or s.state is st_


TestRoomMachine = RoomMachine.TestCase
