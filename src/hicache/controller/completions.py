"""The one completion queue: every worker thread posts immutable records, the owner applies.

Workers (the L1<->L2 transfer worker, the L3 prefetch and backup threads) never touch the
tree or the owner's bookkeeping. Each finished piece of work becomes one frozen record put
on a :class:`CompletionQueue`; the owner (:class:`hicache.cache.sync.CacheSync`) drains the
queue on its own thread and applies the records once the ranks agreed on them.

Records of the L1<->L2 copies are :class:`hicache.transfer.Completion`; the L3 records are
defined here.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Union

from hicache.transfer import Completion

__all__ = ["CompletionQueue", "ComponentFound", "L3Lookup", "L3Read", "L3Write", "Record"]


@dataclass(frozen=True, slots=True)
class ComponentFound:
    """Which of one component's looked-up records are present: indices ``i`` (ascending)
    into the component keys the lookup was given (see
    :class:`~hicache.controller.storage_controller.ComponentLookup`)."""

    name: str
    present: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class L3Lookup:
    """An L3 lookup finished: the first ``hit_pages`` keys of op ``op_id`` are present
    (0 after an error or a timeout). ``components``: for a lookup with component keys
    (recurrent-state snapshots, sliding-window pages), which of them are present, per
    component (only those within reach of the full-KV run found were looked up).
    ``skipped``: keys of the run not asked because the negative cache remembered one of
    them missing (the run's length: no store call for the run at all). ``error``: why the
    lookup failed (the backend's reason; empty when it did not: a miss is no failure).
    ``waited``: the run stopped at an announced page (:mod:`hicache.storage.announce`) and
    the lookup waited for it; ``expired``: that wait ended at its bound with the page
    still announced and absent; ``unwaited``: the run stopped at an announced page and the
    lookup did not wait, as no run it could reach was worth a wait
    (:class:`~hicache.controller.announced.WaitGain`). ``seconds``: how long the store took to answer the run
    (its ``exists_run`` call; 0 when no call was made, or after an announced wait: what
    a lookup costs, :mod:`hicache.rates`)."""

    op_id: int
    hit_pages: int
    components: tuple[ComponentFound, ...] = ()
    skipped: int = 0
    error: str = ""
    waited: bool = False
    expired: bool = False
    unwaited: bool = False
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class L3Read:
    """Progress of an L3 -> L2 read: the first ``done_pages`` host pages of op ``op_id``
    hold intact records (and, for a read with component records, so do their L2 ids; a
    failed component read reports 0). ``final`` is True on the op's last record, posted only once no
    byte can land in any host page of the op any more (a backend call that overran its
    deadline has returned); until then the owner must keep every page of the op.
    ``records``: True on the record posted once every component record of the op is in
    its L2 id (before any page is read; a read of component records alone, with no
    pages, says only so that it succeeded); False on every other record. ``nbytes`` and
    ``seconds``: on a progress record of a batch of pages read whole, the batch's bytes
    in L2 (this rank's full KV of its pages) and the seconds the backend call took; 0 on
    every other record (what restoring from L3 costs: :mod:`hicache.rates`)."""

    op_id: int
    done_pages: int
    final: bool
    records: bool = False
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class L3Write:
    """An L2 -> L3 write finished: of ``pages`` records (full-KV pages, or one
    component's records), ``written`` were stored now, ``present`` were in L3 already, the
    rest failed."""

    op_id: int
    pages: int
    written: int
    present: int

    @property
    def failed(self) -> int:
        return self.pages - self.written - self.present


Record = Union[Completion, L3Lookup, L3Read, L3Write]  # noqa: UP007 - a runtime alias


class CompletionQueue:
    """A thread-safe FIFO of :data:`Record`; many producers, one consumer (the owner)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Record] = queue.SimpleQueue()

    def post(self, record: Record) -> None:
        """Producer side: any thread."""
        self._q.put(record)

    def drain(self) -> list[Record]:
        """Consumer side: every record posted so far, oldest first (non-blocking)."""
        out: list[Record] = []
        q = self._q
        while not q.empty():  # one consumer: what it saw stays there
            out.append(q.get_nowait())
        return out

    def wait(self, timeout_s: float) -> list[Record]:
        """Consumer side: wait up to ``timeout_s`` for one record, then drain; [] if none."""
        try:
            first = self._q.get(timeout=timeout_s)
        except queue.Empty:
            return []
        return [first, *self.drain()]
