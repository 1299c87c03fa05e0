"""Shared fixtures. Tests under tests/unit get the `unit` marker and may not start Ray;
tests under tests/integration get the `integration` marker."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Hypothesis' per-example deadline (200 ms by default) is a wall-clock assertion: on a loaded
# shared machine a cheap example can miss it. No test here has one; pytest-timeout bounds runs.
settings.register_profile("expertmesh", deadline=None)
settings.load_profile("expertmesh")
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


def _load_peer_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "peer_eplb_tool", REPO / "scripts" / "peer_eplb.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _peer_eplb_path() -> tuple[Path | None, str]:
    """Where DeepSeek's EPLB module (from the pinned sglang wheel) is, and why not if it is not:
    EXPERTMESH_PEER_EPLB, else .cache/peers/deepseek_eplb.py, fetched from PyPI when missing
    (scripts/peer_eplb.py)."""
    env = os.environ.get("EXPERTMESH_PEER_EPLB")
    if env:
        return (Path(env), "") if Path(env).is_file() else (None, f"{env} does not exist")
    tool = _load_peer_tool()
    try:
        return tool.fetch(REPO / ".cache" / "peers"), ""
    except tool.PeerUnavailable as err:
        return None, str(err)


@pytest.fixture(scope="session")
def peer_eplb() -> ModuleType:
    """DeepSeek's published EPLB (torch), fetched from the pinned sglang wheel on first use.
    Unavailable (no network): a skip on a developer's machine, a failure under CI=true."""
    pytest.importorskip("torch", reason="the peer DeepSeek EPLB needs torch")
    path, why = _peer_eplb_path()
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"peer DeepSeek EPLB unavailable under CI: {why}", pytrace=False)
        pytest.skip(f"peer DeepSeek EPLB unavailable: {why}")
    spec = importlib.util.spec_from_file_location("deepseek_eplb_peer", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
