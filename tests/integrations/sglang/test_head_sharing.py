"""One L3 across SGLang servers of different TP sizes: ``page_head`` pools' pages as
head-group records (``tp_lcm_size`` 2), under SGLang's own ``HiCacheController``.

Each rank is a controller over its own SGLang device and host pool, built after SGLang's
topology is published for that rank (``tp_size``, world rank = TP rank), in this one
process with a one-rank gloo group: the ranks of a size run one after another, which the
storage path allows (its rank agreement is an all-reduce within one server, a no-op on
one rank here). A model of 4 K/V heads: a TP 2 rank holds 2, one record of g = 2 heads;
a TP 1 rank holds both records. And a model of 2 K/V heads on TP 1 (g = 1), whose records
a hicache ``page_first`` host pool of one-head records reads and writes byte-exact.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import ServerArgs

from hicache.config import MemLayout
from hicache.heads import HeadSplit
from hicache.integrations.sglang.namespace import sglang_page_key
from hicache.keys import HEAD_RECORDS, Namespace, head_key
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage.backends.file import FileConfig, FileStorage
from hicache.storage.backends.mooncake import MooncakeStorage
from tests.integrations.sglang.controller import TOKENS, Scheduler, pages_of, schedulers
from tests.integrations.sglang.pools import DIM, LAYERS, PAGE, attach, fill, host_pool

MODEL_HEADS = 4  # K/V heads of the model of the TP 1 / TP 2 tests
Rank = Callable[..., Scheduler]
"""``rank(tp_size, tp_rank, heads, model, **extra)``: a controller of that rank (``extra``
over the fixture's extra config)."""


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[Rank]:
    """Controllers of any TP rank over one file L3 (``tp_lcm_size`` 2); any not closed
    by the test are detached at the end."""
    extra = {"hicache_backend": "file", "file_path": str(tmp_path / "l3"), "tp_lcm_size": 2}
    with schedulers(tmp_path) as made:

        def new(
            tp_size: int, tp_rank: int, heads: int, model: str = "heads", **more: Any
        ) -> Scheduler:
            reset_context()
            publish(
                ServerArgs(model_path="dummy", device="cpu", tp_size=tp_size),
                role="scheduler",
                ranks=SpawnRanks(world_rank=tp_rank),
            )
            cfg = {**extra, **more}
            if cfg["hicache_backend"] != "file":
                del cfg["file_path"]
            made.append(Scheduler(dist.group.WORLD, "mha", "page_head", cfg, model, heads))
            return made[-1]

        yield new


def _kinds(page: bytes) -> tuple[bytes, bytes]:
    """A flat ``page_head`` page's K half and V half."""
    half = len(page) // 2
    return page[:half], page[half:]


def _join(pages: list[bytes]) -> bytes:
    """The page of a pool holding the heads of ``pages`` (one per rank, in rank order):
    per kind, the ranks' heads one after another."""
    ks, vs = zip(*(_kinds(p) for p in pages), strict=True)
    return b"".join(ks) + b"".join(vs)


def _moved_in_place(s: Scheduler) -> None:
    """Over Mooncake, zero-copy calls moved the records by address in SGLang's
    ``kv_buffer`` (registered whole); nothing to check for other stores."""
    store = s.backend.store
    if isinstance(store, MooncakeStorage) and s.backend.storage_config.extra_config.get(
        "interface_v1"
    ):
        buf = s.host.kv_buffer
        assert store.registered_ranges()[buf.data_ptr()] == buf.numel() * buf.element_size()


def _write(s: Scheduler, seed: int, records: int) -> list[bytes]:
    """``s`` backs up four filled host pages of ``TOKENS`` as ``records`` records; their
    bytes."""
    host_indices = s.host.alloc(len(TOKENS))
    fill(s.host, seed=seed)  # what the L1 -> L2 copy would have left there
    assert s.backup(host_indices, TOKENS) == len(TOKENS)
    stats = s.backend.stats
    assert stats is not None and stats.set_written == records
    _moved_in_place(s)
    pages = pages_of(s, host_indices)
    s.close()
    return pages


def _read(s: Scheduler, hit_pages: int = 4, done_pages: int = 4, corrupt: int = 0) -> list[bytes]:
    """``s`` prefetches ``TOKENS``: the hit and the completed pages as given, and
    ``corrupt`` records rejected; the completed pages' bytes."""
    got = s.prefetch("r", TOKENS)
    assert (got.hit_tokens, got.completed_tokens) == (hit_pages * PAGE, done_pages * PAGE)
    stats = s.backend.stats
    assert stats is not None and stats.misses.get("corrupt", 0) == corrupt
    _moved_in_place(s)
    pages = pages_of(s, got.host_indices)
    s.close()
    return pages


@pytest.mark.parametrize(("store", "interface_v1"), [("file", 1), ("file", 0), ("mooncake", 1)])
def test_tp2_writes_tp1_reads_and_the_reverse(
    rank: Rank, store: str, interface_v1: int, request: pytest.FixtureRequest
) -> None:
    """TP 2's ranks each write their group's record of four pages; a TP 1 rank reads
    both records of each page, byte-exact. Then TP 1 writes four other pages (another
    model name: its own namespace) and each TP 2 rank reads its half, byte-exact. By the
    zero-copy calls (``interface_v1`` 1: two parts of SGLang's buffer per record, which
    Mooncake moves in place) and SGLang's copying ones (0)."""
    per_rank = MODEL_HEADS // 2
    written = []
    more: dict[str, Any] = {"interface_v1": interface_v1}
    if store == "mooncake":
        svc = request.getfixturevalue("mooncake_service")
        # the test's records are small: zero_copy_min_bytes 0 moves them in place anyway
        more.update(hicache_backend="mooncake", zero_copy_min_bytes=0, **svc.extra_config)
    tag = uuid.uuid4().hex[:8]  # namespaces of this test alone on a shared store
    for r in range(2):
        s = rank(2, r, per_rank, f"tp-{tag}", **more)
        want = "_page_set_zero_copy" if interface_v1 else "_generic_page_set"
        assert s.cc.page_set_func.__name__ == want
        assert s.backend.storage_config.tp_lcm_size == 2
        ns = s.backend.namespace
        assert ns is not None and (ns.records, ns.head_group, ns.tp_rank) == (HEAD_RECORDS, 2, None)
        assert ns.engine_layout == "sglang:page_head"  # g > 1: not hicache's page_first
        written.append(_write(s, seed=50 + r, records=4))  # one record per page
    tp1 = rank(1, 0, MODEL_HEADS, f"tp-{tag}", **more)
    assert tp1.backend.storage_config.should_split_heads  # tp_lcm 2 > tp 1
    assert _read(tp1) == [_join([a, b]) for a, b in zip(*written, strict=True)]

    whole = _write(rank(1, 0, MODEL_HEADS, f"rev-{tag}", **more), seed=60, records=8)
    for r in range(2):
        got = _read(rank(2, r, per_rank, f"rev-{tag}", **more))
        assert [_kinds(p) for p in got] == [
            tuple(kind[r * len(kind) // 2 : (r + 1) * len(kind) // 2] for kind in _kinds(p))
            for p in whole
        ]


def test_a_missing_or_corrupt_group_record_is_a_miss_of_its_page(rank: Rank) -> None:
    """TP 2 writes four pages; rank 1's record of page 2 is deleted and rank 0's record
    of page 3 has a flipped byte. TP 1 (which reads both records of a page): the hit
    stops before page 2; after rank 1 writes page 2 again, the hit is four pages but the
    get ends at page 3 (the corrupt record: a miss, counted); page 1 and 2 byte-exact."""
    per_rank = MODEL_HEADS // 2
    written = [_write(rank(2, r, per_rank), seed=70 + r, records=4) for r in range(2)]
    tp1 = rank(1, 0, MODEL_HEADS)
    store = tp1.backend.store
    assert isinstance(store, FileStorage)
    hashes = tp1.page_hashes(TOKENS)
    record = [[head_key(tp1.backend.page_key(h), j) for j in range(2)] for h in hashes]
    store.path_of(record[1][1].key).unlink()
    path = store.path_of(record[2][0].key)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01
    path.write_bytes(bytes(blob))
    joined = [_join([a, b]) for a, b in zip(*written, strict=True)]
    assert _read(tp1, hit_pages=1, done_pages=1) == joined[:1]

    s = rank(2, 1, per_rank)
    host_indices = s.host.alloc(len(TOKENS))
    fill(s.host, seed=71)  # the same bytes rank 1 wrote
    assert s.backup(host_indices, TOKENS) == len(TOKENS)
    stats = s.backend.stats
    assert stats is not None and (stats.set_written, stats.set_skipped) == (1, 3)
    s.close()
    tp1 = rank(1, 0, MODEL_HEADS)
    assert _read(tp1, hit_pages=4, done_pages=2, corrupt=1) == joined[:2]


def test_replicated_heads_are_written_by_their_lowest_rank(rank: Rank) -> None:
    """A model of 2 K/V heads on TP 4 (``tp_lcm_size`` 4, ``hicache_kv_heads`` 2: a
    rank's one head does not tell the model's count): ranks 1 and 3 hold the heads of
    ranks 0 and 2 and write nothing (their backups still succeed); TP 1 reads pages
    byte-exact from ranks 0 and 2's records."""
    more: dict[str, Any] = {"tp_lcm_size": 4, "hicache_kv_heads": 2}
    written = [
        _write(rank(4, r, 1, "replicas", **more), seed=90 + r, records=0 if r % 2 else 4)
        for r in range(4)
    ]
    got = _read(rank(1, 0, 2, "replicas", **more))
    assert got == [_join([a, b]) for a, b in zip(written[0], written[2], strict=True)]


def test_a_rank_of_one_head_needs_the_model_count_to_share(rank: Rank) -> None:
    """At TP 2 a rank of one K/V head may hold a replica: with ``tp_lcm_size`` and no
    ``hicache_kv_heads`` the backend refuses, naming it; without ``tp_lcm_size`` the
    pages stay per-rank records (no sharing asked)."""
    with pytest.raises(ValueError, match="hicache_kv_heads"):
        rank(2, 0, 1, "one-head")
    s = rank(2, 1, 1, "one-head", tp_lcm_size=None)
    ns = s.backend.namespace
    assert s.backend.heads is None and ns is not None
    assert (ns.records, ns.tp_rank, ns.tp_size) == ("page", 1, 2)
    with pytest.raises(ValueError, match="hicache_kv_heads=4 does not match"):
        rank(2, 0, 1, "one-head", hicache_kv_heads=4)


def test_head_splitting_of_another_layout_is_refused(tmp_path: Path) -> None:
    """SGLang splits heads only for ``page_head``; a config asking it of another layout
    is refused, naming the layout."""
    extra = {"hicache_backend": "file", "file_path": str(tmp_path / "l3")}
    with pytest.raises(ValueError, match="page_head host layout, not 'page_first'"):
        attach(host_pool("mha", "page_first"), extra, tp_lcm_size=2, should_split_heads=True)


def _hicache_pool(seed: int | None = None) -> HostPool:
    spec = KVSpec(num_layers=LAYERS, num_kv_heads=2, head_dim=DIM, dtype="bfloat16")
    pool = HostPool(spec, 8, PAGE, MemLayout.PAGE_FIRST, pin_memory=False)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        flat = pool.buffer.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
    return pool


def _hicache_heads(pool: HostPool, pages: list[int]) -> list[bytes]:
    """Per page and head, hicache's one-head record payload: per kind ``(ps, L, D)``."""
    out = []
    canon = pool.read_pages(pages)  # (n, K, L, ps, H, D)
    for i in range(len(pages)):
        for h in range(2):
            head = canon[i, :, :, :, h].transpose(1, 2).contiguous()  # (K, ps, L, D)
            out.append(head.view(torch.uint8).numpy().tobytes())
    return out


def _sglang_heads(pages: list[bytes]) -> list[bytes]:
    """Per page and head, the K span then the V span of a two-head ``page_head`` page."""
    out = []
    for p in pages:
        k, v = _kinds(p)
        n = len(k) // 2
        out += [k[h * n : (h + 1) * n] + v[h * n : (h + 1) * n] for h in range(2)]
    return out


def _hicache_storage(root: Path, ns: Namespace) -> FileStorage:
    st = FileStorage(ns, config=FileConfig(path=str(root)))
    st.start()
    st.use_heads(HeadSplit(2, 2, 1, 0))
    return st


def test_hicache_page_first_shares_one_head_records(rank: Rank, tmp_path: Path) -> None:
    """A 2-head model on SGLang TP 1 with tp_lcm 2 has records of one head (g = 1) in
    hicache's own namespace: that of a hicache server's ``page_first`` pool of one-head
    records. hicache's host pool reads SGLang's pages byte-exact, head by head, and SGLang
    reads hicache's pages byte-exact."""
    s = rank(1, 0, 2, "shared")
    ns = s.backend.namespace
    spec = KVSpec(num_layers=LAYERS, num_kv_heads=2, head_dim=DIM, dtype="bfloat16")
    mine = Namespace.for_spec(
        spec,
        model="shared",
        weights_fingerprint="unset",
        layout=MemLayout.PAGE_FIRST,
        page_size=PAGE,
        head_records=True,
        head_group=1,
    )
    assert ns == mine and ns.engine_layout == ""
    hashes = s.page_hashes(TOKENS)
    written = _write(s, seed=80, records=8)

    st = _hicache_storage(tmp_path / "l3", mine)
    keys = [sglang_page_key(mine, h) for h in hashes]
    pool = _hicache_pool()
    assert st.batch_get(keys, pool, [0, 1, 2, 3]) == [True] * 4
    assert _hicache_heads(pool, [0, 1, 2, 3]) == _sglang_heads(written)

    other = [c * 64 for c in "cdef"]  # hicache writes pages under other hashes
    src = _hicache_pool(seed=81)
    assert st.batch_set([sglang_page_key(mine, h) for h in other], src, [4, 5, 6, 7]).failed == 0
    st.close()
    reader = rank(1, 0, 2, "shared")
    assert reader.backend.batch_exists(other) == 4
    host_indices = reader.host.alloc(len(TOKENS))
    assert reader.backend.batch_get_v1(other, host_indices) == [True] * 4
    assert _sglang_heads(pages_of(reader, host_indices)) == _hicache_heads(src, [4, 5, 6, 7])
