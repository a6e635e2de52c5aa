"""Drive a cache of one tensor-parallel rank the way the engine does: the same steps on
every rank, one ``sync()`` per step, requests admitted once the agreed policy lets them in.

Every decision the loop takes depends on agreed state only (``ready``, ``admit``), so each
rank runs the same number of steps and collectives; a loop that never ends raises on every
rank at the same step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from hicache.cache import CacheRequest, HiCache
from tests.helpers.kvdata import compute, write_tokens

Hit = tuple[int, int, int]
"""The tokens a request got from L1, L2 and L3 (``CachedTokens`` as a JSON-able row)."""


def drive(
    cache: HiCache,
    prompts: Sequence[Sequence[int]],
    *,
    open_per_step: int | None = None,
    hold_steps: int = 0,
    max_running: int | None = None,
    max_steps: int = 4000,
    step_s: float = 0.002,
    timeout_s: float = 10.0,
) -> list[Hit]:
    """Open the prompts (all at once, or ``open_per_step`` more at each step; a request's
    L3 prefetch starts when it opens), then step: ``sync()``, release the requests
    admitted ``hold_steps`` steps ago with their KV kept, and admit each waiting request
    the policy lets in (in prompt order, while fewer than ``max_running`` run; one L1
    cannot take stays waiting), checking its cached prefix byte for byte and "computing"
    the rest. An admitted request waits for the loads it needs (an agreed wait); one whose
    load failed on some rank fails on every rank and is requeued, to recompute. Returns each request's hit, in
    prompt order."""
    n = len(prompts)
    batch = n if open_per_step is None else open_per_step
    reqs: list[CacheRequest] = []
    hits: list[Hit | None] = [None] * n
    waiting: list[int] = []
    running: list[tuple[int, int]] = []  # (step to release at, prompt index)
    for step in range(max_steps):
        for i in range(len(reqs), min(n, len(reqs) + batch)):
            reqs.append(cache.open(list(prompts[i]), compute_last=False))
            waiting.append(i)
        cache.sync()
        for _, i in [r for r in running if r[0] <= step]:
            cache.release(reqs[i], list(prompts[i]))
        running = [r for r in running if r[0] > step]
        still: list[int] = []
        for i in waiting:
            req, tokens = reqs[i], list(prompts[i])
            full_batch = max_running is not None and len(running) >= max_running
            if full_batch or not (cache.ready(req) and cache.admit(req, tokens)):
                still.append(i)
                continue
            if cache.full.pages.host_pool is not None:
                # the loads it needs landed or failed on every rank
                cache.full.pages.host.wait_idle()
                cache.sync()  # a failed load fails its requests here, on every rank alike
            if req.failed is not None:  # recomputed from what L1 holds, later
                cache.requeue(req, tokens)
                still.append(i)
                continue
            # write_tokens looked up here, on every call: a test may replace it
            compute(cache, req, tokens, timeout_s, write=write_tokens)
            c = req.cached
            hits[i] = (c.device, c.host, c.storage)
            if hold_steps:
                running.append((step + hold_steps, i))
            else:
                cache.release(req, tokens)
        waiting = still
        if len(reqs) == n and not waiting and not running:
            return [h for h in hits if h is not None]
        time.sleep(step_s)
    raise AssertionError(f"{len(waiting)} requests still waiting after {max_steps} steps")
