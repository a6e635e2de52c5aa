"""Property test: random operation sequences keep every invariant and every byte.

Requests go through the facade's verbs (open -> ready -> admit -> commit -> release), some
held across steps. After each step the tree and allocators pass ``check_integrity``
(admitted requests' pages included), and every cached prefix read back through the verbs
equals the KV written for those tokens.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hicache.cache import CacheRequest, HiCache
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig, PrefetchConfig
from hicache.keys import Namespace
from hicache.spec import CacheSpec, KVSpec
from hicache.storage.backends.memory import MemoryStorage, MemoryStore
from tests.helpers.kvdata import serve

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
# A small alphabet and short sequences make shared prefixes, splits and evictions common.
sequences = st.lists(st.integers(0, 3), min_size=PAGE, max_size=5 * PAGE)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = "write_through"
        self.cache: HiCache | None = None
        self.held: list[CacheRequest] = []  # admitted requests kept across steps
        self.known: list[tuple[list[int], str]] = []

    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        eviction=st.sampled_from(["lru", "lfu", "fifo", "priority"]),
        io=st.sampled_from(["direct", "kernel"]),
        layout=st.sampled_from(["layer_first", "page_first", "page_first_direct"]),
        l3=st.booleans(),
    )
    def setup(self, policy: str, eviction: str, io: str, layout: str, l3: bool) -> None:
        cfg = CacheConfig(
            page_size=PAGE,
            device_tokens=8 * PAGE,
            hicache_ratio=2.0,
            write_policy=policy,  # type: ignore[arg-type]
            eviction_policy=eviction,  # type: ignore[arg-type]
            io_backend=io,  # type: ignore[arg-type]
            mem_layout=layout,  # type: ignore[arg-type]
            load_back_threshold=0,
        )
        self.cache = HiCache(cfg, self.cache_spec()).start()
        if l3:  # a fresh in-memory L3 shared by nothing else
            ns = Namespace.for_spec(
                SPEC, model="m", weights_fingerprint="w", layout=layout, page_size=PAGE
            )
            prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
            self.cache.l3.attach(MemoryStorage(ns, store=MemoryStore()), ns, prefetch)

    def teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()

    @property
    def c(self) -> HiCache:
        assert self.cache is not None
        return self.cache

    def cache_spec(self) -> KVSpec | CacheSpec:
        """What the cache stores (a subclass adds components)."""
        return SPEC

    def serve(
        self, tokens: list[int], *, tenant: str = "", priority: int = 0, hold: bool = False
    ) -> CacheRequest | None:
        """:func:`tests.helpers.kvdata.serve` on the cache (a subclass checks and writes
        its components' data too)."""
        return serve(self.c, tokens, tenant=tenant, priority=priority, hold=hold)

    @rule(
        tokens=sequences,
        hold=st.booleans(),
        priority=st.integers(0, 2),
        tenant=st.sampled_from(["", "", "t1"]),
    )
    def request(self, tokens: list[int], hold: bool, priority: int, tenant: str) -> None:
        """Admit (prefetch, match, load back), compute the rest, commit; maybe hold it."""
        req = self.serve(tokens, tenant=tenant, priority=priority, hold=hold)
        if req is None:
            return  # L1 full of pinned pages: nothing held, nothing changed
        self.known.append((tokens, tenant))
        if hold:
            self.held.append(req)

    @rule()
    @precondition(lambda self: bool(self.held))
    def finish(self) -> None:
        self.c.release(self.held.pop(0))

    @rule(n=st.integers(1, 8))
    def evict_device(self, n: int) -> None:
        self.c.full.pages.evict_device(n)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        self.c.full.pages.evict_host(n)

    @rule()
    def flush(self) -> None:
        self.c.sync(wait=True)

    @rule()
    @precondition(lambda self: not self.held)
    def reset(self) -> None:
        self.c.reset()

    @rule(i=st.integers(0, 1000))
    @precondition(lambda self: bool(self.known))
    def read_back(self, i: int) -> None:
        """Read a previously inserted sequence back; whatever is cached must be exact."""
        tokens, tenant = self.known[i % len(self.known)]
        self.serve(tokens, tenant=tenant)  # checks the cached prefix byte for byte

    @invariant()
    def integrity(self) -> None:
        if self.cache is None:
            return
        self.cache.sync()
        check_integrity(self.cache)


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
