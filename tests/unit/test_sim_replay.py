"""`expertmesh sim replay`: a runtime run's trace + plan + calibrated constants -> the
runtime step model per step, compared with the measured median; bad input exits 2."""

import pytest
import yaml

from expertmesh.cli.main import main
from expertmesh.formats import write_plan, write_trace
from expertmesh.planner import ModelSpec, Topology, make_policy, plan_trace
from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.plan import Placement
from expertmesh.planner.stepmodel import step_layout, training_step_cost
from expertmesh.planner.trace import TraceSettings, generate_trace
from expertmesh.planner.traffic import traffic_from_route
from expertmesh.sim.replay import Calibration, RuntimeMeta, replay

TOPO = Topology.generate(2, 2, masters=2, spare=2, inter_dc_gbps=1.0, inter_dc_latency_ms=5)
SIZES = {"top_k": 2, "hidden": 64, "ffn_hidden": 32, "weight_bytes": 4, "grad_bytes": 4,
         "act_bytes": 4}  # fmt: skip
MODEL = ModelSpec(num_layers=2, num_experts=8, **SIZES)
CAL = Calibration(flops_per_second=2e9, message_seconds=0.004)


def _run(policy="hybrid", steps=3):
    s = TraceSettings(num_ranks=4, num_experts=8, num_layers=2, num_steps=steps, top_k=2,
                      tokens_per_rank=64, imbalance=1.5, seed=2)  # fmt: skip
    load = generate_trace(s).load
    plan = plan_trace(load, TOPO, MODEL, make_policy(policy)).to_arrays()
    meta = RuntimeMeta(topology=TOPO.to_dict(), dense_params=1000, policy=policy,
                       step_seconds=[0.5, 0.4, 0.6][:steps], **SIZES)  # fmt: skip
    return load, plan, meta


def test_each_step_is_the_runtime_step_model_of_its_plan():
    load, plan, meta = _run()
    res = replay(load, meta, plan["phy2log"], plan["master"], plan["route"], calibration=CAL)
    cost = CostSettings(flops_per_second=2e9, message_seconds=0.004)
    for t in range(3):
        pl, routes, tr = [], [], []
        for layer in range(2):
            rows = plan["route"][(plan["route"][:, 0] == t) & (plan["route"][:, 1] == layer)]
            pl.append(Placement(plan["phy2log"][t, layer], plan["master"][t, layer]))
            routes.append(rows[:, 2:])
            tr.append(traffic_from_route(rows[:, 2:], load[t, layer], TOPO, 2))
        want = training_step_cost(TOPO, MODEL, tr, pl, dense_params=1000, settings=cost,
                                  layout=step_layout(pl, routes, TOPO)).seconds  # fmt: skip
        assert res.predicted[t] == pytest.approx(want)
    assert res.measured_median == 0.5
    assert res.error == pytest.approx(res.predicted_median / 0.5 - 1)
    # the calibrated round time is in every step: more of it, a longer step
    slow = Calibration(flops_per_second=2e9, message_seconds=0.008)
    more = replay(load, meta, plan["phy2log"], plan["master"], plan["route"], calibration=slow)
    assert (more.predicted > res.predicted).all()


def test_shapes_must_agree():
    load, plan, meta = _run()
    with pytest.raises(ValueError, match="master"):
        replay(load, meta, plan["phy2log"], plan["master"][:, :1], plan["route"], calibration=CAL)
    short = meta.model_copy(update={"step_seconds": [1.0]})
    with pytest.raises(ValueError, match="step times"):
        replay(load, short, plan["phy2log"], plan["master"], plan["route"], calibration=CAL)


def test_cli_replay_and_bad_input(tmp_path, capsys):
    load, plan, meta = _run("static")
    write_trace(tmp_path / "t.npz", load, meta.model_dump(mode="json"))
    write_plan(tmp_path / "p.npz", plan, {"policy": "static"})
    (tmp_path / "cal.yaml").write_text(yaml.safe_dump(CAL.model_dump()))
    args = ["sim", "replay", "--trace", str(tmp_path / "t.npz"), "--plan",
            str(tmp_path / "p.npz"), "--calibration", str(tmp_path / "cal.yaml")]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "predicted median step" in out and "measured 0.5 s" in out
    rows = (tmp_path / "o" / "replay.csv").read_text().splitlines()
    assert rows[0] == "step,predicted_seconds,measured_seconds" and len(rows) == 4
    (tmp_path / "bad.yaml").write_text("flops_per_second: -1\nmessage_seconds: 0\n")
    bad = [*args[:-1], str(tmp_path / "bad.yaml")]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert "flops-per-second" in err and len(err.strip().splitlines()) == 1
    write_trace(tmp_path / "nometa.npz", load)
    assert main([*args[:2], "--trace", str(tmp_path / "nometa.npz"), *args[4:]]) == 2
    assert "topology" in capsys.readouterr().err
