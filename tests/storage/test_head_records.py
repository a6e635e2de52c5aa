"""Head records (``records="head"``): one L3 record per page and K/V head, shared by every
TP size. Exact record bytes on every host layout, a TP 1 writer read by TP 2 and TP 4
ranks and the reverse, exists/get of partly present pages, healing per record, and the
count of previous-version records."""

from __future__ import annotations

import pytest
import torch

from hicache.config import MemLayout
from hicache.heads import HeadSplit
from hicache.keys import (
    HEAD_RECORDS,
    Namespace,
    PageKey,
    head_key,
    page_keys,
    previous_page_key,
)
from hicache.memory import HostPool
from hicache.spec import KVSpec
from hicache.storage import MemoryStorage, MemoryStore
from hicache.storage.headio import StageCache
from hicache.storage.record import HEADER_SIZE, encode_record

H, KV, L, D, PS = 4, 2, 3, 4, 2  # query heads, K/V heads, layers, head dim, page size
LAYOUTS = list(MemLayout)


def ns(layout: MemLayout, kv_heads: int = KV, head_group: int = 1) -> Namespace:
    """The head-record namespace of a model of ``kv_heads`` (any TP size's: a TP 2
    rank's here, dropped)."""
    spec = KVSpec(num_layers=L, num_kv_heads=kv_heads, head_dim=D, dtype="float16")
    return Namespace.for_spec(
        spec,
        model="m",
        weights_fingerprint="w",
        layout=layout,
        page_size=PS,
        tp_size=2,
        tp_rank=1,
        head_records=True,
        head_group=head_group,
    )


def bare_ns(**fields: object) -> Namespace:
    """A ``page_first`` namespace built field by field (``fields`` over the defaults)."""
    return Namespace(
        model="m",
        weights_fingerprint="w",
        kv_dtype="float16",
        layout=MemLayout.PAGE_FIRST,
        page_size=PS,
        **fields,  # type: ignore[arg-type]
    )


def pool(layout: MemLayout, heads: int, seed: int | None = None) -> HostPool:
    spec = KVSpec(num_layers=L, num_kv_heads=heads, head_dim=D, dtype="float16")
    p = HostPool(spec, 4, PS, layout, pin_memory=False)
    if seed is None:
        p.buffer.zero_()
    else:
        g = torch.Generator().manual_seed(seed)
        p.buffer.copy_(torch.randn(p.buffer.shape, generator=g).to(p.buffer.dtype))
    return p


def storage(layout: MemLayout, store: MemoryStore, tp: int = 1, rank: int = 0) -> MemoryStorage:
    st = MemoryStorage(ns(layout), store=store)
    st.start()
    st.use_heads(HeadSplit(H, KV, tp, rank))
    return st


def keys(layout: MemLayout, n: int = 2) -> list[PageKey]:
    return page_keys(ns(layout), list(range(100, 100 + PS * n)))


def head_payload(host: HostPool, page: int, head: int) -> bytes:
    """The spec's payload of ``head``'s record of ``page``: per kind, the layout's order
    with the head dimension dropped."""
    canon = host.read_pages([page])[0, :, :, :, head]  # (K, L, ps, D)
    if host.layout is MemLayout.PAGE_FIRST:
        canon = canon.transpose(1, 2)  # (K, ps, L, D)
    return canon.contiguous().view(torch.uint8).numpy().tobytes()


