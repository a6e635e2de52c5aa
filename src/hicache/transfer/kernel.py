"""KernelCopier: vectorized copies over all pages of an op.

CPU (device pool in RAM): :meth:`KernelCopier.strategy` picks per op, from the sizes
involved, ``slabs`` (one strided view pair per run of pages consecutive on both sides: all
layers for a backup, :data:`PAGE_FIRST_LOAD_STEPS` groups of layers for a load; run as
:data:`CpuCopy` says, on torch's OpenMP team or on the serial copy threads of
:mod:`hicache.transfer.workers`, contiguous blocks by address with
:mod:`hicache.transfer.blocks`) when a view moves >= ``slab_min_bytes`` on average, else
``rows`` (one ``index_select`` + ``index_copy_`` over 2-D row views,
:mod:`hicache.transfer.rows`). CUDA: the UVA kernel (:mod:`hicache.transfer.uva`) when
Triton is installed, the host pool pinned and the probe passed; else the DMA path (GPU
gather/scatter through a staging tensor, as few DMAs as the layout allows, small ranges
through one pinned buffer: ``dma_min_bytes``). Copies are byte-exact whatever the path.
Why these strategies and what they reach: ``docs/architecture.md``, "Copies between L1
and L2".
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import torch

from hicache.config import MemLayout
from hicache.memory.base import PageList, row_words
from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.transfer.base import PageCopier, check_layer
from hicache.transfer.blocks import BlockPlan, copy_blocks, copy_layers
from hicache.transfer.plan import OpPlan
from hicache.transfer.rows import row_ids, rows, word_dtype
from hicache.transfer.uva import copy_pages, uva_usable
from hicache.transfer.workers import host_busy, run_steps, serial_torch_threads

__all__ = [
    "DMA_MIN_BYTES",
    "PAGE_FIRST_LOAD_STEPS",
    "SLAB_MIN_BYTES",
    "CpuCopy",
    "KernelCopier",
    "Strategy",
]

Strategy = Literal["slabs", "rows", "device"]

CpuCopy = Literal["auto", "caller", "threads"]
"""Where CPU slab copies made of torch copies (``page_first`` loads, backups) run:
``caller``: one ``torch._foreach_copy_`` on the caller's thread (torch's OpenMP team);
``threads``: the serial copy threads (:mod:`hicache.transfer.workers`); ``auto``: the copy
threads while :func:`host_busy` says the host has more runnable threads than CPUs, else
the caller's thread. Block loads (``memmove``) always use the copy threads."""

SLAB_MIN_BYTES = 64 * 1024
"""CPU: slab views moving at least this many bytes on average; smaller ones use ``rows``.

Measured crossover (8 x 128 fp16 heads, 32 layers): loads at page 8 (32 KiB views) are
faster as rows (4.7 vs 3.3 GB/s), loads at page 64 (256 KiB) as slabs (12.9 vs 9.0); backup
views cover all layers (>= 128 KiB even at page 1) and slabs win there by 3-10x.

A backup slab is a run of pages over all layers and kinds; a load slab is a run of pages
in one layer (all kinds)."""

PAGE_FIRST_LOAD_STEPS = 4
"""CPU ``page_first`` loads land in this many groups of layers (layer-wise progress in as
many steps). Measured at page 64, 32 layers of 8 x 128 fp16 heads, 256 MiB ops on 2 vCPUs:
a group of 1 / 2 / 4 / 8 / 32 layers per strided copy ran at 0.53 / 0.60 / 0.69 / 0.76 /
0.74 of a contiguous copy."""

STRIDED_UNIT_BYTES = 4 * 2**20
"""CPU slab copies on the copy threads (``page_first`` loads, backups): bytes per work
unit (a few runs' strided view pairs, one serial ``torch._foreach_copy_``)."""

DMA_MIN_BYTES = 64 * 1024
"""CUDA: per-block DMAs when the average host block has at least this many bytes."""


def _ids(
    pool: DevicePool | HostPool, k: torch.Tensor, layer: torch.Tensor, tok: torch.Tensor
) -> torch.Tensor:
    return row_ids(pool, k, layer, tok).reshape(-1)


