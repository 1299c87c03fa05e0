"""The figures of docs/reliability.md from the SPMD members tests: with
``EXPERTMESH_MEMBERS_REPORT=FILE`` each test module adds its members changes (pause,
rejoin, dead rank left out: seconds, what moved) and every step's wall time to FILE."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_report(module: str, changes: list[dict[str, Any]], steps: list[Any]) -> None:
    """``steps``: :class:`~expertmesh.runtime.settings.StepResult` of the run."""
    report = os.environ.get("EXPERTMESH_MEMBERS_REPORT")
    if not report:
        return
    path = Path(report)
    old = json.loads(path.read_text()) if path.exists() else {}
    old[module] = {
        "changes": changes,
        "steps": sorted([s.step, s.seconds, s.tokens_per_rank] for s in steps),
    }
    path.write_text(json.dumps(old, indent=1, default=str))
