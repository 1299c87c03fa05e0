"""`expertmesh sim replay`: the trace.npz + plans.npz an SPMD run writes (runtime/trace.py)
and the calibrated constants -> the SPMD step model per step, compared with the measured
median; bad input exits 2. The step model's collectives are counted here by hand."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from expertmesh.cli.main import main
from expertmesh.formats import read_plan, read_trace
from expertmesh.planner import Topology
from expertmesh.planner.static import static_placement
from expertmesh.runtime.settings import RuntimeSettings, StepResult
from expertmesh.runtime.trace import RunTrace, migration_collectives
from expertmesh.sim.replay import Calibration, RuntimeMeta, planned_from, replay
from expertmesh.workers.model import LMConfig

TOPO = Topology.generate(2, 2, masters=1, spare=1).with_inter_dc(1.0, 10.0)  # 4 ranks, 2 slots
LM = LMConfig(num_layers=2, num_experts=4, top_k=2, hidden=8, ffn_hidden=8, batch=2,
              seq_len=16, microbatches=2)  # fmt: skip
CAL = Calibration(seconds_per_token=1e-4, collective_seconds=2e-3, ranks=4)
BW = 1e9 / 8  # bytes per second at 1 Gbit/s


def _home_plan() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each DC holds every expert once, masters stay, every token is routed inside its DC."""
    phy2log = np.array([[0, 2], [1, 3], [2, 0], [3, 1]])
    master = np.array([0, 2, 4, 6])  # static's: slot 0 of rank e
    holder = {(d, int(e)): r for r in range(4) for e in phy2log[r] for d in [TOPO.rank_dc[r]]}
    route = np.array([(s, e, holder[(TOPO.rank_dc[s], e)], 5) for s in range(4) for e in range(4)])
    return [(phy2log, master, route)] * LM.num_layers


def _trace(steps=3, switch_at=2, balance=False, migration="boundary") -> RunTrace:
    """A run of ``steps`` steps, static until ``switch_at``, then the home plan (version 1);
    with ``balance`` the fast loop fetches replica weights in the last step."""
    s = RuntimeSettings(
        topology=TOPO.to_dict(), lm=LM, policy="hybrid", balance=balance, migration=migration
    )
    tr = RunTrace(s)
    tr.plans[1] = (_home_plan(), (3, 1))
    rng = np.random.default_rng(0)
    for t in range(steps):
        v = 0 if t < switch_at else 1
        by = np.zeros((3, 2, 2), np.int64)
        by[0] = [[0, 1_000_000 * (v == 0)], [2_000_000 * (v == 0), 0]]  # tokens
        by[1] = [[0, 50_000], [60_000, 0]]  # weights
        by[2] = [[0, 4_000_000 * (t == switch_at)], [0, 0]]  # the switch's migration
        tr.steps[t] = StepResult(
            step=t, loss=1.0, step_seconds=0.3, control_seconds=0.0, seconds=0.4 + 0.1 * t,
            imbalance=1.0, plan_version=v, cross_dc_token_bytes=0, cross_dc_weight_bytes=0,
            cross_dc_migration_bytes=0, bytes_by_pair=by.tolist(), tokens_per_rank=[0] * 4,
            tokens_per_layer_rank=[[0] * 4] * 2, fanout_bytes=1000 * (balance and t == steps - 1),
        )  # fmt: skip
        tr.load[t] = rng.integers(0, 20, (LM.num_layers, 4, LM.num_experts))
    return tr


def _replay(tr: RunTrace, cal: Calibration = CAL):
    load, meta, plans, pmeta = tr.arrays()
    mig = {int(v): c for v, c in pmeta["migration_collectives"].items()}
    return replay(load, RuntimeMeta(**meta), plans["phy2log"], plans["master"], plans["route"],
                  migration=mig, calibration=cal)  # fmt: skip


