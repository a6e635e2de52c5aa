"""CUDA graphs for decode-only batches of a model that declares
:attr:`~hicache.runner.models.cached.CachedModel.supports_decode_graphs`, one per bucket.

Static buffers for the largest bucket ``max_bs`` (bucket ``bs`` uses the first ``bs``
rows): ``meta (4, max_bs)`` int64 (:attr:`DecodeGraphs.input_ids`, ``positions``,
``write_slots``, ``lengths``), ``table (max_bs, ceil(context_length / page_size))`` int64
page ids, ``logits (max_bs, vocab)`` fp32, plus one shared graph pool (captured largest
first). Invariants: a batch of ``B`` runs as the smallest bucket ``bs >= B``; padding rows
write only to ``scratch_page`` (reserved, never a request's or the tree's) and every row is
rewritten each step, so padding never changes a real row's logits; a batch that does not
fit (:meth:`DecodeGraphs.run` returns None) runs eagerly; under tensor parallelism every
rank captures and replays the same buckets (NCCL only). Why the forward is capturable and
padding harmless: ``docs/architecture.md``, "CUDA graphs for decode".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hicache.memory import DevicePool
from hicache.runner.models.attention import AttentionContext, DecodeGather
from hicache.runner.models.cached import CachedModel

__all__ = ["DecodeGraphs", "decode_buckets", "table_width_for"]

WARMUP_STEPS = 2
"""Eager runs of a bucket on a side stream before its capture (allocator, Triton compile)."""


def decode_buckets(max_bs: int) -> tuple[int, ...]:
    """Batch-size buckets up to ``max_bs`` (>= 1), SGLang-like: 1, 2, 4, 8, 12, 16, then every
    8, and ``max_bs`` itself last (so every batch of at most ``max_bs`` has a bucket)."""
    if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1:
        raise ValueError(f"max_bs={max_bs!r} is invalid; must be an int >= 1")
    small = [b for b in (1, 2, 4, 8, 12) if b < max_bs]
    return (*small, *range(16, max_bs, 8), max_bs)


def table_width_for(context_length: int, page_size: int, max_pages: int) -> int:
    """Page-table columns for sequences of up to ``context_length`` tokens: their pages,
    at most ``max_pages`` (the most one sequence can hold: the pool's pages less the
    reserved ones)."""
    return max(1, min(math.ceil(context_length / page_size), max_pages))


class DecodeGraphs:
    """Decode-only forwards of ``model`` over ``pool`` through static buffers, per bucket.

    ``scratch_page``: a pool page reserved for padding rows (see the module docstring);
    ``max_bs``: the largest batch served (buckets from :func:`decode_buckets` unless
    ``buckets`` is given, ascending, ending at ``max_bs``); ``table_width``: page-table
    columns (:func:`table_width_for`). Nothing is captured until :meth:`capture` (CUDA
    only); until then :meth:`run` runs the bucket's function eagerly on the buffers.
    """

    def __init__(
        self,
        model: CachedModel,
        pool: DevicePool,
        *,
        scratch_page: int,
        max_bs: int,
        table_width: int,
        buckets: Sequence[int] | None = None,
    ) -> None:
        if not model.supports_decode_graphs:
            raise ValueError(
                f"CUDA graphs serve a plain DecoderLM (Llama / Qwen2 / Qwen3), not"
                f" {type(model).__name__}: hybrids carry recurrent state or sliding-window pools"
            )
        if model.device != pool.device:
            raise ValueError(f"pool on {pool.device} but model on {model.device}")
        if not 0 <= scratch_page < pool.num_pages:
            raise ValueError(f"scratch_page={scratch_page} is not a page of the pool")
        if table_width < 1:
            raise ValueError(f"table_width={table_width} is invalid; must be >= 1")
        self.buckets = tuple(buckets) if buckets is not None else decode_buckets(max_bs)
        if (
            not self.buckets
            or list(self.buckets) != sorted(set(self.buckets))
            or self.buckets[0] < 1
            or self.buckets[-1] != max_bs
        ):
            raise ValueError(
                f"buckets={self.buckets} must be distinct, ascending, >= 1 and end at"
                f" max_bs={max_bs}"
            )
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.page_size = pool.page_size
        self.scratch_page = scratch_page
        self.scratch_slot = scratch_page * pool.page_size
        """The slot every padding row writes its K/V to (and reads back)."""
        self.max_bs = max_bs
        self.table_width = table_width
        self.replays = 0
        """Batches served through the buffers (replayed, or run eagerly before capture)."""
        vocab = model.config.vocab_size
        with torch.inference_mode():
            self.meta = torch.empty((4, max_bs), dtype=torch.int64, device=self.device)
            self.table = torch.full(
                (max_bs, table_width), scratch_page, dtype=torch.int64, device=self.device
            )
            self.logits = torch.zeros((max_bs, vocab), dtype=torch.float32, device=self.device)
            self.meta.copy_(self._padding(max_bs))
        self._contexts = {bs: self._context(bs) for bs in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    # ------------------------------------------------------------------ buffers

    @property
    def input_ids(self) -> torch.Tensor:
        """``(max_bs,)`` int64: each row's token."""
        return self.meta[0]

    @property
    def positions(self) -> torch.Tensor:
        """``(max_bs,)`` int64: each row's position (RoPE)."""
        return self.meta[1]

    @property
    def write_slots(self) -> torch.Tensor:
        """``(max_bs,)`` int64: the slot each row's K/V are written to."""
        return self.meta[2]

    @property
    def lengths(self) -> torch.Tensor:
        """``(max_bs,)`` int64: keys each row attends to (its new token included)."""
        return self.meta[3]

    @property
    def captured(self) -> bool:
        """Whether :meth:`run` replays CUDA graphs (else it runs the buckets eagerly)."""
        return bool(self._graphs)

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences; None when none does."""
        for bs in self.buckets:
            if bs >= num_seqs:
                return bs
        return None

    def _padding(self, rows: int) -> torch.Tensor:
        """``(4, rows)`` CPU meta of padding rows: token 0 at position 0, K/V written to
        the scratch slot, one key (that slot)."""
        pad = torch.zeros((4, rows), dtype=torch.int64)
        pad[2] = self.scratch_slot
        pad[3] = 1
        return pad

    def _context(self, bs: int) -> AttentionContext:
        """The attention inputs of bucket ``bs``: views of the first ``bs`` buffer rows; every
        row a single-token sequence attended by the Triton decode kernel by page (the
        kernel ignores ``mask``; ``seq_slots`` are never read when every row is in the
        decode group)."""
        write = self.write_slots[:bs]
        gather = DecodeGather(
            seqs=frozenset(range(bs)),
            rows=torch.arange(bs, device=self.device),
            index=self.table[:bs],
            mask=torch.ones((bs, 1, 1, 1), dtype=torch.bool, device=self.device),
            lengths=self.lengths[:bs],
            by_page=True,
            page_size=self.page_size,
            kernel=True,
        )
        return AttentionContext(
            pool=self.pool,
            seq_slots=[write[i : i + 1] for i in range(bs)],
            extend_lens=[1] * bs,
            write_slots=write,
            masks=[None] * bs,
            decode=gather,
        )

    # ------------------------------------------------------------------ the step

    def _step(self, bs: int) -> None:
        """What bucket ``bs``'s graph records: the forward over the first ``bs`` buffer
        rows, logits into ``self.logits[:bs]``."""
        ctx = self._contexts[bs]
        hidden = self.model.forward_batch(self.input_ids[:bs], self.positions[:bs], ctx).hidden
        self.logits[:bs].copy_(self.model.compute_logits(hidden))

    def _stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_slots: Sequence[torch.Tensor],
        bs: int,
    ) -> bool:
        """Copy a batch into the first ``bs`` buffer rows (padding after it); False (and
        nothing copied) when a sequence is longer than the table or its slots do not lie
        over whole pages in order."""
        b, ps = len(seq_slots), self.page_size
        lengths = [int(s.shape[0]) for s in seq_slots]
        if max(lengths) > self.table_width * ps:
            return False
        flat = torch.cat([s.to("cpu", torch.int64) for s in seq_slots])
        lens = torch.tensor(lengths, dtype=torch.int64)
        ends = lens.cumsum(0)
        seq = torch.repeat_interleave(torch.arange(b), lens)
        pos = torch.arange(flat.shape[0]) - (ends - lens)[seq]  # position within its sequence
        offset = pos % ps
        start = flat - offset  # the slot its page starts at, if it lies on whole pages
        if ps > 1 and not bool(
            ((start % ps == 0) & (start == start[torch.arange(flat.shape[0]) - offset])).all()
        ):
            return False
        heads = offset == 0
        width = -(-max(lengths) // ps)
        table = torch.full((bs, width), self.scratch_page, dtype=torch.int64)
        table[seq[heads], pos[heads] // ps] = start[heads] // ps
        meta = self._padding(bs)
        meta[0, :b] = input_ids.to("cpu", torch.int64)
        meta[1, :b] = positions.to("cpu", torch.int64)
        meta[2, :b] = flat[ends - 1]
        meta[3, :b] = lens
        self.meta[:, :bs].copy_(meta)
        self.table[:bs, :width].copy_(table)
        return True

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_slots: Sequence[torch.Tensor],
        *,
        bucket: int | None = None,
    ) -> torch.Tensor | None:
        """Logits ``(B, vocab)`` fp32 of a decode-only batch of ``B = len(seq_slots)``
        sequences: ``input_ids``/``positions (B,)``, ``seq_slots[i]`` sequence ``i``'s
        slots (its new token's last), as in :class:`~hicache.runner.model_runner.ForwardBatch`.
        Writes each new token's K/V into its slot, as the eager forward does. None
        (nothing run or written) when the batch does not fit: more sequences than
        ``max_bs``, a sequence longer than the table, slots not over whole pages.
        ``bucket``: run in this bucket instead of the smallest that holds the batch (the
        probe checks more than one); ValueError when it is not a bucket or too small."""
        b = len(seq_slots)
        bs = self.bucket_for(b) if b else None
        if bucket is not None:
            if bucket not in self.buckets or bucket < b:
                raise ValueError(f"bucket={bucket} is not one of {self.buckets} holding {b}")
            bs = bucket
        if bs is None or input_ids.shape != (b,) or positions.shape != (b,):
            return None
        if not self._stage(input_ids, positions, seq_slots, bs):
            return None
        graph = self._graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._step(bs)
        self.replays += 1
        return self.logits[:b].clone()

    # ------------------------------------------------------------------ capture (CUDA)

    def capture(self) -> int:
        """Capture every bucket's step as a CUDA graph, largest first, into one shared
        memory pool, each after :data:`WARMUP_STEPS` eager runs on a side stream (they
        write K/V only to the scratch slot: every row is padding then). No tensor of the
        pool outlives a replay (the logits land in :attr:`logits`, outside it), so the
        buckets may replay in any order although they share the pool.
        Returns the bytes the capture reserved on the device (the graph pool and the
        warm-up's leftovers). Raises whatever capture raises (no graph kept then);
        a CPU pool raises ValueError."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        device = self.device
        with torch.cuda.device(device), torch.inference_mode():
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_reserved(device)
            self.meta.copy_(self._padding(self.max_bs).to(device))  # padding: scratch writes
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(device)
            graphs: dict[int, torch.cuda.CUDAGraph] = {}
            for bs in reversed(self.buckets):
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP_STEPS):
                        self._step(bs)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph, pool=pool, stream=stream, capture_error_mode="thread_local"
                ):
                    self._step(bs)
                graphs[bs] = graph
            torch.cuda.synchronize(device)
            self._graphs = graphs
            return torch.cuda.memory_reserved(device) - before
