"""Peers in processes of their own, for the PD tests and the pd-transfer bench.

A receiving (decode-side) peer for the transport tests and the pd-transfer bench: a
process of its own with a CPU DevicePool of random contents, registered with a transport.

:func:`receiver` runs in a child process (``multiprocessing`` spawn context) and speaks
over one pipe end:

1. sends ``(endpoint, geometry dict)`` once its pool is registered (or ``("error", msg)``
   when the transport does not start);
2. then answers commands: ``("check", pages, expected, untouched)`` -> a dict
   ``{"written": bool, "untouched": bool}`` (``expected``: the bytes those pages must
   hold, in ``read_pages`` order; every page not in ``pages`` must still hold what it
   held at start); ``("stop",)`` -> closes the transport and returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from hicache.disagg.transport import Span
from hicache.lifecycle import skip_final_collection
from hicache.memory.device_pool import DevicePool
from hicache.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
"""2 layers x K and V x 2 heads x 4 floats: rows of 32 bytes."""
NUM_PAGES = 12
PAGE_SIZE = 2


def random_pool(seed: int, spec: KVSpec = SPEC, num_pages: int = NUM_PAGES) -> DevicePool:
    """A CPU pool whose bytes are random (seeded)."""
    pool = DevicePool(spec, num_pages, PAGE_SIZE)
    g = torch.Generator().manual_seed(seed)
    b = pool.buffer.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return pool


def receiver(conn: Connection, backend: str, seed: int) -> None:
    from hicache.disagg.backends import make_transport
    from hicache.disagg.pages import PoolGeometry

    pool = random_pool(seed)
    start = pool.buffer.clone()
    try:
        t = make_transport(backend, "127.0.0.1", f"decode-{seed}")
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        geo = PoolGeometry.of(pool)
        t.register([geo.region()])
        conn.send((t.endpoint, geo.to_dict()))
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            _, pages, expected = cmd
            got = pool.read_pages(pages)
            others = [p for p in range(NUM_PAGES) if p not in pages]
            conn.send(
                {
                    "written": bool(torch.equal(got.view(torch.uint8), expected.view(torch.uint8))),
                    "untouched": bool(
                        torch.equal(
                            pool.buffer[:, :, _slots(others)].view(torch.uint8),
                            start[:, :, _slots(others)].view(torch.uint8),
                        )
                    ),
                }
            )
    finally:
        t.close()
        skip_final_collection()


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor(
        [p * PAGE_SIZE + i for p in pages for i in range(PAGE_SIZE)], dtype=torch.int64
    )


def prefill_server(conn: Connection, backend: str, port: int, slow: Any | None) -> None:
    """A prefill instance of tiny-random-llama served over HTTP, in a child process (one
    the tests may pause with SIGSTOP): sends its URL (or ``("error", msg)``), then serves
    until anything comes on ``conn``. ``slow``: a multiprocessing Event set in the middle
    of the sender's first write (half its spans written, the other half 1 s later), so
    that a test can pause the instance during a transfer under way."""
    from hicache.disagg.transport import TransportUnavailable
    from tests.disagg.test_pd_engine import make_engine
    from tests.helpers.api_fixtures import serve

    try:
        engine = make_engine(
            "tiny-random-llama",
            "prefill",
            port=port,
            transfer_backend=backend,
            room_timeout_s=60.0,
            transfer_timeout_s=120.0,
        )
    except TransportUnavailable as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        if slow is not None:
            transport = engine.core.scheduler.ends.role.sender.transport  # type: ignore[attr-defined]
            transport.write = _first_write_paused(transport.write, slow)
        with serve(engine) as url:
            conn.send(url)
            conn.recv()
    finally:
        engine.close()
        skip_final_collection()


def _first_write_paused(
    write: Callable[[str, Sequence[Any], float], None], event: Any
) -> Callable[[str, Sequence[Any], float], None]:
    once = threading.Lock()

    def paused(peer: str, spans: Sequence[Any], timeout_s: float) -> None:
        if not once.acquire(blocking=False):
            write(peer, spans, timeout_s)
            return
        if len(spans) == 1:  # one contiguous copy: two halves of it
            s, n = spans[0], spans[0].nbytes // 2
            spans = [Span(s.src, s.dst, n), Span(s.src + n, s.dst + n, s.nbytes - n)]
        half = len(spans) // 2
        write(peer, spans[:half], timeout_s)
        event.set()
        time.sleep(1.0)
        write(peer, spans[half:], timeout_s)

    return paused
