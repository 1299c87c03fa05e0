"""Shared terminal output of the CLI: rich console and tables, number formats."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["console", "fmt_bytes", "table"]


def console() -> Console:
    """A console on the current ``sys.stdout``; wide when it is not a terminal (files, pipes)."""
    c = Console(highlight=False)
    if not c.is_terminal:
        c = Console(highlight=False, width=max(c.width, 160))
    return c


def table(title: str, columns: list[str], left: int = 1, **kw: Any) -> Table:
    """A table whose first ``left`` columns are left-aligned text that never wraps and whose
    other columns are right-aligned figures."""
    t = Table(title=title, title_justify="left", **kw)
    for i, name in enumerate(columns):
        if i < left:
            t.add_column(name, justify="left", no_wrap=True)
        else:
            t.add_column(name, justify="right", overflow="fold")
    return t


def fmt_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``0``, ``512 B``, ``3.2 MB``, ``1.1 GB``."""
    if n == 0:
        return "0"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
