"""Test helpers: deterministic KV content per token prefix, written and read via pools."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import torch

from hicache.cache import CacheRequest, HiCache
from hicache.controller import page_tensor
from hicache.tree.node import PageIds

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def token_kv(cache: HiCache, tokens: Sequence[int], position: int) -> torch.Tensor:
    """The KV a model would compute for ``tokens[position]`` given its prefix.

    Shape ``(num_kv, num_layers, heads, dim)``; values depend on the whole prefix, so a
    page reused under another prefix would show as different bytes.
    """
    spec = cache.spec
    digest = hashlib.sha256(repr(list(tokens[: position + 1])).encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    shape = (spec.num_kv, spec.num_layers, spec.heads, spec.dim)
    return torch.randn(shape, generator=gen).to(DTYPES[spec.dtype])


def page_kv(cache: HiCache, tokens: Sequence[int], first_page: int, num_pages: int) -> torch.Tensor:
    """Expected canonical page data ``(num_pages, K, L, page_size, H, D)``."""
    ps = cache.page_size
    spec = cache.spec
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
    cache.device_pool.write_pages(page_tensor(pages), data)


def read_device(cache: HiCache, pages: PageIds) -> torch.Tensor:
    return cache.device_pool.read_pages(page_tensor(pages))


def serve(
    cache: HiCache,
    tokens: Sequence[int],
    *,
    tenant: str = "",
    priority: int = 0,
    hold: bool = False,
    timeout_s: float = 10.0,
) -> CacheRequest | None:
    """Drive one request through the verbs as an engine would: open (every whole page of
    ``tokens`` may hit), wait for the prefetch policy, admit, check the cached prefix
    byte for byte, "compute" the rest, commit.

    Returns the handle (released unless ``hold``), or None when L1 had no room.
    """
    seq = list(tokens)
    req = cache.open(seq, tenant=tenant, priority=priority, compute_last=False)
    end = time.monotonic() + timeout_s
    while not cache.ready(req):
        assert time.monotonic() < end, "the prefetch policy never let the request in"
        time.sleep(0.0005)
    if not cache.admit(req, seq):
        cache.release(req)
        return None
    for layer in range(cache.spec.num_layers):
        assert req.wait_layer(layer, timeout_s), req.failed
    prefix = req.pages[: req.prefix_pages]
    assert read_device(cache, prefix).equal(page_kv(cache, tokens, 0, len(prefix))), (
        "a cached prefix came back with other bytes"
    )
    full = len(tokens) // cache.page_size
    write_tokens(cache, tokens, req.pages[req.prefix_pages : full], req.prefix_pages)
    cache.commit(req, tokens)
    if not hold:
        cache.release(req)
    return req


class FailingLoads:
    """A cache ``layer_hook`` that fails every L2 -> L1 load after its first layer while
    ``on`` (the layers before stay valid, as with a copier that breaks mid-op)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, op_id: int, layer: int) -> None:
        if self.on and layer == 0:
            raise RuntimeError("injected copy failure after layer 0")