def test_each_step_is_the_spmd_step_model_of_the_plan_it_ran():
    res = _replay(_trace())
    tokens = 2 * 16 * 2  # batch x seq_len x microbatches
    # static: per microbatch and layer 5 in-DC + 5 crossing collectives; per step the dense
    # sum and broadcast in the DC and 1 across the DC leaders; no replica, no expert sync
    static_total, static_cross = 2 * 2 * 10 + 3, 2 * 2 * 5 + 1
    # home plan: no token crosses; the expert sync's WAN hops (gradients to the master's DC,
    # weights back) run, the in-DC ones do not (one copy per DC)
    home_total, home_cross = 2 * 2 * 5 + 3 + 2, 1 + 2
    lat = 0.010
    want = [
        # step 0: static, 2 MB from DC 1 to DC 0 the busiest pair
        1e-4 * tokens + 2e-3 * static_total + lat * static_cross + 2_060_000 / BW,
        # step 1: static, then the switch to plan 1: its 3 collectives (1 crossing) and
        # its 4 MB of migration, counted in step 2's report, are this step's
        1e-4 * tokens + 2e-3 * (static_total + 3) + lat * (static_cross + 1)
        + (1_050_000 + 4_000_000) / BW,
        # step 2: the home plan
        1e-4 * tokens + 2e-3 * home_total + lat * home_cross + 60_000 / BW,
    ]  # fmt: skip
    np.testing.assert_allclose(res.predicted, want, rtol=1e-12)
    assert res.counts["collectives"].tolist() == [static_total, static_total + 3, home_total]
    assert res.counts["crossing"].tolist() == [static_cross, static_cross + 1, home_cross]
    assert res.counts["migration"].tolist() == [0, 3, 0]
    np.testing.assert_allclose(
        res.parts["compute"] + res.parts["software"] + res.parts["latency"]
        + res.parts["transfer"], res.predicted, rtol=1e-12,
    )  # fmt: skip
    # the fast loop: per microbatch and layer its counts all-gather, and when it fetches
    # replicas their weights and their gradients home (in the DC)
    fast = _replay(_trace(balance=True))
    extra = np.array([4, 4, 4 + 8]) * 2e-3
    np.testing.assert_allclose(fast.predicted - res.predicted, extra, rtol=1e-9)
    assert res.measured.tolist() == pytest.approx([0.4, 0.5, 0.6])
    # the medians start at the first step on a plan the controller made (step 2 ran on
    # version 1); before it every policy runs the initial placement
    assert res.skip == planned_from([0, 0, 1]) == 2
    assert res.measured_median == pytest.approx(0.6)
    assert res.predicted_median == pytest.approx(want[2])
    assert res.error == pytest.approx(want[2] / 0.6 - 1)
    tr = _trace()
    load, meta, plans, pmeta = tr.arrays()
    mig = {int(v): c for v, c in pmeta["migration_collectives"].items()}
    every = replay(load, RuntimeMeta(**meta), plans["phy2log"], plans["master"],
                   plans["route"], migration=mig, calibration=CAL, skip=1)  # fmt: skip
    assert every.measured_median == pytest.approx(0.55)  # only the first step left out
    assert every.predicted_median == pytest.approx(np.median(want[1:]))


def test_planned_from_is_the_first_step_on_a_new_plan_and_never_step_0():
    assert planned_from([0, 0, 0, 1, 1, 2]) == 3
    assert planned_from([3, 3, 3]) == 1  # one plan throughout: all but the first step
    assert planned_from([0, 1, 1]) == 1
    assert planned_from([]) == 1


