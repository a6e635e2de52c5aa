"""Which heads a tensor-parallel rank holds, and which rank writes each K/V head.

Heads in groups that share a per-group input: attention's query heads in K/V heads; the
same split serves Mamba2's heads in groups (B/C) and Gated DeltaNet's value heads in key
heads (``names`` labels the refusal). Heads are always split: rank ``r`` of ``size`` holds
heads ``[r * H / size, (r + 1) * H / size)``. Groups (K/V heads) are split the same way
while there are at least as many of them as ranks; when ranks outnumber them, each is
*replicated*: ``size / H_kv`` consecutive ranks hold the same one, the group their heads
read (as SGLang and vLLM do). A size is refused, naming the numbers, when it divides
neither way: ``size`` must divide ``H``, and either ``size`` divides ``H_kv`` or ``H_kv``
divides ``size``.

The writer rule for bytes several ranks hold: the lowest rank holding a K/V head writes
its L3 records (:meth:`HeadSplit.writes`), every rank holding it reads them; the same
single-writer argument as MLA, where every rank holds the whole latent and rank 0 writes.

This module is pure: no torch, no threads, no IO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hicache.validate import int_at_least, require

__all__ = ["HeadSplit", "record_group"]


def record_group(num_kv_heads: int, tp_lcm: int) -> int:
    """K/V heads per L3 record when the servers sharing an L3 all have TP sizes dividing
    ``tp_lcm``: ``H_kv / gcd(tp_lcm, H_kv)``, the largest group every such size's ranks
    hold whole (a size ``n <= H_kv`` divides ``gcd``, so its ``H_kv / n`` heads are whole
    groups; a larger one replicates single heads, and ``H_kv`` divides ``tp_lcm``)."""
    int_at_least("num_kv_heads", num_kv_heads, 1)
    int_at_least("tp_lcm", tp_lcm, 1)
    return num_kv_heads // math.gcd(tp_lcm, num_kv_heads)


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """The heads of rank ``tp_rank`` in a group of ``tp_size``, for a model of
    ``num_heads`` query and ``num_kv_heads`` K/V heads (or heads in groups: ``names``, the
    config fields of the two counts, as a refusal names them). Construction checks the
    split (ValueError naming the numbers)."""

    num_heads: int
    num_kv_heads: int
    tp_size: int = 1
    tp_rank: int = 0
    names: tuple[str, str] = ("num_attention_heads", "num_key_value_heads")

    def __post_init__(self) -> None:
        int_at_least("num_heads", self.num_heads, 1)
        int_at_least("num_kv_heads", self.num_kv_heads, 1)
        int_at_least("tp_size", self.tp_size, 1)
        require(
            isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size,
            "tp_rank",
            self.tp_rank,
            f"must be an int in [0, {self.tp_size})",
        )
        h, kv, n = self.num_heads, self.num_kv_heads, self.tp_size
        if h % kv:
            raise ValueError(f"num_heads={h} is not a multiple of num_kv_heads={kv}")
        if h % n or (kv % n and n % kv):
            heads, groups = self.names
            raise ValueError(
                f"tensor-parallel size {n} cannot split {heads}={h}, {groups}={kv}: the size"
                f" must divide {heads}, and either divide {groups} or be a multiple of it"
                f" (then replicated, each held by size / {kv} ranks)"
            )

    @property
    def replicas(self) -> int:
        """Ranks holding each K/V head: 1 when the heads are split, ``size / H_kv`` when
        they are replicated."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def local_heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.tp_size

    @property
    def first_head(self) -> int:
        """This rank's first query head."""
        return self.tp_rank * self.local_heads

    @property
    def local_kv_heads(self) -> int:
        """K/V heads on this rank (1 when they are replicated)."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def first_kv_head(self) -> int:
        """This rank's first K/V head (model numbering)."""
        return (self.tp_rank // self.replicas) * self.local_kv_heads

    @property
    def kv_heads(self) -> range:
        """This rank's K/V heads, model numbering."""
        return range(self.first_kv_head, self.first_kv_head + self.local_kv_heads)

    def writer(self, kv_head: int) -> int:
        """The lowest rank holding ``kv_head``: the one that writes its L3 records."""
        require(
            isinstance(kv_head, int) and 0 <= kv_head < self.num_kv_heads,
            "kv_head",
            kv_head,
            f"must be an int in [0, {self.num_kv_heads})",
        )
        return (kv_head // self.local_kv_heads) * self.replicas

    def writes(self, kv_head: int) -> bool:
        """Whether this rank writes ``kv_head``'s L3 records (it holds it, and no lower rank
        does)."""
        return self.writer(kv_head) == self.tp_rank

    @property
    def writes_any(self) -> bool:
        """Whether this rank is the writer of its K/V heads (the first of their replicas)."""
        return self.tp_rank % self.replicas == 0

    def record_groups(self, group: int) -> range:
        """This rank's L3 records of ``group`` K/V heads each: record ``j`` holds heads
        ``[j * group, (j + 1) * group)``. ValueError naming the numbers unless the rank
        holds whole groups."""
        int_at_least("group", group, 1)
        if self.local_kv_heads % group or self.num_kv_heads % group:
            raise ValueError(
                f"rank {self.tp_rank} of tensor-parallel size {self.tp_size} holds"
                f" {self.local_kv_heads} of {self.num_kv_heads} K/V heads, not whole L3"
                f" records of {group} heads: the servers sharing an L3 must give a"
                f" --hicache-storage-tp-lcm that their TP sizes all divide"
            )
        first = self.first_kv_head // group
        return range(first, first + self.local_kv_heads // group)

    def writes_record(self, record: int, group: int) -> bool:
        """Whether this rank writes record ``record`` of ``group`` heads (it holds the
        record's heads and no lower rank does)."""
        return self.writes(record * group)
