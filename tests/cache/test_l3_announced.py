"""A lookup that stops at an announced page waits for it (``controller/announced.py``), and
a request's end announces its pages on their way to L3 (``Writes.announce``).

First :class:`AnnouncedWaits` alone, over the memory backend and a fake clock (exact
states); then two caches on one file L3: a writer whose L3 write has not landed (it has
not synced since its request ended) and a reader that looks the conversation up at once,
as the next turn does behind a PD pair with decode offload."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig, PrefetchConfig
from hicache.controller import CompletionQueue
from hicache.controller.announced import ANNOUNCED_POLL_S, AnnouncedWaits, Stop, WaitGain
from hicache.controller.rank_group import RankGroup
from hicache.controller.storage_controller import ANNOUNCE_STUCK_S, StorageController
from hicache.keys import Namespace, PageKey, page_keys
from hicache.memory import HostPool
from hicache.rates import RateFit
from hicache.spec import KVSpec
from hicache.storage import MemoryFaults, MemoryStorage
from hicache.storage.base import StorageOptions
from hicache.storage.negative import NegativeCache
from hicache.storage.registry import create_storage
from hicache.tokens import encode_tokens
from tests.helpers.kvdata import page_kv, read_device, serve, wait_ready, write_tokens
from tests.helpers.l3_cache import cache_over_l3
from tests.helpers.ranks import run_ranks

MHA = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
CONVERSATION = [3, 1, 4, 1, 5, 9, 2, 6]  # four pages: a prompt and its answer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(n: int = 3) -> list[PageKey]:
    return page_keys(Namespace.for_spec(MHA, model="m", weights_fingerprint="w",
                                        layout="page_first", page_size=PAGE),
                     list(range(PAGE * n)))  # fmt: skip


def land(storage: MemoryStorage, keys: list[PageKey]) -> None:
    """Write ``keys``' pages (any bytes: a lookup only asks whether they are there)."""
    host = HostPool(MHA, 4, PAGE, storage.namespace.layout, pin_memory=False)
    assert storage.batch_set(keys, host, list(range(len(keys)))).all_ok


@pytest.fixture
def setup() -> Iterator[tuple[MemoryStorage, NegativeCache, AnnouncedWaits[str], Clock]]:
    clock = Clock()
    ns = Namespace.for_spec(MHA, model="m", weights_fingerprint="w", layout="page_first",
                            page_size=PAGE)  # fmt: skip
    with MemoryStorage(ns) as storage:
        negative = NegativeCache(60.0, clock=clock)
        yield storage, negative, AnnouncedWaits(storage, negative, 0.5, clock), clock


def test_an_announced_page_is_waited_for_and_found_when_it_lands(
    setup: tuple[MemoryStorage, NegativeCache, AnnouncedWaits[str], Clock],
) -> None:
    storage, negative, waits, clock = setup
    k = run()
    land(storage, k[:1])
    storage.announce(k[1:], 5.0)
    assert waits.stopped("op", k, 3, 1) is Stop.WAIT
    assert len(waits) == 1 and waits.timeout() == pytest.approx(ANNOUNCED_POLL_S)
    clock.now += 0.1
    assert waits.poll() == [] and len(waits) == 1  # not there yet: waits on
    land(storage, k[1:2])
    clock.now += 0.1
    assert waits.poll() == []  # one page more, and the next one is announced too
    land(storage, k[2:])
    clock.now += 0.1
    (done,) = waits.poll()
    assert (done.op, done.hit, done.ended, done.expired, done.error) == ("op", 3, True, False, "")
    assert len(waits) == 0 and waits.timeout() is None
    assert len(negative) == 0


def test_the_wait_ends_at_its_bound_and_the_miss_is_not_remembered(
    setup: tuple[MemoryStorage, NegativeCache, AnnouncedWaits[str], Clock],
) -> None:
    storage, negative, waits, clock = setup
    k = run()
    storage.announce(k, 5.0)  # and never written
    assert waits.stopped("op", k, 3, 0) is Stop.WAIT
    clock.now += 0.499
    assert waits.poll() == []
    clock.now += 0.002
    (done,) = waits.poll()
    assert (done.hit, done.expired) == (0, True)
    assert k[0] not in negative and len(negative) == 0


