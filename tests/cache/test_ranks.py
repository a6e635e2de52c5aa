"""Tensor-parallel ranks as real processes: two ranks joined by a gloo group.

Each rank owns its cache and, for MHA, its own L3 directory (MHA keys carry the rank). The
ranks must agree, through all-reduce(min), on how many L3 pages to read: a rank whose
store holds fewer pages bounds both. For MLA, where every rank holds the same latent KV
under one namespace, only rank 0 writes L3, and every rank reads what it wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from hicache.cache import HiCache
from hicache.cache.report import check_integrity, tree_digest
from hicache.config import CacheConfig, PrefetchConfig
from hicache.controller.rank_group import RankGroup
from hicache.keys import Namespace
from hicache.spec import AttentionKind, KVSpec
from hicache.storage.registry import create_storage
from hicache.tokens import encode_tokens
from tests.helpers.rank_cache import drive
from tests.helpers.ranks import run_ranks

MHA = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
MLA = KVSpec(num_layers=2, attention=AttentionKind.MLA, kv_lora_rank=4, qk_rope_head_dim=2)
PAGE = 2
TOKENS = [3, 1, 4, 1, 5, 9, 2, 6]


def _cache(spec: KVSpec, root: Path, rank: int) -> HiCache:
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=0)
    cache = HiCache(cfg, spec, ranks=RankGroup()).start()
    ns = Namespace.for_spec(
        spec,
        model="m",
        weights_fingerprint="w",
        layout=cfg.mem_layout,
        page_size=PAGE,
        tp_size=2,
        tp_rank=rank,
    )
    storage = create_storage("file", namespace=ns, extra_config={"file_path": str(root)})
    cache.l3.attach(
        storage,
        ns,
        PrefetchConfig(policy="wait_complete", prefetch_threshold=0),
        cache.context.ranks,
    )
    return cache


def _rank_main(rank: int, n: int, out: str, spec_name: str) -> dict[str, object]:
    spec = MHA if spec_name == "mha" else MLA
    # MHA: one L3 directory per rank (its shard); MLA: one for all (rank 0 writes it)
    root = Path(out) / (f"l3-rank{rank}" if spec_name == "mha" else "l3-shared")
    result: dict[str, object] = {}
    with _cache(spec, root, rank) as cache:
        drive(cache, [TOKENS])
        cache.sync(wait=True)
        dist.barrier()
        files = sorted(p for p in root.rglob("*") if p.is_file())
        result["files"] = len(files)
        result["written"] = cache.full.pages.counters.l3_backup_tokens_total
        if spec_name == "mha" and rank == 1:  # this rank's store loses its last two pages
            assert cache.l3.attached is not None
            for key in cache.l3.attached.keys.of(encode_tokens(TOKENS))[2:]:
                cache.l3.attached.controller.storage.path_of(key.key).unlink()  # type: ignore[attr-defined]
        dist.barrier()
        cache.reset()
        [(_, _, storage_tokens)] = drive(cache, [TOKENS])
        result["storage_tokens"] = storage_tokens
        cache.sync(wait=True)
        result["digest"] = tree_digest(cache)
        check_integrity(cache)
    return result


def test_ranks_agree_on_the_shorter_l3_hit(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_rank_main, 2, tmp_path, "mha")
    assert r0["files"] == 4 and r1["files"] == 4  # each rank wrote its own shard's pages
    # rank 1 kept 2 of 4 pages: both ranks read 2 (4 tokens), not rank 0's 4
    assert r0["storage_tokens"] == 2 * PAGE and r1["storage_tokens"] == 2 * PAGE
    assert r0["digest"] == r1["digest"]


def test_mla_only_rank_zero_writes_and_every_rank_reads_it(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_rank_main, 2, tmp_path, "mla")
    assert r0["files"] == r1["files"] == 4  # one shared directory: rank 0's 4 pages
    assert r0["written"] == len(TOKENS) and r1["written"] == 0  # rank 0 alone wrote them
    # every rank reads rank 0's records: the whole prompt is an L3 hit on both
    assert r0["storage_tokens"] == r1["storage_tokens"] == len(TOKENS)
    assert r0["digest"] == r1["digest"]


if __name__ == "__main__":  # pragma: no cover - spawn children import this module
    sys.exit(0)
