"""Both transports between two processes on 127.0.0.1: pages land byte for byte and
nothing else moves; a dead peer and a bad endpoint fail within the deadline."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from typing import Any

import pytest

from hicache.disagg.backends import make_transport
from hicache.disagg.config import TransferBackend
from hicache.disagg.pages import PoolGeometry, page_spans
from hicache.disagg.transport import TransferFailed, Transport, TransportUnavailable
from tests.disagg.peers import random_pool, receiver
from tests.helpers.services import missing

pytestmark = pytest.mark.timeout(60)

BACKENDS = [TransferBackend.MOONCAKE, TransferBackend.NIXL]
SRC_PAGES = [3, 4, 5, 9]
DST_PAGES = [7, 8, 1, 2]
TIMEOUT_S = 2.0
MARGIN_S = 1.5


def _transport(backend: TransferBackend, name: str) -> Transport:
    try:
        return make_transport(backend, "127.0.0.1", name)
    except TransportUnavailable as e:
        missing(f"the {backend.value} transport", str(e))


@contextmanager
def _peer(
    backend: TransferBackend, seed: int = 7
) -> Iterator[tuple[Any, Connection, str, PoolGeometry]]:
    """A receiver process: ``(process, pipe, endpoint, geometry)``; always reaped."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, backend.value, seed), daemon=True)
    proc.start()
    there.close()
    try:
        if not here.poll(30):
            raise AssertionError("the receiver did not start within 30 s")
        endpoint, geo = here.recv()
        if endpoint == "error":
            missing(f"the {backend.value} transport", geo)
        yield proc, here, endpoint, PoolGeometry.from_dict(geo)
    finally:
        if proc.is_alive():
            with suppress(OSError):
                here.send(("stop",))
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        here.close()


@contextmanager
def _sender(backend: TransferBackend) -> Iterator[tuple[Transport, Any]]:
    pool = random_pool(1)
    t = _transport(backend, "prefill")
    try:
        t.register([PoolGeometry.of(pool).region()])
        yield t, pool
    finally:
        t.close()


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_pages_land_and_nothing_else_moves(backend: TransferBackend) -> None:
    with _sender(backend) as (t, pool), _peer(backend) as (_, conn, endpoint, geo):
        spans = page_spans(PoolGeometry.of(pool), SRC_PAGES, geo, DST_PAGES)
        assert len(spans) == 2 * 2 * 3  # per kind and layer: (3, 4) -> (7, 8), 5 -> 1, 9 -> 2
        t.write(endpoint, spans, TIMEOUT_S)
        conn.send(("check", DST_PAGES, pool.read_pages(SRC_PAGES)))
        assert conn.recv() == {"written": True, "untouched": True}
        # a second write of other pages over the same connection
        t.write(endpoint, page_spans(PoolGeometry.of(pool), [0], geo, [5]), TIMEOUT_S)
        conn.send(("check", [*DST_PAGES, 5], pool.read_pages([*SRC_PAGES, 0])))
        assert conn.recv() == {"written": True, "untouched": True}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_a_killed_peer_fails_within_the_deadline(backend: TransferBackend) -> None:
    with _sender(backend) as (t, pool), _peer(backend) as (proc, _, endpoint, geo):
        spans = page_spans(PoolGeometry.of(pool), SRC_PAGES, geo, DST_PAGES)
        t.write(endpoint, spans, TIMEOUT_S)  # connected
        proc.kill()
        proc.join(5)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed):
            t.write(endpoint, spans, TIMEOUT_S)
        assert time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
    # a transport that never reached it
    with _sender(backend) as (t, pool):
        spans = page_spans(PoolGeometry.of(pool), SRC_PAGES, geo, DST_PAGES)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed):
            t.write(endpoint, spans, TIMEOUT_S)
        assert time.monotonic() - t0 < TIMEOUT_S + MARGIN_S


def test_a_frozen_peer_fails_at_the_deadline() -> None:
    """A peer that stops answering (SIGSTOP), whether connected or first reached then:
    the write returns TransferFailed once ``timeout_s`` has passed, not later; a write
    after it wakes up goes through.

    Mooncake only: on one host UCX writes into the peer's memory itself (cross-memory
    attach), so a frozen NIXL peer still receives every byte."""
    backend = TransferBackend.MOONCAKE
    with _sender(backend) as (t, pool), _peer(backend) as (proc, conn, endpoint, geo):
        spans = page_spans(PoolGeometry.of(pool), range(12), geo, range(12))
        t.write(endpoint, spans, TIMEOUT_S)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            try:
                for _ in range(50):  # until the socket buffers are full
                    t.write(endpoint, spans, TIMEOUT_S)
            except TransferFailed:
                pass
            else:
                pytest.fail("writes to a frozen peer kept succeeding")
            took = time.monotonic() - t0
            assert TIMEOUT_S <= took < TIMEOUT_S + MARGIN_S
            # a transport that never reached it: its first write fails at the deadline too
            with _sender(backend) as (t2, pool2):
                spans2 = page_spans(PoolGeometry.of(pool2), SRC_PAGES, geo, DST_PAGES)
                t0 = time.monotonic()
                with pytest.raises(TransferFailed, match="did not answer a probe"):
                    t2.write(endpoint, spans2, TIMEOUT_S)
                assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
                os.kill(proc.pid, signal.SIGCONT)
                t2.write(endpoint, spans2, TIMEOUT_S)  # the same probe, answered now
                conn.send(("check", DST_PAGES, pool2.read_pages(SRC_PAGES)))
                assert conn.recv()["written"] is True
        finally:
            os.kill(proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_a_bad_endpoint_fails_clearly(backend: TransferBackend) -> None:
    with _sender(backend) as (t, pool):
        g = PoolGeometry.of(pool)
        spans = page_spans(g, [0], g, [1])  # any addresses: nothing is reached
        with pytest.raises(TransferFailed, match="bad peer"):
            t.write("not an endpoint", spans, TIMEOUT_S)
        if backend is TransferBackend.MOONCAKE:
            t0 = time.monotonic()
            with pytest.raises(TransferFailed, match=r"127\.0\.0\.1:1: the peer does not answer"):
                t.write("127.0.0.1:1", spans, TIMEOUT_S)  # nobody listens there
            assert time.monotonic() - t0 < TIMEOUT_S + MARGIN_S


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_a_source_outside_the_registered_memory_is_refused(backend: TransferBackend) -> None:
    with _sender(backend) as (t, pool):
        g = PoolGeometry.of(pool)
        other = random_pool(2)
        spans = page_spans(PoolGeometry.of(other), [0], g, [1])
        with pytest.raises(ValueError, match="not inside one registered region"):
            t.write(t.endpoint, spans, TIMEOUT_S)
    t.close()  # idempotent


def test_nixl_first_contact_with_a_frozen_peer_fails_at_the_deadline() -> None:
    """UCX cannot finish connecting to a frozen peer: the first write fails at the
    deadline, and one after the peer wakes up goes through (the peer is loaded anew)."""
    backend = TransferBackend.NIXL
    with _peer(backend) as (proc, conn, endpoint, geo), _sender(backend) as (t, pool):
        spans = page_spans(PoolGeometry.of(pool), SRC_PAGES, geo, DST_PAGES)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferFailed, match="still running after"):
                t.write(endpoint, spans, TIMEOUT_S)
            assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        t.write(endpoint, spans, TIMEOUT_S)
        conn.send(("check", DST_PAGES, pool.read_pages(SRC_PAGES)))
        assert conn.recv() == {"written": True, "untouched": True}
