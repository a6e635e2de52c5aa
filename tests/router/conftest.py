"""``hicache serve`` workers for the router tests: real server subprocesses on
127.0.0.1 (``--host 127.0.0.1``, free ports), over the tiny random Llama on CPU, each with
the admin key that the smg in front of them is given as its ``--api-key`` (smg sends it
to every worker route, so its ``POST /flush_cache`` fan-out passes the worker's admin
check)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from hicache.bench.serverproc import ServerProcess
from tests.helpers.smg import require_smg

ROUTER_KEY = "sk-router-admin"
"""smg's ``--api-key`` and every worker's ``--admin-api-key``."""

WORKER_FLAGS = (
    "--model-path",
    "tiny-random-llama",
    "--device",
    "cpu",
    "--admin-api-key",
    ROUTER_KEY,
)

StartWorker = Callable[..., ServerProcess]


@pytest.fixture(scope="module", autouse=True)
def _smg_installed() -> None:
    require_smg()  # skip the module (fail under CI) before any worker starts


@pytest.fixture(scope="module")
def start_worker() -> Iterator[StartWorker]:
    """Starts ``hicache serve`` workers (extra flags as arguments; ``grpc=True``: also an
    smg gRPC worker, :attr:`ServerProcess.grpc_url`); stops them all at the module's end,
    whatever happened."""
    started: list[ServerProcess] = []

    def start(*flags: str, grpc: bool = False) -> ServerProcess:
        server = ServerProcess([*WORKER_FLAGS, *flags], startup_timeout_s=120.0, grpc=grpc)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.close()


@pytest.fixture(scope="module")
def workers(start_worker: StartWorker) -> Sequence[ServerProcess]:
    """Two plain workers shared by the module's tests (none of which stops them)."""
    return (start_worker(), start_worker())
