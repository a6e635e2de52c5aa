"""Session retention at the cache, exact states on tiny pools: what is pinned in L2 and
when, the bound (demotion of the least recently active), yields to an allocation, a
subagent keeping its parent, expiry and close, and more sessions than L2 can hold."""

from __future__ import annotations

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.cache.sessions import SessionState
from hicache.config import CacheConfig
from hicache.spec import KVSpec
from hicache.storage.backends.memory import MemoryStore
from tests.helpers.kvdata import serve
from tests.helpers.l3_cache import attach_memory

MHA = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2


def make(*, device_pages: int = 8, l2_ratio: float = 1.5, ratio: float = 0.5) -> HiCache:
    cfg = CacheConfig(
        page_size=PAGE,
        device_tokens=device_pages * PAGE,
        hicache_ratio=l2_ratio,
        load_back_threshold=0,
        session_ratio=ratio,
    )
    return HiCache(cfg, MHA).start()


def turn(cache: HiCache, session: str, tokens: list[int], *, parent: str | None = None) -> None:
    """A session's request: served, released (its pages committed), then kept."""
    req = serve(cache, tokens, hold=True)
    assert req is not None
    cache.release(req, tokens)
    cache.sessions.touch(session, tokens, tenant="", deadline=100.0, parent=parent)


def state(cache: HiCache) -> list[tuple[str, str, int]]:
    """(session, state, pinned tokens), least recently active first."""
    return [(v.session_id, v.state.value, v.pinned_tokens) for v in cache.sessions.views()]


def counter(cache: HiCache, name: str) -> int:
    return int(cache_stats(cache).counters[name])


def seq(first: int, pages: int) -> list[int]:
    return list(range(first, first + pages * PAGE))


def test_a_session_is_pinned_in_l2_once_its_backup_has_landed() -> None:
    with make() as cache:
        turn(cache, "a", seq(1, 2))
        assert state(cache) == [("a", "kept", 0)]  # the L1 -> L2 copy is in flight
        cache.sync(wait=True)
        assert state(cache) == [("a", "kept", 4)]
        assert cache.sessions.kept_pages() == 2
        node = cache.full.pages.match_prefix(seq(1, 2)).last_host_node
        assert node.host_ref == 1 and node.lock_ref == 0  # L2 only: L1 may evict it
        check_integrity(cache)


def test_a_turn_extends_the_pin_and_the_old_one_is_dropped() -> None:
    with make() as cache:
        turn(cache, "a", seq(1, 2))
        cache.sync(wait=True)
        turn(cache, "a", seq(1, 3))
        cache.sync(wait=True)
        assert state(cache) == [("a", "kept", 6)]
        tree = cache.full.pages.tree
        assert sorted(n.host_ref for n in tree.iter_nodes()) == [1, 1]  # one path, once


def test_past_the_bound_the_least_recently_active_session_is_demoted() -> None:
    with make() as cache:  # 12 L2 pages, half of them for sessions: 6
        for i, s in enumerate("abc"):
            turn(cache, s, seq(100 * (i + 1), 2))
            cache.sync(wait=True)
        assert state(cache) == [("a", "kept", 4), ("b", "kept", 4), ("c", "kept", 4)]
        turn(cache, "d", seq(400, 2))
        cache.sync(wait=True)
        assert state(cache) == [
            ("a", "demoted", 0),
            ("b", "kept", 4),
            ("c", "kept", 4),
            ("d", "kept", 4),
        ]
        assert counter(cache, "session_demotions_total") == 1
        assert cache.sessions.kept_pages() == 6 == cache.sessions.bound_pages


def test_shared_prefix_pages_count_once_against_the_bound() -> None:
    with make() as cache:
        system = seq(1, 2)
        for s, tail in (("a", 100), ("b", 200), ("c", 300), ("d", 400)):
            turn(cache, s, [*system, *seq(tail, 1)])
            cache.sync(wait=True)
        # 2 shared pages + 1 page each: 6 pages for four sessions, within the bound
        assert [st for _, st, _ in state(cache)] == ["kept"] * 4
        assert cache.sessions.kept_pages() == 6


def test_an_allocation_with_nothing_else_to_evict_makes_sessions_yield() -> None:
    with make(ratio=1.0) as cache:  # 8 L1 pages, 12 L2 pages, all of L2 for sessions
        turn(cache, "a", seq(100, 4))
        cache.sync(wait=True)
        turn(cache, "b", seq(200, 4))
        cache.sync(wait=True)
        assert cache.sessions.kept_pages() == 8
        req = serve(cache, seq(300, 8), hold=True)  # 8 new pages: L2 backup needs 8
        assert req is not None
        cache.release(req, seq(300, 8))
        cache.sync(wait=True)
        assert state(cache) == [("a", "demoted", 0), ("b", "kept", 8)]
        assert counter(cache, "session_yields_total") == 1
        assert cache.full.pages.match_prefix(seq(300, 8)).matched_tokens == 16  # backed up
        check_integrity(cache)


