"""The rooms of ``src/hicache`` and the one direction their imports point.

``server -> engine -> {runner, cache, disagg}``; the cache side (``cache``,
``controller``, ``tree``, ``memory``, ``transfer``, ``storage``) never imports a serving
room; ``disagg`` (prefill/decode transfer) sits below the engine and beside the cache;
``integrations`` (hicache's L3 inside other engines) reach only the storage side;
``kv_events`` (residency reports for routers) reads the tree and is driven by the engine. Inside
``engine``, its rooms point one way too: ``front -> drivers -> step -> shared`` and
``front -> roles -> shared``, where *shared* is the package's own modules (the rank
channel, step inputs, config, the role hooks, the request). Every import counts
(``TYPE_CHECKING`` and function-level ones too), as in :mod:`tests.test_import_cycles`,
whose import graph this reuses.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

import pytest

from tests.test_import_cycles import PACKAGE, SRC, import_graph

CACHE_SIDE = ("cache", "controller", "tree", "memory", "transfer", "storage")

SERVING = ("engine", "server", "runner", "bench")

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "runner": ("engine", "server", "cache", "bench", "disagg", "integrations"),
    "engine": ("server", "bench", "integrations"),
    "server": ("cache", "tree", "controller", "bench", "integrations"),
    "disagg": (*SERVING, "cache", "tree", "controller", "integrations"),
    "integrations": (*SERVING, "cache", "tree", "controller", "disagg"),
    "kv_events": (*SERVING, "cache", "controller", "disagg", "integrations"),
    **{room: (*SERVING, "disagg", "integrations") for room in CACHE_SIDE},
}
"""Room -> rooms it must not import (the HTTP side reaches the cache only through the
engine; the runner knows neither the loop nor the cache facade)."""

ENGINE_FORBIDDEN: dict[str, tuple[str, ...]] = {
    "shared": ("front", "drivers", "step", "roles"),
    "step": ("front", "drivers", "roles"),
    "roles": ("front", "drivers", "step"),
    "drivers": ("front", "roles"),
    "front": (),
}
"""The engine's rooms -> those they must not import (see the module docstring)."""


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _wrong_imports(
    room: str, room_of: Callable[[str], str | None], forbidden: dict[str, tuple[str, ...]]
) -> list[str]:
    """The imports of ``room``'s modules into rooms ``forbidden[room]`` names (``room_of``:
    a module's room, None outside the rooms looked at)."""
    graph = import_graph(SRC, PACKAGE)
    assert any(room_of(m) == room for m in graph), f"no room {room!r} under src/hicache"
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if room_of(m) == room
        for t in targets
        if room_of(t) in forbidden[room]
    )


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_point_one_way(room: str) -> None:
    wrong = _wrong_imports(room, _room, FORBIDDEN)
    assert not wrong, f"{room} imports rooms it must not:\n" + "\n".join(wrong)


def _engine_room(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "engine":
        return None
    return parts[2] if len(parts) > 3 and parts[2] in ENGINE_FORBIDDEN else "shared"


@pytest.mark.parametrize("room", sorted(ENGINE_FORBIDDEN))
def test_the_engines_rooms_point_one_way(room: str) -> None:
    wrong = _wrong_imports(room, _engine_room, ENGINE_FORBIDDEN)
    assert not wrong, f"engine.{room} imports rooms it must not:\n" + "\n".join(wrong)


FRONT_ONLY = ("core", "cache", "scheduler")


def test_the_server_reaches_the_cache_only_through_the_engine() -> None:
    """No module of the HTTP room reads ``engine.core`` (the cache and the scheduler
    behind it), ``engine.cache`` or ``engine.scheduler``: it goes through the engine's own
    methods (``Engine.stats``, ``flush_cache``, ``attach_storage`` ...)."""
    files = sorted((SRC / PACKAGE / "server").rglob("*.py"))
    assert len(files) >= 10, "the server package was not found"
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute) or node.attr not in FRONT_ONLY:
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name == "engine":
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: engine.{node.attr}")
    assert not bad, bad
