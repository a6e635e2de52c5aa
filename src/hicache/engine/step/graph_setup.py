"""Turning CUDA graphs for decode on: eligibility, scratch page, capture, probe, attach.

:func:`enable_decode_graphs` attaches :class:`~hicache.runner.decode_graphs.DecodeGraphs`
to a runner only when they can serve it (a model that declares
:attr:`~hicache.runner.models.cached.CachedModel.supports_decode_graphs`, the Triton
attention backend, no SWA pool, CUDA) and only after a **probe**: a real small batch, run
padded in the smallest bucket that holds it and in the largest, must give the logits of
the eager **SDPA** forward (per row, relative L2 error within :func:`probe_tolerance` of
the dtype). A capture that raises or a probe that disagrees logs one warning and leaves
the runner eager: a failure never costs a failed or wrong forward. The probe batch:
:func:`probe_lengths` keys per sequence on :func:`probe_page_count` lent pages.
:func:`enable_for_cache` reserves the probe's pages for the probe's duration and the
scratch page for as long as the graphs are used. Why SDPA and the batch's shape:
docs/architecture.md, "CUDA graphs for decode".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache.cache import HiCache
from hicache.runner.decode_graphs import DecodeGraphs, table_width_for
from hicache.runner.kernels import AttentionBackend
from hicache.runner.kernels.probe import KEY_BLOCK
from hicache.runner.model_runner import ForwardBatch, ModelRunner

__all__ = [
    "PROBE_KEYS",
    "GraphSetup",
    "enable_decode_graphs",
    "enable_for_cache",
    "probe_lengths",
    "probe_page_count",
    "probe_tolerance",
    "unsupported_reason",
]

log = logging.getLogger("hicache.engine")

PROBE_KEYS = 2 * KEY_BLOCK + KEY_BLOCK // 2
"""Keys of the probe's longest sequence at least (160): two and a half key blocks of the
decode kernel, so a replay whose kernel mishandles the blocks (a missing rescale, a block
dropped or read twice) differs from SDPA."""


def probe_lengths(page_size: int, table_width: int) -> tuple[int, int, int]:
    """Keys of the probe's three sequences (new token included), longest first (a probe
    with ``max_bs`` 1 keeps the longest): ``max(PROBE_KEYS, 2.5 pages)``, one page and
    one token, and one key; each at most what a graph serves, ``table_width`` pages of
    ``page_size`` tokens (a shorter table serves no sequence that crosses more blocks)."""
    cap = table_width * page_size
    longest = max(PROBE_KEYS, 2 * page_size + max(1, page_size // 2))
    return (min(longest, cap), min(page_size + 1, cap), 1)


def probe_page_count(page_size: int, table_width: int) -> int:
    """Pool pages the probe batch needs (:func:`probe_lengths`' sequences' pages): 43 for
    page 4 and 6 for page 64 with a table of 40 pages or more."""
    return sum(-(-n // page_size) for n in probe_lengths(page_size, table_width))


@dataclass(frozen=True, slots=True)
class GraphSetup:
    """What :func:`enable_decode_graphs` did. ``enabled``: the runner now serves decode
    batches of up to ``buckets[-1]`` sequences through the graphs; else ``reason`` says
    why not. ``captured``: CUDA graphs were recorded (False: the buckets run eagerly on
    the static buffers, the CPU test mode). ``seconds``: capture and probe, wall time.
    ``graph_bytes``: device memory the capture reserved (0 without capture).
    ``probe_error``: the probe's largest per-row relative L2 error (None if not run)."""

    enabled: bool
    reason: str | None
    buckets: tuple[int, ...] = ()
    captured: bool = False
    seconds: float = 0.0
    graph_bytes: int = 0
    probe_error: float | None = None


def unsupported_reason(runner: ModelRunner, *, capture: bool) -> str | None:
    """Why decode graphs cannot serve ``runner`` (None when they can)."""
    if not runner.model.supports_decode_graphs:
        return (
            f"{type(runner.model).__name__} is a hybrid model (recurrent state or"
            " sliding-window pools); graphs serve plain Llama / Qwen2 / Qwen3 decoders"
        )
    if runner.swa_pool is not None:
        return "the runner has a sliding-window pool"
    if runner.attention_backend is not AttentionBackend.TRITON:
        return (
            f"the attention backend is {runner.attention_backend.value!r}; graphs need the"
            " Triton decode kernel (attention_backend 'triton', or 'auto' on CUDA)"
        )
    if capture and runner.device.type != "cuda":
        return f"the device is {runner.device}, not CUDA"
    return None


def probe_tolerance(dtype: torch.dtype) -> float:
    """Largest per-row relative L2 error of the probe's logits against the SDPA forward:
    the two differ by rounding (the kernel's online softmax in fp32 against SDPA's, the
    kernel's ``p`` rounded to the model's dtype), so 1e-3 in fp32 (measured ~1e-6 on the
    tiny models) and 5e-2 in 16-bit types; a wrong kernel, table, slot or buffer gives
    errors of order 0.1 to 1."""
    return 1e-3 if dtype == torch.float32 else 5e-2


