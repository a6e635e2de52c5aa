"""Restores through the engine: queued -> loading -> ready with exact tokens per tier,
held until the session's next request, its TTL or a cancel; bounds; no L3 or a failing
one -> failed with the reason, the session's request still served right (by recompute).

Greedy outputs are compared with a run that had no L3 at all.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hicache.cache.request import CachedTokens
from hicache.cache.restores import NO_L3
from hicache.engine.front.engine import Engine
from hicache.engine.restore_book import RestoreBusy, RestoreOp, RestoreState
from hicache.engine.sampling import InvalidRequest
from hicache.engine.session import SessionHint
from hicache.engine.step.restores import restore_page_bytes
from hicache.keys import head_key
from hicache.storage.backends.memory import MemoryFaults, MemoryStorage
from tests.engine.test_l3_engine import (
    FULL,
    GREEDY,
    PAGE,
    PROMPT,
    clean,
    clean_but_sessions,
    make_engine,
    only_in_l3,
)

SESSION = SessionHint("agent-1")


def wait_state(
    engine: Engine, op_id: str, until: set[RestoreState], timeout_s: float = 30.0
) -> tuple[RestoreOp, list[RestoreState]]:
    """Poll ``op_id`` until its state is in ``until``; returns it and the states seen."""
    seen: list[RestoreState] = []
    deadline = time.monotonic() + timeout_s
    while True:
        op = engine.restore_op(op_id)
        assert op is not None
        if not seen or seen[-1] is not op.state:
            seen.append(op.state)
        if op.state in until:
            return op, seen
        assert time.monotonic() < deadline, f"restore stuck in {op.state}"
        time.sleep(0.005)


def host_refs(engine: Engine) -> list[int]:
    def read() -> list[int]:
        return [n.host_ref for n in engine.core.cache.full.pages.tree.iter_nodes()]

    return engine.call(read).result(timeout=30)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    with make_engine(None, {}) as engine:
        return engine.generate(PROMPT, GREEDY, timeout=60).output_ids


def slow_engine(name: str) -> Engine:
    """An engine over a memory L3 holding PROMPT's pages alone (L1 and L2 empty), every
    L3 op taking 0.1 s from now on."""
    engine = make_engine("memory", {"store": f"{name}-{time.monotonic_ns()}"})
    engine.generate(PROMPT, GREEDY, timeout=60)
    only_in_l3(engine)
    storage(engine).set_faults(MemoryFaults(delay_s=0.1))
    return engine


def storage(engine: Engine) -> MemoryStorage:
    l3 = engine.core.cache.l3.attached
    assert l3 is not None and isinstance(l3.controller.storage, MemoryStorage)
    return l3.controller.storage


def test_a_restore_is_ready_with_its_tokens_and_released_by_the_sessions_next_request(
    reference: list[int],
) -> None:
    with slow_engine("next") as engine:
        op = engine.restore(PROMPT, session_id="agent-1", ttl_ms=60_000)
        assert op.state is RestoreState.QUEUED and op.tokens == FULL
        ready, seen = wait_state(engine, op.operation_id, {RestoreState.READY})
        assert seen[-2:] == [RestoreState.LOADING, RestoreState.READY]
        # L1 had room no request needed: the prefix went on from L2 into L1
        assert ready.resident == CachedTokens(device=FULL, host=FULL, storage=FULL)
        assert ready.body()["resident_tokens"] == {"device": FULL, "host": FULL, "storage": FULL}
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=30)
        assert max(host_refs(engine)) == 1  # held in L2 (the L1 copy landed)
        storage(engine).set_faults(MemoryFaults())
        out = engine.generate(PROMPT, GREEDY, timeout=60, session=SESSION)
        assert out.cached == CachedTokens(device=FULL, host=0, storage=0)  # from the hold
        assert out.output_ids == reference
        done, _ = wait_state(engine, op.operation_id, {RestoreState.RELEASED})
        assert done.resident is not None and done.resident.host == FULL
        clean_but_sessions(engine)  # no pin left but the session's own retention


def test_a_request_of_another_session_leaves_the_hold(reference: list[int]) -> None:
    with slow_engine("other") as engine:
        op = engine.restore(PROMPT, session_id="agent-1")
        wait_state(engine, op.operation_id, {RestoreState.READY})
        out = engine.generate(PROMPT, GREEDY, timeout=60, session=SessionHint("agent-2"))
        assert out.output_ids == reference
        assert engine.restore_op(op.operation_id).state is RestoreState.READY  # type: ignore[union-attr]
        engine.cancel_restore(op.operation_id)
        clean_but_sessions(engine)  # the sessions' own retention aside


def test_a_restore_expires_at_its_ttl_and_gives_its_hold_back() -> None:
    with slow_engine("ttl") as engine:
        op = engine.restore(PROMPT, session_id="agent-1", ttl_ms=1500)
        ready, _ = wait_state(engine, op.operation_id, {RestoreState.READY})
        assert ready.state is RestoreState.READY
        ended, _ = wait_state(engine, op.operation_id, {RestoreState.EXPIRED}, 10)
        assert ended.error is None
        clean(engine)


def test_a_restore_loading_past_its_ttl_expires() -> None:
    with slow_engine("ttl-loading") as engine:
        storage(engine).set_faults(MemoryFaults(delay_s=1.0))
        op = engine.restore(PROMPT, session_id="agent-1", ttl_ms=50)
        _, seen = wait_state(engine, op.operation_id, {RestoreState.EXPIRED}, 10)
        assert RestoreState.READY not in seen
        storage(engine).set_faults(MemoryFaults())
        clean(engine)


def test_cancel_gives_the_hold_back_and_unknown_ids_are_none() -> None:
    with slow_engine("cancel") as engine:
        op = engine.restore(PROMPT, session_id="agent-1")
        wait_state(engine, op.operation_id, {RestoreState.READY})
        got = engine.cancel_restore(op.operation_id)
        assert got is not None and got.state is RestoreState.CANCELLED
        again = engine.cancel_restore(op.operation_id)  # ended: keeps its state
        assert again is not None and again.state is RestoreState.CANCELLED
        assert engine.restore_op("restore-nope") is None
        assert engine.cancel_restore("restore-nope") is None
        clean(engine)


def test_restores_over_their_bounds_are_refused() -> None:
    with slow_engine("bounds") as engine:
        book = engine.core.restores.book
        book.max_ops = 1
        op = engine.restore(PROMPT, session_id="agent-1")
        with pytest.raises(RestoreBusy, match="restore-max-ops=1"):
            engine.restore(PROMPT, session_id="agent-2")
        engine.cancel_restore(op.operation_id)
        book.max_ops, book.max_bytes = 16, op.nbytes - 1
        with pytest.raises(RestoreBusy, match="restore-max-bytes"):
            engine.restore(PROMPT, session_id="agent-2")
        book.max_bytes = op.nbytes
        wait_state(
            engine, engine.restore(PROMPT, session_id="a").operation_id, {RestoreState.READY}
        )
        clean_ops(engine)


def clean_ops(engine: Engine) -> None:
    for op in engine.core.restores.book.live():
        engine.cancel_restore(op.operation_id)
    clean(engine)


@pytest.mark.parametrize(
    ("ttl", "why"),
    [(-1, "=-1"), (float("nan"), "=nan"), ("100", "='100'"), (25 * 3600 * 1000, "=90000000")],
)
def test_a_bad_ttl_is_refused_naming_it(ttl: object, why: str) -> None:
    with make_engine(None, {}) as engine:
        with pytest.raises(InvalidRequest, match=f"ttl_ms{why} is invalid") as err:
            engine.restore(PROMPT, session_id="agent-1", ttl_ms=ttl)
        assert err.value.param == "ttl_ms"
        with pytest.raises(InvalidRequest) as err:
            engine.restore(PROMPT[:3], session_id="agent-1")  # under one page
        assert err.value.param == "input_ids"
        with pytest.raises(InvalidRequest) as err:
            engine.restore(PROMPT, session_id="")
        assert err.value.param == "session_id"


def test_without_l3_a_restore_fails_and_the_request_is_served(reference: list[int]) -> None:
    with make_engine(None, {}) as engine:
        op = engine.restore(PROMPT, session_id="agent-1")
        failed, _ = wait_state(engine, op.operation_id, {RestoreState.FAILED})
        assert failed.error == NO_L3
        out = engine.generate(PROMPT, GREEDY, timeout=60, session=SESSION)
        assert out.output_ids == reference
        clean_but_sessions(engine)  # the sessions' own retention aside


def test_a_failing_l3_fails_the_restore_with_its_reason(reference: list[int]) -> None:
    with slow_engine("failing") as engine:
        storage(engine).set_faults(MemoryFaults(fail_after=0))
        op = engine.restore(PROMPT, session_id="agent-1")
        failed, _ = wait_state(engine, op.operation_id, {RestoreState.FAILED})
        assert failed.error is not None and "injected failure" in failed.error
        out = engine.generate(PROMPT, GREEDY, timeout=60, session=SESSION)
        assert out.error is None and out.cached.storage == 0 and out.output_ids == reference
        clean_but_sessions(engine)  # the sessions' own retention aside


def test_a_restore_over_a_corrupt_record_stops_there_and_the_rest_is_recomputed(
    tmp_path: Path, reference: list[int]
) -> None:
    with make_engine("file", {"file_path": str(tmp_path)}) as engine:
        engine.generate(PROMPT, GREEDY, timeout=60)
        only_in_l3(engine)
        l3 = engine.core.cache.l3.attached
        assert l3 is not None
        keys = l3.keys.of(b"".join(t.to_bytes(4, "little") for t in PROMPT[:FULL]))
        victim = l3.controller.storage.path_of(head_key(keys[5], 0).key)  # type: ignore[attr-defined]
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0xFF  # a payload byte of page 6
        victim.write_bytes(bytes(data))
        op = engine.restore(PROMPT, session_id="agent-1")
        ready, _ = wait_state(engine, op.operation_id, {RestoreState.READY})
        assert ready.resident == CachedTokens(device=5 * PAGE, host=5 * PAGE, storage=5 * PAGE)
        page_bytes = restore_page_bytes(engine.core.cache)
        assert op.nbytes == FULL // PAGE * page_bytes  # reserved for the whole prefix,
        assert ready.nbytes == 5 * page_bytes  # then what it brought into L2
        out = engine.generate(PROMPT, GREEDY, timeout=60, session=SESSION)
        assert out.cached.total == 5 * PAGE and out.output_ids == reference
        wait_state(engine, op.operation_id, {RestoreState.RELEASED})
        clean_but_sessions(engine)  # the sessions' own retention aside


def test_closing_the_session_cancels_its_restores() -> None:
    with slow_engine("close") as engine:
        op = engine.restore(PROMPT, session_id="agent-1")
        other = engine.restore(PROMPT, session_id="agent-2")
        wait_state(engine, op.operation_id, {RestoreState.READY})
        assert engine.close_session("agent-1")  # no request yet, but a restore to end
        closed = engine.restore_op(op.operation_id)
        assert closed is not None and closed.state is RestoreState.CANCELLED
        assert closed.error == "the session was closed"
        wait_state(engine, other.operation_id, {RestoreState.READY})  # the other stays
        engine.cancel_restore(other.operation_id)
        clean(engine)
