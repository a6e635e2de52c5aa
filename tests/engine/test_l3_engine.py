"""L3 through the engine: flush -> replay, restart and cross-process reuse, stop policies
against a slow backend, and faults that must turn into misses, never wrong output.

Greedy outputs are compared with a run that had no L3 at all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest

from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.engine.session import SessionHint
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.heads import HeadSplit
from hicache.keys import PageKey, head_key, previous_page_key
from hicache.rates import RateFit
from hicache.storage.backends.aibrix import AibrixStorage
from hicache.storage.backends.file import FileStorage
from hicache.storage.backends.memory import MemoryFaults, MemoryStorage
from hicache.storage.backends.mooncake import MooncakeStorage
from hicache.storage.backends.redis import RedisStorage
from hicache.storage.record import HEADER_SIZE, encode_record, record_size
from hicache.storage.registry import create_storage
from tests.helpers.engine_fixtures import engine_model
from tests.helpers.storage_fixtures import backend_config

MODEL = "tiny-random-llama"
PAGE = 4
PROMPT = [(7 * i + 11) % 4000 + 100 for i in range(81)]  # 81 tokens: 20 whole pages + 1
FULL = 80  # prompt[:-1] is matched: 20 pages
KV_HEADS = 2  # the model's K/V heads
RECORDS = 1  # L3 records per page: at TP 1 and the default storage_tp_lcm, both heads in one
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def make_engine(
    backend: str | None,
    extra: dict[str, object],
    policy: str = "timeout",
    *,
    max_running_requests: int = 4,
    cache: CacheConfig | None = None,
) -> Engine:
    config = EngineConfig(
        model_path=MODEL,
        dtype="float32",
        device="cpu",
        cache=cache
        or CacheConfig(page_size=PAGE, device_tokens=256, hicache_ratio=4.0, load_back_threshold=0),
        scheduler=SchedulerConfig(
            max_running_requests=max_running_requests, chunked_prefill_size=64
        ),
        context_length=128,
        storage_backend=backend,
        storage_prefetch_policy=policy,
        storage_extra_config={"prefetch_threshold": 8, **extra} if backend else {},
    )
    return Engine(config, loaded=engine_model(MODEL)).start()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """The greedy output with no cache tier at all."""
    with make_engine(None, {}) as engine:
        return engine.generate(PROMPT, GREEDY, timeout=60).output_ids


def only_in_l3(engine: Engine) -> None:
    """Let every backup reach L3, then empty L1 and L2."""
    engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=60)
    assert engine.flush_cache()


def clean(engine: Engine) -> None:
    def check() -> None:
        engine.core.cache.sync(wait=True)
        check_integrity(engine.core.cache)
        assert all(
            n.lock_ref == 0 and n.host_ref == 0
            for n in engine.core.cache.full.pages.tree.iter_nodes()
        )

    engine.call(check).result(timeout=30)


def test_flush_then_replay_is_served_from_file_storage(
    tmp_path: Path, reference: list[int]
) -> None:
    with make_engine("file", {"file_path": str(tmp_path)}) as engine:
        first = engine.generate(PROMPT, GREEDY, timeout=60)
        assert first.output_ids == reference
        only_in_l3(engine)
        replay = engine.generate(PROMPT, GREEDY, timeout=60)
        assert replay.cached.storage == FULL and replay.cached.device == 0
        assert replay.output_ids == reference
        stats = engine.call(lambda: cache_stats(engine.core.cache)).result()
        assert stats.counters["storage_hit_tokens_total"] == FULL
        assert stats.storage.get_hits == RECORDS * FULL // PAGE  # records
        clean(engine)
    assert len(list(tmp_path.rglob("*"))) > RECORDS * FULL // PAGE


def test_file_storage_survives_restart_and_is_shared_across_processes(
    tmp_path: Path, reference: list[int]
) -> None:
    extra = json.dumps({"file_path": str(tmp_path), "prefetch_threshold": 8})
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "hicache.cli", "generate", "--model-path", MODEL, "--dtype",
        "float32", "--device", "cpu", "--page-size", str(PAGE), "--max-total-tokens", "256",
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", extra, "--max-tokens", "8",
        "--context-length", "128", "--prompt-ids", ",".join(map(str, PROMPT)),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with make_engine("file", {"file_path": str(tmp_path)}) as engine:  # another process
        out = engine.generate(PROMPT, GREEDY, timeout=60)
        assert out.cached.storage == FULL and out.output_ids == reference
        assert proc.stdout.strip().endswith(out.text.strip()) or out.text.strip() == ""
    with make_engine("file", {"file_path": str(tmp_path)}) as engine:  # a restart
        again = engine.generate(PROMPT, GREEDY, timeout=60)
        assert again.cached.storage == FULL and again.output_ids == reference


def _slow_replay(
    policy: str, delay: float, extra: dict[str, object]
) -> tuple[float, int, list[int]]:
    """Write the prompt to a memory store, then replay it with every L3 op slowed."""
    store = f"slow-{policy}-{time.monotonic_ns()}"
    with make_engine("memory", {"store": store, **extra}, policy) as engine:
        engine.generate(PROMPT, GREEDY, timeout=60)
        only_in_l3(engine)
        l3 = engine.core.cache.l3.attached
        assert l3 is not None and isinstance(l3.controller.storage, MemoryStorage)
        l3.controller.storage.set_faults(MemoryFaults(delay_s=delay))
        t0 = time.monotonic()
        out = engine.generate(PROMPT, GREEDY, timeout=120)
        elapsed = time.monotonic() - t0
        l3.controller.storage.set_faults(MemoryFaults())
        clean(engine)
        return elapsed, out.cached.storage, out.output_ids


def test_stop_policies_against_a_slow_backend(reference: list[int]) -> None:
    # 20 pages in chunks of 8 -> 3 reads; each op (exists included) takes 0.4 s.
    small = {"max_batch_pages": 8}
    t, storage, ids = _slow_replay("wait_complete", 0.4, small)
    assert storage == FULL and ids == reference and t >= 4 * 0.4
    t, storage, ids = _slow_replay("best_effort", 0.4, small)
    assert storage == 0 and ids == reference and t < 4 * 0.4
    timeout = {"prefetch_timeout_base": 1.0, "prefetch_timeout_per_ki_token": 0.0, **small}
    t, storage, ids = _slow_replay("timeout", 0.4, timeout)
    # the deadline counts from arrival, the lookup included: lookup 0.4 s, first chunk
    # (8 pages) in at 0.8 s, the second (at 1.2 s) not by the 1.0 s deadline
    assert storage == 8 * PAGE and ids == reference
    assert t < 1.0 + 0.4 + 2.0  # a chunk in flight may end after the stop; compute


def test_timeout_is_bounded_by_the_formula(reference: list[int]) -> None:
    extra = {
        "prefetch_timeout_base": 0.2,
        "prefetch_timeout_per_ki_token": 0.0,
        "prefetch_timeout_max": 0.3,
        "timeout_s": 30.0,
    }
    t, storage, ids = _slow_replay("timeout", 3.0, extra)  # the lookup alone takes 3 s
    assert ids == reference and storage == 0
    assert t < 0.2 + 2.0  # gave up the lookup after the 0.2 s base timeout; compute margin


PREFILL_1MS = RateFit(
    observations=1, per_second=1e3, mean_amount=1.0, overhead_s=0.0, seconds_per_unit=1e-3
)
"""A prefill of 1 ms a token."""


def _counter(engine: Engine, name: str) -> int:
    return int(engine.call(lambda: cache_stats(engine.core.cache)).result().counters[name])


def test_by_measured_rates_a_fast_l3_is_read_and_a_slow_one_not_waited_for(
    reference: list[int],
) -> None:
    """With ``prefetch_threshold`` unset, a hit below its default (80 tokens against 256)
    is read while the L3's reads are unmeasured (the read measures them); then the rates
    decide
    (``hicache.cache.l3.worth``): a fast L3's hit is read (counted as decided). Made slow (every op 0.5 s), the next
    request waits for it as before (nothing says it is slow yet) and its lookup is
    measured; the one after does not wait at all and recomputes, where the timeout
    (more than 2 s) would have held it through the lookup and the reads. The L3's rates
    are measured; the prefill's is pinned at 1 ms a token (a small model on a CPU), as
    the tiny model's marginal cost per token is too small to decide the same way on
    every machine."""
    store = f"rates-{time.monotonic_ns()}"
    with make_engine("memory", {"store": store, "prefetch_threshold": None}) as engine:
        engine.call(lambda: engine.core.cache.measure_prefill(lambda: PREFILL_1MS)).result()
        assert engine.generate(PROMPT, GREEDY, timeout=60).output_ids == reference
        only_in_l3(engine)
        first = engine.generate(PROMPT, GREEDY, timeout=60)  # read to measure the L3
        assert first.cached.storage == FULL
        assert _counter(engine, "l3_decided_read_tokens_total") == 0
        only_in_l3(engine)
        fast = engine.generate(PROMPT, GREEDY, timeout=60)  # the rates say: read
        assert fast.cached.storage == FULL and fast.output_ids == reference
        assert _counter(engine, "l3_decided_read_tokens_total") == FULL
        only_in_l3(engine)
        l3 = engine.core.cache.l3.attached
        assert l3 is not None and isinstance(l3.controller.storage, MemoryStorage)
        l3.controller.storage.set_faults(MemoryFaults(delay_s=0.5))
        t0 = time.monotonic()
        waited = engine.generate(PROMPT, GREEDY, timeout=60)
        assert time.monotonic() - t0 >= 0.5 and waited.output_ids == reference
        only_in_l3(engine)
        t0 = time.monotonic()
        unwaited = engine.generate(PROMPT, GREEDY, timeout=60)
        elapsed = time.monotonic() - t0
        assert unwaited.output_ids == reference and unwaited.cached.storage == 0
        assert elapsed < 0.5  # not even the lookup's 0.5 s
        assert _counter(engine, "l3_unwaited_prefetches_total") == 1
        l3.controller.storage.set_faults(MemoryFaults())
        clean(engine)


def test_backend_failing_mid_run_gives_misses_not_errors(reference: list[int]) -> None:
    store = f"fail-{time.monotonic_ns()}"
    with make_engine("memory", {"store": store}) as engine:
        engine.generate(PROMPT, GREEDY, timeout=60)
        only_in_l3(engine)
        l3 = engine.core.cache.l3.attached
        assert l3 is not None and isinstance(l3.controller.storage, MemoryStorage)
        l3.controller.storage.set_faults(MemoryFaults(fail_after=0))
        out = engine.generate(PROMPT, GREEDY, timeout=60)
        assert out.error is None and out.cached.storage == 0 and out.output_ids == reference
        other = engine.generate(PROMPT[::-1], GREEDY, timeout=60)  # backups fail too
        assert other.error is None
        clean(engine)


def test_flipped_bytes_and_foreign_records_are_misses(tmp_path: Path, reference: list[int]) -> None:
    with make_engine("file", {"file_path": str(tmp_path)}) as engine:
        engine.generate(PROMPT, GREEDY, timeout=60)
        only_in_l3(engine)
        l3 = engine.core.cache.l3.attached
        assert l3 is not None
        storage = l3.controller.storage
        keys = l3.keys.of(b"".join(t.to_bytes(4, "little") for t in PROMPT[:FULL]))
        victim = storage.path_of(head_key(keys[5], 0).key)  # type: ignore[attr-defined]
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0xFF  # a payload byte
        victim.write_bytes(bytes(data))
        out = engine.generate(PROMPT, GREEDY, timeout=60)
        assert out.cached.storage == 5 * PAGE and out.output_ids == reference
        assert (
            engine.call(lambda: cache_stats(engine.core.cache)).result().storage.miss("corrupt")
            >= 1
        )
        clean(engine)
    # another model's records stored under the keys this one looks up
    with make_engine("file", {"file_path": str(tmp_path)}) as engine:
        l3 = engine.core.cache.l3.attached
        assert l3 is not None and engine.core.cache.full.pages.host_pool is not None
        keys = l3.keys.of(b"".join(t.to_bytes(4, "little") for t in PROMPT[:FULL]))
        for k in keys:
            for h in range(RECORDS):
                path = l3.controller.storage.path_of(head_key(k, h).key)  # type: ignore[attr-defined]
                path.unlink(missing_ok=True)
        foreign = dataclasses.replace(l3.keys.namespace, model="another-model")
        with create_storage(
            "file", namespace=foreign, extra_config={"file_path": str(tmp_path)}
        ) as other:
            other.use_heads(HeadSplit(KV_HEADS, KV_HEADS))
            assert other.batch_set(
                keys, engine.core.cache.full.pages.host_pool, list(range(len(keys)))
            ).all_ok
        out = engine.generate(PROMPT, GREEDY, timeout=60)
        assert out.cached.storage == 0 and out.output_ids == reference
        assert (
            engine.call(lambda: cache_stats(engine.core.cache)).result().storage.miss("foreign")
            >= 1
        )
        clean(engine)


def test_previous_version_records_are_missed_and_counted(
    tmp_path: Path, reference: list[int]
) -> None:
    """A store holding what a spec-2 engine wrote (one record per page under the rank's
    own namespace, ``hc2-`` keys) is a clean miss; the lookup that found nothing probes the
    version-2 key of its first page once and counts it; a lookup that hits probes none."""
    with make_engine("file", {"file_path": str(tmp_path)}) as engine:
        l3 = engine.core.cache.l3.attached
        assert l3 is not None
        st = l3.controller.storage
        assert isinstance(st, FileStorage)
        old = previous_page_key(l3.keys.namespace.previous_digest(1, 0), PROMPT[:PAGE], PAGE)
        path = st.path_of(old.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_record(old.namespace_digest, old.fingerprint, [b"\0" * 64]))
        first = engine.generate(PROMPT, GREEDY, timeout=60)
        assert first.cached.total == 0 and first.output_ids == reference
        assert engine.call(lambda: cache_stats(engine.core.cache)).result().storage.previous == 1
        only_in_l3(engine)
        again = engine.generate(PROMPT, GREEDY, timeout=60)
        assert again.cached.storage == FULL and again.output_ids == reference
        stats = engine.call(lambda: cache_stats(engine.core.cache)).result().storage
        assert stats.previous == 1 and stats.miss("stale") == 0
        clean(engine)


def corrupt_record(engine: Engine, page: PageKey) -> None:
    """Damage the record of K/V head 0 of page key ``page`` in the engine's L3 store itself: flip a payload byte
    (``file`` and ``nixl``, ``redis``, ``aibrix`` over SHFS), or plant zero bytes of the record's length (``mooncake``,
    whose client cannot read a record back without a local buffer)."""
    l3 = engine.core.cache.l3.attached
    assert l3 is not None
    st = l3.controller.storage
    key = head_key(page, 0)
    if isinstance(st, FileStorage):
        path = st.path_of(key.key)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif isinstance(st, AibrixStorage):  # SHFS: one file per record, named by the key's hex
        name = key.key.encode().hex()
        (path,) = Path(st.config.root).glob(f"*/{name[:2]}/{name[2:4]}/{name}")
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE + 3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif isinstance(st, RedisStorage):
        client, rkey = st._client, st._rkey(key)
        data = bytearray(client.get(rkey))
        data[-3] ^= 0xFF
        client.set(rkey, bytes(data))
    else:
        assert isinstance(st, MooncakeStorage)
        store = st._store
        assert store.remove(key.key, True) == 0
        assert engine.core.cache.full.pages.host_pool is not None
        size = record_size(engine.core.cache.full.pages.host_pool.page_bytes // RECORDS)
        arena = st._arenas.take(size)
        assert arena is not None
        arena.tensor[:size].zero_()  # a reused arena holds the records it last staged
        assert store.batch_put_from([key.key], [arena.addr], [size]) == [0]
        arena.release()
        arena.release()


@pytest.mark.parametrize("backend", ["file", "redis", "mooncake", "aibrix-shfs", "nixl"])
def test_a_corrupt_record_is_healed_by_the_recompute(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, reference: list[int]
) -> None:
    """The defect: after a corrupt read the recompute's backup found the key present and
    skipped it, so the prefix stayed an L3 miss for good and every later request read the
    bad record again (misses{corrupt} grew on each repeat). Now the backup replaces it:
    the next request hits L3 for the whole prompt and reads no bad record."""
    name, extra = backend_config(backend, request, tmp_path)
    if name == "redis":
        extra["key_prefix"] = f"heal{time.monotonic_ns()}:"
    with make_engine(name, extra) as engine:
        engine.generate(PROMPT, GREEDY, timeout=60)
        only_in_l3(engine)
        l3 = engine.core.cache.l3.attached
        assert l3 is not None
        keys = l3.keys.of(b"".join(t.to_bytes(4, "little") for t in PROMPT[:FULL]))
        corrupt_record(engine, keys[5])
        before = engine.call(lambda: cache_stats(engine.core.cache)).result().storage
        out = engine.generate(PROMPT, GREEDY, timeout=60)  # pages 0-4 from L3, then compute
        assert out.cached.storage == 5 * PAGE and out.output_ids == reference
        only_in_l3(engine)  # the recompute's backup reaches L3
        mid = engine.call(lambda: cache_stats(engine.core.cache)).result().storage
        assert mid.miss("corrupt") == before.miss("corrupt") + 1
        again = engine.generate(PROMPT, GREEDY, timeout=60)
        assert again.cached.storage == FULL and again.output_ids == reference
        after = engine.call(lambda: cache_stats(engine.core.cache)).result().storage
        assert after.miss("corrupt") == mid.miss("corrupt")  # the bad record is gone
        assert after.repaired == before.repaired + 1
        clean(engine)


def _generate_in_subprocess(backend: str, extra: dict[str, object]) -> str:
    """Run ``hicache generate`` in another process with the given L3; returns its stdout."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "hicache.cli", "generate", "--model-path", MODEL, "--dtype",
        "float32", "--device", "cpu", "--page-size", str(PAGE), "--max-total-tokens", "256",
        "--enable-hierarchical-cache", "--hicache-storage-backend", backend,
        "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": 8, **extra}),
        "--max-tokens", "8", "--context-length", "128",
        "--prompt-ids", ",".join(map(str, PROMPT)),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize("backend", ["redis", "mooncake", "aibrix-shfs", "nixl"])
