"""Shared steps of the engine serving tests: the walk of one prompt through every tier
(cold, L1, L2 after forced eviction, a file L3 after ``flush_cache``), a batch of
concurrent requests (and the retractions they force), and the idle check that closes
every test.

Every step asserts exact results: the output ids equal the reference continuation
``want`` each time, and the cached counts name the tier the prefix came from.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hicache.cache.report import check_integrity
from hicache.engine.front.engine import Engine
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams


def assert_idle(engine: Engine) -> None:
    """No request held, every recurrent state dropped (a model with some), pins zero,
    integrity clean (after the pending backups finished)."""

    def check() -> None:
        assert engine.core.scheduler.idle
        assert len(engine.core.cache.admitted) == 0
        states = engine.core.scheduler.runner.states
        assert states is None or len(states) == 0
        engine.core.cache.sync(wait=True)
        check_integrity(engine.core.cache)
        assert all(
            n.lock_ref == 0 and n.host_ref == 0
            for n in engine.core.cache.full.pages.tree.iter_nodes()
        )

    engine.call(check).result(timeout=30)


def demote_all(engine: Engine) -> int:
    """On the engine thread: finish the backups (nodes unpinned), then evict all of L1;
    the number of tokens evicted."""

    def demote() -> int:
        engine.core.cache.sync(wait=True)
        return engine.core.cache.full.pages.evict_device(10**6)

    return engine.call(demote).result(timeout=30)


def count_retractions(engine: Engine) -> list[str]:
    """From now on, the id of every request ``engine``'s scheduler retracts, appended to
    the returned list as it happens (the retraction itself unchanged)."""
    retracted: list[str] = []
    retract = engine.core.scheduler._retract

    def counting(req: Any, **kw: Any) -> None:
        retracted.append(req.rid)
        retract(req, **kw)

    engine.core.scheduler._retract = counting
    return retracted


@dataclass(frozen=True)
class TierWalk:
    """The four outputs of one prompt walked through the tiers (see :func:`walk_tiers`)."""

    cold: RequestOutput
    from_l1: RequestOutput
    from_l2: RequestOutput
    from_l3: RequestOutput


def walk_tiers(
    engine: Engine,
    ids: list[int],
    params: SamplingParams,
    want: list[int],
    matched: int,
    *,
    after_l3_backup: Callable[[], None] | None = None,
) -> TierWalk:
    """Serve ``ids`` four times on ``engine`` (which has a file L3): cold (nothing
    cached), from L1 (``matched`` tokens on the device), from L2 after :func:`demote_all`
    (``matched`` on the host), and from L3 after every backup reached it and
    ``flush_cache`` emptied L1 and L2 (``matched`` from storage); each time the output is
    ``want``. ``after_l3_backup`` runs between the L3 backups and ``flush_cache``. Ends
    with :func:`assert_idle`."""
    cold = engine.generate(ids, params, timeout=60)
    assert cold.cached.total == 0 and cold.output_ids == want
    from_l1 = engine.generate(ids, params, timeout=60)
    assert from_l1.cached.device == matched and from_l1.output_ids == want
    assert demote_all(engine) > 0
    from_l2 = engine.generate(ids, params, timeout=60)
    assert from_l2.cached.device == 0 and from_l2.cached.host == matched
    assert from_l2.output_ids == want
    engine.call(lambda: engine.core.cache.sync(wait=True)).result(
        timeout=60
    )  # every backup reaches L3
    if after_l3_backup is not None:
        after_l3_backup()
    assert engine.flush_cache()  # L1 and L2 emptied
    from_l3 = engine.generate(ids, params, timeout=60)
    assert from_l3.cached.storage == matched and from_l3.cached.device == 0
    assert from_l3.output_ids == want
    assert_idle(engine)
    return TierWalk(cold=cold, from_l1=from_l1, from_l2=from_l2, from_l3=from_l3)


def assert_hits_storage(
    engine: Engine, ids: list[int], params: SamplingParams, want: list[int], matched: int
) -> None:
    """A fresh ``engine`` on another's file L3: ``ids`` hits ``matched`` tokens of its
    records and gives ``want``; then :func:`assert_idle`."""
    again = engine.generate(ids, params, timeout=60)
    assert again.cached.storage == matched and again.output_ids == want
    assert_idle(engine)


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Submit every prompt at once; their output ids in prompt order (none may fail)."""
    results: dict[int, list[int]] = {}
    errors: list[str] = []
    done = threading.Event()

    def on(i: int) -> Callable[[RequestOutput], None]:
        def cb(out: RequestOutput) -> None:
            if out.finished:
                if out.error:
                    errors.append(out.error)
                results[i] = out.output_ids
                if len(results) == len(prompts):
                    done.set()

        return cb

    for i, p in enumerate(prompts):
        engine.submit(p, params, on(i))
    assert done.wait(120)
    assert not errors
    return [results[i] for i in range(len(prompts))]
