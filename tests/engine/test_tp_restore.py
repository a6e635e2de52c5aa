"""Restores under tensor parallelism, through the engine's real rank processes (gloo,
CPU): every rank holds and releases the same prefix at the same step (equal rank digests,
pins included), the session's request is served from the hold exactly as transformers
answers, and rank 0's clock alone expires a restore for every rank."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from hicache.cache.request import CachedTokens
from hicache.engine.front.engine import Engine
from hicache.engine.restore_book import RestoreState
from hicache.engine.session import SessionHint
from tests.engine.test_restore_engine import wait_state
from tests.engine.test_tp_l3 import GREEDY, MATCHED, config, llama_greedy, llama_prompt

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")


def same_on_every_rank(engine: Engine) -> None:
    digests = engine.rank_digests()
    assert len(digests) == 2 and len(set(digests)) == 1


def test_a_restore_at_tp2_is_held_and_released_alike_on_every_rank(tmp_path: Path) -> None:
    a = llama_prompt(33, seed=7)
    with Engine(config("tiny-random-llama", 2, tmp_path)) as engine:
        expect = llama_greedy(a)
        assert engine.generate(a, GREEDY, timeout=120).output_ids == expect
        assert engine.flush_cache()  # a's pages only in L3 now
        op = engine.restore(a, session_id="agent-1")
        ready, _ = wait_state(engine, op.operation_id, {RestoreState.READY}, 60)
        assert ready.resident == CachedTokens(device=MATCHED, host=MATCHED, storage=MATCHED)
        same_on_every_rank(engine)  # the hold (host_ref) on both ranks
        out = engine.generate(a, GREEDY, timeout=120, session=SessionHint("agent-1"))
        assert out.cached == CachedTokens(device=MATCHED, host=0, storage=0)
        assert out.output_ids == expect
        wait_state(engine, op.operation_id, {RestoreState.RELEASED})
        same_on_every_rank(engine)

        assert engine.flush_cache()
        op = engine.restore(a, session_id="agent-2", ttl_ms=800)
        wait_state(engine, op.operation_id, {RestoreState.READY}, 60)
        wait_state(engine, op.operation_id, {RestoreState.EXPIRED}, 30)
        time.sleep(0.1)
        same_on_every_rank(engine)
        assert engine.flush_cache()
        cancelled = engine.restore(a, session_id="agent-3")
        got = engine.cancel_restore(cancelled.operation_id)
        assert got is not None and got.state is RestoreState.CANCELLED
        same_on_every_rank(engine)
        assert engine.flush_cache()


def test_a_lookup_failing_on_one_rank_fails_the_restore_on_every_rank(tmp_path: Path) -> None:
    a = llama_prompt(33, seed=8)
    cfg = dataclasses.replace(
        config("tiny-random-llama", 2, tmp_path),
        storage_backend="memory",
        storage_extra_config={"fail_after": 0, "fault_rank": 1, "prefetch_threshold": 8},
    )
    with Engine(cfg) as engine:
        expect = llama_greedy(a)
        assert engine.generate(a, GREEDY, timeout=120).output_ids == expect
        assert engine.flush_cache()
        op = engine.restore(a, session_id="agent-1")
        failed, _ = wait_state(engine, op.operation_id, {RestoreState.FAILED}, 60)
        assert failed.error == "the L3 lookup failed: on another rank"  # rank 0's was fine
        same_on_every_rank(engine)  # no rank holds anything
        out = engine.generate(a, GREEDY, timeout=120, session=SessionHint("agent-1"))
        assert out.error is None and out.cached.storage == 0 and out.output_ids == expect
        same_on_every_rank(engine)