def test_distributed_store_flush_replay_and_sharing(
    backend: str, request: pytest.FixtureRequest, reference: list[int]
) -> None:
    """Process A writes through the shared store; this process (B) hits what A wrote, and
    after /flush_cache replays from the store with the same greedy output."""
    name = backend
    if backend == "redis":
        server = request.getfixturevalue("redis_service")
        extra: dict[str, object] = {"url": server.url, "key_prefix": f"t{time.monotonic_ns()}:"}
    elif backend == "mooncake":
        svc = request.getfixturevalue("mooncake_service")
        extra = dict(svc.extra_config)
    else:  # a directory both processes share
        name, extra = backend_config(backend, request, request.getfixturevalue("tmp_path"))
    _generate_in_subprocess(name, extra)
    with make_engine(name, extra) as engine:
        shared = engine.generate(PROMPT, GREEDY, timeout=60)
        assert shared.cached.storage == FULL and shared.output_ids == reference
        only_in_l3(engine)
        replay = engine.generate(PROMPT, GREEDY, timeout=60)
        assert replay.cached.storage == FULL and replay.output_ids == reference
        clean(engine)


def test_full_disk_gives_misses_and_identical_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: list[int]
) -> None:
    import errno

    import hicache.storage.backends.file as file_mod

    def full(fd: int, bufs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_mod.os, "writev", full)
    with make_engine("file", {"file_path": str(tmp_path)}) as engine:
        first = engine.generate(PROMPT, GREEDY, timeout=60)
        only_in_l3(engine)  # every L3 write failed
        replay = engine.generate(PROMPT, GREEDY, timeout=60)
        assert first.output_ids == replay.output_ids == reference
        assert replay.cached.storage == 0
        stats = engine.call(lambda: cache_stats(engine.core.cache)).result()
        assert stats.counters["l3_backup_failed_tokens_total"] >= FULL
        assert stats.storage.set_failed >= FULL // PAGE
        clean(engine)