def test_namespace_of_head_records_drops_the_rank() -> None:
    n = ns(MemLayout.PAGE_FIRST)
    assert n.records == HEAD_RECORDS and n.tp_rank is None and n.tp_size == 1
    with pytest.raises(ValueError, match="tp_rank"):
        bare_ns(records=HEAD_RECORDS)
    with pytest.raises(Exception, match="use_heads"), MemoryStorage(n) as st:
        st.batch_exists(keys(MemLayout.PAGE_FIRST))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_tp1_writes_one_exact_record_per_head(layout: MemLayout) -> None:
    store = MemoryStore()
    src = pool(layout, KV, seed=1)
    ks = keys(layout)
    with storage(layout, store) as st:
        assert st.batch_set(ks, src, [1, 3]).written == 2
        assert st.stats().set_pages == 4  # records
    assert len(store) == 4
    for k, page in zip(ks, [1, 3], strict=True):
        assert store.get(k.key) is None  # the page key names no record
        for h in range(KV):
            rec = store.get(head_key(k, h).key)
            assert rec is not None
            assert rec[HEADER_SIZE:] == head_payload(src, page, h)
            assert rec[8:40] == ns(layout).digest and rec[40:48] == k.fingerprint


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("tp", [2, 4])
def test_other_tp_sizes_read_their_heads(layout: MemLayout, tp: int) -> None:
    store = MemoryStore()
    src = pool(layout, KV, seed=2)
    ks = keys(layout)
    with storage(layout, store) as st:
        st.batch_set(ks, src, [0, 2])
    for rank in range(tp):
        split = HeadSplit(H, KV, tp, rank)
        dst = pool(layout, split.local_kv_heads)
        with storage(layout, store, tp, rank) as st:
            assert st.batch_exists(ks) == 2
            assert st.batch_get(ks, dst, [3, 1]) == [True, True]
        want = src.read_pages([0, 2])[:, :, :, :, split.kv_heads.start : split.kv_heads.stop]
        assert torch.equal(dst.read_pages([3, 1]), want)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_tp2_and_tp4_writers_make_the_tp1_page(layout: MemLayout) -> None:
    for tp in (2, 4):
        store = MemoryStore()
        full = pool(layout, KV, seed=3)
        ks = keys(layout)
        for rank in range(tp):
            split = HeadSplit(H, KV, tp, rank)
            mine = pool(layout, split.local_kv_heads)
            data = full.read_pages([0, 1])[:, :, :, :, split.kv_heads.start : split.kv_heads.stop]
            mine.write_pages([0, 1], data.contiguous())
            with storage(layout, store, tp, rank) as st:
                done = st.batch_set(ks, mine, [0, 1])
                assert st.writes_pages == split.writes_any
                assert done.written == (2 if split.writes_any else 0)
                assert done.present == (0 if split.writes_any else 2)
        assert len(store) == 2 * KV  # one record per page and head, replicas wrote none
        dst = pool(layout, KV)
        with storage(layout, store) as st:
            assert st.batch_get(ks, dst, [2, 3]) == [True, True]
        assert torch.equal(dst.read_pages([2, 3]), full.read_pages([0, 1]))


def test_a_page_with_a_missing_head_is_a_miss() -> None:
    layout = MemLayout.PAGE_FIRST_DIRECT
    store = MemoryStore()
    ks = keys(layout, 3)
    src = pool(layout, KV, seed=4)
    with storage(layout, store) as st:
        st.batch_set(ks, src, [0, 1, 2])
    store.delete(head_key(ks[1], 1).key)
    dst = pool(layout, KV)
    with storage(layout, store) as st:
        assert st.batch_exists(ks) == 1
        assert st.batch_contains(ks) == [True, False, True]
        assert st.batch_get(ks, dst, [0, 1, 2]) == [True, False, True]
        assert st.stats().miss("absent") == 1
    got = dst.read_pages([0, 1, 2])
    assert torch.equal(got[[0, 2]], src.read_pages([0, 2]))
    assert not got[1].any()  # a page missing a head is never scattered, not even in part
    with storage(layout, store, 2, 0) as st:  # rank 0 of TP 2 needs head 0 only
        assert st.batch_exists(ks) == 3


def test_a_bad_head_record_is_healed_by_the_next_write() -> None:
    layout = MemLayout.PAGE_FIRST
    store = MemoryStore()
    ks = keys(layout)
    src = pool(layout, KV, seed=5)
    with storage(layout, store) as st:
        st.batch_set(ks, src, [0, 1])
        bad = head_key(ks[0], 1).key
        rec = store.get(bad)
        assert rec is not None
        store.replace(bad, rec[:-1] + bytes([rec[-1] ^ 1]))
        dst = pool(layout, KV)
        assert st.batch_get(ks, dst, [2, 3]) == [False, True]
        assert st.stats().miss("corrupt") == 1
        assert st.batch_set(ks, src, [0, 1]).written == 1  # page 0: its bad head rewritten
        assert st.stats().repaired == 1
        assert st.batch_get(ks, dst, [2, 3]) == [True, True]
        assert torch.equal(dst.read_pages([2, 3]), src.read_pages([0, 1]))


