"""Which decode ranks one prefill rank writes, and which bytes of each row: :func:`shares_of`.

A pair may run at two tensor-parallel sizes. A store whose rows are whole on every rank
(an MLA latent, indexer keys) goes whole to each decode rank ``d``, from prefill rank
``d % prefill.tp_size``. A store split by K/V heads (:class:`~hicache.heads.HeadSplit`) goes
head by head: every head a decode rank holds is written once, by one prefill rank holding
it (of a head's replicas, the ``d % replicas``-th: the decode ranks spread over them), as
the :class:`~hicache.disagg.pages.Columns` of its rows. Invariant: for every store and
decode rank, the prefill ranks' shares cover its row exactly once. Pure: no IO.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.disagg.layout import InstanceLayout
from hicache.disagg.pages import Columns

__all__ = ["Share", "shares_of"]


@dataclass(frozen=True, slots=True)
class Share:
    """What a prefill rank writes of one store to ``decode_rank``: ``columns`` of every
    row (None: the whole rows)."""

    decode_rank: int
    columns: Columns | None


def shares_of(
    prefill: InstanceLayout, decode: InstanceLayout, store: str, rank: int
) -> list[Share]:
    """What prefill rank ``rank`` writes of ``store`` to the decode ranks (in decode-rank
    order, a decode rank's column runs in head order). The layouts must have passed
    :func:`~hicache.disagg.layout.check_pair`; KeyError for a store neither has."""
    sp = next(s for s in prefill.stores if s.name == store)
    sd = next(s for s in decode.stores if s.name == store)
    out: list[Share] = []
    if not sp.kv_heads:
        return [Share(d, None) for d in range(decode.tp_size) if d % prefill.tp_size == rank]
    mine = prefill.heads(sp, rank)
    first = prefill.heads(sp, 0)
    assert mine is not None and first is not None
    head_bytes = prefill.head_bytes(sp)
    for d in range(decode.tp_size):
        theirs = decode.heads(sd, d)
        assert theirs is not None
        pick = d % first.replicas
        run: list[int] = []
        for h in theirs.kv_heads:
            if first.writer(h) + pick != rank:
                continue
            if run and h != run[-1] + 1:
                out.append(_share(d, run, mine.first_kv_head, theirs.first_kv_head, head_bytes))
                run = []
            run.append(h)
        if run:
            out.append(_share(d, run, mine.first_kv_head, theirs.first_kv_head, head_bytes))
    return out


def _share(d: int, heads: list[int], src_first: int, dst_first: int, head_bytes: int) -> Share:
    h0 = heads[0]
    cols = Columns(
        (h0 - src_first) * head_bytes, (h0 - dst_first) * head_bytes, len(heads) * head_bytes
    )
    return Share(d, cols)
