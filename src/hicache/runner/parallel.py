"""Tensor parallelism inside a model: the rank group and the sharded layers.

A group of ``size`` ranks splits each layer's weights and one collective joins the slices:
:class:`ColumnParallelLinear` keeps output rows ``[rank * out / size, ...)``;
:class:`HeadParallelLinear` the output rows of a range of whole heads ``(first, count)``
(K/V heads fewer than the ranks replicated, :class:`~hicache.heads.HeadSplit`);
:class:`RowParallelLinear` input columns (partial outputs all-reduced, bias added once);
:class:`VocabParallelEmbedding` a range of vocabulary rows (others zero, summed);
:class:`ParallelLMHead` the rank's vocabulary rows, logits gathered so each rank holds the
full ``(N, vocab)``. Invariants: the vocabulary is padded to a multiple of ``size`` (zero
rows, logits cut off); every other split is exact, or :meth:`TPGroup.part` refuses it
naming the numbers; one rank means plain ``nn.Linear`` / ``nn.Embedding`` and no
collective. Checkpoint tensors are full-size: :func:`shard_dims` gives each split
parameter a :class:`Split` and :meth:`TPGroup.shard` cuts it; a fused parameter declares
:class:`RowPieces` (:class:`ShardedParams`, :func:`row_pieces`, :meth:`RowPieces.cut`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ColumnParallelLinear",
    "HeadParallelLinear",
    "Narrowable",
    "ParallelLMHead",
    "RowParallelLinear",
    "RowPieces",
    "ShardedParams",
    "Split",
    "TPGroup",
    "VocabParallelEmbedding",
    "gather_logits",
    "row_pieces",
    "shard_dims",
]


class Narrowable(Protocol):
    """What :meth:`TPGroup.shard` reads: a full ``shape`` and ``narrow(dim, start,
    length)``, the rows ``[start, start + length)`` along ``dim`` as a tensor. A
    ``torch.Tensor`` is one; so is a lazily read checkpoint tensor (its slice read alone)."""

    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True, eq=False)
class TPGroup:
    """A tensor-parallel group as one rank sees it: ``rank`` in ``[0, size)`` and the
    ``torch.distributed`` process group its collectives run on (None: the default group,
    or no group at all when ``size == 1``)."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor-parallel size={self.size!r} is invalid; must be >= 1")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank={self.rank!r} must be in [0, {self.size})")

    @classmethod
    def single(cls) -> TPGroup:
        """The group of one rank: no collective ever runs."""
        return cls()

    @classmethod
    def of(cls, group: object | None = None) -> TPGroup:
        """This process's place in ``group`` (default: the world) of an initialized
        ``torch.distributed``; the single group when it is not initialized."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls.single()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)  # type: ignore[arg-type]

    def part(self, total: int, what: str) -> int:
        """``total / size``: this rank's share of ``total`` ``what`` (heads, columns);
        ValueError naming both numbers when ``size`` does not divide it."""
        if total % self.size:
            raise ValueError(
                f"tensor-parallel size {self.size} does not divide the {total} {what}; "
                f"choose a size that divides it"
            )
        return total // self.size

    def shard(
        self,
        tensor: Narrowable,
        dim: int,
        padded: int | None = None,
        rows: tuple[int, int] | None = None,
        full: int | None = None,
    ) -> torch.Tensor:
        """This rank's slice of the full ``tensor`` along ``dim``: rows ``[rank * k,
        (rank + 1) * k)`` with ``k = (padded or tensor.shape[dim]) / size``, rows past the
        tensor's end (padding up to ``padded``) zeros; or, with ``rows = (start, length)``,
        exactly those rows, whatever the rank (a range of whole heads, which several ranks
        may hold alike). ``full``: the length ``dim`` must have (ValueError naming both
        otherwise). ``tensor``: a tensor, or a checkpoint tensor not read yet
        (:class:`Narrowable`), of which only the slice is read."""
        have = tensor.shape[dim]
        if full is not None and have != full:
            raise ValueError(f"dim {dim} of the full tensor is {have} long; want {full}")
        if rows is not None:
            start, length = rows
            if padded is not None or not (start >= 0 and length > 0 and start + length <= have):
                raise ValueError(
                    f"rows={rows} (start, length) of dim {dim} do not lie within its {have}"
                    f" rows{' (no padding with a row range)' if padded is not None else ''}"
                )
            return tensor.narrow(dim, start, length)
        k = self.part(padded or have, f"rows of dim {dim}")
        start = min(self.rank * k, have)
        piece = tensor.narrow(dim, start, max(0, min(start + k, have) - start))
        if piece.shape[dim] == k:
            return piece
        shape = list(piece.shape)
        shape[dim] = k - piece.shape[dim]
        return torch.cat([piece, piece.new_zeros(shape)], dim=dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` (same shape everywhere) concatenated along ``dim``, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place; returns ``x``."""
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(x, src, group=self.group)  # type: ignore[arg-type]
        return x


