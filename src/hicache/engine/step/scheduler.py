"""Continuous batching over the hierarchical cache: :class:`Scheduler`.

Each :meth:`Scheduler.step` admits waiting requests through the cache's request verbs
(``open``, ``ready``, ``admit``), then runs one mixed forward: every decoding request's
next token plus prefill chunks of the others, ``chunked_prefill_size`` tokens in all.
Every prefill chunk and finished prefix is committed; a request short of an L1 page is
retracted (``requeue``: its KV stays cached); one whose L2 load failed is requeued with
nothing of that forward kept (:meth:`Scheduler._fall_back`) and recomputes; only a failure
of that recompute fails it. Admission order (:meth:`Scheduler.admission_order`):
``priority``, then the per-group cap (work-conserving, :mod:`hicache.engine.step.slots`),
then ``fcfs`` / ``lpm``. The scheduler holds only opaque handles and names no cache
component: the runner's extras reach the cache untouched. Beside it:
:class:`~hicache.engine.step.batch_sampling.BatchSampler` (tokens) and
:class:`~hicache.engine.step.ends.RequestEnds` (ends, pending outputs). Runs on the
engine's thread. Flows: docs/architecture.md, "The scheduler".
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque

import torch

from hicache.cache import CachedTokens, HiCache, ScoreAsk
from hicache.cache.report import cache_stats
from hicache.engine.logits import TokenLogprob
from hicache.engine.ranks import StepChannel
from hicache.engine.request import FinishReason, Request
from hicache.engine.role import Role
from hicache.engine.sampling import make_generator, set_generator_state
from hicache.engine.schedule_config import LPM_MAX_WAITING, SchedulePolicy, SchedulerConfig
from hicache.engine.step.batch import Chunk, forward_batch
from hicache.engine.step.batch_sampling import BatchSampler, PromptRow
from hicache.engine.step.ends import RequestEnds
from hicache.engine.step.output import OutputProcessor
from hicache.engine.step.prefill_timer import PrefillTimer, prefill_tokens
from hicache.engine.step.slots import admission_order, lent_slot, used_slots
from hicache.engine.step_inputs import PagesArrived, RoomEnded, RoomFailed
from hicache.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting queue and the running batch; see the module docstring."""

    def __init__(
        self,
        cache: HiCache,
        runner: ModelRunner,
        output: OutputProcessor,
        config: SchedulerConfig,
        *,
        role: Role | None = None,
        tokens: StepChannel | None = None,
    ) -> None:
        """``role``: the instance's prefill/decode role (None: a plain instance's).
        ``tokens``: under tensor parallelism, this rank's channel: every sampled token
        (and which rows failed) is rank 0's (:class:`BatchSampler`); a follower's requests
        report nothing (:class:`RequestEnds`)."""
        self.cache = cache
        self.runner = runner
        self.output = output
        self.config = config
        self.page_size = cache.context.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # a model that carries state resumes a cached prefix only from a state the cache
        # hands back
        self.resumable_prefix = runner.resumable_prefix or cache.stores.resumes
        overlap = config.overlap_outputs
        self.overlap = torch.device(runner.device).type == "cuda" if overlap is None else overlap
        self.failed_forwards = 0
        """Forwards that raised in a row (0 once one succeeds): the engine's health."""
        self.forward_error: str | None = None
        """Why the last forward that raised did."""
        self.forwards = 0
        """Steps that ran a forward so far: a clock in steps (a request added between two
        steps and admitted at the next one has its first token when this has gone up by 1)."""
        self.reclaimed = 0
        """Sequences retracted so far to give a lent slot back (:meth:`_reclaim`)."""
        self.prefill_timer = PrefillTimer(torch.device(runner.device))
        """How fast this rank's forwards prefill (:meth:`PrefillTimer.rate`); the cache
        weighs L3 hits against it."""
        cache.measure_prefill(self.prefill_timer.rate)
        self.tokens = tokens
        self.sampler = BatchSampler(output.eos_token_ids, tokens)
        reports = tokens is None or tokens.leader
        self.ends = RequestEnds(
            cache,
            runner,
            output,
            self.waiting,
            self.running,
            role=Role() if role is None else role,
            reports=reports,
        )

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
                # a model that carries state needs the cache to hand one back
                cacheable=not self.config.disable_radix_cache and self.resumable_prefix,
                # prompt logprobs need the logits before every scored position computed
                max_prefix=req.params.max_prefix if self.role.computes_prompt(req) else None,
                max_load=req.params.max_load_tokens,
                # scoring entries, kept with the pages, may serve the prefix instead
                scores=score_ask(req) if self.role.computes_prompt(req) else None,
            )
        except Exception as exc:
            log.exception("request %s could not be queued", req.rid)
            self.ends.finish(req, FinishReason.ABORT, error=f"{type(exc).__name__}: {exc}")
            return
        self.waiting.append(req)
        self.role.queued(req)

    def abort(self, rid: str) -> None:
        for req in [*self.waiting, *self.running, *self.ends.parked.values()]:
            if req.rid == rid:
                req.aborted = True

    @property
    def role(self) -> Role:
        """The instance's prefill/decode role (:mod:`hicache.engine.role`)."""
        return self.ends.role

    @property
    def idle(self) -> bool:
        """Nothing queued, running, parked or waiting to be reported."""
        ends = self.ends
        return not self.waiting and not self.running and not ends.parked and not ends.pending

    @property
    def polling(self) -> bool:
        """Whether the next step may have work without any input: requests waiting for
        admission (an L3 prefetch to land) or parked ones the role still has to act on
        (a prefix load to finish before their pages are registered)."""
        return bool(self.waiting) or self.role.polling

    @property
    def occupied(self) -> int:
        """Running slots in use: the running requests and the parked ones."""
        return len(self.running) + len(self.ends.parked)

    @property
    def in_flight(self) -> list[Request]:
        """Every request not yet given its final report (:attr:`RequestEnds.in_flight`)."""
        return self.ends.in_flight

    # ------------------------------------------------------------------ step

    def step(self) -> bool:
        """Admit, run one forward, emit outputs (the previous step's while this one's
        forward runs, with ``overlap``; else this step's at its end). Returns False when no
        forward ran (nothing to do, or only L3 prefetches to wait for); pending outputs
        are emitted then too."""
        self._reap_aborted()
        for req in [r for r in self.running if r.cache is not None and r.cache.failed is not None]:
            self._fall_back(req)  # a load its prefix depends on failed: recompute it
        self._admit()
        for req in self.role.register(list(self.ends.parked.values())):
            self._unpark(req)  # its prefix load failed before anything was promised
        if not self.running:
            self.ends.flush()
            return False
        self.forwards += 1
        self._run(self._mixed_batch())
        if not self.overlap:
            self.ends.flush()
        return True

    def _reap_aborted(self) -> None:
        for req in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(req)
            self.ends.finish(req, FinishReason.ABORT)
        for req in [r for r in self.running if r.aborted]:
            self.ends.finish(req, FinishReason.ABORT)
        for req in [r for r in self.ends.parked.values() if r.aborted]:
            # the other side is told; the request ends once its room has (RoomEnded)
            if self.role.abort(req, req.error or "aborted"):
                self.ends.finish(req, FinishReason.ABORT, commit_kv=False)

    def drop_parked(self, why: str) -> None:
        """End every parked request now, without waiting for the other side (the engine
        stops): the other side is told, best effort."""
        for req in list(self.ends.parked.values()):
            self.role.abort(req, why)
            self.ends.finish(req, FinishReason.ABORT, commit_kv=False, error=why)

    # ------------------------------------------------------------------ PD inputs

    def pages_arrived(self, item: PagesArrived) -> None:
        """Parked ``item.rid``'s prompt KV has landed in its pages, and the prefill
        instance's first token with it: take what the prefill computed besides
        (:func:`_take_prefill_state`), commit the prompt, take the token (reported, and
        checked: it may end the request), and run it from here like any request whose
        prompt is computed."""
        req = self.ends.parked.get(item.rid)
        if req is None:
            return  # ended meanwhile
        if req.aborted:
            self.ends.finish(req, FinishReason.ABORT, commit_kv=False)
            return
        missing = _take_prefill_state(req, item)
        if missing is not None:  # its answer would not be a plain instance's
            self.ends.finish(req, FinishReason.ABORT, commit_kv=False, error=missing)
            return
        assert req.cache is not None
        self.ends.unpark(req)
        self.running.append(req)
        req.kv_len = len(req.prompt_ids)
        self.cache.commit(req.cache, req.prompt_ids)
        resume = self.role.arrived(req)  # a recurrent model's state after the prompt
        if resume is not None:
            self.runner.resume(req.rid, resume)
        req.remote_cached = CachedTokens(*item.cached)
        req.output_ids.append(item.first_token)
        req.first_token_at = time.perf_counter()
        self.output.check_token(req)
        self.ends.took_token(req)

    def room_ended(self, item: RoomEnded) -> None:
        """Parked ``item.rid``'s room has ended: a prefill's request is released and
        reported (with ``item.error`` when its pages could not be sent); a decode's ends
        with that error, its pages freed (nothing it was promised can land any more)."""
        if item.rid in self.ends.fenced:  # a decode's, failed earlier: its pages are free now
            self.ends.unfence(item.rid)
            return
        req = self.ends.parked.get(item.rid)
        if req is None:
            return
        if req.finished:  # a prefill's, parked after its last token
            self.ends.end_parked(item.rid, item.error)
            return
        error = item.error or "the room ended without pages"
        self.ends.finish(req, FinishReason.ABORT, commit_kv=False, error=req.error or error)

    def room_failed(self, item: RoomFailed) -> None:
        """Parked ``item.rid``'s room was given up while the prefill instance may still
        write its pages: it ends now with ``item.error``, its pages fenced until its
        :class:`RoomEnded` (:meth:`RequestEnds.fence <hicache.engine.step.ends.RequestEnds.fence>`)."""
        req = self.ends.parked.get(item.rid)
        if req is not None:
            self.ends.fence(req, item.error)

    def _unpark(self, req: Request) -> None:
        """Parked ``req`` (nothing promised yet) goes back to the front of the queue; its
        cache handle keeps nothing (its failed load is not trusted)."""
        assert req.cache is not None
        self.ends.unpark(req)
        self.cache.requeue(req.cache, [])
        req.kv_len = 0
        self.waiting.appendleft(req)

    def admission_order(self) -> list[Request]:
        """The waiting requests in the order :meth:`step` tries to admit them
        (:func:`~hicache.engine.step.slots.admission_order`: claimants, then borrowers; priority;
        fewest held; under ``lpm`` the longest cached prefix, up to
        :data:`LPM_MAX_WAITING` waiting; queue order, a retracted request at the front).
        Computed at the start of the step."""
        lpm = (
            self.config.schedule_policy == SchedulePolicy.LPM
            and len(self.waiting) <= LPM_MAX_WAITING
        )

        def cached(req: Request) -> int:
            handle = req.cache
            return 0 if handle is None else self.cache.reusable_prefix(handle, req.all_ids)

        return admission_order(
            self.waiting,
            self.running,
            cap=self.config.group_cap,
            lend=self.config.lend_idle_slots,
            full=len(self.running) >= self.config.max_running_requests,
            cached=cached if lpm else None,
        )

    def _admit(self) -> None:
        """Fill free running slots in :meth:`admission_order`: claimants first (taking
        lent slots back when they find none, :meth:`_reclaim`), then, when no ready
        claimant is left waiting, borrowers (fewest held first, re-counted after each)."""
        limit = self.config.max_running_requests
        cap = self.config.group_cap
        if not self.waiting:
            return
        if self.occupied >= limit and not (cap is not None and self._lent()):
            return
        held = used_slots(self.running)
        borrowers: list[Request] = []
        for req in self.admission_order():
            if cap is not None and held[req.group] >= cap:
                borrowers.append(req)  # its client request holds its share: others first
                continue
            handle = req.cache
            assert handle is not None
            if not self.cache.ready(handle) or not self.role.admissible(req):
                continue  # its L3 prefetch (or its room's other side) is still to come
            if self.occupied >= limit and not self._reclaim(held):
                return  # no free slot and none lent: nothing more comes in this step
            admitted = self.cache.admit(handle, req.all_ids)
            while not admitted and self._reclaim(held):  # its pages are evictable now
                admitted = self.cache.admit(handle, req.all_ids)
            if admitted:
                if not self._start(req, held):
                    return
            elif not self.running and not self.ends.parked:  # nothing will free memory
                self._refuse(req)
            else:  # running requests, or parked ones (their other side's half), free it
                return  # a ready claimant waits for L1: no borrower overtakes it
        if not self.config.lend_idle_slots:
            return  # a strict cap: idle slots stay idle
        # every ready claimant is running now: idle slots are lent, fewest held first
        while borrowers and self.occupied < limit:
            req = min(borrowers, key=lambda r: (-r.priority, held[r.group]))  # stable
            borrowers.remove(req)
            handle = req.cache
            assert handle is not None
            if not self.cache.ready(handle) or not self.role.admissible(req):
                continue
            if not self.cache.admit(handle, req.all_ids) or not self._start(req, held):
                return

    def _start(self, req: Request, held: Counter[str]) -> bool:
        """Move ``req`` (just admitted by the cache) from the queue to the running batch,
        or, when the role parks it (a decode instance's request, its prompt's pages given
        now), to the parked ones. False when no L1 is left for those pages: it stays
        queued, holding nothing."""
        handle = req.cache
        assert handle is not None
        parked = self.role.parks_admitted(req)
        if parked:
            # the prompt's pages; its next forward starts past the prompt (a sliding
            # window keeps only what that reads, which is what the prefill side holds)
            n = len(req.prompt_ids)
            if not self.cache.grow(handle, n, computed=n):
                self.cache.requeue(handle, [])
                self.role.requeued(req)
                if not self.running and not self.ends.parked:  # nothing will free memory
                    self._refuse(req)
                return False
        self.waiting.remove(req)
        if req.admitted_at is None:
            req.admitted_at = time.perf_counter()
        req.leave_queue()
        req.kv_len = handle.prefix_tokens
        take_cached_logprobs(req)
        held[req.group] += 1
        if parked:
            self.ends.park(req)
            return True
        resume = handle.take_resume()  # what the runner resumes the prefix from
        if resume is not None:
            self.runner.resume(req.rid, resume)
        self.running.append(req)
        return True

    def _refuse(self, req: Request) -> None:
        """End ``req``, which does not fit in L1 while no request holds any of it (none
        running, none parked): the error names the shortfall (what L1 has, what is free,
        who holds the rest, what the tree could give up)."""
        self.waiting.remove(req)
        need = math.ceil(len(req.all_ids) / self.page_size)
        s = cache_stats(self.cache)
        ps = s.page_size
        total, free = s.device_total_tokens // ps, s.device_free_tokens // ps
        held, cached = s.device_request_tokens // ps, s.device_cached_tokens // ps
        evictable = s.device_evictable_tokens // ps
        if need > total:
            why = f"the device cache has {total} pages in all (--max-total-tokens)"
        else:
            why = (
                f"the device cache cannot make room now: of its {total} pages {free} are"
                f" free, {held} held outside the tree (reserved, or loads in flight) and"
                f" {cached} cached by the tree, of which {evictable} evictable"
            )
        if self.ends.fenced:
            why += (
                f" ({self.ends.fenced_pages} of the held pages are fenced for failed rooms until"
                " their prefill instance confirms that no write of them can land)"
            )
        self.ends.finish(
            req,
            FinishReason.ABORT,
            error=f"the request needs {need} KV pages ({len(req.all_ids)} tokens) but {why};"
            " no running or parked request holds pages that would be freed",
        )

    def _lent(self, among: list[Request] | None = None) -> Request | None:
        """The running sequence (of ``among``) that gives a lent slot back first
        (:func:`~hicache.engine.step.slots.lent_slot`), or None when none is lent (or the cap
        does not lend)."""
        cap = self.config.group_cap
        if cap is None or not self.config.lend_idle_slots:
            return None
        return lent_slot(self.running, cap, among)

    def _reclaim(self, held: Counter[str]) -> bool:
        """Retract one sequence holding a lent slot (:meth:`_lent`) so a claimant can take
        it; ``held`` is kept counting. False when no slot is lent."""
        victim = self._lent()
        if victim is None:
            return False
        self._retract(victim, why="to give a lent slot back")
        held[victim.group] -= 1
        self.reclaimed += 1
        return True

    def _mixed_batch(self) -> list[Chunk]:
        """One forward's work: the next token of every decoding request, then prefill
        chunks of the others in admission order, ``chunked_prefill_size`` tokens in all
        (decode tokens included). The first prefill always gets at least a page's worth,
        so prompts advance however many requests decode. Each chunk is the cache's plan
        (``plan_chunk``, asked once per request: it may end a chunk earlier)."""
        for req in [r for r in self.running if r.seq_len - r.kv_len == 1]:
            if req in self.running:  # not retracted by an earlier one
                self._ensure_pages(req, req.kv_len + 1)
        batch = [self._plan(r, 1) for r in self.running if r.seq_len - r.kv_len == 1]
        chosen = {c.req.rid for c in batch}
        budget = self.config.chunked_prefill_size - len(batch)
        first = True
        for req in list(self.running):  # _ensure_pages may retract later arrivals
            if req not in self.running:
                continue
            left = req.seq_len - req.kv_len
            if left <= 1:
                continue
            n = min(left, budget) if budget > 0 else 0
            if first:  # the first prefill advances by at least a page: never starved
                n = max(n, min(left, self.page_size))
            if n <= 0:
                break
            chunk = self._plan(req, n)  # may end it earlier
            # pages for the chunk (a component's pages may come chunk by chunk); may
            # retract a later arrival that is not in this batch
            if not self._ensure_pages(
                req, req.kv_len + chunk.tokens, spare=chosen, abort=not batch
            ):
                break
            batch.append(chunk)
            chosen.add(req.rid)
            budget -= chunk.tokens
            first = False
        return batch

    def _plan(self, req: Request, tokens: int) -> Chunk:
        """The cache's plan for a forward of ``req`` over ``tokens`` new positions."""
        assert req.cache is not None
        plan = self.cache.plan_chunk(req.cache, req.kv_len, tokens)
        return Chunk(req, plan.tokens, plan.keep)

    def _ensure_pages(
        self, req: Request, tokens: int, *, spare: set[str] | None = None, abort: bool = True
    ) -> bool:
        """Give ``req`` pages for positions up to ``tokens`` (its next forward starts at
        ``req.kv_len``: the cache drops what that forward no longer reads),
        retracting other running requests (not those in ``spare``) if L1 is full. When
        none is left to retract: with ``abort``, retract ``req`` itself while parked
        requests hold pages that will be freed (it waits for them, as behind a running
        request), else abort it; without, just return False."""
        assert req.cache is not None
        while not self.cache.grow(req.cache, tokens, computed=req.kv_len):
            victims = [r for r in self.running if r is not req and r.rid not in (spare or ())]
            if not victims:
                if abort and self.ends.parked:  # their pages will be freed: wait for them
                    self._retract(req, why="until parked requests free their pages")
                elif abort:
                    error = "the device cache cannot hold this request"
                    self.ends.finish(req, FinishReason.ABORT, error=error)
                return False
            # a lent slot first (see _lent), else the latest arrival
            victim = self._lent(victims) or max(victims, key=lambda r: r.arrival)
            self._retract(victim)
        return True

    # ------------------------------------------------------------------ forward

    def _run(self, batch: list[Chunk]) -> None:
        """One forward over ``batch``, then, for each request whose
        sequence is now fully computed, one new token (:meth:`_sample`). Any failure ends
        only the requests it concerns.

        Pending outputs (the previous step's) are done once the forward is launched and
        the requests' positions advanced, before anything reads the forward's results."""
        if not batch:
            self.ends.flush()
            return
        wanted = self.sampler.logit_rows(batch)
        logits = self._forward(batch, wanted.rows if wanted.prompt else None)
        if logits is None:
            self.ends.flush()
            return
        rows = self._advance(batch, wanted.last)
        # the previous step's text and reports while this forward runs (on CUDA); a stop
        # string found now ends its request, whose token in flight is then not sampled
        self.ends.flush()
        if wanted.prompt:  # not those requeued by a failed load: they read unwritten pages
            live = [p for p in wanted.prompt if not p.req.finished and p.req in self.running]
            self._prompt_logprobs(logits, live)
        rows = [row for row in rows if not row[1].finished]  # a failed prompt scoring ended it
        if rows:
            self._sample(logits, rows)

    def _forward(self, batch: list[Chunk], logit_rows: list[int] | None) -> torch.Tensor | None:
        """Run the forward of ``batch`` (logits of ``logit_rows``; None: each sequence's
        last token, the runner's default). A model error fails this batch, not the
        engine: its requests end, the failure is counted (``failed_forwards``, what
        ``/health`` reads) and None is returned; a forward that succeeds resets the
        count."""
        fb = forward_batch(batch, self.page_size, self.config.layer_wait_timeout_s)
        timed = prefill_tokens(batch) if fb.layer_wait is None else None  # not a load's wait
        try:
            with self.prefill_timer.forward(timed):
                if logit_rows is not None:
                    logits = self.runner.forward(fb, logit_rows=logit_rows)
                else:
                    logits = self.runner.forward(fb)
        except Exception as exc:
            if self.tokens is not None:  # a rank must not fail a batch alone: the ranks stop
                raise
            log.exception("forward failed")
            self.failed_forwards += 1
            self.forward_error = f"{type(exc).__name__}: {exc}"
            for chunk in batch:
                error = f"forward failed: {type(exc).__name__}: {exc}"
                self.ends.finish(chunk.req, FinishReason.ABORT, commit_kv=False, error=error)
            return None
        self.failed_forwards = 0
        return logits

    def _advance(self, batch: list[Chunk], last_row: list[int]) -> list[tuple[int, Request, bool]]:
        """After the forward: requeue the requests whose prefix load failed (this
        forward's results for them are discarded; they recompute), advance the
        others' computed positions and hand the runner's extras to the cache untouched (a
        prefill chunk's pages are committed now, so other requests share them); returns
        ``(logits row, request, was a prefill)`` of each request to sample."""
        rows: list[tuple[int, Request, bool]] = []
        for i, chunk in enumerate(batch):
            req, n = chunk.req, chunk.tokens
            assert req.cache is not None
            if req.cache.failed is not None:
                self._fall_back(req)
                continue
            req.kv_len += n
            extras = self.runner.take_extras(req.rid)  # for the cache, untouched
            if req.kv_len < req.seq_len:  # a prefill chunk: its pages (and every
                # component's values, before the next chunk moves past them) are shared now
                self.cache.commit(req.cache, req.all_ids[: req.kv_len], extras=extras)
                self.role.computed(req)  # a prefill instance sends them now
            elif extras is not None:  # its pages: after sampling, or at its release
                self.cache.commit(req.cache, extras=extras)
            if req.kv_len == req.seq_len:
                rows.append((last_row[i], req, n > 1 or not req.output_ids))
        return rows

    def _sample(self, logits: torch.Tensor, rows: list[tuple[int, Request, bool]]) -> None:
        """One new token for each of ``rows`` (logits row, request, was a prefill)
        (:meth:`BatchSampler.draw`); then the token-level checks, and the text work and
        report made pending. A request whose row fails ends alone (its computed KV is
        fine)."""
        reqs = [r for _, r, _ in rows]
        drawn = self.sampler.draw(logits[[i for i, _, _ in rows]], reqs)
        now = time.perf_counter()
        for j, ((_, req, prefilled), token) in enumerate(zip(rows, drawn.tokens, strict=True)):
            if j in drawn.errors:
                self.ends.finish(req, FinishReason.ABORT, error=drawn.errors[j])
                continue
            req.output_ids.append(int(token))
            lp = drawn.logprobs.get(j)
            if req.logprobs is not None and isinstance(lp, TokenLogprob):
                req.logprobs.append(lp)
            if req.first_token_at is None:
                req.first_token_at = now
            self.output.check_token(req)  # the text work comes with the report, later
            self.ends.took_token(req)
            if prefilled and not req.finished:
                assert req.cache is not None
                self.cache.commit(req.cache, req.all_ids[: req.kv_len])

    def _prompt_logprobs(self, logits: torch.Tensor, prompt: list[PromptRow]) -> None:
        """Store the prompt log probabilities ``prompt`` asks for; a request whose
        computation fails ends alone (under tensor parallelism at the next step, on every
        rank: only rank 0 computes them)."""
        for req, why in self.sampler.prompt_logprobs(logits, prompt).items():
            if self.tokens is not None:
                self.ends.abort_next(req, why)
            else:
                self.ends.finish(req, FinishReason.ABORT, error=why)

    # ------------------------------------------------------------------ cache hand-off

    def _retract(self, req: Request, *, why: str = "to free L1 pages") -> None:
        """Preempt a running request: keep its KV in the cache, re-queue it first."""
        log.info("retracting %s %s", req.rid, why)
        self._requeue(req)
        req.retracted += 1

    def _fall_back(self, req: Request) -> None:
        """A load ``req``'s prefix depends on failed: keep nothing it computed since its
        admission (a forward that read the prefix read pages never written), requeue it
        first, and let its re-admission recompute what the load could not bring (the
        cache loads nothing from L2 for it then)."""
        assert req.cache is not None
        log.warning("%s: %s; recomputing it", req.rid, req.cache.failed)
        self._requeue(req)  # a failed handle keeps nothing; the extras go with the state

    def _requeue(self, req: Request) -> None:
        """Move running ``req`` to the front of the queue: the cache keeps what it computed
        (``requeue``; nothing for a failed handle), the runner drops its carried state, and
        it restarts from position 0 (or from the prefix its re-admission finds)."""
        assert req.cache is not None
        self.running.remove(req)
        self.role.requeued(req)  # before its pages may be freed
        self.cache.requeue(req.cache, req.all_ids[: req.kv_len])
        self.runner.drop_state(req.rid)
        req.kv_len = 0
        self.waiting.appendleft(req)


