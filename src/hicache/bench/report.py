"""Shared output helpers for the benchmarks: one table format everywhere."""

from __future__ import annotations

from collections.abc import Sequence

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
