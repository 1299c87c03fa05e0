"""Schemathesis against the live OpenAPI schema of a real server on a free loopback port.

Every operation gets positive and negative (schema-violating) requests, with and without
the bearer token. Checks: no 5xx (plus schemathesis' conformance checks), and a request
that is refused (4xx) changes nothing: plan versions, committed plan, policy, window
sizes, pending loads, stored plans and the applied-report count are compared before and
after each refused request (refused reports may only grow received and rejected alike).

Bounded: ``EXPERTMESH_FUZZ_EXAMPLES`` examples per operation and mode (default 40), so
the module runs in a minute or two on two cores.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import ModelSpec, Topology, available_policies

TOKEN = "fuzz-token"
R, E, L = 4, 8, 2
MAX_EXAMPLES = int(os.environ.get("EXPERTMESH_FUZZ_EXAMPLES", "40"))
STATUS: Counter[tuple[str, str, int]] = Counter()  # (method, path, status) -> requests


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=L, num_experts=E, top_k=2, hidden=16, ffn_hidden=8)
    core = ControllerCore(topo, model, ControllerSettings(trigger={"mode": "every_step"}))
    db = tmp_path_factory.mktemp("fuzz") / "plans.sqlite"
    settings = SurfaceSettings(
        rest_port=0, grpc_port=0, token=TOKEN, db_path=str(db), max_body_bytes=256 * 1024
    )
    with Surfaces(core, settings) as s:
        rng = np.random.default_rng(0)
        for step in range(3):  # a history to read: plans 1..3, windows with loads
            for layer in range(L):
                core.report_layer(step, layer, rng.integers(0, 50, (R, E)))
            core.commit(core.plan(step).version)
        yield core, s
    out = os.environ.get("EXPERTMESH_FUZZ_REPORT")  # figures for docs/reliability.md
    if out:
        rows = [
            {"method": m, "path": p, "status": c, "requests": n} for (m, p, c), n in STATUS.items()
        ]
        Path(out).write_text(
            json.dumps(sorted(rows, key=lambda r: (r["path"], r["method"], r["status"])), indent=1)
        )


def _snapshot(core: ControllerCore, s: Surfaces) -> dict[str, Any]:
    return {
        "versions": [(pv.version, str(pv.state)) for pv in core.versions()],
        "committed": core.committed.version if core.committed else None,
        "settings": core.settings.model_dump(),
        "windows": [(len(core.window(layer)), core.layer_newest_step(layer)) for layer in range(L)],
        "pending": sorted(core.loads._pending),
        "stored": s.store.count(),
        "stored_settings": s.store.load_settings(),
        "applied": core.reports_received - core.reports_rejected,
    }


def _operations(s: Surfaces) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{s.rest_url}/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    assert len(ops) >= 12, [op.label for op in ops]
    return ops


def _check(live: Any, case: Any, headers: dict[str, str], seen: Counter) -> int:
    core, s = live
    before = _snapshot(core, s)
    rejected_before = core.reports_rejected
    # positive_data_acceptance is off: the schema cannot say that a load must be [R, E] for
    # this server's topology, so schema-valid loads of another shape are rightly refused (422)
    response = case.call_and_validate(
        base_url=s.rest_url,
        headers=headers,
        timeout=30,
        excluded_checks=[positive_data_acceptance],
    )
    STATUS[(case.method.upper(), case.path, response.status_code)] += 1
    seen[(case.method.upper(), case.path, response.status_code)] += 1
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        after = _snapshot(core, s)
        assert after == before, f"refused {case.method} {case.path} changed state"
        assert core.reports_rejected >= rejected_before
        body = response.json()
        assert isinstance(body.get("error"), str) and body["error"]
    return int(response.status_code)


def _repair(case: Any, data: st.DataObject) -> None:
    """Give a schema-valid body the shapes and names this server accepts, so that writes
    also succeed (the schema cannot say that a load is [R, E] or which policies exist)."""
    body = case.body if isinstance(case.body, dict) else None
    if body is None:
        return
    counts = st.integers(0, 1000)
    path = case.path
    if path in ("/api/v1/solve", "/api/v1/reports/layer"):
        body["load"] = data.draw(
            st.lists(st.lists(counts, min_size=E, max_size=E), min_size=R, max_size=R)
        )
        body["layer"] = data.draw(st.integers(0, L - 1))
        if path == "/api/v1/solve" and "policy" in body:
            body["policy"] = data.draw(st.sampled_from(sorted(available_policies())))
            body["policy_settings"] = {}
    elif path == "/api/v1/reports":
        body["load"] = data.draw(st.lists(counts, min_size=E, max_size=E))
        body["layer"] = data.draw(st.integers(0, L - 1))
        body["rank"] = data.draw(st.integers(0, R - 1))
        body["step"] = data.draw(st.integers(0, 10**6))
    elif path == "/api/v1/policy":
        body["policy"] = data.draw(st.sampled_from(sorted(available_policies())))
        body["policy_settings"] = {}


WRITES = {("PUT", "/api/v1/policy"), ("POST", "/api/v1/reports"), ("POST", "/api/v1/reports/layer")}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("token", [True, False], ids=["token", "no-token"])
def test_rest_fuzz(live: Any, mode: GenerationMode, token: bool) -> None:
    """Every example's checks (above); then this run's own coverage (it holds when the test
    runs alone): every operation was called, positive requests were accepted somewhere,
    negative ones refused somewhere, and with the token a write went through."""
    core, s = live
    headers = {"Authorization": f"Bearer {TOKEN}"} if token else {}
    seen: Counter[tuple[str, str, int]] = Counter()
    rejected = core.reports_rejected
    ops = _operations(s)
    unsatisfiable = set()
    for op in ops:

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode), data=st.data())
        def run(case: Any, data: st.DataObject) -> None:
            if mode == GenerationMode.POSITIVE and data.draw(st.booleans(), label="repair"):
                _repair(case, data)
            status = _check(live, case, headers, seen)
            if not token and (case.method.upper(), case.path) in WRITES:
                assert status in (400, 401, 403, 413, 422), f"{case.method} {case.path}: {status}"

        try:
            run()
        except Unsatisfiable:
            # nothing to negate (no parameters, no body): the positive run covers it
            assert mode == GenerationMode.NEGATIVE and not op.body and not op.path_parameters
            unsatisfiable.add((op.method.upper(), op.path))
            continue
        except Exception as err:
            raise AssertionError(f"{op.label} ({mode}): {err}") from err
    called = {(m, p) for m, p, _ in seen}
    assert called | unsatisfiable == {(op.method.upper(), op.path) for op in ops}, called
    classes = Counter()
    for (_, _, code), n in seen.items():
        classes[code // 100] += n
    assert classes[5] == 0
    if mode == GenerationMode.POSITIVE:
        assert classes[2] > 0, seen
    else:
        assert classes[4] > 0 and core.reports_rejected > rejected, seen
    if token and mode == GenerationMode.POSITIVE:
        assert any((m, p) in WRITES and c < 300 for m, p, c in seen), seen
