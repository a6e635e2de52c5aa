"""Children started by :func:`hicache.services.process.popen_dying_with_parent`.

They die with the process that started them, and they start cleanly while gRPC streams
run in it: a child that ran Python between fork and exec (a ``preexec_fn``) could abort
in gRPC's fork handlers first (2 of 40 spawns did here).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from hicache.services.process import popen_dying_with_parent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


@pytest.fixture
def grpc_stream() -> Iterator[None]:
    """A server streaming to a client, both in this process, for the test's length."""

    def stream(_req: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
        while ctx.is_active():
            yield b"x"
            time.sleep(0.001)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.unary_stream_rpc_method_handler(stream)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"S": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_stream("/t.T/S")(b"")
    got = threading.Event()

    def drain() -> None:
        try:
            for _ in call:
                got.set()
        except grpc.RpcError:
            pass

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    assert got.wait(10), "the stream never delivered"
    try:
        yield
    finally:
        call.cancel()
        t.join(5)
        channel.close()
        server.stop(0)


def test_children_start_cleanly_while_grpc_streams(grpc_stream: None) -> None:
    codes = [popen_dying_with_parent(["true"]).wait(10) for _ in range(60)]
    assert codes == [0] * 60


def test_a_child_dies_with_its_parent_even_a_killed_one() -> None:
    parent = textwrap.dedent(
        """
        import sys, time
        from hicache.services.process import popen_dying_with_parent
        child = popen_dying_with_parent(["sleep", "60"])
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        child = int(p.stdout.readline())
        comm = ""
        for _ in range(100):  # setpriv execs sleep under the same PID
            with open(f"/proc/{child}/comm") as f:
                comm = f.read().strip()
            if comm == "sleep":
                break
            time.sleep(0.02)
        assert comm == "sleep"
        p.kill()
        p.wait(10)
        end = time.monotonic() + 10
        while time.monotonic() < end and _alive(child):
            time.sleep(0.02)
        assert not _alive(child), "the child outlived its killed parent"
    finally:
        p.kill()
        p.wait(10)


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, reaped by init soon, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_preexec_fn_is_refused() -> None:
    with pytest.raises(ValueError, match="death signal"):
        popen_dying_with_parent(["true"], preexec_fn=os.getpid)