def _probe(runner: ModelRunner, graphs: DecodeGraphs, pages: Sequence[int]) -> float:
    """The probe (module docstring): the largest per-row relative L2 error of the
    graphs' logits against the SDPA forward's (inf when the graphs refuse the batch)."""
    pool, ps = runner.pool, runner.pool.page_size
    lengths = probe_lengths(ps, graphs.table_width)[: graphs.max_bs]
    gen = torch.Generator().manual_seed(0)
    order = [pages[i] for i in torch.randperm(len(pages), generator=gen).tolist()]
    slots: list[torch.Tensor] = []
    for n in lengths:
        own = torch.tensor(order[: -(-n // ps)], dtype=torch.int64)
        order = order[len(own) :]
        t = torch.arange(n)
        slots.append(own[t // ps] * ps + t % ps)
    everything = torch.cat(slots).to(pool.device)
    shape = (*pool.buffer.shape[:2], everything.shape[0], *pool.buffer.shape[3:])
    with torch.inference_mode():  # random K/V for the lent pages (the caller's to write)
        pool.buffer[:, :, everything] = torch.randn(shape, generator=gen).to(
            pool.device, pool.dtype
        )
    vocab = runner.model.config.vocab_size
    batch = ForwardBatch(
        input_ids=torch.randint(0, vocab, (len(lengths),), generator=gen),
        positions=torch.tensor([n - 1 for n in lengths]),
        extend_lens=[1] * len(lengths),
        seq_slots=slots,
    )
    reference = ModelRunner(runner.model, pool, attention_backend=AttentionBackend.SDPA)
    want = reference.forward(batch)
    worst = 0.0
    for bucket in sorted({graphs.bucket_for(len(lengths)) or graphs.max_bs, graphs.max_bs}):
        got = graphs.run(batch.input_ids, batch.positions, batch.seq_slots, bucket=bucket)
        if got is None:
            return float("inf")
        err = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
        worst = max(worst, float(err.max().item()))
    return worst


def enable_decode_graphs(
    runner: ModelRunner,
    *,
    scratch_page: int,
    probe_pages: Sequence[int],
    max_bs: int,
    table_width: int,
    capture: bool = True,
) -> GraphSetup:
    """Build decode graphs for ``runner`` up to ``max_bs`` sequences, capture them
    (``capture``; CUDA only), probe them on ``probe_pages`` (at least
    :func:`probe_page_count` pool pages the caller lends for the call: their contents are
    overwritten) and attach them
    (:meth:`ModelRunner.use_decode_graphs`). ``scratch_page``: a pool page reserved for
    the graphs' padding rows for as long as the runner uses them (never a request's or
    the tree's). Never raises for a capture or probe failure: the runner stays eager and
    the returned :class:`GraphSetup` (and a logged warning) says why."""
    reason = unsupported_reason(runner, capture=capture)
    if reason is None and runner.decode_graphs is not None:
        reason = "the runner already has decode graphs"
    needed = probe_page_count(runner.pool.page_size, table_width)
    if reason is None and len(probe_pages) < needed:
        reason = f"the probe needs {needed} free L1 pages, got {len(probe_pages)}"
    if reason is not None:
        return GraphSetup(enabled=False, reason=reason)
    t0 = time.perf_counter()
    error: float | None = None
    try:
        graphs = DecodeGraphs(
            runner.model,
            runner.pool,
            scratch_page=scratch_page,
            max_bs=max_bs,
            table_width=table_width,
        )
        graph_bytes = graphs.capture() if capture else 0
        error = _probe(runner, graphs, probe_pages)
    except Exception as exc:  # a capture or kernel failure: eager decode
        reason = f"{'capture' if capture else 'the static decode path'} failed: {exc!r}"
    else:
        tol = probe_tolerance(runner.model.dtype)
        if not error <= tol:  # NaN fails too
            reason = f"the probe's logits differ from the SDPA forward's ({error:.3g} > {tol:g})"
    seconds = time.perf_counter() - t0
    if reason is not None:
        log.warning("CUDA graphs for decode are off: %s; decode runs eagerly", reason)
        return GraphSetup(enabled=False, reason=reason, seconds=seconds, probe_error=error)
    runner.use_decode_graphs(graphs)
    log.info(
        "decode %s for batch buckets %s (%.1f s, %.1f MiB, probe error %.2g)",
        "CUDA graphs captured" if capture else "static buffers",
        list(graphs.buckets),
        seconds,
        graph_bytes / 2**20,
        error,
    )
    return GraphSetup(
        enabled=True,
        reason=None,
        buckets=graphs.buckets,
        captured=capture,
        seconds=seconds,
        graph_bytes=graph_bytes,
        probe_error=error,
    )


def enable_for_cache(
    runner: ModelRunner,
    cache: HiCache,
    *,
    max_bs: int,
    context_length: int,
    capture: bool = True,
) -> GraphSetup:
    """:func:`enable_decode_graphs` for an engine: the scratch page is reserved in the
    cache's full KV store (``cache.full.pages.reserve``; given back when the graphs are not
    used), the probe's pages are reserved there for the call and given back
    (``cache.full.pages.unreserve``), and the page table is as wide as ``context_length``
    tokens. Call before any request is admitted."""
    reason = unsupported_reason(runner, capture=capture)
    if reason is not None:
        log.info("CUDA graphs for decode are off: %s", reason)
        return GraphSetup(enabled=False, reason=reason)
    scratch = cache.full.pages.reserve(1)
    if scratch is None:
        return GraphSetup(enabled=False, reason="no L1 page left to reserve as scratch")
    # the width counts the pages a request may hold once the probe's are back
    width = table_width_for(context_length, cache.context.page_size, cache.full.pages.usable)
    lent = cache.full.pages.reserve(probe_page_count(cache.context.page_size, width))
    try:
        setup = enable_decode_graphs(
            runner,
            scratch_page=scratch[0],
            probe_pages=[] if lent is None else list(lent),
            max_bs=max_bs,
            table_width=width,
            capture=capture,
        )
    finally:
        if lent is not None:
            cache.full.pages.unreserve(lent)
    if not setup.enabled:
        cache.full.pages.unreserve(scratch)
    return setup
