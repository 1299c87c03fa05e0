"""Shared fixtures of the integration tests: headless Chromium for the dashboard checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .chromium import Chromium, find_chromium


@pytest.fixture
def browser() -> Iterator[Chromium]:
    """A headless Chromium (skipped where it is not installed)."""
    binary = find_chromium()
    if binary is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it)")
    b = Chromium(binary)
    yield b
    b.close()


@pytest.fixture
def offline_browser() -> Iterator[Chromium]:
    """A headless Chromium that resolves no host name but loopback (no internet)."""
    binary = find_chromium()
    if binary is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it)")
    b = Chromium(binary, offline=True)
    yield b
    b.close()
