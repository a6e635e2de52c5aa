"""The per-step agreement of tensor-parallel ranks on the cache's asynchronous inputs.

Worker records (a copy landed, an L3 lookup found ``n`` pages, a read brought ``d``, a write
landed) and local clocks (prefetch deadlines) may differ between ranks, so the owner
(:class:`~hicache.cache.sync.CacheSync`) and its parties buffer them in
:class:`LocalRecords` and, once per step, hand :meth:`Agreement.agree` their in-flight ops,
one lane per party, each in op-id order, each with this rank's :class:`Vote`. Shape: ONE
all-reduce(min) of an int64 tensor of ``1 + capacity`` rows by :data:`FIELDS` columns; one
:class:`Verdict` per op (arrived on every rank, the minimum value, final everywhere, the
flag everywhere, ready on some rank). Invariants: only what arrived everywhere is applied,
with the agreed values; every rank calls ``agree`` the same number of times whatever its
local state; with one rank no collective is made (the verdict is the vote); ops beyond
``capacity`` wait, the oldest of each lane first (the lanes take turns); each row carries
its op key as ``k`` and ``-k``, so ranks that listed different ops all raise
:class:`RanksDiverged`. Why: ``docs/architecture.md``, "How ranks agree".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hicache.controller.completions import L3Lookup, L3Read, L3Write, Record
from hicache.controller.rank_group import RankGroup
from hicache.transfer import Completion

__all__ = [
    "CAPACITY",
    "FIELDS",
    "Agreement",
    "LocalRecords",
    "RanksDiverged",
    "ReadProgress",
    "Step",
    "Verdict",
    "Vote",
]

CAPACITY = 256
"""In-flight ops agreed per step (rows of the tensor below its header row)."""

FIELDS = 7
"""int64 columns per row: key, -key, arrived, value, final, flag, -ready."""

_KEY, _NEG_KEY, _ARRIVED, _VALUE, _FINAL, _FLAG, _NEG_READY = range(FIELDS)
_LANE_SHIFT = 48  # key = (lane + 1) << 48 | op_id


class RanksDiverged(RuntimeError):
    """The ranks listed different in-flight ops: their caches no longer run in step."""


@dataclass(frozen=True, slots=True)
class Vote:
    """This rank's local state of one in-flight op.

    ``arrived``: the op's record is here (a copy's completion, a lookup's result, a
    write's outcome; always True for a read in progress, whose value is its progress).
    ``value``: the record's value (a copy's ok flag, a lookup's hit pages, a read's done
    pages), ``>= 0``. ``final``: a read's last record is here. ``flag``: a read's
    component records are in L2. ``ready``: the prefetch policy would admit the
    request now, by this rank's clock.
    """

    op_id: int
    arrived: bool
    value: int = 0
    final: bool = False
    flag: bool = False
    ready: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """The agreed state of one op: ``arrived``, ``final`` and ``flag`` on every rank,
    ``value`` the minimum over ranks (meaningful when ``arrived``), ``ready`` on at least
    one rank (a rank whose deadline passed gives up for all)."""

    op_id: int
    arrived: bool
    value: int
    final: bool
    flag: bool
    ready: bool


@dataclass(frozen=True, slots=True)
class Step:
    """One agreement: the verdicts per lane (in the order of the votes, the first ones;
    ``deferred`` ops did not fit and wait for a later step) and ``gave_up``: some rank
    voted to give up the wait it is in (its deadline passed), so all give up together."""

    lanes: tuple[tuple[Verdict, ...], ...]
    gave_up: bool
    deferred: int


class Agreement:
    """The per-step all-reduce over ``ranks`` (see the module docstring).

    Pure bookkeeping around one collective; ``capacity`` rows per step (>= 1).
    """

    def __init__(self, ranks: RankGroup, capacity: int = CAPACITY) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.ranks = ranks
        self.capacity = capacity
        self.steps = 0
        """Agreements made so far (equal on every rank)."""

    def agree(self, lanes: Sequence[Sequence[Vote]], *, give_up: bool = False) -> Step:
        """Agree on the votes of every lane (one per party, each in increasing op-id
        order) and on ``give_up``; one all-reduce(min) of a ``(1 + capacity, FIELDS)``
        tensor (none with one rank: its verdicts are its votes, through the same rows)."""
        if not any(lanes) and not self.ranks.multi:  # one rank, nothing in flight
            self.steps += 1
            return Step(tuple(() for _ in lanes), give_up, 0)
        rows = _interleave([_ordered(i, votes) for i, votes in enumerate(lanes)], self.capacity)
        for _, v in rows:
            if v.value < 0:
                raise ValueError(f"op {v.op_id}: a vote's value must be >= 0, got {v.value}")
        deferred = sum(map(len, lanes)) - len(rows)
        out: list[list[Verdict]] = [[] for _ in lanes]
        if not self.ranks.multi:  # one rank: its verdict is its vote, no collective
            self.steps += 1
            for lane, v in rows:
                out[lane].append(Verdict(v.op_id, v.arrived, v.value, v.final, v.flag, v.ready))
            return Step(tuple(map(tuple, out)), give_up, deferred)
        data = [[len(rows), -len(rows), -int(give_up), 0, 0, 0, 0]]  # the header row
        for lane, v in rows:
            key = (lane + 1) << _LANE_SHIFT | v.op_id
            data.append(
                [key, -key, int(v.arrived), v.value, int(v.final), int(v.flag), -int(v.ready)]
            )
        self.steps += 1
        got = self._reduce(data)
        if got[0][0] != -got[0][1]:
            raise RanksDiverged(
                f"step {self.steps}: ranks agree on {got[0][0]} to {-got[0][1]} in-flight ops"
            )
        for i, (lane, v) in enumerate(rows, start=1):
            r = got[i]
            if r[_KEY] != -r[_NEG_KEY]:
                raise RanksDiverged(
                    f"step {self.steps}: row {i} holds op keys {r[_KEY]:#x} to {-r[_NEG_KEY]:#x}"
                    f" on different ranks (this rank: lane {lane} op {v.op_id})"
                )
            out[lane].append(
                Verdict(
                    op_id=v.op_id,
                    arrived=bool(r[_ARRIVED]),
                    value=int(r[_VALUE]),
                    final=bool(r[_FINAL]),
                    flag=bool(r[_FLAG]),
                    ready=bool(-r[_NEG_READY]),
                )
            )
        return Step(tuple(map(tuple, out)), gave_up=bool(-got[0][2]), deferred=deferred)

    def _reduce(self, data: list[list[int]]) -> list[list[int]]:
        """The elementwise minimum of ``data`` over the ranks: one all-reduce(min) of the
        fixed-shape tensor."""
        t = torch.zeros((1 + self.capacity, FIELDS), dtype=torch.int64)  # padding: neutral
        t[: len(data)] = torch.tensor(data, dtype=torch.int64)
        self.ranks.all_reduce_min(t)
        return t[: len(data)].tolist()


def _ordered(lane: int, votes: Sequence[Vote]) -> Sequence[Vote]:
    for a, b in itertools.pairwise(votes):
        if b.op_id <= a.op_id:
            raise ValueError(
                f"lane {lane} votes must be in increasing op-id order: {a.op_id}, {b.op_id}"
            )
    if votes and not 0 < votes[0].op_id < 1 << _LANE_SHIFT:
        raise ValueError(f"lane {lane} op id {votes[0].op_id} out of range")
    return votes


def _interleave(lanes: Sequence[Sequence[Vote]], capacity: int) -> list[tuple[int, Vote]]:
    """The first ``capacity`` votes of the ``lanes`` taking turns (oldest of each first),
    each with its lane's index."""
    tagged = [zip(itertools.repeat(i), votes, strict=False) for i, votes in enumerate(lanes)]
    turns = itertools.chain.from_iterable(itertools.zip_longest(*tagged))
    return list(itertools.islice(filter(None, turns), capacity))