class KernelCopier(PageCopier):
    """Vectorized page copies; byte-exact for every layout and dtype (copies integer words).

    The ``*_min_bytes`` arguments override the module thresholds (0 forces slabs / DMAs, a
    huge value forces rows / staging).
    ``force_device_path`` runs the CUDA code path on any device (without pinning on CPU);
    it exists so the CUDA index arithmetic is tested on CPU-only machines.
    """

    name = "kernel"

    def __init__(
        self,
        *,
        slab_min_bytes: int = SLAB_MIN_BYTES,
        dma_min_bytes: int = DMA_MIN_BYTES,
        force_device_path: bool = False,
        cpu_copy: CpuCopy = "auto",
    ) -> None:
        super().__init__()
        if cpu_copy not in ("auto", "caller", "threads"):
            raise ValueError(f"cpu_copy={cpu_copy!r}: expected 'auto', 'caller' or 'threads'")
        self._cpu_copy: CpuCopy = cpu_copy
        self._slab_min = slab_min_bytes
        self._dma_min = dma_min_bytes
        self._force_device_path = force_device_path

    def __repr__(self) -> str:
        return (
            f"KernelCopier(slab_min_bytes={self._slab_min}, dma_min_bytes={self._dma_min}"
            f"{', force_device_path=True' if self._force_device_path else ''}"
            f"{'' if self._cpu_copy == 'auto' else f', cpu_copy={self._cpu_copy!r}'})"
        )

    def _threaded(self) -> bool:
        """Whether this op's torch slab copies go to the copy threads (see :data:`CpuCopy`)."""
        if self._cpu_copy == "caller" or torch.get_num_threads() <= 1:
            return False
        if not serial_torch_threads():
            return False
        return self._cpu_copy == "threads" or host_busy()

    def strategy(
        self, device: DevicePool, host: HostPool, plan: OpPlan, *, backup: bool
    ) -> Strategy:
        """Which strategy an op uses (see the module docstring)."""
        if self._force_device_path or device.device.type != "cpu":
            return "device"
        spec = device.spec
        runs = max(1, len(plan.runs))
        slab = plan.n * device.page_bytes // runs
        if not backup:
            slab //= spec.num_layers
        return "slabs" if slab >= self._slab_min else "rows"

    # -- D -> H --------------------------------------------------------------------------
    def backup(
        self,
        device: DevicePool,
        host: HostPool,
        device_pages: PageList,
        host_pages: PageList,
    ) -> None:
        plan = self.plan(device, host, device_pages, host_pages, "backup")
        if plan.n == 0:
            return
        strategy = self.strategy(device, host, plan, backup=True)
        if strategy == "device":
            self._backup_device(device, host, plan)
        elif strategy == "slabs":
            self._backup_slabs(device, host, plan)
        else:
            src, dst = _backup_ids(device, host, plan, torch.device("cpu"))
            assert dst is not None
            rows(host).index_copy_(0, dst, rows(device).index_select(0, src))

    def _backup_slabs(self, device: DevicePool, host: HostPool, plan: OpPlan) -> None:
        """One strided view pair per run (all layers and kinds; per kind on the copy
        threads, whose units are :func:`_copy_units` of them), else all in one
        ``torch._foreach_copy_`` on the caller's thread."""
        threaded = self._threaded()
        dv = row_words(device.buffer)  # (K, L, S, E)
        hv = row_words(host.buffer)
        ps = plan.page_size
        layout = host.layout
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for r in plan.runs:
            src = dv[:, :, r.dev * ps : (r.dev + r.length) * ps]  # (K, L, r*ps, E)
            if layout is MemLayout.LAYER_FIRST:
                dst = hv[:, :, r.host * ps : (r.host + r.length) * ps]
            elif layout is MemLayout.PAGE_FIRST:
                dst = hv[:, r.host * ps : (r.host + r.length) * ps]  # (K, r*ps, L, E)
                src = src.transpose(1, 2)
            else:
                dst = hv[:, r.host : r.host + r.length]  # (K, r, L, ps, E)
                src = src.unflatten(2, (r.length, ps)).transpose(1, 2)
            if threaded:
                dsts.extend(dst.unbind(0))
                srcs.extend(src.unbind(0))
            else:
                dsts.append(dst)
                srcs.append(src)
        if threaded:
            run_steps([_copy_units(dsts, srcs, STRIDED_UNIT_BYTES)], lambda step: None)
        else:
            torch._foreach_copy_(dsts, srcs)

    def _uva_pages(
        self, device: DevicePool, host: HostPool, plan: OpPlan
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The op's (device, host) pages on the GPU when the one-launch UVA kernel
        (:mod:`hicache.transfer.uva`) serves it: CUDA, a pinned host pool, the kernel's
        probe passed; else None (the DMA path)."""
        if self._force_device_path or not host.buffer.is_pinned():
            return None
        if not uva_usable(device.device):
            return None
        got = plan.memo.get("uva_pages")
        if not isinstance(got, tuple):
            on = device.device
            got = (plan.device_pages.to(on), plan.host_pages.to(on))
            plan.memo["uva_pages"] = got
        return got

    def _backup_device(self, device: DevicePool, host: HostPool, plan: OpPlan) -> None:
        uva = self._uva_pages(device, host, plan)
        if uva is not None:  # one launch: every page, kind and layer straight to host
            copy_pages(device, host, uva[0], uva[1], range(0, device.spec.num_layers))
            return
        on = device.device
        spec = device.spec
        kinds, layers, ps = spec.num_kv, spec.num_layers, plan.page_size
        src_ids, _ = _backup_ids(device, host, plan, on, host_side=False)
        word = word_dtype(device)
        flat = rows(device, word).index_select(0, src_ids)  # rows ordered (k, l, i, j)
        g = flat.view(kinds, layers, plan.n * ps, -1)
        hv = row_words(host.buffer, word)
        runs = plan.host_runs
        row_bytes = g.shape[-1] * g.element_size()
        per_block = plan.n * ps * row_bytes // len(runs)
        if host.layout is not MemLayout.LAYER_FIRST:
            per_block *= layers
        if per_block < self._dma_min:
            pinned = torch.empty(flat.shape, dtype=word, pin_memory=on.type == "cuda")
            pinned.copy_(flat, non_blocking=True)
            if on.type == "cuda":
                torch.cuda.current_stream(on).synchronize()
            _, dst_ids = _backup_ids(device, host, plan, torch.device("cpu"))
            assert dst_ids is not None
            rows(host, word).index_copy_(0, dst_ids, pinned)
            return
        if host.layout is MemLayout.LAYER_FIRST:
            for r in runs:
                lo, hi, at = r.host * ps, (r.host + r.length) * ps, r.pos * ps
                for k in range(kinds):
                    for layer in range(layers):
                        hv[k, layer, lo:hi].copy_(g[k, layer, at : at + hi - lo], non_blocking=True)
        elif host.layout is MemLayout.PAGE_FIRST:
            stage = g.transpose(1, 2).contiguous()  # (K, n*ps, L, E)
            for r in runs:
                lo, hi, at = r.host * ps, (r.host + r.length) * ps, r.pos * ps
                for k in range(kinds):
                    hv[k, lo:hi].copy_(stage[k, at : at + hi - lo], non_blocking=True)
        else:
            stage = g.unflatten(2, (plan.n, ps)).transpose(1, 2).contiguous()  # (K, n, L, ps, E)
            for r in runs:
                for k in range(kinds):
                    hv[k, r.host : r.host + r.length].copy_(
                        stage[k, r.pos : r.pos + r.length], non_blocking=True
                    )

    # -- H -> D --------------------------------------------------------------------------
    def load_layer(
        self,
        device: DevicePool,
        host: HostPool,
        host_pages: PageList,
        device_pages: PageList,
        layer: int,
    ) -> None:
        check_layer(device, layer)
        plan = self.plan(device, host, device_pages, host_pages, "load")
        if plan.n == 0:
            return
        strategy = self.strategy(device, host, plan, backup=False)
        if strategy == "device":
            self._load_layer_device(device, host, plan, layer)
        elif strategy == "slabs":
            self._load_layer_slabs(device, host, plan, layer)
        else:
            src, dst = _load_ids(device, host, plan, layer, torch.device("cpu"))
            rows(device).index_copy_(0, dst, rows(host).index_select(0, src))

    def _load_layer_slabs(
        self, device: DevicePool, host: HostPool, plan: OpPlan, layer: int
    ) -> None:
        if host.layout is MemLayout.PAGE_FIRST:
            torch._foreach_copy_(*_group_views(device, host, plan, layer, 1))
            return
        copy_blocks(device.buffer, host.buffer, _block_plan(device, host, plan), layer)

    def load_layers(
        self,
        device: DevicePool,
        host: HostPool,
        host_pages: PageList,
        device_pages: PageList,
        done: Callable[[int], None],
    ) -> None:
        """On CPU with slab-sized blocks, in :data:`PAGE_FIRST_LOAD_STEPS` groups of
        adjacent layers (for ``page_first`` a token's rows of a group are adjacent in the
        host pool, so a group reads them together), one strided view pair per run and
        group (:func:`_group_views`): on the copy threads in units of runs
        (:func:`_group_steps`) for ``page_first``, or all of a group in one
        ``torch._foreach_copy_`` on the caller's thread (see :data:`CpuCopy`). Block
        layouts (``layer_first``, ``page_first_direct``) on the copy threads copy by
        address instead, reported layer by layer (:func:`copy_layers`). Otherwise layer
        by layer."""
        plan = self.plan(device, host, device_pages, host_pages, "load")
        if plan.n == 0 or self.strategy(device, host, plan, backup=False) != "slabs":
            super().load_layers(device, host, host_pages, device_pages, done)
            return
        layers = device.spec.num_layers
        threaded = self._threaded()
        if threaded and host.layout is not MemLayout.PAGE_FIRST:
            blocks = _block_plan(device, host, plan)
            copy_layers(device.buffer, host.buffer, blocks, layers, done)
            return
        group = max(1, -(-layers // PAGE_FIRST_LOAD_STEPS))
        firsts = range(0, layers, group)
        if threaded:
            steps = _group_steps(device, host, plan, group)

            def step_done(step: int) -> None:
                for layer in range(firsts[step], min(firsts[step] + group, layers)):
                    done(layer)

            run_steps(steps, step_done)
            return
        for first in firsts:
            count = min(group, layers - first)
            torch._foreach_copy_(*_group_views(device, host, plan, first, count))
            for layer in range(first, first + count):
                done(layer)

    def _load_layer_device(
        self, device: DevicePool, host: HostPool, plan: OpPlan, layer: int
    ) -> None:
        uva = self._uva_pages(device, host, plan)
        if uva is not None:  # one launch: every page and kind of the layer from host
            copy_pages(host, device, uva[1], uva[0], range(layer, layer + 1))
            return
        on = device.device
        word = word_dtype(device)
        hv = row_words(host.buffer, word)
        hl = hv[:, layer] if host.layout is MemLayout.LAYER_FIRST else hv[:, :, layer]
        ps = plan.page_size
        kinds = device.spec.num_kv
        width = hv.shape[-1]
        layout = host.layout
        blocks = plan.n if layout is MemLayout.PAGE_FIRST_DIRECT else len(plan.host_runs)
        block_bytes = plan.n * ps * width * hv.element_size() // blocks
        stage = torch.empty((kinds, plan.n * ps, width), dtype=word, device=on)
        if layout is MemLayout.LAYER_FIRST and block_bytes >= self._dma_min:
            for r in plan.host_runs:
                lo, hi, at = r.host * ps, (r.host + r.length) * ps, r.pos * ps
                for k in range(kinds):
                    stage[k, at : at + hi - lo].copy_(hl[k, lo:hi], non_blocking=True)
        elif layout is MemLayout.PAGE_FIRST_DIRECT and block_bytes >= self._dma_min:
            for i, (_, h) in enumerate(plan.pairs):
                for k in range(kinds):
                    stage[k, i * ps : (i + 1) * ps].copy_(hl[k, h], non_blocking=True)
        else:
            src_ids, _ = _load_ids(device, host, plan, layer, torch.device("cpu"))
            pinned = torch.empty(stage.shape, dtype=word, pin_memory=on.type == "cuda")
            torch.index_select(rows(host, word), 0, src_ids, out=pinned.view(-1, width))
            stage.copy_(pinned, non_blocking=True)
        _, dst_ids = _load_ids(device, host, plan, layer, on)
        rows(device, word).index_copy_(0, dst_ids, stage.view(-1, width))


def _backup_ids(
    device: DevicePool, host: HostPool, plan: OpPlan, on: torch.device, *, host_side: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(device row ids, host row ids or None) of a backup, rows ordered (kind, layer, token)."""
    spec = device.spec
    k = torch.arange(spec.num_kv, dtype=torch.int64, device=on).view(-1, 1, 1)
    lay = torch.arange(spec.num_layers, dtype=torch.int64, device=on).view(1, -1, 1)
    dtok = plan.index("dev_tokens", on).view(1, 1, -1)
    if not host_side:
        return _ids(device, k, lay, dtok), None
    htok = plan.index("host_tokens", on).view(1, 1, -1)
    return _ids(device, k, lay, dtok), _ids(host, k, lay, htok)


def _load_ids(
    device: DevicePool, host: HostPool, plan: OpPlan, layer: int, on: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(host row ids, device row ids) of one layer of a load, rows ordered (kind, token)."""
    k = torch.arange(device.spec.num_kv, dtype=torch.int64, device=on).view(-1, 1)
    lay = torch.tensor(layer, dtype=torch.int64, device=on)
    dtok = plan.index("dev_tokens", on).view(1, -1)
    htok = plan.index("host_tokens", on).view(1, -1)
    return _ids(host, k, lay, htok), _ids(device, k, lay, dtok)


def _copy_units(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], unit_bytes: int
) -> list[Callable[[], object]]:
    """Consecutive view pairs grouped into :func:`run_steps` units of at least
    ``unit_bytes`` (the last may be smaller), each one ``torch._foreach_copy_``."""
    units: list[Callable[[], object]] = []
    a, acc = 0, 0
    for i, d in enumerate(dsts):
        acc += d.numel() * d.element_size()
        if acc >= unit_bytes:
            units.append(partial(torch._foreach_copy_, dsts[a : i + 1], srcs[a : i + 1]))
            a, acc = i + 1, 0
    if a < len(dsts):
        units.append(partial(torch._foreach_copy_, dsts[a:], srcs[a:]))
    return units


def _group_views(
    device: DevicePool, host: HostPool, plan: OpPlan, first: int, count: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(device views, host views) of layers ``[first, first + count)`` of a load, one
    ``(K, count, tokens, E)`` pair per run (``page_first_direct``: per page).

    ``page_first`` host rows are strided (a token's layers are adjacent, one token every
    L rows): a pair covers both kinds (per-kind views, serial at page 64, measured slower
    on an idle host: 0.22 vs 0.40 of a contiguous copy), and ``count`` layers read that
    many adjacent rows at a time.

    Each view is one ``as_strided`` of the pool's row words at an offset computed from
    the run (word offsets below, ``E`` words a row): slicing and transposing cost ~2.3x
    as much (views of a shuffled 256 MiB load: 0.8 -> 0.35 ms at page 64, 3.1 -> 1.4 ms
    at page 16, where a load takes ~20 ms; docs/benchmarks/transfer.md).
    Device row (k, l, t): ``((k * L + l) * S + t) * E``; host rows: ``layer_first``
    ``((k * L + l) * S_h + t) * E``, ``page_first`` ``((k * S_h + t) * L + l) * E``,
    ``page_first_direct`` ``(((k * P + t // ps) * L + l) * ps + t % ps) * E``."""
    dv = row_words(device.buffer)  # (K, L, S, E)
    hv = row_words(host.buffer)
    if not (dv.is_contiguous() and hv.is_contiguous()):  # the offsets assume it
        raise ValueError("slab loads need contiguous pool buffers")
    kinds, layers, s_dev, width = dv.shape
    ps = plan.page_size
    s_host = host.size_tokens
    d_base, h_base = dv.storage_offset(), hv.storage_offset()
    d_strides = (layers * s_dev * width, s_dev * width, width, 1)
    d_first = d_base + first * s_dev * width
    view = torch.as_strided
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    if host.layout is MemLayout.PAGE_FIRST_DIRECT:
        block = ps * width  # one (page, layer) block of the host
        shape = (kinds, count, ps, width)
        h_strides = (host.num_pages * layers * block, block, width, 1)
        h_first = h_base + first * block
        for d, h in plan.pairs:
            dsts.append(view(dv, shape, d_strides, d_first + d * block))
            srcs.append(view(hv, shape, h_strides, h_first + h * layers * block))
        return dsts, srcs
    if host.layout is MemLayout.PAGE_FIRST:
        h_strides = (s_host * layers * width, width, layers * width, 1)
        h_first, h_token = h_base + first * width, layers * width
    else:
        h_strides = (layers * s_host * width, s_host * width, width, 1)
        h_first, h_token = h_base + first * s_host * width, width
    for r in plan.runs:
        shape = (kinds, count, r.length * ps, width)
        dsts.append(view(dv, shape, d_strides, d_first + r.dev * ps * width))
        srcs.append(view(hv, shape, h_strides, h_first + r.host * ps * h_token))
    return dsts, srcs


def _group_steps(
    device: DevicePool, host: HostPool, plan: OpPlan, group: int
) -> list[list[Callable[[], object]]]:
    """A load as :func:`run_steps` steps, computed once per op: step ``s`` copies layers
    ``[s * group, (s + 1) * group)`` (:func:`_group_views`) in units of views moving
    about :data:`STRIDED_UNIT_BYTES`, each one serial ``torch._foreach_copy_``."""
    key = f"group_steps_{group}"
    got = plan.memo.get(key)
    if isinstance(got, list):
        return got
    layers = device.spec.num_layers
    steps = [
        _copy_units(
            *_group_views(device, host, plan, first, min(group, layers - first)),
            STRIDED_UNIT_BYTES,
        )
        for first in range(0, layers, group)
    ]
    plan.memo[key] = steps
    return steps


def _block_plan(device: DevicePool, host: HostPool, plan: OpPlan) -> BlockPlan:
    """The op's block plan (:func:`_load_blocks`), computed once per op."""
    blocks = plan.memo.get("load_blocks")
    if not isinstance(blocks, BlockPlan):
        blocks = _load_blocks(device, host, plan)
        plan.memo["load_blocks"] = blocks
    return blocks


def _load_blocks(device: DevicePool, host: HostPool, plan: OpPlan) -> BlockPlan:
    """Byte offsets of a load's contiguous blocks (layer 0) for ``layer_first`` and
    ``page_first_direct`` hosts; a layer adds one stride per side.

    Device block of (kind k, run at token t): ``((k * L) * S_dev + t) * R``, layer stride
    ``S_dev * R`` (R = bytes of one token's row). ``layer_first`` host: same form with
    ``S_host``, whole runs of pages per block. ``page_first_direct`` host: one block per
    page, ``((k * P_host + page) * L) * ps * R``, layer stride ``ps * R``.
    """
    spec = device.spec
    kinds, layers, ps = spec.num_kv, spec.num_layers, plan.page_size
    row = spec.heads * spec.dim * spec.dtype_bytes
    s_dev, s_host = device.size_tokens, host.size_tokens
    dst: list[int] = []
    src: list[int] = []
    nbytes: list[int] = []
    if host.layout is MemLayout.LAYER_FIRST:
        for r in plan.runs:
            for k in range(kinds):
                dst.append((k * layers * s_dev + r.dev * ps) * row)
                src.append((k * layers * s_host + r.host * ps) * row)
                nbytes.append(r.length * ps * row)
        return BlockPlan.build(dst, src, nbytes, s_dev * row, s_host * row)
    assert host.layout is MemLayout.PAGE_FIRST_DIRECT
    block = ps * row
    for d, h in plan.pairs:
        for k in range(kinds):
            dst.append((k * layers * s_dev + d * ps) * row)
            src.append((k * host.num_pages + h) * layers * block)
            nbytes.append(block)
    return BlockPlan.build(dst, src, nbytes, s_dev * row, block)
