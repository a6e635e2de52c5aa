"""KV events from a running engine: the pages of a served prompt, L2 keeping them reported,
leaving L2 removing them, a flush clearing them, a tenant's pages salted."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventSubscription,
    Medium,
)
from hicache.kv_events.config import KvEventsConfig
from tests.helpers.api_fixtures import make_engine, scrape, serve

PAGE = 4
PROMPT = list(range(300, 345))  # 11 whole pages + 1 token
GREEDY = SamplingParams(temperature=0, max_tokens=3)


def _chain(tokens: list[int], salt: str = "") -> list[int]:
    """The block hashes of ``tokens``' whole pages (SGLang's event hash, written out)."""
    prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest() if salt else b""
    out = []
    for i in range(0, len(tokens) - PAGE + 1, PAGE):
        prior = hashlib.sha256(prior + struct.pack("<4I", *tokens[i : i + PAGE])).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with make_engine(kv_events=KvEventsConfig()) as engine:
        yield engine


def _events(sub: KvEventSubscription) -> list[KvEvent]:
    out: list[KvEvent] = []
    while (batch := sub.get(0.5)) is not None:
        out.extend(batch.events)
    return out


def _on_engine(engine: Engine, what: str) -> int:
    """Evict all of L1 (``device``) or of L2 (``host``) on the engine thread, and publish."""

    def act() -> int:
        cache = engine.core.cache
        cache.sync(wait=True)
        pages = cache.full.pages
        n = pages.evict_device(10**6) if what == "device" else pages.evict_host(10**6)
        engine.core.publish_kv_events()
        return n

    return engine.call(act).result(timeout=30)


def test_events_follow_the_pages_through_l1_l2_and_a_flush(engine: Engine) -> None:
    hub = engine.kv_events
    assert hub is not None
    assert engine.flush_cache()
    with hub.subscribe() as sub:
        first = sub.get(5)
        assert first is not None and first.snapshot and first.events == (AllBlocksCleared(),)
        out = engine.generate(PROMPT, GREEDY, timeout=60)
        stored = [e for e in _events(sub) if isinstance(e, BlockStored)]
        # The prompt's pages, in order, chained from the root with their token ids.
        hashes = [h for e in stored for h in e.block_hashes]
        tokens = [t for e in stored for t in e.token_ids]
        assert hashes[:11] == _chain(PROMPT) and tokens[:44] == PROMPT[:44]
        assert stored[0].parent_block_hash is None
        assert all(e.medium is Medium.DEVICE and e.cache_salt is None for e in stored)
        assert len(tokens) == len(hashes) * PAGE
        assert len(hashes) == (len(PROMPT) + len(out.output_ids) - 1) // PAGE
        # Out of L1 but backed up in L2: nothing leaves.
        assert _on_engine(engine, "device") > 0
        assert _events(sub) == []
        # Out of L2 too: every page is removed, with the medium it was stored with.
        assert _on_engine(engine, "host") > 0
        removed = _events(sub)
        assert all(isinstance(e, BlockRemoved) and e.medium is Medium.DEVICE for e in removed)
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)  # type: ignore[union-attr]
        assert hub.stats().resident_blocks == 0
        # A flush after a new request: AllBlocksCleared.
        engine.generate(PROMPT, GREEDY, timeout=60)
        _events(sub)
        assert engine.flush_cache()
        assert _events(sub) == [AllBlocksCleared()]


def test_a_tenants_pages_are_salted_and_a_resubscription_resyncs(engine: Engine) -> None:
    hub = engine.kv_events
    assert hub is not None
    assert engine.flush_cache()
    engine.generate(PROMPT, GREEDY, timeout=60, cache_salt="acme")
    with hub.subscribe() as sub:
        snap = sub.get(5)
        assert snap is not None and snap.events[0] == AllBlocksCleared()
        stored = [e for e in snap.events[1:] if isinstance(e, BlockStored)]
        assert all(e.cache_salt == "acme" for e in stored)
        hashes = [h for e in stored for h in e.block_hashes]
        assert hashes[:11] == _chain(PROMPT, "acme")
        assert not set(hashes) & set(_chain(PROMPT))


def test_metrics_count_what_was_published(engine: Engine) -> None:
    hub = engine.kv_events
    assert hub is not None
    engine.generate(PROMPT, GREEDY, timeout=60)
    with serve(engine) as url:
        families = {f.name: f for f in text_string_to_metric_families(scrape(url, engine))}
    published = families["hicache_kv_events_published_batches"].samples[0].value
    assert 0 < published <= hub.stats().published_batches
    assert families["hicache_kv_events_dropped_events"].samples[0].value == 0
    assert families["hicache_kv_events_resident_pages"].samples[0].value > 0
    assert "hicache_kv_events_zmq_sent" not in families  # publisher "null": no ZMQ


def test_a_restart_clears_what_was_reported(engine: Engine) -> None:
    """After the other tests of the shared engine: it closes and restarts it."""
    hub = engine.kv_events
    assert hub is not None
    engine.generate(PROMPT, GREEDY, timeout=60)
    with hub.subscribe() as sub:
        first = sub.get(5)
        assert first is not None and len(first.events) > 1  # the pages held
        engine.close()
        assert _events(sub) == [AllBlocksCleared()]
        engine.start()
        assert _events(sub) == [AllBlocksCleared()]  # a new, empty cache
        engine.generate(PROMPT, GREEDY, timeout=60)
        stored = [e for e in _events(sub) if isinstance(e, BlockStored)]
        assert [h for e in stored for h in e.block_hashes][:11] == _chain(PROMPT)


def test_an_engine_with_publisher_zmq_serves_its_events_over_zmq() -> None:
    import msgspec
    import zmq

    cfg = KvEventsConfig(
        publisher="zmq", endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"
    )
    with make_engine(kv_events=cfg) as zmq_engine:
        pub = zmq_engine.kv_zmq
        assert pub is not None and pub.replay_address is not None
        zmq_engine.generate(PROMPT, GREEDY, timeout=60)
        ctx = zmq.Context()
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(pub.replay_address)
        stored: list[int] = []
        deadline = 20_000
        while len(stored) < 44:  # the publisher thread may still be sending
            req.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert req.poll(deadline)
                _, _, seq, payload = req.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                _, events, _ = msgspec.msgpack.decode(payload)
                stored += [t for e in events if e["type"] == "BlockStored" for t in e["token_ids"]]
            if len(stored) < 44:
                stored.clear()
        assert stored[:44] == PROMPT[:44]
        req.close()
        ctx.term()
    assert zmq_engine.kv_zmq is None  # closed with the engine


def test_a_tp_2_engine_reports_its_pages_once_as_at_tp_1() -> None:
    """Every rank holds the same tree (the ranks agree page by page), so rank 0 alone
    reports: a TP-2 engine's events are the TP-1 engine's, each page once."""
    config = EngineConfig(
        model_path="tiny-random-llama",
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=PAGE, device_tokens=1024, hicache_ratio=2.0),
        context_length=256,
        tp_size=2,
        kv_events=KvEventsConfig(),
    )
    with Engine(config) as engine:
        hub = engine.kv_events
        assert hub is not None
        with hub.subscribe() as sub:
            first = sub.get(5)
            assert first is not None and first.events == (AllBlocksCleared(),)
            assert engine.generate(PROMPT, GREEDY, timeout=60).error is None
            stored = [e for e in _events(sub) if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes[:11] == _chain(PROMPT) and len(hashes) == len(set(hashes))
    assert [t for e in stored for t in e.token_ids][:44] == PROMPT[:44]