@dataclass(frozen=True, slots=True)
class ReadProgress:
    """What this rank's L3 read records of one op said so far: ``done`` pages intact (the
    largest reported), ``final`` seen, component ``records`` in L2."""

    done: int = 0
    final: bool = False
    records: bool = False


class LocalRecords:
    """The worker records this rank received and did not apply yet, by op.

    The owner's ``sync`` puts every record of an op in flight here (nothing is applied
    before the ranks agreed, with one rank as with several); the owner's votes read it and, once an op's record is
    applied with the agreed values, the owner pops it. A read's records fold into one
    :class:`ReadProgress`.
    """

    def __init__(self) -> None:
        self.completions: dict[int, Completion] = {}
        self.lookups: dict[int, L3Lookup] = {}
        self.reads: dict[int, ReadProgress] = {}
        self.writes: dict[int, L3Write] = {}

    def put(self, r: Record) -> None:
        """Keep worker record ``r`` (a copy's :class:`Completion` or an L3 record)."""
        if isinstance(r, Completion):
            self.completions.setdefault(r.op_id, r)
        elif isinstance(r, L3Lookup):
            self.lookups.setdefault(r.op_id, r)
        elif isinstance(r, L3Read):
            got = self.reads.get(r.op_id, ReadProgress())
            self.reads[r.op_id] = replace(
                got,
                done=max(got.done, r.done_pages),
                final=got.final or r.final,
                records=got.records or r.records,
            )
        else:
            self.writes.setdefault(r.op_id, r)

    def clear(self) -> None:
        """Forget every record (their ops were given up)."""
        self.completions.clear()
        self.lookups.clear()
        self.reads.clear()
        self.writes.clear()

    def __len__(self) -> int:
        return len(self.completions) + len(self.lookups) + len(self.reads) + len(self.writes)
