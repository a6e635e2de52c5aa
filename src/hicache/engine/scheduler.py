"""Continuous batching over the hierarchical cache.

Each :meth:`Scheduler.step` admits waiting requests through the cache's request verbs
(``open`` on arrival starts the L3 prefetch; ``ready`` and ``admit`` match, load back and
give L1 pages), then runs one mixed forward: the next token of every decoding request
plus prefill chunks of the others, ``chunked_prefill_size`` tokens in all, so a new
prompt's prefill neither waits for the decodes nor stalls them. Every prefill chunk and
every finished prefix is committed to the cache (its write policy backs them up), so
concurrent requests share a prefix as soon as it is computed and every component's values
reach the tree before the request moves past them; a request that cannot get an L1 page
for its next token is retracted (``requeue``): its KV stays cached and it waits to be
re-admitted, which then finds its own prefix. A request whose prefix load from L2 failed
does not fail: seen at the step's poll or after the forward that waited on the load's
layers, it is requeued with nothing of that forward kept (:meth:`Scheduler._fall_back`)
and its re-admission recomputes what the load could not bring; only a failure of that
recompute fails it. The scheduler holds only opaque handles and names no cache component.

Admission order (:meth:`Scheduler.admission_order`), so that one wide client request
cannot lock out the others: higher ``priority`` first; then, with the group rule on
(``max_running_requests_per_group``, default half the running slots), requests whose group
(one client request: its ``n`` copies and batched prompts) holds fewer running slots; then
the policy's order (``fcfs``, or ``lpm``: longest cached prefix first, which asks the cache
for each waiting request's match). A request whose L3 prefetch is still running is passed
over; one that does not fit in L1 stops admission for the step (later ones do not overtake
it for memory).

The cap is work-conserving (``lend_idle_slots``, the default): a waiting request of a group
below its cap has a *claim*; one of a group at its cap is a *borrower*. Borrowers are
admitted (fewest held first) only once no ready claimant is left waiting, so a lone wide
request fills every idle slot. A ready claimant that finds no free slot, or not enough L1,
takes a lent slot back: one sequence of a group holding more than its cap is retracted
(:meth:`Scheduler._lent` says which) through the same retraction as under memory pressure
(its committed KV stays cached; re-admission finds it), one per claimant and never below
the cap. A retracted sequence is a borrower again, so it returns only when no claimant
waits: no thrash. Under memory pressure (:meth:`Scheduler._ensure_pages`) a lent slot is
given back first, too.

What a model caches besides K/V stays between the cache and the runner: each forward asks
the cache for its plan per request (``plan_chunk``: where the chunk must end, and after
which tokens the runner keeps the sequence's extras); the batch carries the handle's
per-pool slot tables (``pool_slots``) and the plan's offsets (``keep``); the runner's
extras of each request go back to the cache untouched, with the chunk's commit or
(``keep``) without one; and what a re-admitted request resumes from goes from its handle
to the runner (``take_resume``). Each forward names its requests (``seq_ids``) so the
runner can carry their state; a request's carried state is dropped when it ends or is
retracted. A model whose runner carries state (``runner.resumable_prefix`` False) reuses
cached prefixes only when the cache hands states back (``cache.stores.resumes``); otherwise
its handles are opened uncacheable.

Outputs off the critical path. A step's sampled tokens get the token-level checks
(end-of-sequence, stop ids, ``max_tokens``, the context length) at once, so a request that
must stop is released before the next step is built and never runs a step it must not.
Their text work (detokenization, stop strings) and reports (``on_output``) are *pending*
until the next step has launched its forward: on CUDA that forward runs while the CPU
does them, before its tokens are read (``overlap_outputs``; without it, as on CPU where a
forward is synchronous, they are done at the end of the step that sampled them). A stop
string found then ends its request one step late: the token in flight is discarded
(finished requests are not sampled), and the position that step computed is the stopping
token's own, so the KV kept is right. Pending outputs are done, in order, at the latest at
the end of the next step, also one that runs no forward; a request that ends otherwise
(abort, failure) first has its pending output done and reported, so a request's final
report always comes last, and comes exactly once.

Everything here runs on the engine's thread.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.cache import HiCache
from hicache.engine.logits import TokenLogprob, adjust_logits, token_logprobs
from hicache.engine.output import OutputProcessor
from hicache.engine.ranks import StepChannel
from hicache.engine.request import FinishReason, Request
from hicache.engine.sampling import make_generator, sample_rows
from hicache.engine.slots import admission_order, held_slots, lent_slot
from hicache.runner.model_runner import ForwardBatch, ModelRunner
from hicache.validate import int_at_least, is_int, number_at_least, require

log = logging.getLogger(__name__)

LPM_MAX_WAITING = 128
"""Above this many waiting requests ``lpm`` orders them as ``fcfs`` (as SGLang does): its
key costs one prefix match per waiting request per step."""


class SchedulePolicy(str, enum.Enum):
    """The order waiting requests are admitted in, within one priority and fair-share
    class (see :meth:`Scheduler.admission_order`)."""

    FCFS = "fcfs"
    """First come, first served (a retracted request first of all)."""
    LPM = "lpm"
    """Longest cached prefix first (L1 + L2, as the cache matches it now); ties first come."""


_UNSUPPORTED_POLICIES = ("dfs-weight", "lof", "random")
"""SGLang's other ``--schedule-policy`` names, refused with the supported ones."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batching limits. ``chunked_prefill_size``: new prompt tokens per prefill step."""

    max_running_requests: int = 32
    chunked_prefill_size: int = 512
    disable_radix_cache: bool = False
    layer_wait_timeout_s: float = 60.0
    """Longest a forward waits for one layer of a prefix being loaded back from L2."""
    overlap_outputs: bool | None = None
    """Do a step's text work and reports while the next step's forward runs (see the
    module docstring); None: when the model runs on CUDA (a CPU forward is synchronous, so
    there deferring them would only delay them)."""
    schedule_policy: str = SchedulePolicy.FCFS.value
    """Admission order within a priority and fair-share class: ``fcfs`` or ``lpm``
    (:class:`SchedulePolicy`)."""
    max_running_requests_per_group: int | None = None
    """Running slots one client request (a group: its ``n`` copies and batched prompts)
    may hold at once; waiting requests of the group holding the fewest slots go first.
    None: half of ``max_running_requests`` (at least 1); 0: no group rule at all (the
    policy's order alone, as before groups existed)."""
    lend_idle_slots: bool = True
    """With a group rule: a group may run past its cap while no request of a group below
    its cap waits ready, and gives the lent slots back (its sequences past the cap are
    retracted, their KV kept cached) when one does (see the module docstring). False: the
    cap is strict, slots stay idle rather than lent."""

    def __post_init__(self) -> None:
        int_at_least("max_running_requests", self.max_running_requests, 1)
        if self.schedule_policy in _UNSUPPORTED_POLICIES:
            raise ValueError(
                f"schedule_policy={self.schedule_policy!r} is not supported; supported:"
                f" {', '.join(p.value for p in SchedulePolicy)}"
            )
        require(
            self.schedule_policy in tuple(p.value for p in SchedulePolicy),
            "schedule_policy",
            self.schedule_policy,
            f"choose one of {', '.join(p.value for p in SchedulePolicy)}",
        )
        cap = self.max_running_requests_per_group
        require(
            cap is None or (is_int(cap) and 0 <= cap <= self.max_running_requests),
            "max_running_requests_per_group",
            cap,
            f"must be None (half the running slots), 0 (no group rule) or an int in"
            f" [1, max_running_requests={self.max_running_requests}]",
        )
        require(
            isinstance(self.lend_idle_slots, bool),
            "lend_idle_slots",
            self.lend_idle_slots,
            "must be a bool",
        )
        int_at_least("chunked_prefill_size", self.chunked_prefill_size, 1, "(tokens)")
        require(
            isinstance(self.disable_radix_cache, bool),
            "disable_radix_cache",
            self.disable_radix_cache,
            "must be a bool",
        )
        number_at_least("layer_wait_timeout_s", self.layer_wait_timeout_s, 0.001, "of seconds")
        require(
            self.overlap_outputs is None or isinstance(self.overlap_outputs, bool),
            "overlap_outputs",
            self.overlap_outputs,
            "must be a bool or None",
        )

    @property
    def group_cap(self) -> int | None:
        """Running slots a group may hold (None: no group rule)."""
        cap = self.max_running_requests_per_group
        if cap is None:
            return max(1, self.max_running_requests // 2)
        return cap or None


class Scheduler:
    """Owns the waiting queue and the running batch; see the module docstring."""

    def __init__(
        self,
        cache: HiCache,
        runner: ModelRunner,
        output: OutputProcessor,
        config: SchedulerConfig,
        *,
        tokens: StepChannel | None = None,
        abort_later: Callable[[str], None] | None = None,
    ) -> None:
        """``tokens``: under tensor parallelism, this rank's channel: every sampled token
        (and which rows failed) is rank 0's (:meth:`_sample`). ``abort_later(rid)``: how a
        request whose report failed is aborted (through the next step's inputs, so on
        every rank); None: at once, here."""
        self.cache = cache
        self.runner = runner
        self.output = output
        self.config = config
        self.page_size = cache.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # a model that carries state resumes a cached prefix only from a state the cache
        # hands back
        self.resumable_prefix = runner.resumable_prefix or cache.stores.resumes
        overlap = config.overlap_outputs
        self.overlap = torch.device(runner.device).type == "cuda" if overlap is None else overlap
        self._pending: dict[Request, None] = {}
        """Requests with a token whose text work and report are still to do, oldest first
        (at most one token each); those already ended wait here for their final report."""
        self.failed_forwards = 0
        """Forwards that raised in a row (0 once one succeeds): the engine's health."""
        self.forward_error: str | None = None
        """Why the last forward that raised did."""
        self.forwards = 0
        """Steps that ran a forward so far: a clock in steps (a request added between two
        steps and admitted at the next one has its first token when this has gone up by 1)."""
        self.reclaimed = 0
        """Sequences retracted so far to give a lent slot back (:meth:`_reclaim`)."""
        self.tokens = tokens
        self.abort_later = abort_later

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
                # prompt logprobs need every prompt position computed: no prefix match;
                # a model that carries state needs the cache to hand one back
                cacheable=not self.config.disable_radix_cache
                and req.params.prompt_logprobs is None
                and self.resumable_prefix,
            )
        except Exception as exc:
            log.exception("request %s could not be queued", req.rid)
            self._finish(req, FinishReason.ABORT, error=f"{type(exc).__name__}: {exc}")
            return
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        for req in [*self.waiting, *self.running]:
            if req.rid == rid:
                req.aborted = True

    @property
    def idle(self) -> bool:
        """Nothing queued, running or waiting to be reported."""
        return not self.waiting and not self.running and not self._pending

    @property
    def in_flight(self) -> list[Request]:
        """Every request not yet given its final report: waiting, running, and ended
        with that report pending."""
        held = [*self.waiting, *self.running]
        return held + [r for r in self._pending if r.finished and not r.final_reported]

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
        if not self.running:
            self._flush_outputs()
            return False
        self.forwards += 1
        self._run(self._mixed_batch())
        if not self.overlap:
            self._flush_outputs()
        return True

    def _reap_aborted(self) -> None:
        for req in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(req)
            self._finish(req, FinishReason.ABORT)
        for req in [r for r in self.running if r.aborted]:
            self._finish(req, FinishReason.ABORT)

    def admission_order(self) -> list[Request]:
        """The waiting requests in the order :meth:`step` tries to admit them
        (:func:`~hicache.engine.slots.admission_order`: claimants, then borrowers; priority;
        fewest held; under ``lpm`` the longest cached prefix, up to
        :data:`LPM_MAX_WAITING` waiting; queue order, a retracted request at the front).
        Computed at the start of the step."""
        lpm = (
            self.config.schedule_policy == SchedulePolicy.LPM
            and len(self.waiting) <= LPM_MAX_WAITING
        )

        def cached(req: Request) -> int:
            handle = req.cache
            if handle is None or not handle.cacheable:
                return 0
            return self.cache.cached_prefix(req.all_ids, req.cache_salt)

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
        if len(self.running) >= limit and not (cap is not None and self._lent()):
            return
        held = held_slots(self.running)
        borrowers: list[Request] = []
        for req in self.admission_order():
            if cap is not None and held[req.group] >= cap:
                borrowers.append(req)  # its client request holds its share: others first
                continue
            handle = req.cache
            assert handle is not None
            if not self.cache.ready(handle):
                continue  # its L3 prefetch is still running: let others go first
            if len(self.running) >= limit and not self._reclaim(held):
                return  # no free slot and none lent: nothing more comes in this step
            admitted = self.cache.admit(handle, req.all_ids)
            while not admitted and self._reclaim(held):  # its pages are evictable now
                admitted = self.cache.admit(handle, req.all_ids)
            if admitted:
                self._start(req, held)
            elif not self.running:  # nothing will ever free memory for it
                self._refuse(req)
            else:
                return  # a ready claimant waits for L1: no borrower overtakes it
        if not self.config.lend_idle_slots:
            return  # a strict cap: idle slots stay idle
        # every ready claimant is running now: idle slots are lent, fewest held first
        while borrowers and len(self.running) < limit:
            req = min(borrowers, key=lambda r: (-r.priority, held[r.group]))  # stable
            borrowers.remove(req)
            handle = req.cache
            assert handle is not None
            if not self.cache.ready(handle):
                continue
            if not self.cache.admit(handle, req.all_ids):
                return
            self._start(req, held)

    def _start(self, req: Request, held: Counter[str]) -> None:
        """Move ``req`` (just admitted by the cache) from the queue to the running batch."""
        handle = req.cache
        assert handle is not None
        self.waiting.remove(req)
        if req.admitted_at is None:
            req.admitted_at = time.perf_counter()
        req.leave_queue()
        req.kv_len = handle.prefix_tokens
        resume = handle.take_resume()  # what the runner resumes the prefix from
        if resume is not None:
            self.runner.resume(req.rid, resume)
        self.running.append(req)
        held[req.group] += 1

    def _refuse(self, req: Request) -> None:
        """End ``req``, which does not fit in an empty L1."""
        self.waiting.remove(req)
        need = math.ceil(len(req.all_ids) / self.page_size)
        self._finish(
            req,
            FinishReason.ABORT,
            error=f"the request needs {need} KV pages but the device cache has"
            f" {self.cache.full.pages}",
        )

    def _lent(self, among: list[Request] | None = None) -> Request | None:
        """The running sequence (of ``among``) that gives a lent slot back first
        (:func:`~hicache.engine.slots.lent_slot`), or None when none is lent (or the cap
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

    def _mixed_batch(self) -> list[tuple[Request, int]]:
        """One forward's work: the next token of every decoding request, then prefill
        chunks of the others in admission order, ``chunked_prefill_size`` tokens in all
        (decode tokens included). The first prefill always gets at least a page's worth,
        so prompts advance however many requests decode."""
        for req in [r for r in self.running if r.seq_len - r.kv_len == 1]:
            if req in self.running:  # not retracted by an earlier one
                self._ensure_pages(req, req.kv_len + 1)
        batch = [(r, 1) for r in self.running if r.seq_len - r.kv_len == 1]
        chosen = {r.rid for r, _ in batch}
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
            assert req.cache is not None
            n = self.cache.plan_chunk(req.cache, req.kv_len, n).tokens  # may end it earlier
            # pages for the chunk (a component's pages may come chunk by chunk); may
            # retract a later arrival that is not in this batch
            if not self._ensure_pages(req, req.kv_len + n, keep=chosen, abort=not batch):
                break
            batch.append((req, n))
            chosen.add(req.rid)
            budget -= n
            first = False
        return batch

    def _ensure_pages(
        self, req: Request, tokens: int, *, keep: set[str] | None = None, abort: bool = True
    ) -> bool:
        """Give ``req`` pages for positions up to ``tokens`` (its next forward starts at
        ``req.kv_len``: the cache drops what that forward no longer reads),
        retracting other running requests (not those in ``keep``) if L1 is full. When
        none is left to retract: abort ``req`` (``abort``) or just return False."""
        assert req.cache is not None
        while not self.cache.grow(req.cache, tokens, computed=req.kv_len):
            victims = [r for r in self.running if r is not req and r.rid not in (keep or ())]
            if not victims:
                if abort:
                    error = "the device cache cannot hold this request"
                    self._finish(req, FinishReason.ABORT, error=error)
                return False
            # a lent slot first (see _lent), else the latest arrival
            victim = self._lent(victims) or max(victims, key=lambda r: r.arrival)
            self._retract(victim)
        return True

    # ------------------------------------------------------------------ forward

    def _run(self, batch: list[tuple[Request, int]]) -> None:
        """One forward over ``batch`` (request, new tokens), then, for each request whose
        sequence is now fully computed, one new token (:meth:`_sample`). Any failure ends
        only the requests it concerns.

        Pending outputs (the previous step's) are done once the forward is launched and
        the requests' positions advanced, before anything reads the forward's results."""
        if not batch:
            self._flush_outputs()
            return
        logit_rows, last_row, prompt_rows = self._logit_rows(batch)
        logits = self._forward(batch, logit_rows if prompt_rows else None)
        if logits is None:
            self._flush_outputs()
            return
        rows = self._advance(batch, last_row)
        # the previous step's text and reports while this forward runs (on CUDA); a stop
        # string found now ends its request, whose token in flight is then not sampled
        self._flush_outputs()
        self._prompt_logprobs(logits, [(r, pos, j) for r, pos, j in prompt_rows if not r.finished])
        rows = [row for row in rows if not row[1].finished]  # a failed prompt scoring ended it
        if rows:
            self._sample(logits, rows)

    def _forward_batch(self, batch: list[tuple[Request, int]]) -> ForwardBatch:
        """The runner's inputs for ``batch``: new token ids and positions, each sequence's
        L1 slots and its slots in every other pool the cache keeps for it, the positions
        where the runner keeps per-request extras (the cache's chunk plan), and a layer
        wait for the requests whose prefix is still being loaded back."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        pool_slots: dict[str, list[torch.Tensor]] = {}  # per component pool the model uses
        keep: list[tuple[int, ...]] = []
        loading = []
        for req, n in batch:
            assert req.cache is not None
            ids += req.all_ids[req.kv_len : req.kv_len + n]
            positions += range(req.kv_len, req.kv_len + n)
            slots.append(req.cache.slots(ps, req.kv_len + n))
            for name, table in req.cache.pool_slots(ps, req.kv_len + n).items():
                pool_slots.setdefault(name, []).append(table)
            plan = self.cache.plan_chunk(req.cache, req.kv_len, n)
            if plan.tokens != n:  # pragma: no cover - _mixed_batch asked the same plan
                raise RuntimeError(f"{req.rid}: the cache plans {plan.tokens} tokens, not {n}")
            keep.append(plan.keep)
            if req.cache.loading:
                loading.append(req.cache)
        timeout = self.config.layer_wait_timeout_s

        def layer_wait(layer: int) -> None:
            for handle in loading:
                handle.wait_layer(layer, timeout)  # False: the request fails later

        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            extend_lens=[n for _, n in batch],
            seq_slots=slots,
            layer_wait=layer_wait if loading else None,
            seq_ids=[req.rid for req, _ in batch],
            pool_slots=pool_slots or None,
            keep=keep if any(keep) else None,
        )

    def _forward(
        self, batch: list[tuple[Request, int]], logit_rows: list[int] | None
    ) -> torch.Tensor | None:
        """Run the forward of ``batch`` (logits of ``logit_rows``; None: each sequence's
        last token, the runner's default). A model error fails this batch, not the
        engine: its requests end, the failure is counted (``failed_forwards``, what
        ``/health`` reads) and None is returned; a forward that succeeds resets the
        count."""
        fb = self._forward_batch(batch)
        try:
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
            for req, _ in batch:
                error = f"forward failed: {type(exc).__name__}: {exc}"
                self._finish(req, FinishReason.ABORT, keep_kv=False, error=error)
            return None
        self.failed_forwards = 0
        return logits

    def _advance(
        self, batch: list[tuple[Request, int]], last_row: list[int]
    ) -> list[tuple[int, Request, bool]]:
        """After the forward: requeue the requests whose prefix load failed (this
        forward's results for them are discarded; they recompute), advance the
        others' computed positions and hand the runner's extras to the cache untouched (a
        prefill chunk's pages are committed now, so other requests share them); returns
        ``(logits row, request, was a prefill)`` of each request to sample."""
        rows: list[tuple[int, Request, bool]] = []
        for i, (req, n) in enumerate(batch):
            assert req.cache is not None
            if req.cache.failed is not None:
                self._fall_back(req)
                continue
            req.kv_len += n
            extras = self.runner.take_extras(req.rid)  # for the cache, untouched
            if req.kv_len < req.seq_len:  # a prefill chunk: its pages (and every
                # component's values, before the next chunk moves past them) are shared now
                self.cache.commit(req.cache, req.all_ids[: req.kv_len], extras=extras)
            else:  # committed after sampling, or at its release
                self.cache.keep(req.cache, extras)
            if req.kv_len == req.seq_len:
                rows.append((last_row[i], req, n > 1 or not req.output_ids))
        return rows

    def _sample(self, logits: torch.Tensor, rows: list[tuple[int, Request, bool]]) -> None:
        """One new token for each of ``rows`` (logits row, request, was a prefill): raw
        logits -> token log probabilities (when asked), penalties and bias
        (:func:`adjust_logits`), draw (:func:`sample_rows`); then the token-level checks,
        and the text work and report made pending. A request whose row fails ends alone
        (its computed KV is fine)."""
        raw = logits[[i for i, _, _ in rows]]
        reqs = [r for _, r, _ in rows]
        adjusted = adjust_logits(
            raw,
            [r.params for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            self.output.eos_token_ids,
        )
        picked = sample_rows(adjusted.logits, [r.params for r in reqs], [r.generator for r in reqs])
        errors = {j: f"sampling failed: {why}" for j, why in picked.errors.items()}
        errors |= {j: f"logit processing failed: {why}" for j, why in adjusted.errors.items()}
        tokens: list[int] | tuple[int, ...] = picked.token_ids
        want = [j for j, r in enumerate(reqs) if r.logprobs is not None and j not in errors]
        logprobs = _logprobs_by_row(
            raw, want, [tokens[j] for j in want], [reqs[j].params.logprobs or 0 for j in want]
        )
        for j, got in logprobs.items():
            if isinstance(got, str):
                errors[j] = f"logprobs failed: {got}"
        if self.tokens is not None:  # every rank takes rank 0's tokens and failed rows
            tokens, failed = self.tokens.agree_tokens(tokens, sorted(errors))
            errors = {j: errors.get(j, "sampling failed on rank 0") for j in failed}
        now = time.perf_counter()
        for j, ((_, req, prefilled), token) in enumerate(zip(rows, tokens, strict=True)):
            lp = logprobs.get(j)
            if j in errors:
                self._finish(req, FinishReason.ABORT, error=errors[j])
                continue
            req.output_ids.append(int(token))
            if req.logprobs is not None and isinstance(lp, TokenLogprob):
                req.logprobs.append(lp)
            if req.first_token_at is None:
                req.first_token_at = now
            self.output.check_token(req)  # the text work comes with the report, later
            self._pending[req] = None
            if req.finished:
                self._release(req)
                continue
            if prefilled:
                assert req.cache is not None
                self.cache.commit(req.cache, req.all_ids[: req.kv_len])

    @staticmethod
    def _logit_rows(
        batch: list[tuple[Request, int]],
    ) -> tuple[list[int], list[int], list[tuple[Request, int, int]]]:
        """Which new tokens of ``batch`` need logits: ``(rows, last_row, prompt_rows)``.

        ``rows``: indices into the batch's new tokens, each sequence's last one and, for a
        request with ``prompt_logprobs``, every prompt position whose next prompt token's
        logprob it still lacks (positions recomputed after a retraction are not repeated).
        ``last_row[i]``: where sequence ``i``'s last token is in ``rows``. ``prompt_rows``:
        ``(request, prompt position p >= 1 scored, index in rows of position p - 1)``.
        Without ``prompt_rows``, ``rows`` is each sequence's last token, in order.
        """
        rows: list[int] = []
        last_row: list[int] = []
        prompt_rows: list[tuple[Request, int, int]] = []
        offset = 0
        for req, n in batch:
            scored = req.prompt_logprobs
            if scored is not None:
                for pos in range(req.kv_len, min(req.kv_len + n, len(req.prompt_ids) - 1)):
                    if scored[pos + 1] is None:
                        prompt_rows.append((req, pos + 1, len(rows)))
                        rows.append(offset + pos - req.kv_len)
            if not rows or rows[-1] != offset + n - 1:
                rows.append(offset + n - 1)
            last_row.append(len(rows) - 1)
            offset += n
        return rows, last_row, prompt_rows

    def _prompt_logprobs(
        self, logits: torch.Tensor, prompt_rows: list[tuple[Request, int, int]]
    ) -> None:
        """Store the prompt log probabilities ``prompt_rows`` (see :meth:`_logit_rows`)
        asked for; a request whose computation fails is aborted alone."""
        if not prompt_rows:
            return
        got = _logprobs_by_row(
            logits,
            [j for _, _, j in prompt_rows],
            [r.prompt_ids[pos] for r, pos, _ in prompt_rows],
            [r.params.prompt_logprobs or 0 for r, _, _ in prompt_rows],
        )
        for req, pos, j in prompt_rows:
            lp = got[j]
            if req.finished:
                continue
            if isinstance(lp, str):
                self._finish(req, FinishReason.ABORT, error=f"prompt logprobs failed: {lp}")
            elif req.prompt_logprobs is not None:
                req.prompt_logprobs[pos] = lp

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
        self.cache.requeue(req.cache, req.all_ids[: req.kv_len])
        self.runner.drop_state(req.rid)
        req.kv_len = 0
        self.waiting.appendleft(req)

    def _finish(
        self,
        req: Request,
        reason: FinishReason | None,
        *,
        keep_kv: bool = True,
        error: str | None = None,
    ) -> None:
        """End ``req`` now (``error``: why, when set) and send its final report. Its pending
        output goes first; if that ends it (a stop string), it ends so instead."""
        if self._settle(req, keep_kv=keep_kv):
            return
        req.finish_reason = reason
        if error is not None:
            req.error = error
        self._release(req, keep_kv=keep_kv)
        self._emit(req)

    def _release(self, req: Request, *, keep_kv: bool = True) -> None:
        """Take ``req`` out of the queues and give back what it holds (its computed KV
        committed first, with ``keep_kv``). Idempotent."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.leave_queue()
        self.runner.drop_state(req.rid)
        if req.cache is not None:
            self.cache.release(req.cache, req.all_ids[: req.kv_len], keep=keep_kv)

    def _settle(self, req: Request, *, keep_kv: bool = True) -> bool:
        """Do ``req``'s pending output, if any: its text, then its report. Returns whether
        that ended it (a stop string, or a token that cannot be decoded): it is then
        released here (its KV kept with ``keep_kv``), its token in flight (if any) never
        to be sampled."""
        if req not in self._pending:
            return False
        ended = False
        if not req.final_reported:  # (the engine may have failed it directly)
            was_finished = req.finished
            self.output.update_text(req)
            ended = req.finished and not was_finished
            if ended:
                if req.finish_reason is FinishReason.STOP:
                    # it had stopped before any abort took effect: an abort's reason
                    # (set with it, the only error a running request carries) is void
                    req.error = None
                self._release(req, keep_kv=keep_kv)
            self._emit(req)
        del self._pending[req]
        return ended

    def _flush_outputs(self) -> None:
        """Do every pending output, oldest first."""
        while self._pending:
            self._settle(next(iter(self._pending)))

    def _emit(self, req: Request) -> None:
        """Report ``req``'s progress; nothing after its final report."""
        if req.final_reported:
            return
        req.final_reported = req.finished
        if req.on_output is not None:
            try:
                req.on_output(self.output.report(req))
            except Exception:  # a broken consumer must not stop the engine
                log.exception("output callback of %s failed", req.rid)
                if self.abort_later is not None:
                    self.abort_later(req.rid)
                else:
                    req.aborted = True


def _logprobs_by_row(
    logits: torch.Tensor, rows: list[int], token_ids: list[int], top: list[int]
) -> dict[int, TokenLogprob | str]:
    """:func:`token_logprobs` of ``logits[rows]`` keyed by row; a row whose computation
    fails (alone) maps to why."""
    if not rows:
        return {}
    try:
        lps = token_logprobs(logits[rows], token_ids, top)
        return dict(zip(rows, lps, strict=True))
    except Exception:
        out: dict[int, TokenLogprob | str] = {}
        for r, t, k in zip(rows, token_ids, top, strict=True):
            try:
                out[r] = token_logprobs(logits[[r]], [t], [k])[0]
            except Exception as exc:
                out[r] = f"{type(exc).__name__}: {exc}"
        return out
