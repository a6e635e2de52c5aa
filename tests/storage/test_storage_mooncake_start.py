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
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from hicache.services.process import freeze_process
from tests.helpers.services import require_mooncake, start_mooncake

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


_START = """
import sys, time
from hicache.keys import Namespace
from hicache.storage import StorageError, StorageOptions, create_storage
ns = Namespace(model="m", weights_fingerprint="start", kv_dtype="bfloat16",
               layout="page_first", page_size=4)
st = create_storage("mooncake", namespace=ns,
                    extra_config={"master_server_address": sys.argv[1]},
                    options=StorageOptions(connect_timeout_s=float(sys.argv[2])))
t = time.monotonic()
try:
    st.start()
except StorageError as e:
    print(f"{time.monotonic() - t:.3f}")
    print(e)
    sys.exit(0)
print("started")
sys.exit(1)
"""


def assert_fails_in_time(address: str) -> None:
    """Start the backend in a child process: the Mooncake client's ``setup`` holds the GIL,
    so a regression that reached it against a dead master would wedge this process, not
    fail it. The child must exit with the one-line error well within the deadline."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _START, address, str(CONNECT_S)],
            capture_output=True,
            text=True,
            timeout=CONNECT_S + SLACK_S + 20,  # interpreter start and imports included
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"start() against {address} did not return (hung in the client)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    took_s, msg = proc.stdout.strip().split("\n", 1)
    assert float(took_s) < CONNECT_S + SLACK_S, f"start() took {took_s} s"
    assert address in msg and f"{CONNECT_S:g} s" in msg, msg
    assert "\n" not in msg


def test_black_hole_master(black_hole: str) -> None:
    require_mooncake()
    assert_fails_in_time(black_hole)


def test_frozen_master() -> None:
    svc = start_mooncake(segment_size="64MiB")
    assert svc.master_pid is not None
    freeze_process(svc.master_pid)  # every thread stopped: none can answer the probe
    try:
        assert_fails_in_time(svc.master_server_address)
    finally:
        os.kill(svc.master_pid, signal.SIGCONT)
        svc.close()