def test_an_announcement_that_expires_first_ends_the_wait_then(
    setup: tuple[MemoryStorage, NegativeCache, AnnouncedWaits[str], Clock],
) -> None:
    storage, _, waits, clock = setup
    k = run()
    storage.announce(k, 0.1)
    assert waits.stopped("op", k, 3, 0) is Stop.WAIT
    clock.now += 0.11
    (done,) = waits.poll()
    assert (done.hit, done.expired) == (0, True)


def test_an_unannounced_miss_does_not_wait_and_is_remembered(
    setup: tuple[MemoryStorage, NegativeCache, AnnouncedWaits[str], Clock],
) -> None:
    _, negative, waits, _ = setup
    k = run()
    assert waits.stopped("op", k, 3, 0) is Stop.MISS
    assert len(waits) == 0 and waits.timeout() is None and k[0] in negative


def test_a_run_that_grows_to_a_page_not_announced_ends_there(
    setup: tuple[MemoryStorage, NegativeCache, AnnouncedWaits[str], Clock],
) -> None:
    storage, negative, waits, clock = setup
    k = run()
    storage.announce(k[:1], 5.0)
    assert waits.stopped("op", k, 3, 0) is Stop.WAIT
    land(storage, k[:1])
    clock.now += 0.01
    (done,) = waits.poll()
    assert (done.hit, done.expired) == (1, False)
    assert k[1] in negative and k[0] not in negative


def test_no_wait_when_waits_are_off_and_closing_ends_every_wait() -> None:
    clock = Clock()
    ns = Namespace.for_spec(MHA, model="m", weights_fingerprint="w", layout="page_first",
                            page_size=PAGE)  # fmt: skip
    with MemoryStorage(ns) as storage:
        k = run()
        storage.announce(k, 5.0)
        off: AnnouncedWaits[str] = AnnouncedWaits(storage, None, 0.0, clock)
        assert off.stopped("op", k, 3, 0) is Stop.MISS
        on: AnnouncedWaits[str] = AnnouncedWaits(storage, None, 0.5, clock)
        assert on.stopped("a", k, 3, 0) is on.stopped("b", k, 3, 0) is Stop.WAIT
        assert [w.op for w in on.poll(closing=True)] == ["a", "b"]
        assert len(on) == 0


def test_a_run_not_worth_a_wait_is_not_waited_for_nor_remembered(
    setup: tuple[MemoryStorage, NegativeCache, AnnouncedWaits[str], Clock],
) -> None:
    """A run read from 3 pages on: one page present and one announced reach 2, no wait
    (the announced page not remembered missing); the third announced too, it waits."""
    storage, negative, waits, _ = setup
    k = run()
    land(storage, k[:1])
    storage.announce(k[1:2], 5.0)
    three = WaitGain(min_pages=3)
    assert waits.stopped("op", k, 3, 1, three) is Stop.NOT_WORTH
    assert len(waits) == 0 and len(negative) == 0
    storage.announce(k[2:], 5.0)
    assert waits.stopped("op", k, 3, 1, three) is Stop.WAIT


def test_the_wait_ends_when_a_read_of_the_run_would_no_longer_pay(
    setup: tuple[MemoryStorage, NegativeCache, AnnouncedWaits[str], Clock],
) -> None:
    """Reading a run of ``n`` pages saves ``n * 50 - 100`` ms: three announced pages are
    worth 50 ms of waiting (not ``wait_s``' 500), one alone nothing."""
    storage, negative, waits, clock = setup
    k = run()
    gain = WaitGain(fixed_s=0.1, per_page_s=0.05)
    storage.announce(k[:1], 5.0)
    assert waits.stopped("a", k, 3, 0, gain) is Stop.NOT_WORTH
    storage.announce(k[1:], 5.0)
    assert waits.stopped("b", k, 3, 0, gain) is Stop.WAIT
    clock.now += 0.049
    assert waits.poll() == []
    clock.now += 0.002
    (done,) = waits.poll()
    assert (done.op, done.hit, done.expired) == ("b", 0, True)
    assert len(negative) == 0


