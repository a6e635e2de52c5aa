"""A restore on the prefill instance of a prefill/decode pair: the conversation the decode
instance offloaded to L3 is brought into the prefill instance's L2 ahead of the session's
next turn, which the prefill side then serves from that hold (greedy outputs equal a
plain engine's)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hicache.cache.request import CachedTokens
from hicache.config import CacheConfig
from hicache.disagg.config import Bootstrap, DisaggConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.restore_book import RestoreState
from hicache.engine.session import SessionHint
from hicache.engine.step.scheduler import SchedulerConfig
from tests.disagg.test_pd_engine import FAST, GREEDY, PROMPT, assert_idle, free_port, reference
from tests.engine.test_restore_engine import wait_state

MODEL = "tiny-random-llama"
WHOLE = 44  # PROMPT's whole pages of 4


def make(mode: str, port: int, l3: Path) -> Engine:
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=4, device_tokens=256, hicache_ratio=4.0, load_back_threshold=0),
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=32),
        context_length=128,
        storage_backend="file",
        storage_extra_config={"file_path": str(l3), "prefetch_threshold": 4},
        storage_prefetch_policy="wait_complete",
        disagg=DisaggConfig(
            mode=mode,  # type: ignore[arg-type]
            bootstrap_port=port,
            transfer_backend="mooncake",  # type: ignore[arg-type]
            decode_offload=mode == "decode",
            **FAST,  # type: ignore[arg-type]
        ),
    )
    return Engine(config).start()


def turn(
    prefill: Engine, decode: Engine, room: int, session: SessionHint
) -> tuple[RequestOutput, RequestOutput]:
    b = Bootstrap("127.0.0.1", prefill.config.disagg.bootstrap_port, room)
    with ThreadPoolExecutor(2) as ex:
        p = ex.submit(prefill.generate, PROMPT, GREEDY, 60, bootstrap=b, session=session)
        d = ex.submit(decode.generate, PROMPT, GREEDY, 60, bootstrap=b, session=session)
        return p.result(), d.result()


def test_a_prefill_instance_restores_from_l3_ahead_of_the_next_turn(tmp_path: Path) -> None:
    want = reference(MODEL)
    port = free_port()
    session = SessionHint("agent-1")
    with make("prefill", port, tmp_path) as prefill, make("decode", port, tmp_path) as decode:
        _, first = turn(prefill, decode, 1, session)
        assert first.output_ids == want
        assert_idle(prefill, decode)
        prefill.call(lambda: prefill.core.cache.sync(wait=True)).result(timeout=60)
        decode.call(lambda: decode.core.cache.sync(wait=True)).result(timeout=60)
        assert prefill.flush_cache()  # the prefill side keeps nothing: L3 alone has it
        op = prefill.restore(PROMPT, session_id="agent-1")
        ready, _ = wait_state(prefill, op.operation_id, {RestoreState.READY}, 60)
        assert ready.resident == CachedTokens(device=WHOLE, host=WHOLE, storage=WHOLE)
        p, d = turn(prefill, decode, 2, session)
        assert p.cached == CachedTokens(device=WHOLE, host=0, storage=0)  # from the hold
        assert d.output_ids == want
        wait_state(prefill, op.operation_id, {RestoreState.RELEASED})
        time.sleep(0.05)
        assert_idle(prefill, decode)
