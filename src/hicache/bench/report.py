"""Shared output helpers for the benchmarks: one table format and one JSON format
everywhere."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` under ``columns`` as a table titled ``title``."""
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def write_json(path: str | Path, doc: Any) -> None:
    """Write ``doc`` to ``path`` as indented JSON, with a final newline (``--json PATH``)."""
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
