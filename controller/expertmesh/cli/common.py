"""Argument helpers shared by the CLI subcommands."""

from __future__ import annotations

import json
from typing import Any

from expertmesh.cli.main import UsageError

__all__ = ["json_object"]


def json_object(text: str | None, flag: str) -> dict[str, Any]:
    """The JSON object ``text`` given to ``flag`` ({} when not given).

    ``UsageError`` (one line, exit 2) when it is not JSON, not an object, or nested too
    deeply for the parser."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{flag} is not JSON: {err.msg}") from None
    except RecursionError:
        raise UsageError(f"{flag} is nested too deeply") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object")
    return value
