"""Continuous batching over the hierarchical cache.

Each :meth:`Scheduler.step` admits waiting requests through the cache's request verbs
(``open`` on arrival starts the L3 prefetch; ``ready`` and ``admit`` match, load back and
give L1 pages), then runs one forward: a prefill batch (chunked, at most
``chunked_prefill_size`` new tokens) when any request still has prompt to prefill, else a
decode batch of every running request. Freshly prefilled and finished prefixes are
committed to the cache (its write policy backs them up); a request that cannot get an L1
page for its next token is retracted (``requeue``): its KV stays cached and it waits to be
re-admitted, which then finds its own prefix. The scheduler holds only opaque handles.

Everything here runs on the engine's thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import torch

from hicache.cache import HiCache
from hicache.engine.output import OutputProcessor
from hicache.engine.request import FinishReason, Request
from hicache.engine.runner import ForwardBatch, ModelRunner
from hicache.engine.sampling import make_generator, sample_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batching limits. ``chunked_prefill_size``: new prompt tokens per prefill step."""

    max_running_requests: int = 32
    chunked_prefill_size: int = 512
    disable_radix_cache: bool = False
    layer_wait_timeout_s: float = 60.0
    """Longest a forward waits for one layer of a prefix being loaded back from L2."""

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "chunked_prefill_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid; must be an int >= 1")


