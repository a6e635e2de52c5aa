"""Test helpers: deterministic KV content per token prefix, written and read via pools."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hicache.cache import CacheRequest, HiCache
from hicache.controller import page_tensor
from hicache.tree.node import PageIds, page_ids

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def token_kv(cache: HiCache, tokens: Sequence[int], position: int) -> torch.Tensor:
    """The KV a model would compute for ``tokens[position]`` given its prefix.

    Shape ``(num_kv, num_layers, heads, dim)``; values depend on the whole prefix, so a
    page reused under another prefix would show as different bytes.
    """
    spec = cache.context.spec
    digest = hashlib.sha256(repr(list(tokens[: position + 1])).encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    shape = (spec.num_kv, spec.num_layers, spec.heads, spec.dim)
    return torch.randn(shape, generator=gen).to(DTYPES[spec.dtype])


def page_kv(cache: HiCache, tokens: Sequence[int], first_page: int, num_pages: int) -> torch.Tensor:
    """Expected canonical page data ``(num_pages, K, L, page_size, H, D)``."""
    ps = cache.context.page_size
    spec = cache.context.spec
    if num_pages == 0:
        shape = (0, spec.num_kv, spec.num_layers, ps, spec.heads, spec.dim)
        return torch.empty(shape, dtype=DTYPES[spec.dtype])
    out = []
    for p in range(first_page, first_page + num_pages):
        toks = [token_kv(cache, tokens, p * ps + i) for i in range(ps)]
        out.append(torch.stack(toks, dim=2))  # (K, L, ps, H, D)
    return torch.stack(out)


def write_tokens(cache: HiCache, tokens: Sequence[int], pages: PageIds, first_page: int) -> None:
    """Write the expected KV of pages ``first_page ..`` of ``tokens`` into L1 ``pages``."""
    if len(pages) == 0:
        return
    data = page_kv(cache, tokens, first_page, len(pages))
    cache.full.pages.device_pool.write_pages(page_tensor(pages), data)


def insert(cache: HiCache, tokens: Sequence[int], *, tenant: str = "") -> None:
    """ "Compute" ``tokens`` (whole pages) into fresh L1 pages (evicting the coldest) and
    hand them to the tree, as a request's commit would; the backup may be in flight."""
    ps = cache.context.page_size
    pages = cache.full.pages.alloc(len(tokens) // ps)
    assert pages is not None
    write_tokens(cache, tokens, pages, 0)
    cache.full.pages.insert(tokens, pages, tenant=tenant)


def read_device(cache: HiCache, pages: PageIds) -> torch.Tensor:
    return cache.full.pages.device_pool.read_pages(page_tensor(pages))


def wait_ready(cache: HiCache, req: CacheRequest, timeout_s: float = 10.0) -> None:
    """Wait until the prefetch policy lets ``req`` be admitted (``cache.ready``, as agreed
    at the last sync: one ``cache.sync()`` per round, as an engine's steps);
    AssertionError after ``timeout_s`` seconds."""
    end = time.monotonic() + timeout_s
    while not cache.ready(req):
        assert time.monotonic() < end, "the prefetch policy never let the request in"
        time.sleep(0.0005)
        cache.sync()


def compute(
    cache: HiCache,
    req: CacheRequest,
    tokens: Sequence[int],
    timeout_s: float = 10.0,
    write: Callable[[HiCache, Sequence[int], PageIds, int], None] = write_tokens,
) -> None:
    """An admitted request's forward, as the tests play it: wait for every layer's load,
    check the cached prefix's L1 KV byte for byte (:func:`page_kv`), then ``write`` the
    KV of its other whole pages (default :func:`write_tokens`; a test writing more beside
    the KV passes its own)."""
    for layer in range(cache.context.spec.num_layers):
        assert req.wait_layer(layer, timeout_s), req.failed
    prefix = req.pages[: req.prefix_pages]
    assert read_device(cache, prefix).equal(page_kv(cache, tokens, 0, len(prefix))), (
        "a cached prefix came back with other bytes"
    )
    full = len(tokens) // cache.context.page_size
    write(cache, tokens, req.pages[req.prefix_pages : full], req.prefix_pages)


def serve(
    cache: HiCache,
    tokens: Sequence[int],
    *,
    tenant: str = "",
    priority: int = 0,
    hold: bool = False,
    timeout_s: float = 10.0,
) -> CacheRequest | None:
    """Drive one request through the verbs as an engine would: sync (the start of a step),
    open (every whole page of ``tokens`` may hit), wait for the prefetch policy, admit,
    check the cached prefix byte for byte, "compute" the rest, commit.

    Returns the handle (released unless ``hold``), or None when L1 had no room.
    """
    cache.sync()
    seq = list(tokens)
    req = cache.open(seq, tenant=tenant, priority=priority, compute_last=False)
    wait_ready(cache, req, timeout_s)
    if not cache.admit(req, seq):
        cache.release(req)
        return None
    compute(cache, req, tokens, timeout_s)
    cache.commit(req, tokens)
    if not hold:
        cache.release(req)
    return req


def fill_device(cache: HiCache, pages: Sequence[int], value: float) -> None:
    """Overwrite L1 ``pages`` with ``value`` everywhere, so stale bytes never pass for
    KV a load or a forward should have written."""
    if not pages:
        return
    pt = page_tensor(page_ids(pages))
    cache.full.pages.device_pool.write_pages(
        pt, torch.full_like(cache.full.pages.device_pool.read_pages(pt), value)
    )


def free_device_pages(cache: HiCache) -> list[int]:
    """The L1 pages nobody holds, ascending."""
    alloc = cache.full.pages.device_pool.allocator
    return [p for p in range(cache.full.pages.device_pool.num_pages) if not alloc.is_used(p)]


def serve_or_fail(cache: HiCache, tokens: Sequence[int], *, timeout_s: float = 10.0) -> bool:
    """:func:`serve` for a cache whose copies may fail: a request whose load failed is
    released without keeping its KV (False); otherwise its cached prefix is checked byte
    for byte, the rest "computed" and committed (True). False too when L1 had no room."""
    cache.sync()  # the start of a step
    seq = list(tokens)
    req = cache.open(seq, compute_last=False)
    if not cache.admit(req, seq):
        cache.release(req)
        return False
    return finish(cache, req, seq, timeout_s=timeout_s)


def finish(
    cache: HiCache, req: CacheRequest, tokens: Sequence[int], *, timeout_s: float = 10.0
) -> bool:
    """Run the forward of an admitted ``req`` as an engine would: wait for each layer of
    its prefix, then check the prefix byte for byte, write the rest and release it with
    its KV kept (True); a failed wait releases it without keeping anything (False)."""
    if not all(req.wait_layer(layer, timeout_s) for layer in range(cache.context.spec.num_layers)):
        assert req.failed is not None
        cache.release(req, commit=False)
        return False
    prefix = req.pages[: req.prefix_pages]
    assert read_device(cache, prefix).equal(page_kv(cache, tokens, 0, len(prefix))), (
        "a cached prefix came back with other bytes"
    )
    full = len(tokens) // cache.context.page_size
    write_tokens(cache, tokens, req.pages[req.prefix_pages : full], req.prefix_pages)
    cache.sync()  # as the engine's next step does: a failure it applies fails req
    if req.failed is not None:
        cache.release(req, commit=False)
        return False
    cache.release(req, list(tokens))
    return True


def check_l1_hits(cache: HiCache, known: Sequence[Sequence[int]]) -> None:
    """Every L1 page a match of a ``known`` sequence returns holds that sequence's KV.
    Call with no copy in flight (after ``flush``)."""
    for tokens in known:
        m = cache.full.pages.match_prefix(list(tokens))
        n = len(m.device_pages)
        assert read_device(cache, m.device_pages).equal(page_kv(cache, tokens, 0, n)), (
            f"an L1 hit of {list(tokens)} holds other bytes"
        )


class FailingLoads:
    """A cache ``layer_hook`` that fails every L2 -> L1 load after its first layer while
    ``on`` (the layers before stay valid, as with a copier that breaks mid-op).
    ``fired`` is set each time it fails one."""

    def __init__(self) -> None:
        self.on = False
        self.fired = threading.Event()

    def __call__(self, op_id: int, layer: int) -> None:
        if self.on and layer == 0:
            self.fired.set()
            raise RuntimeError("injected copy failure after layer 0")


class LoadGates:
    """A cache ``layer_hook`` that parks chosen loads after their layer 0 (so layer 1
    and on wait) until released, then lets them go on or fail.

    ``park(n, fail=...)`` picks the ``n``-th load (0-based, in the order loads reach the
    hook); ``parked(n)`` waits until it is parked; ``release(n)`` lets it continue.
    """

    def __init__(self, timeout_s: float = 10.0) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._order: list[int] = []  # op ids, in the order their layer 0 arrived
        self._plans: dict[int, tuple[threading.Event, threading.Event, bool]] = {}

    def park(self, n: int, *, fail: bool = False) -> None:
        self._plans[n] = (threading.Event(), threading.Event(), fail)

    def parked(self, n: int) -> bool:
        return self._plans[n][0].wait(self._timeout_s)

    def release(self, n: int) -> None:
        self._plans[n][1].set()

    def release_all(self) -> None:
        for _, go, _ in self._plans.values():
            go.set()

    def __call__(self, op_id: int, layer: int) -> None:
        if layer != 0:
            return
        with self._lock:
            n = len(self._order)
            self._order.append(op_id)
        plan = self._plans.get(n)
        if plan is None:
            return
        parked, go, fail = plan
        parked.set()
        if not go.wait(self._timeout_s):
            raise RuntimeError(f"load {n} (op {op_id}) was never released")
        if fail:
            raise RuntimeError(f"injected failure of load {n} after layer 0")


class FailingBackups:
    """Wraps a :class:`~hicache.transfer.PageCopier`: every L1 -> L2 backup raises (and
    copies nothing) while ``on``; loads pass through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.on = False

    def backup(self, *args: Any) -> None:
        if self.on:
            raise RuntimeError("injected backup failure")
        self.inner.backup(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
