"""Continuous batching over the hierarchical cache.

Each :meth:`Scheduler.step` admits waiting requests (local match, load back from L2, L1
pages for the rest of the prompt), then runs one forward: a prefill batch (chunked, at most
``chunked_prefill_size`` new tokens) when any request still has prompt to prefill, else a
decode batch of every running request. Finished and freshly prefilled prefixes go into the
tree (the write policy backs them up); a request that cannot get an L1 page for its next
token is retracted: its KV goes into the tree and it waits to be re-admitted, which then
finds its own prefix cached.

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
from hicache.engine.request import CachedTokens, FinishReason, Request
from hicache.engine.runner import ForwardBatch, ModelRunner
from hicache.engine.sampling import make_generator, sample
from hicache.tree.node import encode_tokens, page_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batching limits. ``chunked_prefill_size``: new prompt tokens per prefill step."""

    max_running_requests: int = 32
    chunked_prefill_size: int = 512
    disable_radix_cache: bool = False

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
        req.generator = make_generator(req.params, self.runner.device)
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        for req in [*self.waiting, *self.running]:
            if req.rid == rid:
                req.aborted = True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def held_pages(self) -> list[int]:
        """L1 pages that running requests own (for the cache's leak check)."""
        return [p for r in self.running for p in r.pages[r.prefix_pages :]]

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
            if req.prefetch is not None and self.cache.l3 is not None:
                self.cache.l3.finish(req.prefetch)
                req.prefetch = None
            self._finish(req, FinishReason.ABORT)
        for req in [r for r in self.running if r.aborted]:
            self._finish(req, FinishReason.ABORT)

    def _admit(self) -> None:
        ps = self.page_size
        for req in list(self.waiting):
            if len(self.running) >= self.config.max_running_requests:
                return
            if not self._prefetched(req):
                continue  # its L3 prefetch is still running: let others go first
            ids = req.all_ids
            if self.config.disable_radix_cache:
                match = self.cache.match_prefix([])
            else:
                # keep >= 1 token to compute; a salted request sees only its tenant's spans
                match = self.cache.match_prefix(ids[:-1], req.cache_salt)
            lb = self.cache.load_back(match)
            self.cache.lock(lb.last_node)
            new = self.cache.alloc_device(math.ceil(len(ids) / ps) - len(lb.device_pages))
            if new is None:
                self.cache.unlock(lb.last_node)
                if not self.running:  # nothing will ever free memory for it
                    self.waiting.remove(req)
                    req.error = (
                        f"the request needs {math.ceil(len(ids) / ps)} KV pages but the device"
                        f" cache has {self.cache.device_pool.num_pages}"
                    )
                    self._finish(req, FinishReason.ABORT)
                    continue
                return
            self.waiting.remove(req)
            req.pages = lb.device_pages + new
            req.prefix_pages = len(lb.device_pages)
            req.prefix_node = lb.last_node
            req.kv_len = lb.device_tokens
            req.progress = lb.progress if lb.loaded_tokens else None
            if not req.retracted:  # count each prompt once
                self.cache.count_request(len(req.prompt_ids), match, lb, req.storage_tokens)
                storage = min(req.storage_tokens, lb.loaded_tokens)
                req.cached = CachedTokens(
                    device=match.device_tokens, host=lb.loaded_tokens - storage, storage=storage
                )
            self.running.append(req)

    def _prefetched(self, req: Request) -> bool:
        """Start or check ``req``'s L3 prefetch; True once it may be admitted."""
        l3 = self.cache.l3
        if req.prefetch_done or l3 is None or self.config.disable_radix_cache:
            return True
        if req.prefetch is None:
            key = encode_tokens(req.all_ids[:-1])
            match = self.cache.match_prefix(key, req.cache_salt)
            req.prefetch = l3.start_prefetch(key, match, req.cache_salt)
            if req.prefetch is None:
                req.prefetch_done = True
                return True
        if not l3.ready(req.prefetch):
            return False
        req.storage_tokens = l3.finish(req.prefetch)
        req.prefetch = None
        req.prefetch_done = True
        return True

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
        need = math.ceil(tokens / self.page_size) - len(req.pages)
        while need > 0:
            new = self.cache.alloc_device(need)
            if new is not None:
                req.pages += new
                return True
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
        progresses = []
        for req, n in batch:
            ids += req.all_ids[req.kv_len : req.kv_len + n]
            positions += range(req.kv_len, req.kv_len + n)
            slots.append(req.slots(ps, req.kv_len + n))
            if req.progress is not None:
                progresses.append(req.progress)

        def layer_wait(layer: int) -> None:
            for p in progresses:
                p.wait(layer)

        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            extend_lens=[n for _, n in batch],
            seq_slots=slots,
            layer_wait=layer_wait if progresses else None,
        )
        try:
            logits = self.runner.forward(fb)
        except Exception as exc:  # a model error fails this batch, not the engine
            log.exception("forward failed")
            for req, _ in batch:
                req.error = f"forward failed: {type(exc).__name__}: {exc}"
                req.kv_len = req.prefix_pages * ps  # own pages hold garbage: drop them
                self._finish(req, FinishReason.ABORT, keep_kv=False)
            return
        rows: list[tuple[int, Request, bool]] = []  # (logits row, request, was a prefill)
        for i, (req, n) in enumerate(batch):
            req.kv_len += n
            req.progress = None
            if req.kv_len == req.seq_len:
                rows.append((i, req, n > 1 or not req.output_ids))
        if not rows:
            return
        tokens = sample(
            logits[[i for i, _, _ in rows]],
            [r.params for _, r, _ in rows],
            [r.generator for _, r, _ in rows],
        ).tolist()
        now = time.perf_counter()
        for (_, req, prefilled), token in zip(rows, tokens, strict=True):
            req.output_ids.append(int(token))
            if req.first_token_at is None:
                req.first_token_at = now
            self.output.on_token(req)
            if req.finished:
                self._finish(req, req.finish_reason)
                continue
            if prefilled and not self.config.disable_radix_cache:
                self._cache_prefix(req)
            self._emit(req)

    # ------------------------------------------------------------------ cache hand-off

    def _cache_prefix(self, req: Request) -> None:
        """Insert the computed whole pages of a running request so others can share them."""
        ps = self.page_size
        full = req.kv_len // ps
        if full <= req.prefix_pages:
            return
        tokens = req.all_ids[: full * ps]
        self.cache.insert(tokens, req.pages[:full], tenant=req.cache_salt)
        match = self.cache.match_prefix(tokens, req.cache_salt)
        assert match.device_tokens == full * ps, "inserted prefix not resident"
        self.cache.lock(match.last_device_node)
        assert req.prefix_node is not None
        self.cache.unlock(req.prefix_node)
        req.prefix_node = match.last_device_node
        req.pages = match.device_pages + req.pages[full:]
        req.prefix_pages = full

    def _release(self, req: Request, *, keep_kv: bool) -> None:
        """Hand ``req``'s pages back: computed whole pages to the tree, the rest freed."""
        ps = self.page_size
        own_from = req.prefix_pages
        if keep_kv and not self.config.disable_radix_cache:
            full = req.kv_len // ps
            if full > req.prefix_pages:
                self.cache.insert(req.all_ids[: full * ps], req.pages[:full], tenant=req.cache_salt)
                own_from = full
        if len(req.pages) > own_from:
            self.cache.free_device(req.pages[own_from:])
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.pages = page_ids()
        req.prefix_pages = 0
        req.prefix_node = None
        req.kv_len = 0
        req.progress = None

    def _retract(self, req: Request) -> None:
        """Preempt a running request: keep its KV in the tree, re-queue it first."""
        log.info("retracting %s to free L1 pages", req.rid)
        self.running.remove(req)
        if req.progress is not None:
            req.progress.wait_all()
        self._release(req, keep_kv=True)
        req.retracted += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: FinishReason | None, *, keep_kv: bool = True) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
            if req.progress is not None:
                req.progress.wait_all()
            self._release(req, keep_kv=keep_kv)
        self._emit(req)

    def _emit(self, req: Request) -> None:
        if req.on_output is not None:
            try:
                req.on_output(self.output.report(req))
            except Exception:  # a broken consumer must not stop the engine
                log.exception("output callback of %s failed", req.rid)
                req.aborted = True
