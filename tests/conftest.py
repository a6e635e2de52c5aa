"""Shared fixtures: the L3 services (Redis, Valkey, Mooncake) live in conftest_storage."""

import os

import pytest
import torch

from hicache.lifecycle import skip_final_collection

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers.storage_fixtures import (  # noqa: F401
    mooncake_service,
    redis_private,
    redis_service,
    valkey_service,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests (``@pytest.mark.gpu``) are gated here, once: skipped without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over: exit without the interpreter's last collection."""
    skip_final_collection()
