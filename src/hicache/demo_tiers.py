"""``hicache demo-tiers``: a scripted walk through the tiers on the HiCache facade.

Writes a few prompts' KV into a small L1, shows them demoted to L2 when L1 runs out,
then loads one back layer by layer (the consumer reads each layer as soon as it arrives)
and checks every byte. Prints tokens per tier at each step.
"""

from __future__ import annotations

import threading
import time

import torch
from rich.console import Console
from rich.table import Table

from hicache.cache import HiCache
from hicache.cache.report import cache_stats, check_integrity
from hicache.config import CacheConfig
from hicache.controller import page_tensor
from hicache.spec import KVSpec

console = Console()
SPEC = KVSpec(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16")
PAGE = 16


def fake_kv(tokens: list[int], first_page: int, num_pages: int) -> torch.Tensor:
    """Deterministic stand-in for a model's KV: ``(pages, 2, L, page, H, D)``."""
    gen = torch.Generator().manual_seed(hash(tuple(tokens)) & 0xFFFF_FFFF)
    shape = (len(tokens) // PAGE, SPEC.num_kv, SPEC.num_layers, PAGE, SPEC.heads, SPEC.dim)
    return torch.randn(shape, generator=gen).half()[first_page : first_page + num_pages]


def show(cache: HiCache, step: str) -> None:
    s = cache_stats(cache)
    table = Table(title=step, title_justify="left", show_edge=False)
    for col in ("L1 cached", "L1 free", "L2 cached", "L2 only", "L2 free", "nodes"):
        table.add_column(col, justify="right")
    table.add_row(
        *map(
            str,
            (
                s.device_cached_tokens,
                s.device_free_tokens,
                s.host_cached_tokens,
                s.host_only_tokens,
                s.host_free_tokens,
                s.nodes,
            ),
        )
    )
    console.print(table)


def prefill(cache: HiCache, tokens: list[int]) -> None:
    """What an engine does for one prompt, through the request verbs; the fake KV stands
    in for the model's forward."""
    req = cache.open(tokens)
    assert cache.admit(req, tokens), "L1 too small for this prompt"
    for layer in range(SPEC.num_layers):
        req.wait_layer(layer, timeout_s=10)
    own = req.pages[req.prefix_pages :]
    kv = fake_kv(tokens, req.prefix_pages, len(own))
    cache.full.pages.device_pool.write_pages(page_tensor(own), kv)
    cache.release(req, tokens)  # commit the computed pages, unpin


def main() -> int:
    cfg = CacheConfig(page_size=PAGE, device_tokens=256, hicache_ratio=3.0, load_back_threshold=16)
    console.rule("[bold]hicache demo: L1 (device) + L2 (host)")
    console.print(
        f"KV per token: {SPEC.token_bytes} B over {SPEC.num_layers} layers; page = {PAGE} tokens;"
        f" L1 = {cfg.device_tokens} tokens, L2 = {cfg.host_tokens(SPEC)} tokens,"
        f" write policy {cfg.write_policy.value}, layout {cfg.mem_layout.value}"
    )
    gate = threading.Event()
    arrived: list[tuple[int, float]] = []

    def slow_layers(op_id: int, layer: int) -> None:
        arrived.append((layer, time.perf_counter()))
        if gate.is_set():
            time.sleep(0.02)  # make the layer-by-layer arrival visible

    with HiCache(cfg, SPEC, layer_hook=slow_layers) as cache:
        system = list(range(1000, 1064))  # a 64-token shared system prompt
        prompts = [system + list(range(i * 100, i * 100 + 64)) for i in range(6)]
        for i, p in enumerate(prompts):
            prefill(cache, p)
            cache.sync(wait=True)
            demoted = cache_stats(cache).counters["device_demoted_tokens_total"]
            what = (
                f"L1 full: {demoted} tokens demoted to L2 so far (LRU first)"
                if demoted
                else "backed up to L2 (write_through)"
            )
            show(cache, f"prompt {i} ({len(p)} tokens, 64 shared) prefilled; {what}")
        m = cache.full.pages.match_prefix(prompts[0])
        console.print(f"prompt 0 again: {m.device_tokens} tokens in L1, {m.host_tokens} in L2 only")
        gate.set()
        t0 = time.perf_counter()
        req = cache.open(prompts[0])
        assert cache.admit(req, prompts[0])
        for layer in range(SPEC.num_layers):
            req.wait_layer(layer, timeout_s=10)
            console.print(
                f"  layer {layer} readable after {1e3 * (time.perf_counter() - t0):5.1f} ms"
                " (the next layers are still copying)"
            )
        prefix = req.pages[: req.prefix_pages]
        got = cache.full.pages.device_pool.read_pages(page_tensor(prefix))
        ok = torch.equal(got, fake_kv(prompts[0], 0, len(prefix)))
        loaded = req.cached.host
        cache.release(req)
        cache.sync(wait=True)
        show(cache, f"loaded back {loaded} tokens; bytes equal to the original: {ok}")
        c = cache_stats(cache).counters
        console.print(
            f"backed up {c['backup_tokens_total']} tokens ({c['backup_bytes_total'] / 2**20:.1f} MiB),"
            f" loaded back {c['load_tokens_total']} tokens, demoted {c['device_demoted_tokens_total']}"
        )
        check_integrity(cache)
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
