"""Tensor-parallel ranks as real processes: two ranks joined by a gloo group.

Each rank owns its cache and its own L3 directory (MHA keys carry the rank). The ranks
must agree, through all-reduce(min), on how many L3 pages to read: a rank whose store
holds fewer pages bounds both. For MLA, where every rank holds the same latent KV under
one namespace, only rank 0 writes L3.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hicache.cache import HiCache
from hicache.config import AttentionKind, CacheConfig, KVSpec, PrefetchConfig
from hicache.controller.rank_group import RankGroup
from hicache.keys import Namespace
from hicache.services.process import free_port
from hicache.storage.registry import create_storage
from hicache.tokens import encode_tokens

MHA = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
MLA = KVSpec(num_layers=2, attention=AttentionKind.MLA, kv_lora_rank=4, qk_rope_head_dim=2)
PAGE = 2
TOKENS = [3, 1, 4, 1, 5, 9, 2, 6]


def _cache(spec: KVSpec, root: Path, rank: int, ranks: RankGroup) -> HiCache:
    cfg = CacheConfig(page_size=PAGE, device_tokens=16, hicache_ratio=2.0, load_back_threshold=0)
    cache = HiCache(cfg, spec).start()
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
    cache.attach_storage(
        storage, ns, PrefetchConfig(policy="wait_complete", prefetch_threshold=0), ranks
    )
    return cache


def _rank_main(rank: int, port: int, out: str, spec_name: str) -> None:
    from tests.helpers.kvdata import serve

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        torch.set_num_threads(1)
        spec = MHA if spec_name == "mha" else MLA
        root = Path(out) / f"l3-rank{rank}"
        result: dict[str, object] = {}
        with _cache(spec, root, rank, RankGroup()) as cache:
            assert serve(cache, TOKENS) is not None
            cache.flush()
            files = sorted(p for p in root.rglob("*") if p.is_file())
            result["files"] = len(files)
            if spec_name == "mha":
                if rank == 1:  # this rank's store loses its last two pages
                    assert cache.storage is not None
                    for key in cache.storage.keys(encode_tokens(TOKENS))[2:]:
                        cache.storage.controller.storage.path_of(key.key).unlink()  # type: ignore[attr-defined]
                dist.barrier()
                cache.reset()
                again = serve(cache, TOKENS)
                assert again is not None
                result["storage_tokens"] = again.cached.storage
                cache.check_integrity()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_two_ranks(tmp_path: Path, spec_name: str) -> list[dict[str, int]]:
    port = free_port()
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    try:
        mp.start_processes(
            _rank_main,
            args=(port, str(tmp_path), spec_name),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
    except Exception:
        errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.err")))
        raise AssertionError(f"a rank failed:\n{errors}") from None
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ranks_agree_on_the_shorter_l3_hit(tmp_path: Path) -> None:
    r0, r1 = _run_two_ranks(tmp_path, "mha")
    assert r0["files"] == 4 and r1["files"] == 4  # each rank wrote its own shard's pages
    # rank 1 kept 2 of 4 pages: both ranks read 2 (4 tokens), not rank 0's 4
    assert r0["storage_tokens"] == 2 * PAGE and r1["storage_tokens"] == 2 * PAGE


def test_mla_only_rank_zero_writes_l3(tmp_path: Path) -> None:
    r0, r1 = _run_two_ranks(tmp_path, "mla")
    assert r0["files"] == 4 and r1["files"] == 0


if __name__ == "__main__":  # pragma: no cover - spawn children import this module
    sys.exit(0)
