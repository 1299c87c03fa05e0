"""Shared fixtures. Tests under tests/unit get the `unit` marker and may not start Ray;
tests under tests/integration get the `integration` marker."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
from types import ModuleType

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


def _peer_eplb_path() -> tuple[Path | None, str]:
    """Where DeepSeek's EPLB module (from the sglang wheel) is, and why not if it is not."""
    env = os.environ.get("EXPERTMESH_PEER_EPLB")
    if env:
        return (Path(env), "") if Path(env).is_file() else (None, f"{env} does not exist")
    cached = REPO / ".cache" / "peers" / "deepseek_eplb.py"
    if cached.is_file():
        return cached, ""
    tool = next(
        (p / "shared" / "tools" / "peer-eplb" for p in REPO.parents
         if (p / "shared" / "tools" / "peer-eplb").is_file()),
        None,
    )  # fmt: skip
    if tool is None:
        return None, "shared/tools/peer-eplb not found; set EXPERTMESH_PEER_EPLB"
    try:
        out = subprocess.run(
            [str(tool), str(cached.parent)],
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"peer-eplb failed: {err}"
    if out.returncode != 0 or not cached.is_file():
        return None, f"peer-eplb failed: {out.stderr.strip()[-300:]}"
    return cached, ""


@pytest.fixture(scope="session")
def peer_eplb() -> ModuleType:
    """DeepSeek's published EPLB (torch) via shared/tools/peer-eplb; skips if unavailable."""
    pytest.importorskip("torch", reason="the peer DeepSeek EPLB needs torch")
    path, why = _peer_eplb_path()
    if path is None:
        pytest.skip(f"peer DeepSeek EPLB unavailable: {why}")
    spec = importlib.util.spec_from_file_location("deepseek_eplb_peer", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
