"""The HTTP room's boundary: ``server -> engine``, one way. No module of the engine loop
package imports :mod:`hicache.server`; no module of the server imports :mod:`hicache.cache`
or reaches into ``engine.cache`` / ``engine.scheduler``: it goes through the engine's
methods (``Engine.stats``, ``flush_cache``, ``attach_storage`` ...)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "hicache"


def imported(path: Path) -> Iterator[str]:
    """Every module name an import anywhere in ``path`` names (absolute imports)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_engine_does_not_import_the_server() -> None:
    bad = [
        f"{path.relative_to(SRC)}: {name}"
        for path in sorted((SRC / "engine").rglob("*.py"))
        for name in imported(path)
        if under(name, "hicache.server")
    ]
    assert not bad, bad
    assert not (SRC / "engine" / "server.py").exists()


def test_the_server_reaches_the_cache_only_through_the_engine() -> None:
    files = sorted((SRC / "server").rglob("*.py"))
    assert len(files) >= 10
    bad = [
        f"{path.relative_to(SRC)}: imports {name}"
        for path in files
        for name in imported(path)
        if under(name, "hicache.cache")
    ]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute) or node.attr not in ("cache", "scheduler"):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name == "engine":
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: engine.{node.attr}")
    assert not bad, bad
