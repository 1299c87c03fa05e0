"""Shared fixtures. Tests under tests/unit get the `unit` marker and may not start Ray;
tests under tests/integration get the `integration` marker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "unit" in parts:
            item.add_marker(pytest.mark.unit)
        elif "integration" in parts:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _no_ray_in_unit_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests must not start Ray (as Ray Serve does for its unit tests)."""
    if request.node.get_closest_marker("unit") is None:
        return
    try:
        import ray
    except ImportError:
        return

    def _forbidden(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unit tests may not call ray.init; put the test under tests/integration")

    monkeypatch.setattr(ray, "init", _forbidden)


@pytest.fixture
def repo() -> Path:
    return REPO
