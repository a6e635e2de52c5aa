"""Property test: L2->L1 loads and L1->L2 backups fail at random under L1 pressure, and no
L1 hit ever holds bytes other than the KV stored for its tokens.

Requests go through the verbs, alone or several admitted in one step before any of them
runs its forward (so later ones share pages the earlier ones are still loading). A caller
outside the cache holds some L1 pages now and then (their bytes scribbled over), so
admissions wait for backups to make room and loads land in pages that held other bytes.
After each step the cache passes ``check_integrity``; ``check`` flushes the copies and
reads every L1 hit of every sequence stored so far back byte for byte.

No rule has a precondition: what is held or stored depends on when copies land, and
hypothesis needs the rules it may draw to be the same on every run of an example.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hicache.cache import CacheRequest, HiCache
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig
from hicache.spec import CacheSpec, KVSpec
from hicache.tree.node import PageIds
from tests.helpers.kvdata import (
    FailingBackups,
    FailingLoads,
    check_l1_hits,
    fill_device,
    finish,
    serve_or_fail,
)

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
sequences = st.lists(st.integers(0, 2), min_size=PAGE, max_size=5 * PAGE)


class LoadFaultMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: HiCache | None = None
        self.loads = FailingLoads()
        self.backups: FailingBackups | None = None
        self.private: list[PageIds] = []  # L1 pages held outside the cache
        self.known: list[list[int]] = []
        self.held: list[tuple[CacheRequest, list[int]]] = []  # admitted across steps

    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        io=st.sampled_from(["direct", "kernel"]),
        first=st.lists(sequences, min_size=1, max_size=3),
    )
    def setup(self, policy: str, io: str, first: list[list[int]]) -> None:
        cfg = CacheConfig(
            page_size=PAGE,
            device_tokens=8 * PAGE,
            hicache_ratio=2.0,
            write_policy=policy,  # type: ignore[arg-type]
            io_backend=io,  # type: ignore[arg-type]
            load_back_threshold=0,
        )
        spec = self.cache_spec()
        self.cache = HiCache(cfg, spec, layer_hook=self.loads, wait_timeout_s=10.0).start()
        assert self.cache.full.pages.host_pool is not None
        engine = self.cache.full.pages.host.controller._engine
        self.backups = FailingBackups(engine.copier)
        engine.copier = self.backups  # type: ignore[assignment]
        for tokens in first:  # something to hit from the first step on
            self.request(tokens)

    def teardown(self) -> None:
        if self.cache is not None:
            for req, _ in self.held:
                self.cache.release(req, commit=False)
            self.cache.close()

    @property
    def c(self) -> HiCache:
        assert self.cache is not None
        return self.cache

    def cache_spec(self) -> KVSpec | CacheSpec:
        """What the cache stores (a subclass adds components)."""
        return SPEC

    @rule(tokens=sequences)
    def request(self, tokens: list[int]) -> None:
        if serve_or_fail(self.c, tokens):
            self.known.append(tokens)

    @rule(i=st.integers(0, 1000), extra=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, i: int, extra: list[int]) -> None:
        """A later turn: a stored sequence and more, so its prefix hits and the rest needs
        fresh pages."""
        if not self.known:
            return
        tokens = self.known[i % len(self.known)] + extra
        if serve_or_fail(self.c, tokens):
            self.known.append(tokens)

    @rule(
        i=st.integers(0, 1000),
        extra=st.lists(st.integers(0, 2), min_size=1, max_size=6),
        k=st.integers(0, 5),
        fail=st.booleans(),
    )
    def turn_under_pressure(self, i: int, extra: list[int], k: int, fail: bool) -> None:
        """A later turn when L1 is nearly full: every cached L1 copy is demoted, all but
        ``k`` free pages are held elsewhere (until the turn ends), so the load and the
        pages after it compete for the last pages; with ``fail`` its load fails."""
        self.c.sync(wait=True)  # backups in flight pin their L1 sources
        self.c.full.pages.evict_device(self.c.full.pages.usable)
        before = len(self.private)
        self.leave_free(k)
        was, self.loads.on = self.loads.on, self.loads.on or fail
        try:
            self.extend(i, extra)
        finally:
            self.loads.on = was
            while len(self.private) > before:
                self.c.full.pages.free(self.private.pop())

    @rule(seqs=st.lists(sequences, min_size=2, max_size=3))
    def step(self, seqs: list[list[int]]) -> None:
        """Admit several requests, then run their forwards (as one engine step)."""
        admitted = []
        for tokens in seqs:
            req = self.c.open(tokens, compute_last=False)
            if self.c.admit(req, tokens):
                admitted.append((req, tokens))
            else:
                self.c.release(req)
        for req, tokens in admitted:
            if finish(self.c, req, tokens):
                self.known.append(tokens)

    @rule(tokens=sequences)
    def hold(self, tokens: list[int]) -> None:
        """Admit and keep the request admitted (its forward runs in a later step)."""
        req = self.c.open(tokens, compute_last=False)
        if self.c.admit(req, tokens):
            self.held.append((req, tokens))
        else:
            self.c.release(req)

    @rule()
    def run_held(self) -> None:
        if not self.held:
            return
        req, tokens = self.held.pop(0)
        if finish(self.c, req, tokens):
            self.known.append(tokens)

    @rule(on=st.booleans())
    def fail_loads(self, on: bool) -> None:
        self.loads.on = on

    @rule(on=st.booleans())
    def fail_backups(self, on: bool) -> None:
        assert self.backups is not None
        self.backups.on = on

    @rule(n=st.integers(1, 5))
    def squeeze(self, n: int) -> None:
        pages = self.c.full.pages.alloc(n)
        if pages is not None:
            fill_device(self.c, list(pages), 7.0)
            self.private.append(pages)

    @rule(k=st.integers(0, 4))
    def leave_free(self, k: int) -> None:
        """Hold every free L1 page but ``k`` (no eviction): the next admission must make
        room, waiting for backups in flight, while its own load is copying."""
        n = self.c.full.pages.device_pool.allocator.free_pages - k
        if n > 0:
            self.squeeze(n)

    @rule()
    def unsqueeze(self) -> None:
        if self.private:
            self.c.full.pages.free(self.private.pop(0))

    @rule(n=st.integers(1, 8))
    def evict_device(self, n: int) -> None:
        self.c.full.pages.evict_device(n)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        self.c.full.pages.evict_host(n)

    @rule()
    def check(self) -> None:
        self.c.sync(wait=True)
        check_l1_hits(self.c, self.known)

    @invariant()
    def integrity(self) -> None:
        if self.cache is None:
            return
        self.cache.sync()
        check_integrity(self.cache, [p for pages in self.private for p in pages])


LoadFaultMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLoadFaultMachine = LoadFaultMachine.TestCase
