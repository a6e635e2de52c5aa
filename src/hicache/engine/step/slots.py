"""Who gets a running slot: the order waiting requests are admitted in, and which running
sequence gives a slot lent past its group's cap back. Pure functions over the requests
(no cache, no runner); :class:`~hicache.engine.step.scheduler.Scheduler` applies them.

A *group* is one client request (its ``n`` copies and batched prompts); ``cap`` is the
running slots a group is guaranteed (None: no group rule). With ``lend`` a group may run
past its cap on idle slots (its waiting requests are then *borrowers*, ordered after
every *claimant*, a request of a group below its cap); without it they are left out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from hicache.engine.request import Request


def used_slots(running: Sequence[Request]) -> Counter[str]:
    """Running slots per group."""
    return Counter(r.group for r in running)


def admission_order(
    waiting: Sequence[Request],
    running: Sequence[Request],
    *,
    cap: int | None,
    lend: bool,
    full: bool,
    cached: Callable[[Request], int] | None,
) -> list[Request]:
    """``waiting`` in the order they are tried: claimants before borrowers; then higher
    ``priority``; then the group holding fewer running slots (round-robin among client
    requests); then the longest cached prefix (``cached``: tokens a request would find,
    None for ``fcfs``); then queue order. ``full``: every slot is taken, so no borrower can
    come in and none is matched. Borrowers are left out without ``lend``."""
    held = used_slots(running) if cap is not None else Counter[str]()

    def at_cap(req: Request) -> bool:
        return cap is not None and held[req.group] >= cap

    def prefix(req: Request) -> int:
        return 0 if cached is None or (full and at_cap(req)) else cached(req)

    keyed = [
        (at_cap(req), -req.priority, held[req.group], -prefix(req), i, req)
        for i, req in enumerate(waiting)
        if lend or not at_cap(req)
    ]
    keyed.sort(key=lambda k: k[:5])
    return [k[5] for k in keyed]


def lent_slot(
    running: Sequence[Request], cap: int, among: Sequence[Request] | None = None
) -> Request | None:
    """The running sequence (of ``among``; default every running one) that gives a lent
    slot back first, or None when no group holds more than ``cap``. Lowest ``priority``
    first (what the rule protects last), then the group most over its cap; within it the
    sequence retracted the fewest times so far, then the one with the fewest output tokens,
    the most recently admitted among equals.

    Why, in that order: a client request ends with its last copy, so each retraction (a
    few steps' delay for the copy) should fall on a different copy: picking the least
    progressed one alone would pick the same copy again and again (it is least progressed
    *because* it was retracted), and that copy's delays add up (measured: the fairness
    bench's ``n: 64`` request took 288 steps that way against 257 without a rule, 259 with
    this order; see ``docs/benchmarks/fairness.md``). Among copies retracted equally often, the
    least progressed holds the least KV of its own (its siblings' shared prompt stays
    pinned) so its re-admission costs the least, and the copies closest to their end keep
    running and free their slots soonest."""
    held = used_slots(running)
    order = {id(r): i for i, r in enumerate(running)}
    lent = [r for r in (running if among is None else among) if held[r.group] > cap]
    if not lent:
        return None
    return min(
        lent,
        key=lambda r: (r.priority, -held[r.group], r.retracted, len(r.output_ids), -order[id(r)]),
    )
