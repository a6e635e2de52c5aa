"""Mooncake backend start against an unresponsive master fails within connect_timeout_s.

Two ways a master can be unresponsive while its port still accepts TCP connections: the
master process is frozen (SIGSTOP; the kernel still completes handshakes into its listen
backlog), or a "black hole" listener accepts and never answers. Either must make
``start()`` raise one line of StorageError naming the address and the timeout, in time.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from hicache.keys import Namespace
from hicache.storage import StorageError, StorageOptions, create_storage
from tests.services import require_mooncake, start_mooncake

NS = Namespace(
    model="m", weights_fingerprint="start", kv_dtype="bfloat16", layout="page_first", page_size=4
)
CONNECT_S = 2.0
SLACK_S = 2.5


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A listener on 127.0.0.1 that accepts connections and never answers nor closes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


def assert_fails_in_time(address: str) -> None:
    st = create_storage(
        "mooncake",
        namespace=NS,
        extra_config={"master_server_address": address},
        options=StorageOptions(connect_timeout_s=CONNECT_S),
    )
    t = time.monotonic()
    with pytest.raises(StorageError) as info:
        st.start()
    took = time.monotonic() - t
    msg = str(info.value)
    assert took < CONNECT_S + SLACK_S, f"start() took {took:.1f} s"
    assert address in msg and f"{CONNECT_S:g} s" in msg, msg
    assert "\n" not in msg
    st.close()


def test_black_hole_master(black_hole: str) -> None:
    require_mooncake()
    assert_fails_in_time(black_hole)


def test_frozen_master() -> None:
    svc = start_mooncake(segment_size="64MiB")
    assert svc.master_pid is not None
    os.kill(svc.master_pid, signal.SIGSTOP)
    try:
        assert_fails_in_time(svc.master_server_address)
    finally:
        os.kill(svc.master_pid, signal.SIGCONT)
        svc.close()
