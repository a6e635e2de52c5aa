"""``HiCacheTier``: hicache's L3 as a secondary tier of vLLM's offloading connector.

vLLM (0.33) loads it, unmodified, from the offloading connector's extra config
(``"secondary_tiers": [{"type": "HiCacheTier", "module_path": "hicache.integrations.vllm",
"hicache_backend": "file", ...}]``); ``SecondaryTierFactory`` builds it in the scheduler
process. Construction validates the keys (:class:`~.settings.VllmTierSettings`) and the
dtype (:func:`~.namespace.vllm_namespace`), builds the backend unstarted and starts the IO
thread, which starts the backend (:mod:`~.transfers`). vLLM's ``TieringOffloadingManager``
calls ``lookup``, ``submit_store``, ``submit_load``, ``get_finished_jobs`` and
``drain_jobs`` under its lock. Invariants: no call blocks (jobs are queued to the IO thread;
``drain_jobs`` waits, each backend call bounded by a deadline); a backend that is down
answers every key absent; a load whose records did not all pass the checks reports
``success=False`` with the good keys as ``successful_keys`` and the bad ones become misses;
a store never fails a request. Records are hicache records, so engines share chunks exactly
when their namespaces match. The flow in full: ``docs/integrations.md``, "vLLM".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hicache.integrations.vllm.namespace import ChunkLayout, page_keys_of, vllm_namespace
from hicache.integrations.vllm.rows import flat_rows
from hicache.integrations.vllm.settings import VllmTierSettings
from hicache.integrations.vllm.transfers import Direction, TierTransfers, Transfer
from hicache.keys import Namespace
from hicache.storage.base import HiCacheStorage

__all__ = ["HiCacheTier"]

log = logging.getLogger("hicache.integrations.vllm")


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup front end over the backend's ``batch_contains``."""

    def __init__(self, tier_type: str, transfers: TierTransfers, namespace: Namespace) -> None:
        super().__init__(tier_type=tier_type)
        self._transfers = transfers
        self._namespace = namespace

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        # On vLLM's lookup thread, which may wait: the first batch waits for the IO
        # thread's first attempt to start the backend (bounded by its connect deadline).
        if not self._transfers.ready(self._transfers.storage.options.connect_timeout_s):
            return [False] * len(keys)
        storage = self._transfers.storage
        return storage.batch_contains(page_keys_of(self._namespace, keys))


class HiCacheTier(SecondaryTierManager):
    """A vLLM secondary tier over a hicache L3 backend (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **params: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self.settings = VllmTierSettings.from_params(params)
        self.chunk_layout = ChunkLayout.from_config(offloading_spec.config, self.block_size_bytes)
        self.namespace = vllm_namespace(
            self.chunk_layout,
            weights_fingerprint=self.settings.weights_fingerprint,
            model=self.settings.model,
        )
        if self.settings.locality is not None:
            self.locality = Locality(self.settings.locality)
        storage = self.settings.storage.create(self.namespace)
        # the last step that can fail: a view left exported would keep vLLM's region mapped
        flat, _, row_bytes = flat_rows(primary_kv_view)
        self._flat = flat
        self._transfers = TierTransfers(storage, flat, row_bytes)
        self._transfers.start()
        self._lookups = _Lookups(tier_type, self._transfers, self.namespace)
        self._shut = False

    @property
    def storage(self) -> HiCacheStorage:
        """The hicache backend (its :meth:`~HiCacheStorage.stats` count every record)."""
        return self._transfers.storage

    # -- vLLM's tier interface ---------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, Direction.STORE)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, Direction.LOAD)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        for f in self._transfers.take():
            if f.direction is Direction.LOAD and f.failed:
                self._lookups.mark_miss([OffloadKey(k) for k in f.failed])
            partial = not f.success and f.direction is Direction.LOAD and f.done
            results.append(
                JobResult(
                    job_id=f.job_id,
                    success=f.success,
                    successful_keys=tuple(OffloadKey(k) for k in f.done) if partial else None,
                    transfer_time=f.seconds,
                    transfer_bytes=f.nbytes,
                )
            )
        return results

    def has_pending_work(self) -> bool:
        """True while a job runs or its result waits for :meth:`get_finished_jobs`."""
        return self._transfers.busy

    def drain_jobs(self) -> None:
        self._transfers.wait_idle()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def shutdown(self) -> None:
        """Stop the lookup and IO threads, close the backend and release this tier's view
        of the primary buffer (vLLM unmaps it next, which needs every view released)."""
        if self._shut:
            return
        self._shut = True
        self._lookups.shutdown()
        self._transfers.close()
        try:
            self._flat.release()
        except BufferError:  # a row view still held somewhere: vLLM then keeps the mapping
            log.warning("vLLM tier %s: a view of the primary buffer is still held", self.tier_type)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("hicache_backend",)

    def config_info(self) -> dict[str, str | int | float | bool]:
        return {"hicache_backend": self.settings.storage.backend}

    # -- helpers -----------------------------------------------------------------------
    def _submit(self, job: TransferJob, direction: Direction) -> None:
        keys = tuple(bytes(k) for k in job.keys)
        self._transfers.submit(
            Transfer(
                job_id=job.job_id,
                direction=direction,
                keys=keys,
                page_keys=tuple(page_keys_of(self.namespace, keys)),
                chunk_ids=tuple(int(c) for c in job.chunk_ids),
            )
        )
