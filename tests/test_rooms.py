"""The rooms of ``src/hicache`` and the one direction their imports point.

``server -> engine -> {runner, cache}``; the cache side (``cache``, ``controller``,
``tree``, ``memory``, ``transfer``, ``storage``) never imports a serving room. Every
import counts (``TYPE_CHECKING`` and function-level ones too), as in
:mod:`tests.test_import_cycles`, whose import graph this reuses.
"""

from __future__ import annotations

import ast

import pytest

from tests.test_import_cycles import PACKAGE, SRC, import_graph

CACHE_SIDE = ("cache", "controller", "tree", "memory", "transfer", "storage")

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "runner": ("engine", "server", "cache", "bench"),
    "engine": ("server", "bench"),
    "server": ("cache", "tree", "controller", "bench"),
    **{room: ("engine", "server", "runner", "bench") for room in CACHE_SIDE},
}
"""Room -> rooms it must not import (the HTTP side reaches the cache only through the
engine; the runner knows neither the loop nor the cache facade)."""


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_point_one_way(room: str) -> None:
    graph = import_graph(SRC, PACKAGE)
    assert any(_room(m) == room for m in graph), f"no room {room!r} under src/hicache"
    wrong = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _room(m) == room
        for t in targets
        if _room(t) in FORBIDDEN[room]
    )
    assert not wrong, f"{room} imports rooms it must not:\n" + "\n".join(wrong)


def test_the_server_reaches_the_cache_only_through_the_engine() -> None:
    """No module of the HTTP room reads ``engine.cache`` or ``engine.scheduler``: it goes
    through the engine's own methods (``Engine.stats``, ``flush_cache``,
    ``attach_storage`` ...)."""
    files = sorted((SRC / PACKAGE / "server").rglob("*.py"))
    assert len(files) >= 10, "the server package was not found"
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute) or node.attr not in ("cache", "scheduler"):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name == "engine":
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: engine.{node.attr}")
    assert not bad, bad