def test_a_background_switch_is_one_transfer_in_the_step_and_the_sync_switches():
    """The runtime's default: the moved masters travel on one background all-to-all during
    the switch step (the workers count it in that step's report: its bytes are that step's)
    and the step's sync sends gradients to the new masters and refreshes the new copies."""
    tr = _trace(migration="background")
    res = _replay(tr)
    tokens, lat = 2 * 16 * 2, 0.010
    static_total, static_cross = 2 * 2 * 10 + 3, 2 * 2 * 5 + 1
    home_total, home_cross = 2 * 2 * 5 + 3 + 2, 1 + 2
    # step 1 switches: no master moves (no background transfer); its refresh fills the
    # home plan's copies (the WAN weights hop), its gradients stay with static's holders
    switch_total, switch_cross = static_total + 1, static_cross + 1
    assert res.counts["collectives"].tolist() == [static_total, switch_total, home_total]
    assert res.counts["crossing"].tolist() == [static_cross, switch_cross, home_cross]
    assert res.counts["migration"].tolist() == [0, 0, 0]
    want_1 = 1e-4 * tokens + 2e-3 * switch_total + lat * switch_cross + 2_060_000 / BW
    # step 2: its own report's 4 MB a -> b of migration is its own (background)
    want_2 = 1e-4 * tokens + 2e-3 * home_total + lat * home_cross + 4_050_000 / BW
    np.testing.assert_allclose(res.predicted[1:], [want_1, want_2], rtol=1e-12)
    # a plan that moves a master: one more collective (latency hidden in the step) ...
    moved = _home_plan()
    # expert 2's master from rank 2 (DC 1) to its copy on rank 0 (DC 0), slot 1
    moved[0] = (moved[0][0], np.array([0, 2, 1, 6]), moved[0][2])
    tr.plans[1] = (moved, (5, 2))
    res = _replay(tr)
    assert res.counts["migration"].tolist() == [0, 1, 0]
    # ... and the switch step's gradients of expert 2 go over the WAN to its new master
    assert res.counts["collectives"][1] == switch_total + 1 + 1
    assert res.counts["crossing"][1] == switch_cross + 1


def test_bytes_per_collective_sum_their_busiest_pairs():
    """With the workers' bytes per crossing collective, each collective takes its busiest
    pair over the bandwidth and the step the sum (pairs run in parallel only inside one
    collective): two collectives loading opposite directions cost both, not the larger."""
    tr = _trace(migration="background")
    a_to_b, b_to_a = [[0, 1_000_000], [0, 0]], [[0, 0], [3_000_000, 0]]
    tr.crossed = {0: [(0, a_to_b), (0, b_to_a)], 1: [(1, a_to_b)], 2: [(2, b_to_a), (1, a_to_b)]}
    res = _replay(tr)
    by_step = _replay(_trace(migration="background"))
    np.testing.assert_allclose(
        res.parts["transfer"], [4_000_000 / BW, 1_000_000 / BW, 4_000_000 / BW], rtol=1e-12
    )
    np.testing.assert_allclose(
        res.predicted - res.parts["transfer"], by_step.predicted - by_step.parts["transfer"]
    )
    # boundary switches: a migration transfer counted in step 2's report is step 1's
    tr.settings = tr.settings.model_copy(update={"migration": "boundary"})
    res = _replay(tr)
    np.testing.assert_allclose(
        res.parts["transfer"], [4_000_000 / BW, 4_000_000 / BW, 1_000_000 / BW], rtol=1e-12
    )
    load, meta, plans, _ = tr.arrays()
    meta["collective_bytes"] = meta["collective_bytes"][:2]
    with pytest.raises(ValueError, match="collective bytes of 2 steps"):
        replay(load, RuntimeMeta(**meta), plans["phy2log"], plans["master"], plans["route"],
               migration={1: (3, 1)}, calibration=CAL)  # fmt: skip


def test_migration_collectives_count_rounds_and_kinds():
    rounds = [
        [(0, 1, 0, 1, "w"), (1, 1, 0, 1, "w")],  # in DC 0
        [(0, 2, 0, 2, "w"), (0, 3, 2, 3, "opt")],  # crossing copy; in-DC state
        [(0, 0, 3, 0, "opt")],  # crossing state
    ]
    assert migration_collectives(rounds, TOPO) == (4, 2)
    assert migration_collectives([], TOPO) == (0, 0)