class Scheduler:
    """Owns the waiting queue and the running batch; see the module docstring."""

    def __init__(
        self,
        cache: HiCache,
        runner: ModelRunner,
        output: OutputProcessor,
        config: SchedulerConfig,
    ) -> None:
        self.cache = cache
        self.runner = runner
        self.output = output
        self.config = config
        self.page_size = cache.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ------------------------------------------------------------------ queue

    def add(self, req: Request) -> None:
        """Queue ``req``; its L3 prefetch starts now. A request that cannot even be set
        up (say, a seed its generator refuses) fails alone."""
        try:
            req.generator = make_generator(req.params, self.runner.device)
            req.cache = self.cache.open(
                req.prompt_ids,
                tenant=req.cache_salt,
                priority=req.priority,
                cacheable=not self.config.disable_radix_cache,
            )
        except Exception as exc:
            log.exception("request %s could not be queued", req.rid)
            req.error = f"{type(exc).__name__}: {exc}"
            self._finish(req, FinishReason.ABORT)
            return
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        for req in [*self.waiting, *self.running]:
            if req.rid == rid:
                req.aborted = True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ------------------------------------------------------------------ step

    def step(self) -> bool:
        """Admit, run one forward, emit outputs. Returns False when no forward ran (nothing
        to do, or only L3 prefetches to wait for)."""
        self.cache.poll()
        self._reap_aborted()
        self._admit()
        if not self.running:
            return False
        prefill = [r for r in self.running if r.seq_len - r.kv_len > 1]
        if prefill:
            self._run(self._prefill_chunks(prefill))
        else:
            self._run(self._decode_batch())
        return True

    def _reap_aborted(self) -> None:
        for req in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(req)
            self._finish(req, FinishReason.ABORT)
        for req in [r for r in self.running if r.aborted]:
            self._finish(req, FinishReason.ABORT)

    def _admit(self) -> None:
        for req in list(self.waiting):
            if len(self.running) >= self.config.max_running_requests:
                return
            handle = req.cache
            assert handle is not None
            if not self.cache.ready(handle):
                continue  # its L3 prefetch is still running: let others go first
            ids = req.all_ids
            if not self.cache.admit(handle, ids):
                if not self.running:  # nothing will ever free memory for it
                    self.waiting.remove(req)
                    need = math.ceil(len(ids) / self.page_size)
                    req.error = (
                        f"the request needs {need} KV pages but the device cache has"
                        f" {self.cache.device_pages}"
                    )
                    self._finish(req, FinishReason.ABORT)
                    continue
                return
            self.waiting.remove(req)
            req.kv_len = handle.prefix_tokens
            self.running.append(req)

    def _prefill_chunks(self, reqs: list[Request]) -> list[tuple[Request, int]]:
        budget = self.config.chunked_prefill_size
        batch: list[tuple[Request, int]] = []
        for req in reqs:
            if budget <= 0:
                break
            n = min(req.seq_len - req.kv_len, budget)
            batch.append((req, n))
            budget -= n
        return batch

    def _decode_batch(self) -> list[tuple[Request, int]]:
        for req in list(self.running):
            if req in self.running:  # not retracted by an earlier one
                self._ensure_pages(req, req.kv_len + 1)
        return [(req, 1) for req in self.running]

    def _ensure_pages(self, req: Request, tokens: int) -> bool:
        """Give ``req`` pages for ``tokens`` positions, retracting others if L1 is full."""
        assert req.cache is not None
        while not self.cache.grow(req.cache, tokens):
            victims = [r for r in self.running if r is not req]
            if not victims:
                req.error = "the device cache cannot hold this request"
                self._finish(req, FinishReason.ABORT)
                return False
            self._retract(max(victims, key=lambda r: r.arrival))
        return True

    # ------------------------------------------------------------------ forward

    def _run(self, batch: list[tuple[Request, int]]) -> None:
        if not batch:
            return
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        loading = []
        for req, n in batch:
            assert req.cache is not None
            ids += req.all_ids[req.kv_len : req.kv_len + n]
            positions += range(req.kv_len, req.kv_len + n)
            slots.append(req.cache.slots(ps, req.kv_len + n))
            if req.cache.loading:
                loading.append(req.cache)
        timeout = self.config.layer_wait_timeout_s

        def layer_wait(layer: int) -> None:
            for handle in loading:
                handle.wait_layer(layer, timeout)  # False: the request fails below

        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            extend_lens=[n for _, n in batch],
            seq_slots=slots,
            layer_wait=layer_wait if loading else None,
        )
        try:
            logits = self.runner.forward(fb)
        except Exception as exc:  # a model error fails this batch, not the engine
            log.exception("forward failed")
            for req, _ in batch:
                req.error = f"forward failed: {type(exc).__name__}: {exc}"
                self._finish(req, FinishReason.ABORT, keep_kv=False)
            return
        self.cache.poll()  # a failed load marks its requests failed
        rows: list[tuple[int, Request, bool]] = []  # (logits row, request, was a prefill)
        for i, (req, n) in enumerate(batch):
            assert req.cache is not None
            if req.cache.failed is not None:
                req.error = req.cache.failed
                self._finish(req, FinishReason.ABORT, keep_kv=False)
                continue
            req.kv_len += n
            if req.kv_len == req.seq_len:
                rows.append((i, req, n > 1 or not req.output_ids))
        if not rows:
            return
        picked = sample_rows(
            logits[[i for i, _, _ in rows]],
            [r.params for _, r, _ in rows],
            [r.generator for _, r, _ in rows],
        )
        tokens = picked.tokens.tolist()
        now = time.perf_counter()
        for j, ((_, req, prefilled), token) in enumerate(zip(rows, tokens, strict=True)):
            if j in picked.errors:  # this request alone fails; its computed KV is fine
                req.error = f"sampling failed: {picked.errors[j]}"
                self._finish(req, FinishReason.ABORT)
                continue
            req.output_ids.append(int(token))
            if req.first_token_at is None:
                req.first_token_at = now
            self.output.on_token(req)
            if req.finished:
                self._finish(req, req.finish_reason)
                continue
            if prefilled:
                assert req.cache is not None
                self.cache.commit(req.cache, req.all_ids[: req.kv_len])
            self._emit(req)

    # ------------------------------------------------------------------ cache hand-off

    def _retract(self, req: Request) -> None:
        """Preempt a running request: keep its KV in the cache, re-queue it first."""
        log.info("retracting %s to free L1 pages", req.rid)
        assert req.cache is not None
        self.running.remove(req)
        self.cache.requeue(req.cache, req.all_ids[: req.kv_len])
        req.kv_len = 0
        req.retracted += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: FinishReason | None, *, keep_kv: bool = True) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req.cache is not None:
            self.cache.release(req.cache, req.all_ids[: req.kv_len], keep=keep_kv)
        self._emit(req)

    def _emit(self, req: Request) -> None:
        if req.on_output is not None:
            try:
                req.on_output(self.output.report(req))
            except Exception:  # a broken consumer must not stop the engine
                log.exception("output callback of %s failed", req.rid)
                req.aborted = True
