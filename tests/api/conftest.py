"""The default engine served over HTTP, shared by the API test modules that need nothing
else (a module may define its own ``server``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.engine.front.engine import Engine
from tests.helpers.api_fixtures import make_engine, serve


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Engine]]:
    """``(url, engine)`` of the default tiny engine, one per test module."""
    engine = make_engine()
    with serve(engine) as url:
        yield url, engine
    engine.close()
