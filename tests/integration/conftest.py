"""Shared fixtures of the integration tests.

``fault_runtime``: the small runtime the fault tests (worker killed, DC cut, controller
killed) train on, started on a real local Ray cluster (one node per DC labeled
``dc=<name>``) once per test module and shut down after it. A module changes its settings
with a module-level ``RUNTIME_OVERRIDES = {...}`` (:class:`RuntimeSettings` fields).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from expertmesh.controller.core import Trigger
from expertmesh.planner import Topology
from expertmesh.runtime.cluster import Runtime, RuntimeSettings
from expertmesh.workers.model import LMConfig

from .chromium import Chromium, find_chromium

# 2 layers x 8 experts, tiny widths: a step takes a fraction of a second on 2 cores
FAULT_LM = LMConfig(
    num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32
)


def fault_settings(**overrides: Any) -> RuntimeSettings:
    """2 DCs x 2 ranks (2 master + 2 spare slots each, 0.5 Gbit/s and 2 ms between DCs),
    :data:`FAULT_LM`, eplb planned after every step, a checkpoint every 2 steps."""
    topo = Topology.generate(2, 2, masters=2, spare=2).with_inter_dc(0.5, 2.0)
    base: dict[str, Any] = {
        "topology": topo.to_dict(),
        "lm": FAULT_LM,
        "policy": "eplb",
        "trigger": Trigger(mode="every_step"),
        "corpus_bytes": 200_000,
        "checkpoint_every": 2,
    }
    return RuntimeSettings(**{**base, **overrides})


@pytest.fixture(scope="module")
def fault_runtime(request: pytest.FixtureRequest) -> Iterator[Runtime]:
    """A started :class:`Runtime` with :func:`fault_settings` (plus the module's
    ``RUNTIME_OVERRIDES``); shut down after the module."""
    rt = Runtime(fault_settings(**getattr(request.module, "RUNTIME_OVERRIDES", {})))
    try:
        rt.start()
        yield rt
    finally:
        rt.shutdown()


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
