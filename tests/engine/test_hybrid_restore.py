"""Restores of hybrid models (sliding-window layers, recurrent-state snapshots) from a file
L3: the held prefix ends at a boundary every component serves, the session's request is
served from the hold exactly as transformers answers, and no pin is left."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.cache.request import CachedTokens
from hicache.engine.restore_book import RestoreState
from hicache.engine.session import SessionHint
from tests.engine.test_hybrid_serving import (
    GREEDY,
    MATCHED,
    PROMPT_LEN,
    assert_idle,
    hf_greedy,
    make_engine,
)
from tests.engine.test_restore_engine import wait_state
from tests.runner.models.hybrid_fixtures import prompt


@pytest.mark.parametrize("name", ["tiny-random-gemma3", "tiny-random-qwen3-next"])
def test_a_hybrid_restore_serves_the_next_turn_from_the_hold(name: str, tmp_path: Path) -> None:
    ids = prompt(name, PROMPT_LEN).tolist()
    want = hf_greedy(name, ids)
    with make_engine(name, storage=tmp_path) as engine:
        assert engine.generate(ids, GREEDY, timeout=60).output_ids == want
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=60)
        assert engine.flush_cache()
        op = engine.restore(ids, session_id="agent-1")
        ready, _ = wait_state(engine, op.operation_id, {RestoreState.READY}, 60)
        # no L1 copy ahead of the turn for a model with extra component stores
        assert ready.resident == CachedTokens(device=0, host=MATCHED, storage=MATCHED)
        out = engine.generate(ids, GREEDY, timeout=60, session=SessionHint("agent-1"))
        assert out.cached == CachedTokens(device=0, host=MATCHED, storage=0)
        assert out.output_ids == want
        wait_state(engine, op.operation_id, {RestoreState.RELEASED})
        assert engine.close_session("agent-1")  # its own retention: no pin is left then
        assert_idle(engine)
