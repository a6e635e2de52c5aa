"""HiCacheTier driven by vLLM's own TieringOffloadingManager (see :mod:`.drive`): chunks
cascade from vLLM's primary tier into hicache's L3 and are promoted back byte-exact, by a
second engine after a restart; a bad record is a miss, never data; a store that is down or
slow gives misses and never blocks the scheduler."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult

from hicache.integrations.vllm.namespace import vllm_page_key
from hicache.services.mooncake_process import MooncakeProcess
from hicache.services.process import free_port
from hicache.services.redis import RedisServer
from hicache.storage.record import HEADER_SIZE
from tests.integrations.vllm.drive import ROW_BYTES, Engine, key, pattern

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def record_path(eng: Engine, root: Path, k: bytes) -> Path:
    name = vllm_page_key(eng.tier.namespace, k).key
    return root / name[4:6] / name


def fill(eng: Engine, ids: list[int]) -> None:
    """One request computes chunks ``ids`` (rows ``pattern(i)``); vLLM cascades them."""
    ctx = eng.request()
    eng.store(ctx, [key(i) for i in ids], [pattern(i) for i in ids])
    eng.finish(ctx)
    eng.wait_quiet()


def test_chunks_round_trip_byte_exact_through_a_restart(tmp_path: Path) -> None:
    with Engine({"file_path": str(tmp_path)}) as a:
        fill(a, [0, 1, 2])
        st = a.tier.storage.stats()
        assert (st.set_written, st.set_failed) == (3, 0)
        assert record_path(a, tmp_path, key(1)).stat().st_size == HEADER_SIZE + ROW_BYTES
    with Engine({"file_path": str(tmp_path)}) as b:  # a fresh engine: empty primary tier
        ctx = b.request()
        assert b.lookup(ctx, [key(0), key(1), key(2), key(9)]) == [HIT, HIT, HIT, MISS]
        assert b.load(ctx, [key(0), key(1), key(2)]) == [pattern(0), pattern(1), pattern(2)]
        b.finish(ctx)
        b.wait_quiet()
        st = b.tier.storage.stats()
        assert (st.get_pages, st.get_hits, st.bytes_read) == (3, 3, 3 * (HEADER_SIZE + ROW_BYTES))
    with Engine({"file_path": str(tmp_path)}) as c:
        # vLLM cascades every chunk it stores to every tier; present records are skipped
        fill(c, [2, 3])
        st = c.tier.storage.stats()
        assert (st.set_written, st.set_skipped) == (1, 1)


def test_a_flipped_byte_is_a_miss_the_rest_loads_and_the_next_store_heals_it(
    tmp_path: Path,
) -> None:
    with Engine({"file_path": str(tmp_path)}) as a:
        fill(a, [0, 1, 2])
        path = record_path(a, tmp_path, key(1))
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 100] ^= 0x01
    path.write_bytes(bytes(raw))
    with Engine({"file_path": str(tmp_path)}) as b:
        ctx = b.request()
        # one promotion job of three chunks: two load, the corrupt one is refused
        assert b.lookup(ctx, [key(0), key(1), key(2)]) == [HIT, MISS, HIT]
        assert b.load(ctx, [key(0), key(2)]) == [pattern(0), pattern(2)]
        with b.manager.lock:
            assert b.manager.primary_tier.lookup(key(1), ctx) is MISS
        st = b.tier.storage.stats()
        assert (st.get_pages, st.get_hits, st.misses["corrupt"]) == (3, 2, 1)
        b.finish(ctx)
        b.wait_quiet()
        fill(b, [1])  # vLLM recomputes chunk 1; its store replaces the bad record
        assert b.tier.storage.stats().repaired == 1
    with Engine({"file_path": str(tmp_path)}) as c:
        ctx = c.request()
        assert c.lookup(ctx, [key(1)]) == [HIT]
        assert c.load(ctx, [key(1)]) == [pattern(1)]
        c.finish(ctx)


def test_a_record_under_another_key_or_of_another_namespace_is_a_miss(tmp_path: Path) -> None:
    with Engine({"file_path": str(tmp_path)}) as a:
        fill(a, [0])
        dst = record_path(a, tmp_path, key(5))
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(record_path(a, tmp_path, key(0)), dst)  # chunk 0's record as chunk 5's
    with Engine({"file_path": str(tmp_path)}) as b:
        ctx = b.request()
        assert b.lookup(ctx, [key(5)]) == [MISS]
        assert b.tier.storage.stats().misses["foreign"] == 1
        b.finish(ctx)
    for other in ({"model": "other/model"}, {"dtype": "float16"}, {"tp_size": 2}):
        with Engine({"file_path": str(tmp_path)}, **other) as c:  # type: ignore[arg-type]
            ctx = c.request()
            assert c.lookup(ctx, [key(0)]) == [MISS], other
            c.finish(ctx)


@pytest.mark.parametrize("backend", ["redis", "mooncake"])
def test_two_engines_share_chunks_through(backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis_service")
        extra: dict[str, Any] = {"url": server.url}
    else:
        svc: MooncakeProcess = request.getfixturevalue("mooncake_service")
        extra = dict(svc.extra_config)
    # a namespace of this test's own, so records of earlier runs do not count
    tier = {"hicache_backend": backend, "hicache_model": f"m-{uuid.uuid4().hex}", **extra}
    with Engine(tier) as a, Engine(tier) as b:
        fill(a, [0, 1])
        ctx = b.request()
        assert b.lookup(ctx, [key(0), key(1), key(2)]) == [HIT, HIT, MISS]
        assert b.load(ctx, [key(0), key(1)]) == [pattern(0), pattern(1)]
        b.finish(ctx)
        b.wait_quiet()


def test_a_store_that_is_down_gives_misses_not_errors() -> None:
    tier = {
        "hicache_backend": "redis",
        "url": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        "connect_timeout_s": 0.3,
        "timeout_s": 0.3,
    }
    with Engine(tier) as eng:
        ctx = eng.request()
        eng.store(ctx, [key(0)], [pattern(0)])  # the cascade job fails, quietly
        eng.wait_quiet()
        assert not eng.tier.storage.started
        assert eng.lookup(ctx, [key(0), key(1)]) == [HIT, MISS]  # chunk 0 is in the primary
        eng.finish(ctx)
        eng.wait_quiet()


def test_a_late_get_lands_in_staging_never_in_vllms_rows() -> None:
    store = f"vllm-{uuid.uuid4().hex}"
    with Engine({"hicache_backend": "memory", "store": store}) as a:
        fill(a, [0])
    slow = {"hicache_backend": "memory", "store": store, "get_delay_s": 0.8, "timeout_s": 0.2}
    with Engine(slow) as b:
        ctx = b.request()
        assert b.lookup(ctx, [key(0)]) == [MISS]  # the get overran its deadline
        st = b.tier.storage.stats()
        assert (st.get_hits, st.misses["timeout"]) == (0, 1)
        assert b.tier.storage.host_writes_settled(5.0)  # the late write is done
        assert bytes(b.view) == bytes(len(b.view))  # and no byte of it reached a row
        b.finish(ctx)


def test_tier_calls_return_at_once_while_the_backend_is_slow() -> None:
    store = f"vllm-{uuid.uuid4().hex}"
    with Engine({"hicache_backend": "memory", "store": store, "delay_s": 0.5}) as eng:
        ctx = eng.request()
        t0 = time.monotonic()
        eng.store(ctx, [key(0), key(1)], [pattern(0), pattern(1)])  # cascades: submit_store
        with eng.manager.lock:
            assert eng.manager.lookup(key(7), ctx) is LookupResult.RETRY  # not asked yet
            assert eng.manager.has_pending_work()
        assert time.monotonic() - t0 < 0.25
        # vLLM's reset_cache drains the tiers' jobs before it frees the primary rows (it
        # asserts that no job is left)
        with eng.manager.lock:
            eng.manager.reset_cache()
            eng.manager.on_reset_flushed()
        assert eng.tier.storage.stats().set_written == 2
        eng.finish(ctx)
        eng.wait_quiet()