def test_a_subagent_keeps_its_parent_alive() -> None:
    with make() as cache:
        parent = seq(1, 2)
        turn(cache, "p", parent)
        cache.sync(wait=True)
        turn(cache, "x", seq(100, 2))
        cache.sync(wait=True)
        turn(cache, "p.1", [*parent, *seq(200, 1)], parent="p")
        cache.sync(wait=True)
        # the subagent's turn made its parent recently active: x is the oldest now
        assert [s for s, _, _ in state(cache)] == ["x", "p", "p.1"]
        turn(cache, "y", seq(300, 2))
        cache.sync(wait=True)
        assert state(cache) == [
            ("x", "demoted", 0),
            ("p", "kept", 4),
            ("p.1", "kept", 6),
            ("y", "kept", 4),
        ]


def test_expiry_names_a_session_once_and_close_unpins_it() -> None:
    with make() as cache:
        turn(cache, "a", seq(1, 2))
        cache.sync(wait=True)
        assert cache.sessions.expired(now=99.0) == []
        assert cache.sessions.expired(now=100.0) == ["a"]
        assert cache.sessions.expired(now=101.0) == []  # named already
        assert cache.sessions.close("a", expired=True)
        assert not cache.sessions.close("a")  # unknown now
        assert counter(cache, "session_expired_total") == 1
        assert all(n.host_ref == 0 for n in cache.full.pages.tree.iter_nodes())


def test_more_sessions_than_l2_holds_stay_within_the_bound() -> None:
    with make() as cache:
        for i in range(1000):
            turn(cache, f"s{i}", seq(10_000 + 10 * i, 2))
            cache.sync(wait=True)
            assert cache.sessions.kept_pages() <= cache.sessions.bound_pages
            if i % 100 == 0:
                check_integrity(cache)
        kept = [s for s, st, _ in state(cache) if st == SessionState.KEPT.value]
        assert kept == ["s997", "s998", "s999"] and len(cache.sessions) == 1000
        assert counter(cache, "session_demotions_total") == 997
        check_integrity(cache)


def test_emptying_the_cache_ends_every_session() -> None:
    with make() as cache:
        turn(cache, "a", seq(1, 2))
        cache.sync(wait=True)
        cache.reset()
        assert len(cache.sessions) == 0
        assert not list(cache.full.pages.tree.iter_nodes())


def test_no_l2_keeps_nothing() -> None:
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, enable_hierarchical_cache=False)
    with HiCache(cfg, MHA).start() as cache:
        turn(cache, "a", seq(1, 2))
        cache.sync(wait=True)
        assert state(cache) == [("a", "kept", 0)]
        assert cache.sessions.bound_pages == 0


def test_keeping_a_session_never_makes_its_spans_look_recent() -> None:
    with make() as cache:
        turn(cache, "a", seq(1, 2))
        tree = cache.full.pages.tree
        before = [(n.id, n.last_access) for n in tree.iter_nodes()]
        cache.sync(wait=True)  # the pin moves down as the backup lands: a look, no access
        for _ in range(3):
            cache.sync()
        assert [(n.id, n.last_access) for n in tree.iter_nodes()] == before
        assert state(cache) == [("a", "kept", 4)]


def test_a_demoted_session_leaves_l2_only_with_an_l3_copy() -> None:
    """Under ``watermark`` nothing is written to L3 below the high mark: a session's spans
    are in L2 alone until its demotion writes them (pinned by the write until it landed,
    then ``stored``, then evictable)."""
    cfg = CacheConfig(
        page_size=PAGE,
        device_tokens=8 * PAGE,
        hicache_ratio=1.5,
        load_back_threshold=0,
        session_ratio=0.5,
        write_policy="watermark",
        write_back_threshold=1.0,
    )
    store = MemoryStore()
    with HiCache(cfg, MHA).start() as cache:
        attach_memory(cache, store)
        for i, s in enumerate("abc"):
            turn(cache, s, seq(100 * (i + 1), 2))
            cache.sync(wait=True)
        assert len(store) == 0  # below the mark: nothing written
        tree = cache.full.pages.tree
        a = tree.within(seq(100, 2))
        assert a is not None and not a.stored
        turn(cache, "d", seq(400, 2))  # its backup lands at the sync: a is demoted past
        cache.sync(wait=True)  # the bound, written first, pinned by the write till it landed
        assert state(cache)[0] == ("a", "demoted", 0)
        assert a.stored and a.host_ref == 0 and len(store) == 2
        check_integrity(cache)