class _ShardedLinear(nn.Module):
    """What the column- and row-parallel linears hold: the full ``in_features`` and
    ``out_features``, this rank's ``weight (rows, cols)`` slice and, with ``bias``, a
    ``bias (rows,)``; uninitialized (the checkpoint loads them)."""

    def __init__(
        self, in_features: int, out_features: int, rows: int, cols: int, *, bias: bool, tp: TPGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(rows, cols))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None


class ColumnParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with this rank's ``out_features / size`` output rows of ``W``
    (and of ``b``): ``x (T, in)`` -> ``(T, out / size)``, no collective."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TPGroup) -> None:
        local = tp.part(out_features, "output features")
        super().__init__(in_features, out_features, local, in_features, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class HeadParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with the output rows (and bias entries) of whole heads ``[first,
    first + count)`` of ``num_heads`` heads ``head_dim`` wide: ``x (T, in)`` -> ``(T,
    count * head_dim)``, no collective. Column-parallel by heads, the range given rather
    than the rank's equal share: a K/V projection whose heads are fewer than the ranks
    holds on each rank the head its query heads read, the same rows on several ranks
    (:class:`~hicache.heads.HeadSplit` says which)."""

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        head_dim: int,
        heads: tuple[int, int],
        *,
        bias: bool,
        tp: TPGroup,
    ) -> None:
        first, count = heads
        if not (first >= 0 and count > 0 and first + count <= num_heads):
            raise ValueError(
                f"heads={heads} (first, count) do not lie within the {num_heads} heads"
            )
        rows = count * head_dim
        super().__init__(in_features, num_heads * head_dim, rows, in_features, bias=bias, tp=tp)
        self.head_dim = head_dim
        self.heads = (first, count)

    @property
    def rows(self) -> tuple[int, int]:
        """``(start, length)``: this rank's output rows of the full weight."""
        first, count = self.heads
        return first * self.head_dim, count * self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with this rank's ``in_features / size`` input columns of ``W``:
    ``x (T, in / size)`` -> ``(T, out)``, the partial products summed over the ranks and
    ``b`` (kept whole) added once after the sum."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TPGroup) -> None:
        local = tp.part(in_features, "input features")
        super().__init__(in_features, out_features, out_features, local, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # nn.Linear's one fused call: TP 1 is bit-identical to it
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def padded_vocab(vocab_size: int, tp: TPGroup) -> int:
    """``vocab_size`` rounded up to a multiple of the group's size."""
    return math.ceil(vocab_size / tp.size) * tp.size


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: this rank holds ids ``[start, start +
    rows)`` of the padded vocabulary. ``ids (T,)`` -> ``(T, dim)``: looked up where in range,
    zero elsewhere, summed over the ranks."""

    def __init__(self, vocab_size: int, dim: int, *, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded = padded_vocab(vocab_size, tp)
        self.rows = self.padded // tp.size
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Module):
    """The output projection split by vocabulary rows (as :class:`VocabParallelEmbedding`,
    whose weight it may share): ``hidden (N, dim)`` -> fp32 logits ``(N, vocab_size)`` on
    every rank (the ranks' slices gathered, the padding cut off)."""

    def __init__(self, vocab_size: int, dim: int, *, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded = padded_vocab(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.padded // tp.size, dim))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight``: a tied embedding's rows instead of this head's own."""
        w = self.weight if weight is None else weight
        return gather_logits(hidden, w, self.vocab_size, self.tp)


def gather_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup
) -> torch.Tensor:
    """The full fp32 logits ``(N, vocab_size)`` on every rank from this rank's vocabulary
    rows ``weight (padded / size, dim)`` (a :class:`ParallelLMHead`'s, or a tied
    :class:`VocabParallelEmbedding`'s): ``hidden (N, dim)`` projected onto them, the
    ranks' slices gathered in rank order and the padding rows cut off. With one rank:
    ``F.linear(hidden, weight).float()``."""
    logits = tp.all_gather(F.linear(hidden, weight).float(), dim=-1)
    return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size]


class Split(NamedTuple):
    """How one parameter is cut from its full checkpoint tensor: along ``dim``, which is
    ``full`` long in the checkpoint; ``padded``: the length it is padded to before the
    equal split (vocabulary rows; None: no padding); ``rows``: ``(start, length)``, an
    explicit row range (a :class:`HeadParallelLinear`'s heads; None: the rank's equal
    share). The fields are :meth:`TPGroup.shard`'s arguments: ``tp.shard(t, *split)``."""

    dim: int
    padded: int | None = None
    rows: tuple[int, int] | None = None
    full: int | None = None


def shard_dims(model: nn.Module) -> dict[str, Split]:
    """For every parameter of ``model`` that the parallel layers split: its name (as in
    ``named_parameters``) -> its :class:`Split` (``full`` always set). Parameters not
    listed are whole on every rank."""
    out: dict[str, Split] = {}
    for prefix, m in model.named_modules():
        base = f"{prefix}." if prefix else ""
        if isinstance(m, ColumnParallelLinear | HeadParallelLinear):
            rows = m.rows if isinstance(m, HeadParallelLinear) else None
            out[base + "weight"] = Split(0, rows=rows, full=m.out_features)
            if m.bias is not None:
                out[base + "bias"] = Split(0, rows=rows, full=m.out_features)
        elif isinstance(m, RowParallelLinear):
            out[base + "weight"] = Split(1, full=m.in_features)
        elif isinstance(m, VocabParallelEmbedding | ParallelLMHead):
            out[base + "weight"] = Split(0, m.padded, full=m.vocab_size)
    return out


@dataclass(frozen=True, slots=True)
class RowPieces:
    """A rank's slice of a full checkpoint tensor as ranges along ``dim``: the rows
    ``[start, start + length)`` of each ``(start, length)`` of ``pieces``, concatenated in
    order. A fused projection ``[a | b | c]`` whose parts each split by heads takes the
    rank's share of every part (:meth:`split`); replicated K/V heads take one range that
    several ranks share."""

    dim: int
    pieces: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if self.dim < 0 or not self.pieces or any(s < 0 or n < 1 for s, n in self.pieces):
            raise ValueError(f"RowPieces(dim={self.dim}, pieces={self.pieces}) is invalid")

    @classmethod
    def split(
        cls,
        sizes: Sequence[int],
        tp: TPGroup,
        what: str,
        *,
        dim: int = 0,
        unit: int | Sequence[int] = 1,
    ) -> RowPieces:
        """The consecutive parts of lengths ``sizes`` (their sum: the full length along
        ``dim``), each split evenly in whole blocks of ``unit`` rows (a head; one unit for
        all parts or one per part): this rank's share of every part. ValueError naming
        ``what`` when ``size`` does not divide a part's blocks."""
        units = [unit] * len(sizes) if isinstance(unit, int) else list(unit)
        pieces, start = [], 0
        for n, u in zip(sizes, units, strict=True):
            if n % u:
                raise ValueError(f"{what}: a part of {n} rows is not whole blocks of {u}")
            k = tp.part(n // u, what) * u
            pieces.append((start + tp.rank * k, k))
            start += n
        return cls(dim, tuple(pieces))

    @classmethod
    def within(
        cls, sizes: Sequence[int], ranges: Sequence[tuple[int, int]], *, dim: int = 0
    ) -> RowPieces:
        """The consecutive parts of lengths ``sizes``, of each the rows ``ranges[i] =
        (start, length)`` counted from the part's first row (a rank's heads, or a group
        several ranks share): one piece per part, adjacent pieces merged (:meth:`merged`).
        ValueError when a range does not lie within its part."""
        pieces, offset = [], 0
        for n, (start, length) in zip(sizes, ranges, strict=True):
            if not (start >= 0 and length > 0 and start + length <= n):
                raise ValueError(f"rows {(start, length)} do not lie within a part of {n} rows")
            pieces.append((offset + start, length))
            offset += n
        return cls.merged(pieces, dim=dim)

    @classmethod
    def merged(cls, pieces: Sequence[tuple[int, int]], *, dim: int = 0) -> RowPieces:
        """``pieces`` in order, each one that starts where the one before ends joined to
        it (fewer reads and copies, the same rows)."""
        out: list[tuple[int, int]] = []
        for start, length in pieces:
            if out and sum(out[-1]) == start:
                out[-1] = (out[-1][0], out[-1][1] + length)
            else:
                out.append((start, length))
        return cls(dim, tuple(out))

    @property
    def length(self) -> int:
        """Rows of the rank's slice along ``dim``."""
        return sum(n for _, n in self.pieces)

    def cut(self, tensor: Narrowable) -> torch.Tensor:
        """The rank's slice of the full ``tensor`` (only those rows read of a lazily read
        one); ValueError when a piece runs past the tensor's end."""
        full = tensor.shape[self.dim]
        if any(s + n > full for s, n in self.pieces):
            raise ValueError(f"pieces {self.pieces} run past the {full} rows of dim {self.dim}")
        parts = [tensor.narrow(self.dim, s, n) for s, n in self.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


@runtime_checkable
class ShardedParams(Protocol):
    """A module that declares its own parameters' slices: ``tp_pieces()`` maps a parameter
    name relative to the module (``"in_proj.weight"``; for a stacked expert parameter,
    ``"up_proj"``: the slice of ONE expert's checkpoint tensor) to its :class:`RowPieces`."""

    def tp_pieces(self) -> Mapping[str, RowPieces]: ...


def row_pieces(model: nn.Module) -> dict[str, RowPieces]:
    """Every parameter slice the modules of ``model`` declare (:class:`ShardedParams`), by
    full name (as in ``named_parameters``; a stacked expert parameter by its stacked
    name)."""
    out: dict[str, RowPieces] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, ShardedParams):
            base = f"{prefix}." if prefix else ""
            out.update({base + name: spec for name, spec in m.tp_pieces().items()})
    return out