def test_the_trace_files_hold_what_the_run_trained_on(tmp_path):
    tr = _trace(steps=4, switch_at=2)
    del tr.load[3]  # the controller has not recorded step 3 yet: not written
    trace_path, plan_path = tr.write(tmp_path)
    trace, plan = read_trace(trace_path), read_plan(plan_path)
    assert trace.load.shape == (3, 2, 4, 4)
    np.testing.assert_array_equal(trace.load[1], tr.load[1])
    meta = RuntimeMeta(**trace.meta)
    assert meta.plan_versions == [0, 0, 1] and meta.step_seconds == pytest.approx([0.4, 0.5, 0.6])
    assert meta.microbatches == 2 and meta.tokens_per_rank == 32 and meta.policy == "hybrid"
    assert meta.topology == TOPO.to_dict()
    static = static_placement(4, 2, 4, 1)
    np.testing.assert_array_equal(plan.phy2log[0, 1], static.phy2log)
    np.testing.assert_array_equal(plan.phy2log[2, 0], _home_plan()[0][0])
    np.testing.assert_array_equal(plan.master[2, 1], _home_plan()[1][1])
    rows = plan.route[(plan.route[:, 0] == 2) & (plan.route[:, 1] == 1)]
    np.testing.assert_array_equal(rows[:, 2:], _home_plan()[1][2])
    assert not (plan.route[:, 0] < 2).any()  # static's plan has no route rows
    assert plan.meta["migration_collectives"] == {"1": [3, 1]}


def test_shapes_and_constants_must_agree():
    tr = _trace()
    load, meta, plans, _ = tr.arrays()
    m = RuntimeMeta(**meta)
    with pytest.raises(ValueError, match="master"):
        replay(load, m, plans["phy2log"], plans["master"][:, :1], plans["route"],
               migration={1: (3, 1)}, calibration=CAL)  # fmt: skip
    with pytest.raises(ValueError, match="6 ranks, the trace has 4"):
        replay(load, m, plans["phy2log"], plans["master"], plans["route"],
               migration={1: (3, 1)}, calibration=CAL.model_copy(update={"ranks": 6}))  # fmt: skip
    with pytest.raises(ValueError, match=r"versions \[1\]"):
        replay(load, m, plans["phy2log"], plans["master"], plans["route"],
               migration={}, calibration=CAL)  # fmt: skip
    short = m.model_copy(update={"step_seconds": [1.0]})
    with pytest.raises(ValueError, match="step times"):
        replay(load, short, plans["phy2log"], plans["master"], plans["route"],
               migration={1: (3, 1)}, calibration=CAL)  # fmt: skip


