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

import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import ServerArgs

from hicache.integrations.sglang import HiCacheL3
from hicache.storage.backends.file import FileStorage
from tests.integrations.sglang.pools import DYNAMIC, PAGE, device_pool, fill, host_of

WAIT_S = 30.0
"""Longest wait for one ack from a storage thread (they answer in milliseconds)."""

TOKENS = list(range(1000, 1000 + 4 * PAGE))  # four pages


@dataclass(frozen=True)
class Prefetched:
    """One prefetch as the scheduler saw it: the rank-agreed L3 hit (tokens), the tokens
    the IO thread completed, and the host indices of the completed part (kept; the rest
    was freed through SGLang's release queue)."""

    hit_tokens: int
    completed_tokens: int
    host_indices: torch.Tensor


class Scheduler:
    """SGLang's controller over one fresh device pool, allocator and host pool, with
    HiCacheL3 attached; its methods are the scheduler-thread side of the storage path."""

    def __init__(self, group: Any, kind: str, layout: str, extra: dict[str, Any], model: str):
        self.device = device_pool(kind)
        self.host = host_of(self.device, layout)
        allocator = PagedTokenToKVPoolAllocator(
            self.device.size, PAGE, self.device.dtype, "cpu", self.device, False
        )
        self.cc = HiCacheController(
            allocator,
            self.host,
            PAGE,
            group,
            threading.Event(),
            io_backend="direct",
            storage_backend="dynamic",
            prefetch_threshold=PAGE,
            model_name=model,
            storage_backend_extra_config={**DYNAMIC, **extra},
        )
        self.backend: HiCacheL3 = self.cc.storage_backend

    def page_hashes(self, tokens: list[int]) -> list[str]:
        """SGLang's chained page hashes from the root (as its radix tree keys pages)."""
        out: list[str] = []
        last: str | None = None
        for i in range(0, len(tokens), PAGE):
            last = self.cc.get_hash_str(tokens[i : i + PAGE], last)
            assert last is not None
            out.append(last)
        return out

    def backup(self, host_indices: torch.Tensor, tokens: list[int]) -> int:
        """``write_storage`` then its ack from the backup thread: tokens stored."""
        op_id = self.cc.write_storage(host_indices, tokens, hash_value=self.page_hashes(tokens))
        done = self.cc.ack_backup_queue.get(timeout=WAIT_S)
        assert done.id == op_id
        return int(done.completed_tokens)

    def prefetch(self, rid: str, tokens: list[int]) -> Prefetched:
        """A prefetch under ``wait_complete``: the hit query's result, the host pages of
        the hit allocated and handed to the IO thread, its acks drained to the final one,
        terminate, and the pages past the completed prefix released and freed."""
        cc = self.cc
        op = cc.prefetch(rid, tokens)
        hit: PrefetchOperation = cc.prefetch_hit_queue.get(timeout=WAIT_S)
        assert hit is op
        if hit.storage_hit_count < cc.prefetch_threshold:
            cc.terminate_prefetch(op)
            return Prefetched(hit.storage_hit_count, 0, torch.empty(0, dtype=torch.int64))
        indices = cc.mem_pool_host.alloc(hit.storage_hit_count)
        assert indices is not None
        op.host_indices = indices
        cc.prefetch_buffer.put(op)
        while True:
            ack = cc.ack_prefetch_queue.get(timeout=WAIT_S)
            assert ack.operation is op
            if ack.completed_tokens is not None:
                assert op.completed_tokens <= ack.completed_tokens
                op.completed_tokens = ack.completed_tokens
            if ack.completed_req:
                break
        completed, _ = cc.terminate_prefetch(op)
        cc.append_host_mem_release(indices[completed:])
        freed = [
            cc.host_mem_release_queue.get_nowait() for _ in range(cc.host_mem_release_queue.qsize())
        ]
        if freed:
            cc.mem_pool_host.free(torch.cat(freed))
        return Prefetched(hit.storage_hit_count, completed, indices[:completed])

    def page(self, host_index: int) -> bytes:
        """The host page starting at token ``host_index``, by SGLang's own accessor."""
        flat = self.host.get_data_page(host_index, flat=True).contiguous()
        return bytes(flat.view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        """SGLang's detach: stop the storage threads, close the backend (idempotent)."""
        self.cc.detach_storage_backend()
        assert self.backend.store is None


Make = Callable[[str, str, dict[str, Any], str], Scheduler]
"""``make(kind, layout, extra, model)``: a new :class:`Scheduler`."""


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Make]:
    """What a one-rank SGLang scheduler process has before it builds its cache (SGLang's
    topology published: world rank 0 of one, on CPU; a real one-rank gloo group, from
    which the controller sizes its rank-agreement groups), then controllers over it;
    any not closed by the test are detached at the end."""
    reset_context()
    publish(
        ServerArgs(model_path="dummy", device="cpu"),
        role="scheduler",
        ranks=SpawnRanks(world_rank=0),
    )
    owns = not dist.is_initialized()
    if owns:
        init = f"file://{tmp_path / 'gloo-store'}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    made: list[Scheduler] = []

    def new(kind: str, layout: str, extra: dict[str, Any], model: str) -> Scheduler:
        made.append(Scheduler(dist.group.WORLD, kind, layout, extra, model))
        return made[-1]

    try:
        yield new
    finally:
        for sched in made:
            sched.close()
        if owns:
            dist.destroy_process_group()
        reset_context()


def _pages(s: Scheduler, indices: torch.Tensor) -> list[bytes]:
    return [s.page(int(indices[i])) for i in range(0, len(indices), PAGE)]


def _write_four_pages(
    make: Make, kind: str, layout: str, extra: dict[str, Any], model: str
) -> list[bytes]:
    """A controller backs four host pages up to L3 and detaches; their bytes."""
    writer = make(kind, layout, extra, model)
    host_indices = writer.host.alloc(len(TOKENS))
    fill(writer.host, seed=21)  # what the L1 -> L2 copy would have left there
    assert writer.backup(host_indices, TOKENS) == len(TOKENS)
    stats = writer.backend.stats
    assert stats is not None and stats.set_written == 4
    pages = _pages(writer, host_indices)
    writer.close()
    return pages


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
    written = _write_four_pages(make, kind, layout, extra, model)

    reader = make(kind, layout, extra, model)
    _page_path(reader, interface_v1)
    longer = TOKENS + list(range(5000, 5000 + 2 * PAGE))  # two more pages, never stored
    got = reader.prefetch("r1", longer)
    assert (got.hit_tokens, got.completed_tokens) == (len(TOKENS), len(TOKENS))
    assert _pages(reader, got.host_indices) == written
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
    written = _write_four_pages(make, "mha", "page_first", extra, "ctl-corrupt")
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
    assert _pages(reader, got.host_indices) == written[:1]
    assert reader.host.available_size() == reader.host.size - PAGE
    stats = reader.backend.stats
    assert stats is not None and stats.misses["corrupt"] == 1
    reader.close()
