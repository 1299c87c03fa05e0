"""The REST bearer-token check (controller/auth.py, shared with gRPC) refuses every near miss of the configured token: longer
(the token plus a suffix), shorter (a prefix), case-changed and empty. A check that compares
only a prefix (the first ``len(token)`` characters of what was sent, or of what is wanted)
lets one of them through. Refused writes change nothing and reports are counted as rejected.
The gRPC side of the same check is in tests/integration/test_security.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from expertmesh.controller.api import create_app
from expertmesh.controller.auth import bearer_token, token_matches
from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.controller.telemetry import Telemetry
from expertmesh.planner import ModelSpec, Topology

TOKEN = "Tok3n-with-Case"
R, E = 4, 8

# what a client may send in place of the token
NEAR_MISSES = {
    "longer": TOKEN + "x",
    "longer_by_a_word": TOKEN + TOKEN,
    "shorter": TOKEN[:-1],
    "one_character": TOKEN[:1],
    "upper": TOKEN.upper(),
    "lower": TOKEN.lower(),
    "empty": "",
}


@pytest.fixture
def env():
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=1, num_experts=E, top_k=2, hidden=16, ffn_hidden=8)
    core = ControllerCore(topo, model, ControllerSettings(trigger={"mode": "every_step"}))
    store = SqlitePlanStore(":memory:")
    app = create_app(core, Telemetry(core), store, SurfaceSettings(token=TOKEN))
    return core, TestClient(app)


def _writes(c: TestClient, headers: dict[str, str]) -> list[int]:
    return [
        c.post(
            "/api/v1/reports",
            json={"step": 0, "layer": 0, "rank": 0, "load": [1] * E},
            headers=headers,
        ).status_code,
        c.post(
            "/api/v1/reports/layer",
            json={"step": 0, "layer": 0, "load": [[1] * E] * R},
            headers=headers,
        ).status_code,
        c.put(
            "/api/v1/policy", json={"policy": "static", "window": 3}, headers=headers
        ).status_code,
    ]


@pytest.mark.parametrize("kind", sorted(NEAR_MISSES))
def test_near_miss_tokens_are_refused_on_rest(env, kind):
    core, c = env
    sent = NEAR_MISSES[kind]
    assert sent != TOKEN
    window = core.settings.window
    assert _writes(c, {"Authorization": f"Bearer {sent}"}) == [401, 401, 401]
    assert core.reports_rejected == core.reports_received == 2
    assert not core.loads._pending and core.window(0).shape[0] == 0
    assert core.settings.window == window


def test_the_exact_token_is_accepted_on_rest(env):
    """The control: the same requests with the token itself go through."""
    core, c = env
    assert _writes(c, {"Authorization": f"Bearer {TOKEN}"}) == [200, 200, 200]
    assert core.reports_rejected == 0 and core.settings.window == 3


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {TOKEN}", True),
        (f"bearer {TOKEN}", True),  # the scheme is case-insensitive (RFC 7235)
        (f"Bearer   {TOKEN}", True),  # one or more spaces after the scheme
        (f"  Bearer {TOKEN}  ", True),
        (f"Basic {TOKEN}", False),  # another scheme with the right token
        (f"Bearer{TOKEN}", False),
        (f"Bearer {TOKEN} {TOKEN}", False),  # more than one word
        (f"Bearer {TOKEN} x", False),
        ("Bearer", False),
        (TOKEN, False),
    ],
)
def test_the_bearer_rule_on_rest(env, header, ok):
    """controller/auth.py's rule as REST applies it; a refusal is a 401 that names the
    scheme (WWW-Authenticate: Bearer, RFC 6750) and says why in the JSON error."""
    core, c = env
    r = c.post(
        "/api/v1/reports",
        json={"step": 0, "layer": 0, "rank": 0, "load": [1] * E},
        headers={"Authorization": header},
    )
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": "missing or wrong bearer token"}
        assert core.reports_rejected == 1 and not core.loads._pending
    r = c.put("/api/v1/policy", json={"policy": "static"}, headers={"Authorization": header})
    assert r.status_code == (200 if ok else 401)
    if not ok:
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": "missing or wrong bearer token"}


def test_without_a_configured_token_no_header_matches():
    assert not token_matches(f"Bearer {TOKEN}", None) and not token_matches("Bearer x", "")
    assert bearer_token(f"Bearer {TOKEN}") == TOKEN and bearer_token(None) is None


def test_writes_without_a_configured_token_name_the_setting():
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    core = ControllerCore(topo, ModelSpec(num_layers=1, num_experts=E))
    c = TestClient(
        create_app(core, Telemetry(core), SqlitePlanStore(":memory:"), SurfaceSettings())
    )
    r = c.put("/api/v1/policy", json={"policy": "static"}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 403
    assert r.json() == {"error": "writes are disabled: no token is configured (EXPERTMESH_TOKEN)"}
