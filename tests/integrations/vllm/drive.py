"""Drive vLLM's own ``TieringOffloadingSpec`` / ``TieringOffloadingManager`` as its
scheduler-side connector does, with ``HiCacheTier`` as the secondary tier.

:func:`make_spec` builds a real ``OffloadingConfig`` (tiny: a few rows of
``ROW_BYTES``, one KV group); :class:`Engine` wraps the manager it creates (vLLM's CPU
primary tier over a ``/dev/shm`` region, the tier through ``SecondaryTierFactory`` with
``module_path``) and plays the scheduler: a request's chunks are prepared, their rows
filled (what vLLM's GPU->CPU worker does, here through the primary memoryview) and
completed, which cascades them to the tier; lookups are retried step by step, as the
connector does, until they settle.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache.integrations.vllm import HiCacheTier

ROW_BYTES = 4096
"""vLLM aligns rows to 4 KiB; one worker block of 1 KiB, 4 blocks per chunk fills one."""
TIER = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm"}


def make_config(
    tier: Mapping[str, Any],
    *,
    rows: int = 8,
    model: str = "tiny/model",
    dtype: str = "bfloat16",
    tp_size: int = 1,
    agnostic: bool = False,
) -> OffloadingConfig:
    """A one-group config whose primary tier has ``rows`` rows of :data:`ROW_BYTES`."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=4, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=ROW_BYTES // (4 * tp_size),
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": rows * ROW_BYTES, "secondary_tiers": [dict(tier)]},
        engine_id=f"hicache-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=4, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
    )


def key(i: int, group: int = 0) -> OffloadKey:
    """The offload key of a made-up 32-byte block hash ``i``."""
    return make_offload_key(i.to_bytes(32, "big"), group)


def pattern(i: int, n: int = ROW_BYTES) -> bytes:
    """Distinct bytes for chunk ``i``."""
    return bytes((i * 31 + j * 7 + (j >> 8)) % 256 for j in range(n))


class Engine:
    """One vLLM scheduler's offloading manager with ``HiCacheTier`` (tier config ``tier``)."""

    def __init__(self, tier: Mapping[str, Any], **config: Any) -> None:
        self.spec = TieringOffloadingSpec(make_config({**TIER, **tier}, **config))
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        (tier_obj,) = manager.secondary_tiers
        assert isinstance(tier_obj, HiCacheTier)
        self.tier = tier_obj
        self.view = manager.primary_tier.get_kv_memoryview().cast("B")
        self._n = 0

    def close(self) -> None:
        self.view.release()  # vLLM unmaps the region only once no view is exported
        self.manager.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self) -> ReqContext:
        self._n += 1
        ctx = ReqContext(req_id=f"req-{self._n}")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def step(self) -> None:
        """The end of one scheduler step (vLLM flushes lookups and promotions here)."""
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def row(self, chunk: int) -> bytes:
        return bytes(self.view[chunk * ROW_BYTES : (chunk + 1) * ROW_BYTES])

    def store(self, ctx: ReqContext, keys: Sequence[OffloadKey], data: Sequence[bytes]) -> None:
        """GPU -> primary for ``keys`` (rows filled with ``data``), which vLLM cascades to
        the tier at ``complete_store``."""
        with self.manager.lock:
            out = self.manager.prepare_store(list(keys), ctx)
            assert out is not None
            assert list(out.keys_to_store) == list(keys), "chunks already in the primary tier"
            for chunk, payload in zip(out.store_spec.chunk_ids, data, strict=True):
                self.view[int(chunk) * ROW_BYTES : (int(chunk) + 1) * ROW_BYTES] = payload
            self.manager.complete_store(list(keys), ctx)

    def wait_quiet(self, timeout_s: float = 20.0) -> None:
        """Step until the tier has no job in flight and vLLM took every result."""
        end = time.monotonic() + timeout_s
        while True:
            self.tier.drain_jobs()
            self.step()
            with self.manager.lock:
                pending = self.manager.has_pending_work()
            if not pending:
                return
            assert time.monotonic() < end, "the tier did not settle"

    def lookup(
        self, ctx: ReqContext, keys: Sequence[OffloadKey], timeout_s: float = 20.0
    ) -> list[LookupResult]:
        """vLLM's lookups of ``keys``, asked each step (as the connector asks each step
        for a waiting request) until each is HIT or MISS. Promotions of one step go to the
        tier as one job."""
        end = time.monotonic() + timeout_s
        final: dict[int, LookupResult] = {}
        while True:
            with self.manager.lock:
                for i, k in enumerate(keys):
                    if i not in final:
                        res = self.manager.lookup(k, ctx)
                        if res in (LookupResult.HIT, LookupResult.MISS):
                            final[i] = res
            if len(final) == len(keys):
                return [final[i] for i in range(len(keys))]
            assert time.monotonic() < end, f"lookups did not settle: {final}"
            self.step()
            self.tier.drain_jobs()
            time.sleep(0.01)

    def load(self, ctx: ReqContext, keys: Sequence[OffloadKey]) -> list[bytes]:
        """Primary -> GPU for ``keys`` (all HIT): the bytes of their rows."""
        with self.manager.lock:
            spec = self.manager.prepare_load(list(keys), ctx)
        out = [self.row(int(c)) for c in spec.chunk_ids]
        with self.manager.lock:
            self.manager.complete_load(list(keys), ctx)
        return out
