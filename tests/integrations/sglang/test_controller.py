"""HiCacheL3 driven by SGLang's own ``HiCacheController``: its backup thread writes host
pages to L3, and a fresh controller's prefetch threads (exists query, hit agreement, the
gets, completion acks) bring them back into a new host pool; through the zero-copy v1
calls (``interface_v1: 1``) and SGLang's copying ``batch_get`` / ``batch_set``.

The controller is SGLang's, unmodified, built the way a one-rank scheduler builds it: a
published topology (``ServerArgs`` on CPU), a real one-rank gloo group, SGLang's
``MHATokenToKVPool`` / ``MLATokenToKVPool`` on ``"cpu"`` with its
``PagedTokenToKVPoolAllocator``, the host pool, and ``storage_backend="dynamic"`` with
HiCacheL3's extra config (which attaches it through ``attach_storage_backend`` and starts
the four storage threads). :class:`Scheduler` does what SGLang's radix cache does on the
scheduler thread: it enqueues (``write_storage``, ``prefetch``), allocates the host pages
of a hit, hands the operation to the IO thread, drains the ack queues, terminates the
prefetch and frees what was not completed through the release queue. With one rank the
controller builds no agreement groups (it skips groups of size 1), so its all-reduces are
no-ops here.

Not driven: the L1 <-> L2 copies (``write`` / ``load`` + ``start_loading``). On CPU SGLang
imports its copy kernels only for CUDA, HIP and XPU (``sglang/srt/mem_cache/pool_host/mha.py``
lines 60-89), so with io backend ``direct`` both raise ``NameError`` (``transfer_kv_direct``
for ``layer_first``; ``transfer_kv_all_layer_direct_lf_pf`` at ``mha.py:686`` and
``transfer_kv_per_layer_direct_pf_lf`` for ``page_first_direct``), which SGLang's cleanup
turns into ``AttributeError: 'Stream' object has no attribute 'synchronize'``
(``sglang/srt/mem_cache/l2_transfer.py:123``: ``torch.cpu.Stream``). The controller's
streams and events are otherwise built on CPU. The test fills the host pages itself, as
a finished L1 -> L2 copy would.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from hicache.storage.backends.file import FileStorage
from tests.integrations.sglang.controller import (
    TOKENS,
    Make,
    Scheduler,
    pages_of,
    write_four_pages,
)
from tests.integrations.sglang.pools import PAGE


def _page_path(sched: Scheduler, interface_v1: int) -> None:
    """The controller took the page IO path ``interface_v1`` selects."""
    get, put = sched.cc.page_get_func.__name__, sched.cc.page_set_func.__name__
    want = ("_page_get_zero_copy", "_page_set_zero_copy")
    assert (get, put) == (want if interface_v1 else ("_generic_page_get", "_generic_page_set"))


CASES = [  # (store, kind, layout, interface_v1: 0 = SGLang's copying batch_get / batch_set)
    ("file", "mha", "page_first", 1),
    ("file", "mha", "page_head", 1),
    ("file", "mla", "page_first_direct", 1),
    ("file", "mha", "layer_first", 0),
    ("file", "mla", "page_first", 0),
    ("redis", "mha", "layer_first", 1),
    ("mooncake", "mha", "page_first", 1),
]


@pytest.mark.parametrize(("store", "kind", "layout", "interface_v1"), CASES)
def test_backup_then_prefetch_by_a_fresh_controller(
    store: str,
    kind: str,
    layout: str,
    interface_v1: int,
    make: Make,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """Pages backed up by one controller are prefetched by a fresh one (new pools, same
    store) byte-exact; its hit query stops at the first page not stored; a prefix that
    was never stored is a 0-token hit."""
    if store == "file":
        extra: dict[str, Any] = {"hicache_backend": "file", "file_path": str(tmp_path / "l3")}
    elif store == "redis":
        server = request.getfixturevalue("redis_service")
        extra = {"hicache_backend": "redis", "url": server.url}
    else:
        svc = request.getfixturevalue("mooncake_service")
        extra = {"hicache_backend": "mooncake", **svc.extra_config}
    extra["interface_v1"] = interface_v1
    model = f"ctl-{uuid.uuid4().hex[:8]}"  # a namespace of this test alone on shared stores
    written = write_four_pages(make, kind, layout, extra, model)

    reader = make(kind, layout, extra, model)
    _page_path(reader, interface_v1)
    longer = TOKENS + list(range(5000, 5000 + 2 * PAGE))  # two more pages, never stored
    got = reader.prefetch("r1", longer)
    assert (got.hit_tokens, got.completed_tokens) == (len(TOKENS), len(TOKENS))
    assert pages_of(reader, got.host_indices) == written
    assert reader.host.available_size() == reader.host.size - len(TOKENS)
    miss = reader.prefetch("r2", [7, *TOKENS[1:]])  # another first token: other hashes
    assert (miss.hit_tokens, miss.completed_tokens) == (0, 0)
    stats = reader.backend.stats
    assert stats is not None and (stats.get_pages, stats.get_hits) == (4, 4)
    reader.close()


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_a_corrupt_page_ends_the_prefetch_there(
    interface_v1: int, make: Make, tmp_path: Path
) -> None:
    """The second of four stored pages has a flipped byte in the store: the hit query
    (presence) says four pages, the get (v1 or copying) rejects the second record, so the
    controller completes one page; that page is byte-exact and the three others go back
    to the host pool through SGLang's release queue."""
    extra: dict[str, Any] = {"hicache_backend": "file", "file_path": str(tmp_path / "l3")}
    extra["interface_v1"] = interface_v1
    written = write_four_pages(make, "mha", "page_first", extra, "ctl-corrupt")
    reader = make("mha", "page_first", extra, "ctl-corrupt")
    _page_path(reader, interface_v1)
    second = reader.page_hashes(TOKENS)[1]
    store = reader.backend.store
    assert isinstance(store, FileStorage)
    path = store.path_of(reader.backend.page_key(second).key)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01
    path.write_bytes(bytes(blob))
    got = reader.prefetch("r1", TOKENS)
    assert (got.hit_tokens, got.completed_tokens) == (len(TOKENS), PAGE)
    assert pages_of(reader, got.host_indices) == written[:1]
    assert reader.host.available_size() == reader.host.size - PAGE
    stats = reader.backend.stats
    assert stats is not None and stats.misses["corrupt"] == 1
    reader.close()