def test_cache_salt_isolates_tenants_in_l3(tmp_path: Path, reference: list[int]) -> None:
    def run(engine: Engine, salt: str) -> RequestOutput:
        fut: Future[RequestOutput] = Future()
        engine.submit(
            PROMPT, GREEDY, lambda o: fut.set_result(o) if o.finished else None, cache_salt=salt
        )
        return fut.result(timeout=60)

    with make_engine("file", {"file_path": str(tmp_path)}) as engine:
        assert run(engine, "acme").output_ids == reference
        only_in_l3(engine)
        assert run(engine, "").cached.storage == 0  # the shared namespace has none of it
        assert run(engine, "globex").cached.storage == 0
        own = run(engine, "acme")
        assert own.cached.storage == FULL and own.output_ids == reference
        clean(engine)


def test_best_effort_gives_a_request_queued_behind_a_busy_engine_storage_hits(
    reference: list[int],
) -> None:
    """The prefetch starts on arrival and runs while the request waits for a running
    slot, so best_effort (never wait) still serves it from L3 on a busy engine."""
    store = f"busy-{time.monotonic_ns()}"
    with make_engine("memory", {"store": store}, "best_effort", max_running_requests=1) as engine:
        engine.generate(PROMPT, GREEDY, timeout=60)
        only_in_l3(engine)
        busy: Future[RequestOutput] = Future()
        queued: Future[RequestOutput] = Future()
        long = SamplingParams(temperature=0, max_tokens=40)

        def done(fut: Future[RequestOutput]) -> Callable[[RequestOutput], None]:
            return lambda out: fut.set_result(out) if out.finished else None

        engine.submit(PROMPT[::-1][:40], long, done(busy))  # holds the only running slot
        engine.submit(PROMPT, GREEDY, done(queued))
        out = queued.result(timeout=120)
        assert busy.result(timeout=120).finished
        assert out.cached.storage == FULL and out.output_ids == reference
        clean(engine)