def test_cli_replay_and_bad_input(tmp_path, capsys):
    trace, plan = _trace().write(tmp_path)
    (tmp_path / "cal.yaml").write_text(yaml.safe_dump(CAL.model_dump()))
    args = ["sim", "replay", "--trace", str(trace), "--plan", str(plan),
            "--calibration", str(tmp_path / "cal.yaml")]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    want = _replay(_trace())
    assert f"predicted median step {want.predicted_median:.4g} s" in out
    assert "measured 0.6 s" in out
    rows = (tmp_path / "o" / "replay.csv").read_text().splitlines()
    assert rows[0].startswith("step,predicted_seconds,measured_seconds,compute") and len(rows) == 4
    (tmp_path / "bad.yaml").write_text("seconds_per_token: -1\ncollective_seconds: 0\n")
    assert main([*args[:-1], str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert "seconds-per-token" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "six.yaml").write_text(yaml.safe_dump({**CAL.model_dump(), "ranks": 6}))
    assert main([*args[:-1], str(tmp_path / "six.yaml")]) == 2
    assert "calibrate on the run's shape" in capsys.readouterr().err
    from expertmesh.formats import write_trace

    write_trace(tmp_path / "nometa.npz", read_trace(trace).load)
    assert main([*args[:2], "--trace", str(tmp_path / "nometa.npz"), *args[4:]]) == 2
    assert "topology" in capsys.readouterr().err


def test_the_copy_term_charges_each_steps_copies_per_rank():
    """h times the (layer, expert) copies a rank holds under the step's plan, the mean
    over ranks: static holds 1 per layer, the home plan 2 (each DC every expert); the
    rest of the step is unchanged."""
    base = _replay(_trace())
    h = 3e-3
    cal = Calibration(seconds_per_token=1e-4, collective_seconds=2e-3, copy_seconds=h, ranks=4)
    res = _replay(_trace(), cal)
    copies = np.array([1.0, 1.0, 2.0]) * LM.num_layers  # steps 0, 1 static; 2 the home plan
    assert res.counts["copies"].tolist() == copies.tolist()
    np.testing.assert_allclose(res.predicted - base.predicted, h * copies, rtol=1e-12)
    np.testing.assert_allclose(res.parts["copies"], h * copies, rtol=1e-12)
    np.testing.assert_allclose(
        res.parts["compute"] + res.parts["software"] + res.parts["copies"]
        + res.parts["latency"] + res.parts["transfer"], res.predicted, rtol=1e-12,
    )  # fmt: skip


def test_copy_constants_exact_when_non_negative_else_the_non_negative_fit():
    from expertmesh.sim.replay import fit_copy_constants

    # c = 5 ms, h = 2 ms: 23 c + 6 h and 15 c + 12 h
    got = fit_copy_constants((23, 6, 23 * 5e-3 + 6 * 2e-3), (15, 12, 15 * 5e-3 + 12 * 2e-3))
    assert got["fit"] == "exact"
    assert got["collective_seconds"] == pytest.approx(5e-3)
    assert got["copy_seconds"] == pytest.approx(2e-3)
    # the replicated layout a little faster than fewer collectives alone explain: the
    # exact h is negative; the fit is h = 0 and c the least squares of both layouts, not
    # static's alone (the old fallback), and the exact solution is kept beside it
    r1, r2 = 0.187, 0.118
    got = fit_copy_constants((23, 4, r1), (15, 12, r2))
    assert got["fit"].startswith("non-negative least squares")
    assert got["copy_seconds"] == 0.0
    assert got["collective_seconds"] == pytest.approx((23 * r1 + 15 * r2) / (23**2 + 15**2))
    assert got["exact_copy_seconds"] < 0
    assert 23 * got["exact_collective_seconds"] + 4 * got["exact_copy_seconds"] == pytest.approx(r1)


def test_the_trace_holds_each_ranks_cpu_and_shaper_waits_per_step(tmp_path):
    tr = _trace(steps=3, switch_at=2)
    # cumulative per rank (collectives, shaper waits, CPU seconds); rank 3 restarted at
    # step 2 (counts from 0) and rank 2 did not report step 1
    tr.counters = {
        0: {r: (10, 0.1 * r, 1.0 + r) for r in range(4)},
        1: {0: (20, 0.3, 1.5), 1: (20, 0.4, 2.25), 3: (20, 0.5, 4.5)},
        2: {0: (30, 0.3, 2.0), 1: (30, 0.4, 3.0), 2: (30, 0.2, 3.5), 3: (10, 0.0, 0.25)},
    }
    trace = read_trace(tr.write(tmp_path)[0])
    cpu = np.asarray(trace.meta["rank_cpu_seconds"])
    waits = np.asarray(trace.meta["rank_shaped_seconds"])
    np.testing.assert_allclose(cpu[1], [0.5, 0.25, 0.0, 0.5])
    np.testing.assert_allclose(cpu[2], [0.5, 0.75, 0.5, 0.25])
    np.testing.assert_allclose(waits[1], [0.3, 0.3, 0.0, 0.2])
    np.testing.assert_allclose(waits[2], [0.0, 0.0, 0.0, 0.0])
    assert trace.meta["collectives"] == [10, 10, 20]
    # counters written before the CPU was reported (two numbers): CPU 0, the rest as before
    tr.counters = {t: {r: c[:2] for r, c in d.items()} for t, d in tr.counters.items()}
    trace = read_trace(tr.write(tmp_path)[0])
    assert np.asarray(trace.meta["rank_cpu_seconds"]).sum() == 0
    assert trace.meta["collectives"] == [10, 10, 20]