def test_previous_version_records_are_counted_never_read() -> None:
    layout = MemLayout.PAGE_FIRST
    store = MemoryStore()
    tokens = list(range(100, 100 + PS * 2))
    old = previous_page_key(ns(layout).previous_digest(2, 1), tokens[:PS], PS)
    assert old.key.startswith("hc2-")
    store.replace(old.key, encode_record(old.namespace_digest, old.fingerprint, [b"x" * 8]))
    with storage(layout, store) as st:
        assert st.batch_exists(keys(layout)) == 0
        assert st.probe_previous(old)
        wrong = previous_page_key(ns(layout).previous_digest(2, 0), tokens[:PS], PS)
        assert not st.probe_previous(wrong)
        assert st.stats().previous == 1


def test_stage_cache_reuses_the_largest_buffers() -> None:
    cache = StageCache(keep=1)
    a = cache.take(100)
    cache.give(a)
    b = cache.take(60)  # a view of the kept buffer
    assert b.numel() == 60 and b.data_ptr() == a.data_ptr()
    cache.give(b)
    cache.give(torch.empty(10, dtype=torch.uint8))  # smaller: not kept beside the 100
    assert cache.take(100).data_ptr() == a.data_ptr()
    assert cache.take(100).data_ptr() != a.data_ptr()  # taken: a new one


@pytest.mark.parametrize("layout", list(MemLayout), ids=lambda x: x.value)
def test_head_staging_in_runs_matches_page_by_page(layout: MemLayout) -> None:
    """Staging copies runs of consecutive pages at once: the rows equal each page's
    head slices taken one by one (pages in runs, alone, out of order, a head subset),
    and a get commits exactly the good pages, byte for byte."""
    from hicache.storage.headio import HeadPages, kind_views

    spec = KVSpec(num_layers=3, num_kv_heads=4, head_dim=8, dtype="bfloat16")
    src = HostPool(spec, 12, 2, layout, pin_memory=False)
    src.buffer.copy_(torch.randn(src.buffer.shape).to(src.dtype))
    pages = [3, 4, 5, 9, 0, 1, 7]
    for local in ([0, 1, 2, 3], [2, 0]):
        hp = HeadPages(src, pages, local, for_get=False)
        rows = hp.stage.view(len(pages), len(local), -1)
        for i, page in enumerate(pages):
            for j, head in enumerate(local):
                want = torch.cat(
                    [v.select(2, head).contiguous().view(-1) for v in kind_views(src, page)]
                )
                assert torch.equal(rows[i, j].view(src.dtype), want)
    dst = HostPool(spec, 12, 2, layout, pin_memory=False)
    before = dst.buffer.clone()
    get = HeadPages(dst, [8, 9, 10, 2, 6], [0, 1, 2, 3], for_get=True)
    put = HeadPages(src, [0, 1, 2, 3, 4], [0, 1, 2, 3], for_get=False)
    get.stage.copy_(put.stage)
    ok = [True] * 20
    ok[9] = False  # page 2 of the batch (pool page 10) has a bad head record
    get.commit(ok)
    for i, page in enumerate([8, 9, 10, 2, 6]):
        got = [v.clone() for v in kind_views(dst, page)]
        want = kind_views(src, i) if i != 2 else kind_views(before_pool(before, dst), page)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def before_pool(buffer: torch.Tensor, like: HostPool) -> HostPool:
    """A pool like ``like`` holding ``buffer`` (its contents before a commit)."""
    pool = HostPool(like.spec, like.num_pages, like.page_size, like.layout, pin_memory=False)
    pool.buffer.copy_(buffer)
    return pool