__all__ = ["LPM_MAX_WAITING", "Chunk", "SchedulePolicy", "Scheduler", "SchedulerConfig"]


def score_ask(req: Request) -> ScoreAsk | None:
    """What ``req`` asks the cache's scoring entries for: its prompt logprobs from
    ``logprob_start_len`` (at least position 1) with its ``prompt_logprobs``
    alternatives; None when it asks none."""
    k, start = req.params.prompt_logprobs, req.params.logprob_start_len
    if not isinstance(k, int) or not isinstance(start, int) or k < 0:
        return None  # none asked (or params that bypassed validation: its row fails)
    return ScoreAsk(start=max(1, start), top=k)


def take_cached_logprobs(req: Request) -> None:
    """After an admission: the prompt logprobs of the positions its cached prefix
    served (``1 .. kv_len``), from the records the cache handed back, cut to the
    alternatives ``req`` asks."""
    handle, mine = req.cache, req.prompt_logprobs
    if handle is None or handle.scores is None or mine is None:
        return
    k = req.params.prompt_logprobs or 0
    for pos, rec in handle.scores.records.items():
        if pos <= req.kv_len and pos < len(mine) and mine[pos] is None:
            mine[pos] = rec.cut(k)


def _take_prefill_state(req: Request, item: PagesArrived) -> str | None:
    """Take what the prefill instance computed for decode request ``req`` besides its
    pages: the first token's logprob and the prompt logprobs (when ``req`` asks them), its
    generator's state past the first draw (a seeded request then draws the rest as one
    plain instance would). Returns why ``req`` cannot go on (what it asks is missing),
    else None."""
    if req.logprobs is not None:
        if item.first_logprob is None:
            return "the prefill instance sent no logprob for the first token"
        req.logprobs.append(item.first_logprob)
    if req.prompt_logprobs is not None:
        got = item.prompt_logprobs
        if got is None or len(got) != len(req.prompt_ids):
            return "the prefill instance sent no prompt logprobs for this prompt"
        req.prompt_logprobs = list(got)
    if req.generator is not None and item.sampler_state is not None:
        why = set_generator_state(req.generator, item.sampler_state)
        if why is not None:
            log.warning("%s: the prefill's sampler state is not used (%s)", req.rid, why)
    return None
