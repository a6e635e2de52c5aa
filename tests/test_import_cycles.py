"""No import cycles under ``src/hicache``, ``TYPE_CHECKING`` ones and function-level ones included.

Every ``import`` / ``from ... import`` anywhere in a module's AST is an edge. ``from
hicache.x import y`` goes to ``hicache.x.y`` when that is a module, else to ``hicache.x``
(the package's ``__init__``); ``import hicache.x.y`` goes to ``hicache.x.y``. Importing a
submodule is not counted as an edge to its parent packages. Only edges between modules of
the package count; a module importing itself (a package ``__init__`` importing a name it
defines) is ignored.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "hicache"

Graph = dict[str, set[str]]


def module_files(src: Path, package: str) -> dict[str, Path]:
    """Module name -> file for every ``.py`` under ``src/package`` (``__init__`` = package)."""
    out: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imports_of(module: str, path: Path, modules: Iterable[str]) -> Iterator[str]:
    """The modules of the package that ``module`` (at ``path``) imports, anywhere in it."""
    known = set(modules)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _existing(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield sub
                else:
                    yield from _existing(base, known)


def _existing(name: str, known: set[str]) -> Iterator[str]:
    """``name`` or its nearest enclosing module that belongs to the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            yield candidate
            return
        parts.pop()


def import_graph(src: Path, package: str) -> Graph:
    """Module -> the package's modules it imports (self-imports dropped)."""
    files = module_files(src, package)
    graph: Graph = {m: set() for m in files}
    for module, path in files.items():
        graph[module].update(t for t in imports_of(module, path, files) if t != module)
    return graph


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module, each sorted, sorted by first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def one_cycle(graph: Mapping[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth-first)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def describe_cycles(graph: Mapping[str, set[str]]) -> list[str]:
    """One line per cyclic component: its modules and one cycle through it."""
    lines = []
    for comp in strongly_connected(graph):
        cycle = " -> ".join(one_cycle(graph, comp))
        lines.append(f"{len(comp)} modules {comp}: e.g. {cycle}")
    return lines


# ---------------------------------------------------------------------------- the check


def test_no_import_cycles_under_src_hicache() -> None:
    graph = import_graph(SRC, PACKAGE)
    assert len(graph) > 20, "the source tree was not found"
    cycles = describe_cycles(graph)
    for line in cycles:
        print("import cycle:", line)
    assert not cycles, "import cycles under src/hicache:\n" + "\n".join(cycles)


# ---------------------------------------------------------------------------- the checker


def _write(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_checker_sees_type_checking_function_level_and_relative_imports(
    tmp_path: Path,
) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n"
            ),
            "pkg/b.py": "def f():\n    from .a import A\n    return A\nB = 2\n",
            "pkg/sub/__init__.py": "X = 1\n",
            "pkg/sub/c.py": "from .. import a\nfrom pkg.sub import X\nimport pkg.sub.d\n",
            "pkg/sub/d.py": "import os\nfrom ..sub import c\n",
            "pkg/e.py": "from pkg import sub\nfrom pkg.sub import c, X\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.sub", "pkg.sub.d"}
    assert graph["pkg.sub.d"] == {"pkg.sub.c"}
    assert graph["pkg.e"] == {"pkg.sub", "pkg.sub.c"}
    assert strongly_connected(graph) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]
    lines = describe_cycles(graph)
    assert lines[0].endswith("pkg.a -> pkg.b -> pkg.a")


def test_checker_counts_a_package_init_as_the_package(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/x/__init__.py": "from pkg.x.y import Y\nZ = 3\n",
            "pkg/x/y.py": "from pkg.x import Z\nY = 1\n",  # Z is no module: edge to pkg.x
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert strongly_connected(graph) == [["pkg.x", "pkg.x.y"]]


@pytest.mark.parametrize("name", ["hicache.tree.radix", "hicache.tree.integrity"])
def test_tree_modules_are_in_no_cycle(name: str) -> None:
    graph = import_graph(SRC, PACKAGE)
    assert all(name not in comp for comp in strongly_connected(graph))
