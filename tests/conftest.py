"""Shared fixtures: the L3 services (Redis, Valkey, Mooncake) live in conftest_storage."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.conftest_storage import mooncake_service, redis_service, valkey_service  # noqa: F401