def test_record_keys_are_head_keys_memo_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo (bounded: forgotten at its cap) never changes a key."""
    from hicache.storage import headio

    monkeypatch.setattr(headio, "_MEMO_CAP", 5)
    monkeypatch.setattr(headio, "_memo", {})
    ns = Namespace.for_spec(
        KVSpec(num_layers=1, num_kv_heads=4, head_dim=8, dtype="float32"),
        model="m",
        weights_fingerprint="memo",
        layout="page_first",
        page_size=2,
        head_records=True,
    )
    pages = page_keys(ns, list(range(8)))
    want = [head_key(k, h) for k in pages for h in (3, 1)]
    for _ in range(3):  # cold, partly remembered, after being forgotten
        assert headio.record_keys(pages, [3, 1]) == want
        assert len(headio._memo) <= 5


# -- records of groups of heads (Namespace.head_group) ---------------------------------
GKV = 4  # K/V heads of the grouped cases (query heads: 2 per K/V head)


def group_ns(layout: MemLayout, group: int) -> Namespace:
    return ns(layout, GKV, group)


def group_storage(
    layout: MemLayout, group: int, store: MemoryStore, tp: int = 1, rank: int = 0
) -> MemoryStorage:
    st = MemoryStorage(group_ns(layout, group), store=store)
    st.start()
    st.use_heads(HeadSplit(2 * GKV, GKV, tp, rank))
    return st


def group_payload(host: HostPool, page: int, heads: range) -> bytes:
    """The spec's payload of the record of ``heads`` of ``page``: the page payload of a
    pool holding those heads alone (per kind, the layout's order, heads innermost but
    the dim)."""
    canon = host.read_pages([page])[0, :, :, :, heads.start : heads.stop]  # (K, L, ps, g, D)
    if host.layout is MemLayout.PAGE_FIRST:
        canon = canon.transpose(1, 2)  # (K, ps, L, g, D)
    return canon.contiguous().view(torch.uint8).numpy().tobytes()


def test_head_group_is_in_the_digest_only_when_not_one() -> None:
    one = group_ns(MemLayout.PAGE_FIRST, 1)
    assert one.digest == ns_with(one, GKV).digest == ns_with(one, 1).digest
    two = group_ns(MemLayout.PAGE_FIRST, 2)
    assert two.head_group == 2 and two.digest != one.digest
    assert b'"head_group":2' in two.encode() and b"head_group" not in one.encode()
    with pytest.raises(ValueError, match='head_group=2 is invalid; must be 1 with records="page"'):
        bare_ns(head_group=2)
    assert two.for_slots(2, 1).head_group == 1


def ns_with(n: Namespace, kv_heads: int) -> Namespace:
    """``n`` rebuilt by :meth:`Namespace.for_spec` for a model of ``kv_heads`` (the
    group stays 1): the digest does not depend on the model's head count."""
    spec = KVSpec(num_layers=L, num_kv_heads=kv_heads, head_dim=D, dtype="float16")
    return Namespace.for_spec(
        spec,
        model=n.model,
        weights_fingerprint=n.weights_fingerprint,
        layout=n.layout,
        page_size=n.page_size,
        head_records=True,
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("group", [2, 4])
def test_group_records_hold_exact_bytes_and_serve_each_size(layout: MemLayout, group: int) -> None:
    """A TP 1 writer stores ``4 / group`` records a page, each byte for byte the page of
    a pool holding the group's heads (at group 4: a page record's payload); every TP size
    whose ranks hold whole groups reads its heads exactly, and a size that splits a group
    is refused naming the numbers."""
    store = MemoryStore()
    src = pool_of(layout, GKV, seed=7)
    ks = page_keys(group_ns(layout, group), list(range(100, 100 + PS * 2)))
    with group_storage(layout, group, store) as st:
        assert st.batch_set(ks, src, [1, 3]).written == 2
        assert st.stats().set_pages == 2 * GKV // group  # records
    assert len(store) == 2 * GKV // group
    for k, page in zip(ks, [1, 3], strict=True):
        for j in range(GKV // group):
            rec = store.get(head_key(k, j).key)
            assert rec is not None
            assert rec[HEADER_SIZE:] == group_payload(src, page, range(j * group, (j + 1) * group))
    if group == GKV:
        page_pool = pool_of(layout, GKV)
        page_pool.write_pages([0], src.read_pages([1]))
        assert store.get(head_key(ks[0], 0).key)[HEADER_SIZE:] == b"".join(  # type: ignore[index]
            bytes(p) for p in page_parts(page_pool, 0)
        )
    for tp in (1, 2, 4):
        if GKV // tp < group:
            with pytest.raises(
                ValueError, match=f"holds {GKV // tp} of {GKV} K/V heads, not whole"
            ):
                group_storage(layout, group, store, tp, 0)
            continue
        for rank in range(tp):
            split = HeadSplit(2 * GKV, GKV, tp, rank)
            dst = pool_of(layout, split.local_kv_heads)
            with group_storage(layout, group, store, tp, rank) as st:
                assert st.batch_exists(ks) == 2
                assert st.batch_contains(ks) == [True, True]
                assert st.batch_get(ks, dst, [3, 0]) == [True, True]
            want = src.read_pages([1, 3])[:, :, :, :, split.kv_heads.start : split.kv_heads.stop]
            assert torch.equal(dst.read_pages([3, 0]), want)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_tp2_writers_of_group_records_make_the_tp1_page(layout: MemLayout) -> None:
    """Group 2 (an L3 shared by TP 1 and TP 2): each TP 2 rank writes its one record per
    page in place (its heads are the group); a TP 1 reader stages both into its page."""
    store = MemoryStore()
    full = pool_of(layout, GKV, seed=8)
    ks = page_keys(group_ns(layout, 2), list(range(100, 100 + PS * 2)))
    for rank in range(2):
        split = HeadSplit(2 * GKV, GKV, 2, rank)
        mine = pool_of(layout, split.local_kv_heads)
        mine.write_pages(
            [2, 3],
            full.read_pages([0, 1])[
                :, :, :, :, split.kv_heads.start : split.kv_heads.stop
            ].contiguous(),
        )
        with group_storage(layout, 2, store, 2, rank) as st:
            assert st.batch_set(ks, mine, [2, 3]).written == 2
    assert len(store) == 4
    dst = pool_of(layout, GKV)
    with group_storage(layout, 2, store) as st:
        assert st.batch_get(ks, dst, [1, 0]) == [True, True]
    assert torch.equal(dst.read_pages([1, 0]), full.read_pages([0, 1]))


def test_a_missing_group_record_is_a_miss_of_its_page() -> None:
    layout = MemLayout.PAGE_FIRST
    store = MemoryStore()
    src = pool_of(layout, GKV, seed=9)
    ks = page_keys(group_ns(layout, 2), list(range(100, 100 + PS * 3)))
    with group_storage(layout, 2, store) as st:
        st.batch_set(ks, src, [0, 1, 2])
    store.delete(head_key(ks[1], 1).key)
    dst = pool_of(layout, GKV)
    with group_storage(layout, 2, store) as st:
        assert st.batch_exists(ks) == 1
        assert st.batch_get(ks, dst, [0, 1, 2]) == [True, False, True]
    assert not dst.read_pages([1]).any()  # never scattered in part
    with group_storage(layout, 2, store, 2, 0) as st:  # rank 0 of TP 2: record 0 alone
        assert st.batch_exists(ks) == 3


def pool_of(layout: MemLayout, heads: int, seed: int | None = None) -> HostPool:
    return pool(layout, heads, seed)


def page_parts(host: HostPool, page: int) -> list[memoryview]:
    """``page``'s payload as a page record holds it."""
    from hicache.storage.pageio import HostPages

    return HostPages(host, [page], for_get=False).parts(0)


def test_record_group_is_whole_on_every_size_dividing_the_lcm() -> None:
    from hicache.heads import record_group

    assert [record_group(8, n) for n in (1, 2, 4, 8, 16, 6)] == [8, 4, 2, 1, 1, 4]
    assert [record_group(2, n) for n in (1, 2, 4)] == [2, 1, 1]
    for kv in (1, 2, 4, 8):
        for lcm in (1, 2, 4, 8, 16):
            g = record_group(kv, lcm)
            for n in (d for d in range(1, lcm + 1) if lcm % d == 0):
                for rank in range(n):
                    HeadSplit(16, kv, n, rank).record_groups(g)  # whole: no error
    with pytest.raises(ValueError, match="tp_lcm=0 is invalid"):
        record_group(8, 0)


def test_the_tp_lcm_flag_is_checked_and_sizes_the_group() -> None:
    import argparse

    from hicache.server.args import add_engine_args, engine_config_from_args, flag_message

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cpu = ["--device", "cpu"]
    assert engine_config_from_args(p.parse_args(cpu)).storage_tp_lcm is None
    got = engine_config_from_args(p.parse_args([*cpu, "--hicache-storage-tp-lcm", "4"]))
    assert got.storage_tp_lcm == 4
    for bad, why in (
        ("0", "must be an int >= 1"),
        ("3", "must be a multiple of this server's tp_size=2"),
    ):
        with pytest.raises(ValueError) as err:
            engine_config_from_args(
                p.parse_args([*cpu, "--tp-size", "2", "--hicache-storage-tp-lcm", bad])
            )
        assert flag_message(err.value) == f"--hicache-storage-tp-lcm {bad} is invalid; {why}"
