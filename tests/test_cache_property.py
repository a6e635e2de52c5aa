"""Property test: random operation sequences keep every invariant and every byte.

After each step the tree and allocators pass ``check_integrity`` (with the pages that
in-flight requests hold), and every cached prefix read back through the facade (match ->
load back -> read L1) equals the KV written for those tokens.
"""

from __future__ import annotations

import time

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hicache.cache import HiCache
from hicache.config import CacheConfig, KVSpec, PrefetchConfig
from hicache.controller.storage_controller import StorageController
from hicache.keys import Namespace
from hicache.storage.backends.memory import MemoryStorage, MemoryStore
from hicache.tree import TreeNode
from hicache.tree.node import PageIds, encode_tokens
from tests.kvdata import page_kv, read_device, write_tokens

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
# A small alphabet and short sequences make shared prefixes, splits and evictions common.
sequences = st.lists(st.integers(0, 3), min_size=PAGE, max_size=5 * PAGE)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = "write_through"
        self.cache: HiCache | None = None
        self.held: list[tuple[TreeNode, PageIds]] = []  # locked prefixes + caller pages
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
        self.cache = HiCache(cfg, SPEC).start()
        if l3:  # a fresh in-memory L3 shared by nothing else
            ns = Namespace.for_spec(
                SPEC, model="m", weights_fingerprint="w", layout=layout, page_size=PAGE
            )
            assert self.cache.host_pool is not None
            ctl = StorageController(MemoryStorage(ns, store=MemoryStore()), self.cache.host_pool)
            prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
            self.cache.attach_storage(ctl, ns, prefetch)

    def teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()

    @property
    def c(self) -> HiCache:
        assert self.cache is not None
        return self.cache

    @rule(
        tokens=sequences,
        hold=st.booleans(),
        priority=st.integers(0, 2),
        tenant=st.sampled_from(["", "", "t1"]),
    )
    def request(self, tokens: list[int], hold: bool, priority: int, tenant: str) -> None:
        """Match, load back, compute the rest, insert; optionally keep the prefix locked."""
        c = self.c
        if c.l3 is not None and not tenant:  # what the scheduler does before admission
            key = encode_tokens(tokens)
            handle = c.l3.start_prefetch(key, c.match_prefix(key))
            if handle is not None:
                while not c.l3.ready(handle):
                    time.sleep(0.0005)
                c.l3.finish(handle)
        m = c.match_prefix(tokens, tenant)
        lb = c.load_back(m)
        c.count_request(len(tokens), m, lb)
        lb.progress.wait_all()
        assert read_device(c, lb.device_pages).equal(page_kv(c, tokens, 0, len(lb.device_pages))), (
            "a cached prefix came back with other bytes"
        )
        c.lock(lb.last_node)
        n_new = len(tokens) // PAGE - len(lb.device_pages)
        new = c.alloc_device(n_new)
        if new is None:
            c.unlock(lb.last_node)
            return
        write_tokens(c, tokens, new, len(lb.device_pages))
        result = c.insert(tokens, lb.device_pages + new, priority=priority, tenant=tenant)
        c.unlock(lb.last_node)
        self.known.append((tokens, tenant))
        if hold:
            c.lock(result.last_node)
            extra = c.alloc_device(1)  # a decode page the request owns
            if extra is None:
                c.unlock(result.last_node)
            else:
                self.held.append((result.last_node, extra))

    @rule()
    @precondition(lambda self: bool(self.held))
    def finish(self) -> None:
        node, pages = self.held.pop(0)
        self.c.unlock(node)
        self.c.free_device(pages)

    @rule(n=st.integers(1, 8))
    def evict_device(self, n: int) -> None:
        self.c.evict_device(n)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        self.c.evict_host(n)

    @rule()
    def flush(self) -> None:
        self.c.flush()

    @rule()
    @precondition(lambda self: not self.held)
    def reset(self) -> None:
        self.c.reset()

    @rule(i=st.integers(0, 1000))
    @precondition(lambda self: bool(self.known))
    def read_back(self, i: int) -> None:
        """Read a previously inserted sequence back; whatever is cached must be exact."""
        tokens, tenant = self.known[i % len(self.known)]
        c = self.c
        lb = c.load_back(c.match_prefix(tokens, tenant))
        lb.progress.wait_all()
        assert read_device(c, lb.device_pages).equal(page_kv(c, tokens, 0, len(lb.device_pages)))

    @invariant()
    def integrity(self) -> None:
        if self.cache is None:
            return
        self.cache.poll()
        held = [p for _, pages in self.held for p in pages]
        self.cache.check_integrity(request_pages=held)


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
