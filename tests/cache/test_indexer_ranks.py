"""The DSA indexer under tensor parallelism: two real rank processes (gloo), an MLA model's
cache (latent KV, one namespace for every rank, rank 0 alone writes L3) with the indexer's
keys, over one shared file L3.

Both ranks serve the prompts (rank 0 writes the latent pages and the ``"indexer"`` records),
empty L1 and L2, and serve them again from L3, each rank reading the records rank 0 wrote.
With no fault, and with rank 1's backend slow: both ranks hit the same lengths in L3, end
with equal tree digests, and each cached prefix's keys come back byte for byte; with rank
1's lookups failing, no rank reads (equal hits of 0). No rank hangs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import tests.helpers.rank_cache as rank_cache
from hicache.cache import HiCache
from hicache.cache.report import check_integrity, tree_digest
from hicache.config import CacheConfig, PrefetchConfig
from hicache.controller.rank_group import RankGroup
from hicache.keys import Namespace
from hicache.spec import AttentionKind, CacheSpec, IndexerSpec, KVSpec
from hicache.storage.base import ExistsRun
from hicache.storage.registry import create_storage
from hicache.tree.node import PageIds
from tests.helpers.indexer_keys import keys_buffer, token_key
from tests.helpers.ranks import run_ranks

MLA = KVSpec(num_layers=2, attention=AttentionKind.MLA, kv_lora_rank=4, qk_rope_head_dim=2)
KEYS = IndexerSpec(num_layers=2, index_head_dim=3)
PAGE = 2
A = [1, 2, 3, 4, 5, 6, 7, 8]
PROMPTS = [A, [*A[:4], 20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36, 37]]
FAULTS = ("none", "slow", "lookup_fail")


def _write_with_keys(
    cache: HiCache, tokens: Sequence[int], pages: PageIds, first_page: int
) -> None:
    """``kvdata.write_tokens`` (the latent), and the indexer keys of the same pages."""
    _write_tokens(cache, tokens, pages, first_page)
    buf = keys_buffer(cache)
    for i, page in enumerate(pages):
        for off in range(PAGE):
            buf[:, page * PAGE + off] = token_key(KEYS, tokens, (first_page + i) * PAGE + off)


_write_tokens = rank_cache.write_tokens


def _check_keys(cache: HiCache, prompts: Sequence[Sequence[int]]) -> list[int]:
    """Admit each prompt again (all in L1 now: no L3 op), check its prefix's keys; the
    prefix lengths."""
    out = []
    buf = keys_buffer(cache)
    for tokens in prompts:
        req = cache.open(list(tokens), compute_last=False)
        assert cache.admit(req, list(tokens))
        slots = req.pool_slots(PAGE, req.prefix_tokens)["indexer"]
        for pos in range(req.prefix_tokens):
            assert torch.equal(buf[:, int(slots[pos])], token_key(KEYS, tokens, pos)), pos
        out.append(req.prefix_tokens)
        cache.release(req)
    return out


def _late(call: Callable[..., Any]) -> Callable[..., Any]:
    def late(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.15)
        return call(*args, **kwargs)

    return late


def _scenario(rank: int, root: str, fault: str) -> dict[str, Any]:
    cfg = CacheConfig(
        page_size=PAGE, device_tokens=32, hicache_ratio=4.0, load_back_threshold=0,
        write_policy="write_through",
    )  # fmt: skip
    cache = HiCache(cfg, CacheSpec(kv=MLA, components=(KEYS,)), ranks=RankGroup()).start()
    ns = Namespace.for_spec(
        MLA, model="m", weights_fingerprint="w", layout=cfg.mem_layout, page_size=PAGE,
        tp_size=2, tp_rank=rank,
    )  # fmt: skip
    storage = create_storage("file", namespace=ns, extra_config={"file_path": f"{root}/{fault}"})
    prefetch = PrefetchConfig(policy="wait_complete", prefetch_threshold=0)
    cache.l3.attach(storage, ns, prefetch)
    with cache:
        rank_cache.drive(cache, PROMPTS)
        cache.sync(wait=True)
        cache.sync()  # both ranks past their writes before either reads
        cache.reset()
        if rank == 1 and fault == "slow":  # every lookup and read 0.15 s late
            for name in ("exists_run", "batch_contains", "batch_get"):
                setattr(storage, name, _late(getattr(storage, name)))
        if rank == 1 and fault == "lookup_fail":
            storage.exists_run = lambda keys: ExistsRun(0, failed=True)  # type: ignore[method-assign]
        hits = rank_cache.drive(cache, PROMPTS)
        cache.sync(wait=True)
        prefixes = _check_keys(cache, PROMPTS)
        check_integrity(cache)
        return {
            "hits": hits,
            "digest": tree_digest(cache),
            "prefixes": prefixes,
            "indexer_written": cache.full.pages.counters.l3_backup_indexer_pages_total,
        }


def _main(rank: int, n: int, out: str) -> dict[str, Any]:
    rank_cache.write_tokens = _write_with_keys  # type: ignore[assignment]
    return {fault: _scenario(rank, out, fault) for fault in FAULTS}


def test_ranks_read_the_keys_rank_0_wrote(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_main, 2, tmp_path)
    for fault in FAULTS:
        a, b = r0[fault], r1[fault]
        assert a["hits"] == b["hits"], (fault, a["hits"], b["hits"])
        assert a["digest"] == b["digest"], fault
        assert a["prefixes"] == b["prefixes"] == [8, 8, 8], fault
        assert b["indexer_written"] == 0 < a["indexer_written"], fault  # rank 0 writes
    storage = {fault: [h[2] for h in r0[fault]["hits"]] for fault in FAULTS}
    assert storage["none"] == storage["slow"] == [8, 4, 8]
    assert storage["lookup_fail"] == [0, 0, 0]


if __name__ == "__main__":  # pragma: no cover - spawn children import this module
    sys.exit(0)
