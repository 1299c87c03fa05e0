"""``expertmesh demo`` arguments -> runtime settings (no Ray started)."""

from __future__ import annotations

import pytest

from expertmesh.cli.demo import build_settings
from expertmesh.cli.main import build_parser, main
from expertmesh.controller.settings import DEFAULT_GRPC_PORT, DEFAULT_REST_PORT


def _settings(*argv: str):
    return build_settings(build_parser().parse_args(["demo", "--policy", "static", *argv]))


def test_surfaces_default_to_the_control_planes_ports_on_loopback(monkeypatch) -> None:
    for var in ("EXPERTMESH_HOST", "EXPERTMESH_REST_PORT", "EXPERTMESH_GRPC_PORT"):
        monkeypatch.delenv(var, raising=False)
    s = _settings()
    assert s.surfaces is not None
    assert (s.surfaces.host, s.surfaces.rest_port, s.surfaces.grpc_port) == (
        "127.0.0.1",
        DEFAULT_REST_PORT,
        DEFAULT_GRPC_PORT,
    )
    s = _settings("--rest-port", "0", "--grpc-port", "9123")
    assert s.surfaces is not None and (s.surfaces.rest_port, s.surfaces.grpc_port) == (0, 9123)
    assert _settings("--no-serve").surfaces is None


def test_bad_demo_arguments_exit_2_with_one_line(capsys) -> None:
    assert main(["demo", "--policy", "static", "--rest-port", "70000", "--exit"]) == 2
    err = capsys.readouterr().err.strip()
    assert "rest_port" in err and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match="unknown policy"):
        _settings("--policy", "nope")


def test_checkpoint_and_replacement_flags(tmp_path) -> None:
    s = _settings()
    assert (s.checkpoint_dir, s.checkpoint_every, s.checkpoint_keep) == (None, 5, 3)
    assert s.replace_dead_workers is True
    s = _settings("--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
                  "--checkpoint-keep", "4", "--no-replace")  # fmt: skip
    assert (s.checkpoint_dir, s.checkpoint_every, s.checkpoint_keep) == (str(tmp_path / "ck"), 2, 4)
    assert s.replace_dead_workers is False
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        _settings("--checkpoint-dir", str(tmp_path / "file"))
    with pytest.raises(ValueError, match="checkpoint-keep"):
        _settings("--checkpoint-keep", "0")


def test_step_deadline_flag() -> None:
    assert _settings().step_deadline_s == 0.0  # derived by the runtime
    assert _settings("--step-deadline", "12.5").step_deadline_s == 12.5
    with pytest.raises(ValueError, match="step-deadline"):
        _settings("--step-deadline", "-1")


def test_the_trace_goes_beside_the_json(tmp_path) -> None:
    assert _settings().trace_dir is None
    s = _settings("--json", str(tmp_path / "run" / "demo.json"))
    assert s.trace_dir == str(tmp_path / "run")


def test_the_fast_loops_hybrid_and_the_planner_level() -> None:
    """With the fast loop, hybrid keeps a slot per rank free, evens out its DCs and re-plans
    at every plan on the newest window, unless --policy-settings says otherwise; the
    controller solves the planner's level unless told not to."""
    parse = build_parser().parse_args
    s = build_settings(parse(["demo", "--policy", "hybrid"]))
    assert s.policy_settings == {"reserve_slots": 1, "even_dcs": True, "period": 5, "window": 1}
    assert s.planner_level
    s = build_settings(
        parse(["demo", "--policy", "hybrid", "--policy-settings", '{"even_dcs": false}'])
    )
    assert s.policy_settings["even_dcs"] is False and s.policy_settings["reserve_slots"] == 1
    s = build_settings(parse(["demo", "--policy", "hybrid", "--no-balance"]))
    assert s.policy_settings == {}
    assert not _settings("--no-planner-level").planner_level
