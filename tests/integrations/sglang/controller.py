"""SGLang's own ``HiCacheController`` with HiCacheL3 attached, driven as a one-rank
scheduler drives it (see ``test_controller.py`` for what is and is not driven): the
:class:`Scheduler` helper and the ``make`` fixture (the conftest exposes it).

Import only after :func:`hicache.integrations.pinned.enable` (the conftest does).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from tests.integrations.sglang.pools import DYNAMIC, HEADS, PAGE, device_pool, fill, host_of

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

    def __init__(
        self,
        group: Any,
        kind: str,
        layout: str,
        extra: dict[str, Any],
        model: str,
        heads: int = HEADS,
    ):
        self.device = device_pool(kind, heads=heads)
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
        attached = self.cc.storage_backend  # SGLang's fault injector when its env asks
        self.backend: HiCacheL3 = getattr(attached, "_backend", attached)
        assert isinstance(self.backend, HiCacheL3)

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
    with schedulers(tmp_path) as made:

        def new(kind: str, layout: str, extra: dict[str, Any], model: str) -> Scheduler:
            made.append(Scheduler(dist.group.WORLD, kind, layout, extra, model))
            return made[-1]

        yield new


@contextmanager
def schedulers(tmp_path: Path) -> Iterator[list[Scheduler]]:
    """A one-rank gloo group (unless one is up) and a list for the :class:`Scheduler`
    objects made in it: each is closed at the end, then the group destroyed (if made
    here) and SGLang's published context reset."""
    owns = not dist.is_initialized()
    if owns:
        init = f"file://{tmp_path / 'gloo-store'}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    made: list[Scheduler] = []
    try:
        yield made
    finally:
        for sched in made:
            sched.close()
        if owns:
            dist.destroy_process_group()
        reset_context()


def pages_of(s: Scheduler, indices: torch.Tensor) -> list[bytes]:
    return [s.page(int(indices[i])) for i in range(0, len(indices), PAGE)]


def write_four_pages(
    make: Make, kind: str, layout: str, extra: dict[str, Any], model: str
) -> list[bytes]:
    """A controller backs four host pages up to L3 and detaches; their bytes."""
    writer = make(kind, layout, extra, model)
    host_indices = writer.host.alloc(len(TOKENS))
    fill(writer.host, seed=21)  # what the L1 -> L2 copy would have left there
    assert writer.backup(host_indices, TOKENS) == len(TOKENS)
    stats = writer.backend.stats
    assert stats is not None and stats.set_written == 4
    pages = pages_of(writer, host_indices)
    writer.close()
    return pages