def test_a_demoted_session_comes_back_right_from_a_damaged_l3(tmp_path: Path) -> None:
    """A kept session is demoted by a newer one (the sessions' share of L2 holds one) and
    one-off traffic pushes it out of L2, its pages in L3 (written as they reached L2); one
    record goes bad meanwhile. Its next turn takes the pages before the bad one from L3
    and recomputes the rest: the output is the no-cache engine's."""
    small = CacheConfig(  # 32 pages of L1, 64 of L2 (half for sessions): one-offs overflow
        page_size=PAGE, device_tokens=128, hicache_ratio=2.0, load_back_threshold=0
    )
    turn = SamplingParams(temperature=0, max_tokens=4)
    with make_engine(None, {}) as plain:
        first = plain.generate(PROMPT, turn, timeout=60).output_ids
        nxt = [*PROMPT, *first, *range(900, 911)]  # the next turn: history and a tool result
        want = plain.generate(nxt, turn, timeout=60).output_ids
    hint = SessionHint("agent-7")
    with make_engine("file", {"file_path": str(tmp_path)}, cache=small) as engine:
        assert engine.generate(PROMPT, turn, timeout=60, session=hint).output_ids == first
        other = [(17 * j + 5) % 3000 + 500 for j in range(81)]
        engine.generate(other, turn, timeout=60, session=SessionHint("agent-8"))
        for i in range(4):  # unique long prompts, no session
            engine.generate([(13 * j + 29 * i) % 3000 + 500 for j in range(81)], turn, timeout=60)
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=60)
        stats = engine.call(lambda: cache_stats(engine.core.cache)).result()
        assert stats.counters["session_demotions_total"] == 1
        l3 = engine.core.cache.l3.attached
        assert l3 is not None
        keys = l3.keys.of(b"".join(t.to_bytes(4, "little") for t in PROMPT[:FULL]))
        corrupt_record(engine, keys[5])
        out = engine.generate(nxt, turn, timeout=60, session=hint)
        assert out.output_ids == want
        assert (out.cached.device, out.cached.host, out.cached.storage) == (0, 0, 5 * PAGE)
        clean_but_sessions(engine)


def clean_but_sessions(engine: Engine) -> None:
    """:func:`clean` once the sessions' pins are gone."""
    engine.call(lambda: engine.core.cache.sessions.clear()).result(timeout=30)
    clean(engine)
