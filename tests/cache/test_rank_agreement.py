"""Tensor-parallel ranks agree on every asynchronous input, whatever one rank's faults.

Two real rank processes (gloo) each run the same cache steps (:func:`drive`: one
``sync()`` per step) over their own L3 shard (the ``memory`` backend, one private store
per rank and scenario). Rank 1 alone gets a fault: its backend slow, its lookups failing,
its reads timing out (past the backend's deadline, and past the ``timeout`` policy's),
its L2 full of pages an outside holder pinned, or its L2 -> L1 loads failing. For each prefetch policy both ranks must
report equal hit lengths for every request, end with equal tree digests, and not hang (a
collective blocked past ``COLLECTIVE_TIMEOUT_S`` fails the rank, and with it the test).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hicache.cache import HiCache
from hicache.cache.report import check_integrity, tree_digest
from hicache.config import CacheConfig, PrefetchConfig
from hicache.controller.rank_group import RankGroup
from hicache.keys import Namespace, page_keys
from hicache.spec import CacheSpec, KVSpec
from hicache.storage.backends.memory import MemoryFaults, MemoryStorage, shared_store
from hicache.storage.registry import create_storage
from tests.helpers.kvdata import FailingLoads
from tests.helpers.rank_cache import drive
from tests.helpers.ranks import run_ranks

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 2
A = [1, 2, 3, 4, 5, 6, 7, 8]
PROMPTS = [A, [*A[:4], 20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36, 37]]
FAULTS = ("none", "slow", "lookup_fail", "read_timeout", "l2_full", "load_fail")
POLICIES = ("best_effort", "wait_complete", "timeout")


def _cache(
    rank: int,
    store: str,
    policy: str,
    *,
    device_tokens: int = 32,
    extra: dict[str, Any],
    hook: FailingLoads | None = None,
) -> HiCache:
    cfg = CacheConfig(
        page_size=PAGE,
        device_tokens=device_tokens,
        hicache_ratio=4.0,
        load_back_threshold=0,
        write_policy="write_through",
    )
    cache = HiCache(cfg, SPEC, ranks=RankGroup(), layer_hook=hook).start()
    ns = Namespace.for_spec(
        SPEC,
        model="m",
        weights_fingerprint="w",
        layout=cfg.mem_layout,
        page_size=PAGE,
        tp_size=cache.context.ranks.size,
        tp_rank=rank,
    )
    storage = create_storage("memory", namespace=ns, extra_config={"store": store, **extra})
    base = 0.1 if extra.get("timeout_s") else 3.0  # read_timeout: the policy gives up first
    prefetch = PrefetchConfig(
        policy=policy,
        prefetch_threshold=0,
        prefetch_timeout_base=base,
        prefetch_timeout_per_ki_token=0.0,
        prefetch_timeout_max=5.0,
    )
    cache.l3.attach(storage, ns, prefetch)
    return cache


def _backend(cache: HiCache) -> MemoryStorage:
    assert cache.l3.attached is not None
    storage = cache.l3.attached.controller.storage
    assert isinstance(storage, MemoryStorage)
    return storage


def _inject(cache: HiCache, fault: str) -> Any:
    """Give this rank's cache ``fault`` (of :data:`FAULTS`; ``load_fail`` is the caller's
    hook): its backend slow, failing or late; or its whole L2 held by an outside pin,
    whose pages are returned (free them after)."""
    if fault == "slow":
        _backend(cache).set_faults(MemoryFaults(delay_s=0.15))
    elif fault == "lookup_fail":
        _backend(cache).set_faults(MemoryFaults(fail_after=0))
    elif fault == "read_timeout":
        _backend(cache).set_faults(MemoryFaults(get_delay_s=0.5))
    elif fault == "l2_full":
        assert cache.full.pages.host_pool is not None
        return cache.full.pages.host.allocator.alloc(cache.full.pages.host.allocator.free_pages)
    return None


def _fault_scenario(rank: int, policy: str, fault: str) -> dict[str, Any]:
    """Serve PROMPTS once (write-through to L3), empty L1 and L2, fault rank 1, serve
    them again from L3; what each rank saw."""
    faulty = rank == 1
    extra: dict[str, Any] = {"timeout_s": 0.25} if faulty and fault == "read_timeout" else {}
    hook = FailingLoads()
    with _cache(rank, f"{policy}-{fault}-{rank}", policy, extra=extra, hook=hook) as cache:
        drive(cache, PROMPTS)
        cache.sync(wait=True)
        cache.reset()
        backed_before = cache.full.pages.counters.backup_tokens_total
        held = _inject(cache, fault) if faulty else None
        if faulty and fault == "load_fail":
            hook.on = True
        hits = drive(cache, PROMPTS)
        hook.on = False
        cache.sync(wait=True)
        digest = tree_digest(cache)
        if held is not None:
            assert cache.full.pages.host_pool is not None
            cache.full.pages.host.allocator.free(held)
        _backend(cache).set_faults(MemoryFaults())
        check_integrity(cache)
        return {
            "hits": hits,
            "digest": digest,
            "timeouts": cache.full.pages.counters.prefetch_timeouts_total,
            "backed_up": cache.full.pages.counters.backup_tokens_total - backed_before,
            "fallbacks": cache.full.pages.counters.load_fallbacks_total,
        }


def _policy_main(rank: int, n: int, out: str, policy: str) -> dict[str, Any]:
    return {fault: _fault_scenario(rank, policy, fault) for fault in FAULTS}


@pytest.mark.parametrize("policy", POLICIES)
def test_one_faulty_rank_neither_blocks_nor_splits_the_group(tmp_path: Path, policy: str) -> None:
    r0, r1 = run_ranks(_policy_main, 2, tmp_path, policy)
    for fault in FAULTS:
        a, b = r0[fault], r1[fault]
        assert a["hits"] == b["hits"], (fault, a["hits"], b["hits"])
        assert a["digest"] == b["digest"], fault
        assert a["timeouts"] == b["timeouts"], fault
        assert a["backed_up"] == b["backed_up"], fault
        assert a["fallbacks"] == b["fallbacks"], fault
    storage = {fault: [h[2] for h in r0[fault]["hits"]] for fault in FAULTS}
    # what rank 1 cannot serve, no rank reads: the shorter (here: no) hit bounds both
    assert storage["lookup_fail"] == storage["read_timeout"] == storage["l2_full"] == [0, 0, 0]
    if policy != "best_effort":  # the policy waits for L3 (for the slow rank too)
        assert storage["none"] == storage["slow"] == [8, 4, 8]
        # what L3 brought could not be loaded on rank 1: every rank recomputes it
        assert storage["load_fail"] == [0, 0, 0] and r0["load_fail"]["fallbacks"] > 0
    # rank 1's L2 had no room: no rank backed anything up, so both trees hold L1 only
    # (with lookups failing, the prompts are computed again and backed up)
    assert r0["l2_full"]["backed_up"] == 0 < r0["lookup_fail"]["backed_up"]


def _race_main(rank: int, n: int, out: str, policy: str) -> dict[str, Any]:
    """Many requests arriving over several steps, each rank's lookups and reads landing at
    other times (rank 1's backend slower), two running at a time."""
    prompts = [
        [g * 100 + j for j in range(4)] + [k * 10 + j for j in range(4)]
        for g in range(3)
        for k in range(4)
    ]
    with _cache(rank, f"race-{policy}-{rank}", policy, extra={}) as cache:
        drive(cache, prompts)
        cache.sync(wait=True)
        cache.reset()
        _backend(cache).set_faults(MemoryFaults(delay_s=0.02 * rank))
        hits = drive(cache, prompts, open_per_step=2, hold_steps=8, max_running=2, step_s=0.01)
        cache.sync(wait=True)
        check_integrity(cache)
        return {"hits": hits, "digest": tree_digest(cache)}


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_racing_prefetches_pair_correctly(tmp_path: Path, policy: str) -> None:
    r0, r1 = run_ranks(_race_main, 2, tmp_path, policy)
    assert r0["hits"] == r1["hits"]
    assert r0["digest"] == r1["digest"]
    if policy != "best_effort":  # best_effort never waits: on a loaded machine no read may land
        assert sum(h[2] for h in r0["hits"]) > 0  # some requests did read L3


def _retired_main(rank: int, n: int, out: str) -> dict[str, Any]:
    """Detach while rank 1's read is late (its backend still writes the L2 pages): every
    rank keeps the detached backend's pages until it settled on every rank, so their L2
    pools keep the same free pages at every step."""
    with _cache(rank, f"retired-{rank}", "wait_complete", extra={}) as cache:
        assert cache.full.pages.host_pool is not None
        drive(cache, [A])
        cache.sync(wait=True)
        ns = cache.l3.attached.keys.namespace if cache.l3.attached is not None else None
        assert ns is not None and cache.l3.detach()
        cache.reset()
        late = create_storage(
            "memory",
            namespace=ns,
            extra_config={"store": f"retired-{rank}", "timeout_s": 0.1,
                          "get_delay_s": 1.0 if rank == 1 else 0.0},
        )  # fmt: skip
        cache.l3.attach(late, ns, PrefetchConfig(policy="wait_complete", prefetch_threshold=0))
        req = cache.open(A, compute_last=False)
        while (
            cache.l3.attached is not None
            and not cache.l3.attached.prefetches.quarantined_host_pages()
        ):
            cache.sync()  # the lookup applied on every rank: the read is issued
            time.sleep(0.002)
        time.sleep(0.3)  # rank 0's read is over, rank 1's still writes late
        assert cache.l3.detach()
        steps = 0
        while True:
            cache.sync()
            free = cache.full.pages.host.allocator.free_pages
            assert cache.context.ranks.min(free) == cache.context.ranks.max(free), (
                "L2 pools drifted apart"
            )
            if not cache.full.pages.host.allocator.used_pages:
                break
            steps += 1
            assert steps < 2000, "the retired backend's pages were never freed"
            time.sleep(0.005)
        cache.release(req)
        check_integrity(cache)
        return {"steps": steps}


def test_a_late_read_on_one_rank_holds_every_ranks_pages_until_it_settles(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_retired_main, 2, tmp_path)
    assert r0["steps"] == r1["steps"] > 0  # freed in the same step, once rank 1 settled


def _swa_main(rank: int, n: int, out: str) -> dict[str, Any]:
    """A hybrid model (sliding window 4, pages of 2): rank 1's L3 lost the SWA record of
    page 5, so its deepest usable boundary of 6 pages is 4; both ranks must read 4."""
    from tests.cache.test_swa import FULL, SWA_SPEC, read_swa, serve_in_chunks

    cfg = CacheConfig(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, load_back_threshold=0,
        swa_full_tokens_ratio=0.5,
    )  # fmt: skip
    tokens = list(range(100, 121))
    ns = Namespace.for_spec(
        FULL, model="m", weights_fingerprint="w", layout=cfg.mem_layout, page_size=PAGE,
        tp_size=2, tp_rank=rank,
    )  # fmt: skip
    store = f"swa-{rank}"
    policy = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
    with HiCache(cfg, CacheSpec(kv=FULL, components=(SWA_SPEC,)), ranks=RankGroup()) as cache:
        cache.l3.attach(
            create_storage("memory", namespace=ns, extra_config={"store": store}), ns, policy
        )
        serve_in_chunks(cache, tokens)
        cache.reset()
        if rank == 1:
            shared_store(store).delete(page_keys(ns.with_component("swa"), tokens, PAGE)[4].key)
        prompt = tokens[:13]  # 6 whole pages before the last token
        req = cache.open(prompt)
        for _ in range(2000):
            cache.sync()
            if cache.ready(req):
                break
            time.sleep(0.002)
        assert cache.admit(req, prompt)
        prefix = req.prefix_tokens
        assert read_swa(cache, req, prompt, max(0, prefix - SWA_SPEC.window), prefix)
        hit = (req.cached.storage, prefix)
        cache.release(req)
        cache.sync(wait=True)
        check_integrity(cache)
        return {"hit": hit, "digest": tree_digest(cache)}


def test_ranks_agree_on_a_hybrid_models_deepest_common_boundary(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_swa_main, 2, tmp_path)
    assert r0["hit"] == r1["hit"] == [4 * PAGE, 4 * PAGE]  # rank 0 alone could serve 6
    assert r0["digest"] == r1["digest"]


HYBRID_PROMPTS = [list(range(100, 121)), [*range(100, 108), *range(200, 213)]]
"""Two prompts of 21 tokens (10 whole pages of 2 before the last token) sharing 4 pages."""


def _hybrid_fault_scenario(rank: int, policy: str, fault: str) -> dict[str, Any]:
    """A hybrid model's cache (full KV and a sliding window of 4 in its own pools, pages
    of 2): serve the prompts (write-through to each rank's memory L3: full and SWA
    records), empty L1 and L2, fault rank 1 as :func:`_fault_scenario` does (slow,
    lookups failing, reads timing out, L2 full of pinned pages), then open each prompt
    again; its hit (L3 tokens, prefix) and whether its window came back right."""
    from tests.cache.test_swa import FULL, SWA_SPEC, read_swa, serve_in_chunks

    faulty = rank == 1
    cfg = CacheConfig(
        page_size=PAGE, device_tokens=64, hicache_ratio=2.0, load_back_threshold=0,
        swa_full_tokens_ratio=0.5, write_policy="write_through",
    )  # fmt: skip
    ns = Namespace.for_spec(
        FULL, model="m", weights_fingerprint="w", layout=cfg.mem_layout, page_size=PAGE,
        tp_size=2, tp_rank=rank,
    )  # fmt: skip
    extra: dict[str, Any] = {"store": f"hybrid-{policy}-{fault}-{rank}"}
    if faulty and fault == "read_timeout":
        extra["timeout_s"] = 0.25
    prefetch = PrefetchConfig(
        policy=policy, prefetch_threshold=0, prefetch_timeout_base=3.0,
        prefetch_timeout_per_ki_token=0.0, prefetch_timeout_max=5.0,
    )  # fmt: skip
    with HiCache(cfg, CacheSpec(kv=FULL, components=(SWA_SPEC,)), ranks=RankGroup()) as cache:
        cache.l3.attach(create_storage("memory", namespace=ns, extra_config=extra), ns, prefetch)
        for tokens in HYBRID_PROMPTS:
            serve_in_chunks(cache, tokens)
        cache.reset()
        held = _inject(cache, fault) if faulty else None
        hits: list[tuple[int, int, bool]] = []
        for tokens in HYBRID_PROMPTS:
            prompt = tokens[:-1]
            req = cache.open(prompt)
            for _ in range(4000):
                cache.sync()
                if cache.ready(req):
                    break
                time.sleep(0.002)
            assert cache.admit(req, prompt)
            if cache.full.pages.host_pool is not None:
                cache.full.pages.host.wait_idle()
                cache.sync()
            prefix = req.prefix_tokens
            window = read_swa(cache, req, prompt, max(0, prefix - SWA_SPEC.window), prefix)
            hits.append((req.cached.storage, prefix, window))
            cache.release(req)
        cache.sync(wait=True)
        digest = tree_digest(cache)
        if held is not None:
            assert cache.full.pages.host_pool is not None
            cache.full.pages.host.allocator.free(held)
        _backend(cache).set_faults(MemoryFaults())
        check_integrity(cache)
        return {"hits": hits, "digest": digest}


def _hybrid_main(rank: int, n: int, out: str, policy: str) -> dict[str, Any]:
    return {fault: _hybrid_fault_scenario(rank, policy, fault) for fault in FAULTS[:-1]}


@pytest.mark.parametrize("policy", POLICIES)
def test_one_faulty_rank_of_a_hybrid_model_neither_blocks_nor_splits(
    tmp_path: Path, policy: str
) -> None:
    """The scenarios above (but the failing L2 -> L1 load) on a sliding-window hybrid:
    equal hits and digests, every hit's window right; what rank 1 cannot serve, no rank
    reads."""
    r0, r1 = run_ranks(_hybrid_main, 2, tmp_path, policy)
    for fault in FAULTS[:-1]:
        a, b = r0[fault], r1[fault]
        assert a["hits"] == b["hits"], (fault, a["hits"], b["hits"])
        assert a["digest"] == b["digest"], fault
        assert all(window for _, _, window in a["hits"]), fault
    storage = {fault: [h[0] for h in r0[fault]["hits"]] for fault in FAULTS[:-1]}
    assert storage["lookup_fail"] == storage["read_timeout"] == storage["l2_full"] == [0, 0]
    if policy != "best_effort":  # the policy waits for L3 (for the slow rank too)
        assert storage["none"] == storage["slow"] and storage["none"][0] > 0, storage


if __name__ == "__main__":  # pragma: no cover - spawn children import this module
    sys.exit(0)