class CountingAnnouncements(MemoryStorage):
    """The memory backend, recording how many keys each announcement read asked."""

    def __init__(self, ns: Namespace) -> None:
        super().__init__(ns)
        self.asked: list[int] = []

    def announced_many(self, keys: Sequence[PageKey]) -> list[float]:
        self.asked.append(len(keys))
        return super().announced_many(keys)


def test_announced_pages_are_asked_only_as_far_as_they_raise_the_bound() -> None:
    """Any run worth the whole wait: the page the run stopped at alone. A gain of ``n *
    50 - 100`` ms: 12 pages would be worth ``wait_s``, so the 7 announced after a present
    one are asked in batches of 1, 2, 4 and the run stops growing at the first page not
    announced (the 9th of 10)."""
    ns = Namespace.for_spec(MHA, model="m", weights_fingerprint="w", layout="page_first",
                            page_size=PAGE)  # fmt: skip
    with CountingAnnouncements(ns) as storage:
        k = run(10)
        land(storage, k[:1])
        storage.announce(k[1:8], 5.0)
        clock = Clock()
        waits: AnnouncedWaits[str] = AnnouncedWaits(storage, None, 0.5, clock)
        assert waits.stopped("any", k, 10, 1) is Stop.WAIT
        assert storage.asked == [1]
        storage.asked.clear()
        assert waits.stopped("line", k, 10, 1, WaitGain(fixed_s=0.1, per_page_s=0.05)) is Stop.WAIT
        assert storage.asked == [1, 2, 4, 2]  # pages 2, 3-4, 5-8, then 9-10 (9 is not)
        (line,) = [w for w in waits.poll(closing=True) if w.op == "line"]
        assert line.until == pytest.approx(clock.now + 8 * 0.05 - 0.1)  # a run of 8 pages


# ---------------------------------------------------------------- two caches, one L3


def make(
    root: Path, wait_s: float, negative_ttl_s: float = 0.0, *, announces: bool = True
) -> HiCache:
    """A cache over the file L3 in ``root`` whose lookups wait ``wait_s`` at most for
    announced pages and that announces its writes at requests' ends (``announces``)."""
    prefetch = PrefetchConfig(
        policy="wait_complete",
        prefetch_threshold=0,
        negative_ttl_s=negative_ttl_s,
        announced_wait_s=wait_s,
        announce_writes=announces,
    )
    extra = {"file_path": str(root)}
    return cache_over_l3(MHA, "file", extra, StorageOptions(), prefetch, page_size=PAGE,
                         device_pages=32)  # fmt: skip


def counter(cache: HiCache, name: str) -> int:
    return cache_stats(cache).counters[name]


def end_unsynced(cache: HiCache, tokens: list[int]) -> None:
    """A request computes ``tokens`` and ends (its KV committed at its release), and the
    cache does not sync: its L1 -> L2 copy has not been applied, so its L3 write is not
    even issued yet (what a decode instance's answer has just after its last token)."""
    cache.sync()
    req = cache.open(tokens, compute_last=False)
    wait_ready(cache, req)
    assert cache.admit(req, tokens)
    write_tokens(cache, tokens, req.pages[req.prefix_pages :], req.prefix_pages)
    cache.release(req, tokens)


def look_up(cache: HiCache, tokens: list[int]) -> tuple[int, float]:
    """The next turn: a request over ``tokens`` arrives, waits for its prefetch policy
    (``wait_complete``), is admitted and computed; returns the tokens it took from L3
    (checked byte for byte) and the seconds it took."""
    t0 = time.monotonic()
    req = serve(cache, tokens, hold=True)
    took = time.monotonic() - t0
    assert req is not None
    got = req.cached.storage
    want = page_kv(cache, tokens, 0, len(tokens) // PAGE)
    assert torch.equal(read_device(cache, req.pages[: len(tokens) // PAGE]), want)
    cache.release(req)
    cache.sync(wait=True)
    return got, took


def ask(cache: HiCache, tokens: list[int]) -> tuple[int, float]:
    """A request over ``tokens`` arrives, waits for its prefetch policy and goes away
    (nothing computed, nothing kept): the tokens its lookup found in L3, and the seconds
    it waited."""
    cache.sync()
    t0 = time.monotonic()
    req = cache.open(tokens, compute_last=False)
    wait_ready(cache, req)
    took = time.monotonic() - t0
    found = req.prefetch.boundary * PAGE if req.prefetch is not None else 0
    cache.release(req)
    cache.sync(wait=True)
    return found, took


def stored_announcement(cache: HiCache, tokens: list[int]) -> None:
    """Wait until ``cache``'s announcement of the last page of ``tokens`` is stored: the
    end waited 5 ms for that at most, and a loaded box may take longer (the guarantee
    the engine adds is that its answer leaves after that wait)."""
    tier = cache.l3.attached
    assert tier is not None
    last = tier.keys.of(encode_tokens(tokens))[-1]
    end = time.monotonic() + 10.0
    while tier.controller.storage.announced(last) == 0.0:
        assert time.monotonic() < end, "the announcement was never stored"
        time.sleep(0.001)


def land_later(cache: HiCache, delay_s: float) -> threading.Thread:
    """The writer's next steps, ``delay_s`` from now: its copies and L3 writes land."""

    def later() -> None:
        time.sleep(delay_s)
        cache.sync(wait=True)

    t = threading.Thread(target=later)
    t.start()
    return t


@pytest.mark.parametrize(("wait_s", "found"), [(2.0, 8), (0.0, 0)])
def test_the_next_turn_at_once_finds_the_answer_its_writer_announced(
    tmp_path: Path, wait_s: float, found: int
) -> None:
    """With waits on the next turn takes the whole conversation from L3, the pages landing
    0.2 s after it arrived; with them off it finds nothing (the race, before)."""
    with make(tmp_path, 0.0) as writer, make(tmp_path, wait_s) as reader:
        end_unsynced(writer, CONVERSATION)
        assert counter(writer, "l3_announced_pages_total") == 4
        stored_announcement(writer, CONVERSATION)
        later = land_later(writer, 0.2)
        got, took = look_up(reader, [*CONVERSATION, 7, 7])
        later.join()
        assert got == found
        assert counter(reader, "l3_announced_waits_total") == int(wait_s > 0)
        if wait_s:
            assert 0.15 < took < 1.5
            assert counter(reader, "l3_announced_waits_expired_total") == 0
        check_integrity(reader)
        check_integrity(writer)


def test_a_write_that_never_lands_is_waited_for_the_bound_and_not_remembered(
    tmp_path: Path,
) -> None:
    with make(tmp_path, 0.0) as writer, make(tmp_path, 0.3, negative_ttl_s=60.0) as reader:
        storage = writer.l3.attached
        assert storage is not None
        keys = storage.keys.of(encode_tokens(CONVERSATION))
        storage.controller.storage.announce(keys, 5.0)  # announced, never written
        got, took = ask(reader, [*CONVERSATION, 7, 7])
        assert got == 0 and 0.25 < took < 1.5
        assert counter(reader, "l3_announced_waits_expired_total") == 1
        serve(writer, CONVERSATION)  # now written
        writer.sync(wait=True)
        got, took = ask(reader, [*CONVERSATION, 7, 8])
        assert got == 8  # the miss was not remembered: asked again, found
        assert int(cache_stats(reader).storage.exists_calls) >= 2


def test_an_unannounced_miss_does_not_wait(tmp_path: Path) -> None:
    with make(tmp_path, 2.0) as reader:
        got, took = look_up(reader, [*CONVERSATION, 7, 7])
        assert got == 0 and took < 1.0
        assert counter(reader, "l3_announced_waits_total") == 0


def test_the_end_announces_only_pages_on_their_way(tmp_path: Path) -> None:
    """Pages in L3 already (``stored``) are not announced again; a cache that does not
    announce its writes (the default) announces nothing."""
    with make(tmp_path, 0.0) as writer:
        end_unsynced(writer, CONVERSATION)
        writer.sync(wait=True)  # written: stored
        end_unsynced(writer, [*CONVERSATION, 5, 5])
        assert counter(writer, "l3_announced_pages_total") == 4 + 1
        writer.sync(wait=True)
        check_integrity(writer)
    with make(tmp_path / "quiet", 0.0, announces=False) as quiet:
        end_unsynced(quiet, CONVERSATION)
        assert counter(quiet, "l3_announced_pages_total") == 0
        tier = quiet.l3.attached
        assert tier is not None
        keys = tier.keys.of(encode_tokens(CONVERSATION))
        assert tier.controller.storage.announced(keys[0]) == 0.0
        quiet.sync(wait=True)


def test_a_slow_store_delays_an_end_by_the_wait_at_most_and_a_stuck_one_not_again() -> None:
    """``StorageController.announce``: stored within the wait (True); a store slower than
    the wait costs the caller the wait (False); once an announcement is unstored for more
    than ``ANNOUNCE_STUCK_S`` nobody waits."""
    ns = Namespace.for_spec(MHA, model="m", weights_fingerprint="w", layout="page_first",
                            page_size=PAGE)  # fmt: skip
    storage = MemoryStorage(ns, faults=MemoryFaults())
    host = HostPool(MHA, 4, PAGE, ns.layout, pin_memory=False)
    with StorageController(storage, host, CompletionQueue()) as ctl:
        k = run()
        assert ctl.announce(k[:1], 5.0, 1.0)
        assert storage.announced(k[0]) > 4.0
        storage.set_faults(MemoryFaults(delay_s=0.5))
        t0 = time.monotonic()
        assert not ctl.announce(k[1:2], 5.0, 0.05)
        assert 0.04 < time.monotonic() - t0 < 0.4
        time.sleep(ANNOUNCE_STUCK_S)
        t0 = time.monotonic()
        assert not ctl.announce(k[2:], 5.0, 0.5)  # the first is stuck: no wait
        assert time.monotonic() - t0 < 0.25
        storage.set_faults(MemoryFaults())
        time.sleep(0.6)
        assert storage.announced(k[1]) > 0 and storage.announced(k[2]) > 0  # landed late
        assert ctl.announce(k[:1], 5.0, 1.0)  # nothing unstored: waits again


# ---------------------------------------------------------------- by the measured rates

READ_CALL_S = 0.010
"""The reader's pinned L3 read: 10 ms a call, next to nothing a byte."""


def over_memory(store: str, *, wait_s: float = 0.0, writer: bool = False) -> HiCache:
    """A cache over the in-memory L3 ``store`` (a page lands whole: a file record can be
    seen by a lookup an instant before its bytes, which a read then misses). A ``writer``
    announces its writes, as :func:`make`'s; else its measured rates decide (``timeout``,
    ``prefetch_threshold`` unset), misses remembered for a minute and announced pages
    waited for ``wait_s`` at most."""
    if writer:
        prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0,
                                  announced_wait_s=0.0, announce_writes=True)  # fmt: skip
    else:
        prefetch = PrefetchConfig(policy="timeout", negative_ttl_s=60.0, announced_wait_s=wait_s)
    return cache_over_l3(MHA, "memory", {"store": store}, StorageOptions(), prefetch,
                         page_size=PAGE, device_pages=64)  # fmt: skip


def pin_rates(cache: HiCache, prefill: list[float]) -> None:
    """Pin ``cache``'s rates, which on a tiny model depend on the machine: its L3 reads
    at :data:`READ_CALL_S` a call (fresh observations of two sizes, so the cost line has
    that overhead), its prefill at ``prefill[0]`` seconds a token (read at each use)."""

    def rate() -> RateFit:
        s = prefill[0]
        return RateFit(
            observations=1, per_second=1 / s, mean_amount=1.0, overhead_s=0.0, seconds_per_unit=s
        )

    cache.measure_prefill(rate)
    meter = cache._sync.restore_meter.storage
    for i in range(64):
        nbytes = 1_000 if i % 2 else 100_000
        meter.observe(nbytes, READ_CALL_S + nbytes * 1e-12, time.monotonic())


def test_the_next_turn_does_not_wait_for_an_answer_the_rates_would_not_read() -> None:
    """The next turn (the 8-token answer announced, then 24 new tokens) waits for its
    lookup: reading 32 tokens (10 ms) beats recomputing them (32 ms). Reading the 8 the
    lookup could find does not (10 ms against 8), so the lookup does not wait for them
    (they land 0.3 s later; it used to wait that long, then recompute). Not remembered
    missing: once landed, a turn whose prefill costs 1 s a token reads them."""
    prefill = [0.001]
    store = f"announced-{time.monotonic_ns()}"
    with over_memory(store, writer=True) as writer, over_memory(store, wait_s=2.0) as reader:
        pin_rates(reader, prefill)
        end_unsynced(writer, CONVERSATION)
        stored_announcement(writer, CONVERSATION)
        later = land_later(writer, 0.3)
        got, took = ask(reader, [*CONVERSATION, *[7] * 24])
        later.join()
        assert got == 0 and took < 0.2
        assert counter(reader, "l3_unwaited_prefetches_total") == 0  # it waited for the lookup
        assert counter(reader, "l3_announced_waits_total") == 0
        assert counter(reader, "l3_announced_unwaited_total") == 1
        prefill[0] = 1.0
        got, _ = ask(reader, [*CONVERSATION, *[7] * 24])
        assert got == 8 and counter(reader, "l3_decided_read_tokens_total") == 8
        check_integrity(reader)
        check_integrity(writer)


def test_the_next_turn_waits_for_an_answer_the_rates_would_read() -> None:
    """Recomputing at 1 s a token, the announced answer is worth the wait: the lookup
    waits until it lands (0.2 s) and the request reads it, byte for byte."""
    store = f"announced-{time.monotonic_ns()}"
    with over_memory(store, writer=True) as writer, over_memory(store, wait_s=2.0) as reader:
        pin_rates(reader, [1.0])
        end_unsynced(writer, CONVERSATION)
        stored_announcement(writer, CONVERSATION)
        later = land_later(writer, 0.2)
        got, took = look_up(reader, [*CONVERSATION, 7, 7])
        later.join()
        assert got == 8 and 0.15 < took < 1.5
        assert counter(reader, "l3_announced_waits_total") == 1
        assert counter(reader, "l3_announced_waits_expired_total") == 0
        assert counter(reader, "l3_decided_read_tokens_total") == 8
        check_integrity(reader)
        check_integrity(writer)


def _rank_asks(rank: int, n: int, out: str) -> dict[str, float]:
    """One of two ranks, each with its own view of the rates: rank 0 recomputes at 1 s a
    token (the 8-token answer would be worth waiting for), rank 1 at 1 ms (it would not).
    Every rank's pages are announced and never written."""
    prefetch = PrefetchConfig(policy="timeout", negative_ttl_s=60.0, announced_wait_s=2.0)
    config = CacheConfig(page_size=PAGE, device_tokens=64 * PAGE, hicache_ratio=2.0,
                         load_back_threshold=0, mem_layout="page_first")  # fmt: skip
    with HiCache(config, MHA, ranks=RankGroup()).start() as cache:
        ns = Namespace.for_spec(MHA, model="m", weights_fingerprint="w", layout="page_first",
                                page_size=PAGE, tp_size=n, tp_rank=rank)  # fmt: skip
        storage = create_storage("file", namespace=ns, extra_config={"file_path": out})
        tier = cache.l3.attach(storage, ns, prefetch, cache.context.ranks)
        pin_rates(cache, [1.0 if rank == 0 else 0.001])
        tier.controller.storage.announce(tier.keys.of(encode_tokens(CONVERSATION)), 5.0)
        got, took = ask(cache, [*CONVERSATION, *[7] * 24])
        return {
            "got": got,
            "took": took,
            "unwaited": counter(cache, "l3_announced_unwaited_total"),
            "waits": counter(cache, "l3_announced_waits_total"),
        }


def test_ranks_agree_not_to_wait_when_one_rank_would_not_read(tmp_path: Path) -> None:
    """The ranks agree on the smallest gain (all-reduce(min)): rank 1's rates would not
    read the announced answer, so neither rank waits for it. (Each by its own rates, rank
    0 would wait its 2 s bound, and the hit every rank agrees on would hold both.)"""
    r0, r1 = run_ranks(_rank_asks, 2, tmp_path)
    for r in (r0, r1):
        assert (r["got"], r["unwaited"], r["waits"]) == (0, 1, 0), r
        assert r["took"] < 1.0, r
