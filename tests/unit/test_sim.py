"""The simulator: totals are the sum of per-step rows, fast path == route path, skipped policies,
reports and the `expertmesh sim` CLI (including bad input: one line, exit 2)."""

import csv
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.cli.main import main
from expertmesh.planner import ModelSpec, Topology, make_policy
from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.policy import PolicyContext
from expertmesh.planner.runner import plan_layer
from expertmesh.planner.trace import TraceSettings, generate_trace
from expertmesh.planner.traffic import even_traffic, even_traffic_steps, traffic_from_route
from expertmesh.sim import dense_source, simulate
from expertmesh.sim.engine import COLUMNS, EVEN_SPLITS
from expertmesh.sim.report import summary_rows, write_steps_csv
from expertmesh.sim.sweep import load_sweep_config, run_sweep

TOPO = Topology.generate(3, 2, masters=2, spare=2, inter_dc_gbps=1.0)
MODEL = ModelSpec(num_layers=2, num_experts=8, top_k=2, hidden=256, ffn_hidden=64)


def _trace(steps=4):
    s = TraceSettings(num_ranks=TOPO.num_ranks, num_experts=8, num_layers=2, num_steps=steps,
                      top_k=2, tokens_per_rank=256, imbalance=1.5, drift=0.1, seed=1)  # fmt: skip
    return generate_trace(s).load


def _source(steps=4):
    return dense_source(_trace(steps))


def test_totals_equal_the_sum_of_per_step_rows(tmp_path):
    res = simulate(_source(), TOPO, MODEL, ["static", "fastermoe", "hybrid", "eplb"])
    write_steps_csv(res, tmp_path / "steps.csv")
    with (tmp_path / "steps.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(COLUMNS)
    for s in summary_rows(res):
        mine = [r for r in rows if r["policy"] == s["policy"]]
        assert len(mine) == s["steps"] == 4
        for col in ("seconds", "cross_dc_token_bytes", "cross_dc_weight_bytes", "migration_bytes"):
            key = "total_seconds" if col == "seconds" else col
            assert sum(float(r[col]) for r in mine) == pytest.approx(s[key], rel=1e-6)
        assert s["mean_seconds"] == pytest.approx(s["total_seconds"] / 4)
    assert res.speedup("static") == pytest.approx(1.0)


def test_every_step_is_modeled_and_positive():
    res = simulate(_source(), TOPO, MODEL, ["static", "hybrid"])
    for run in res.runs:
        assert [r.step for r in run.rows] == [0, 1, 2, 3]
        assert all(r.seconds > 0 and r.imbalance >= 1.0 for r in run.rows)


def test_unregistered_policies_are_skipped_not_crashed():
    res = simulate(_source(2), TOPO, MODEL, ["static", "nope"])
    assert res.run("static") is not None
    nope = next(r for r in res.runs if r.name == "nope")
    assert nope.skipped and "unknown policy" in nope.skipped and not nope.rows


def test_the_simulation_is_deterministic():
    # measured solve seconds on the critical path are the one thing that is not
    cost = CostSettings(solve_on_critical_path=False)
    a = simulate(_source(3), TOPO, MODEL, ["static", "hybrid", "fastermoe"], cost=cost)
    b = simulate(_source(3), TOPO, MODEL, ["static", "hybrid", "fastermoe"], cost=cost)
    for ra, rb in zip(a.runs, b.runs, strict=True):
        assert [r.seconds for r in ra.rows] == [r.seconds for r in rb.rows]


def _modeled(row):
    return [v for c, v in zip(COLUMNS, row.values(), strict=True) if c != "solve_seconds"]


def test_steps_costed_together_give_the_rows_of_steps_costed_alone(monkeypatch):
    from expertmesh.sim import engine

    cost = CostSettings(solve_on_critical_path=False)
    names = ["static", "fastermoe", "eplb", "quota", "hybrid", "nope"]
    s = TraceSettings(num_ranks=TOPO.num_ranks, num_experts=8, num_layers=2, num_steps=5,
                      top_k=2, tokens_per_rank=256, imbalance=2.0, drift=0.3, seed=4)  # fmt: skip
    load = generate_trace(s).load
    together = simulate(dense_source(load), TOPO, MODEL, names, cost=cost)  # one batch
    monkeypatch.setattr(engine, "BATCH_CELLS", 1)  # every step costed on its own
    alone = simulate(dense_source(load), TOPO, MODEL, names, cost=cost)
    for a, b in zip(alone.runs, together.runs, strict=True):
        assert a.skipped == b.skipped
        assert len(b.rows) == (0 if b.skipped else 5)
        assert [_modeled(r) for r in a.rows] == [_modeled(r) for r in b.rows]


def test_an_even_split_that_fails_stops_its_policy_at_that_step(monkeypatch):
    # even splits are computed when costed (a placement's steps together); one that fails
    # stops its policy at its step, as when it was computed while planning: the rows before
    # it stay, the other policies run on
    from expertmesh.sim import engine

    load = _trace(4)
    bad = load[2, 1]  # step 2, layer 1

    def steps(loads, *args, **kwargs):
        if any(np.array_equal(x, bad) for x in loads):
            raise ValueError("no copy")
        return even_traffic_steps(loads, *args, **kwargs)

    def one(x, *args, **kwargs):
        return steps(x[None], *args, **kwargs)[0]

    monkeypatch.setattr(engine, "even_traffic_steps", steps)
    monkeypatch.setattr(engine, "even_traffic", one)
    res = simulate(dense_source(load), TOPO, MODEL, ["static", "quota"])
    static = next(r for r in res.runs if r.name == "static")
    assert static.skipped == "failed at step 2: no copy"
    assert [r.step for r in static.rows] == [0, 1]
    assert [r.step for r in res.runs[1].rows] == [0, 1, 2, 3] and res.runs[1].skipped is None


def test_a_step_that_cannot_be_costed_stops_only_its_policy(monkeypatch):
    # steps are costed in batches over policies; a batch that fails is costed entry by
    # entry, so only the policy whose step fails stops (at that step) and the others keep
    # every row, the same rows as a run without the failure
    from expertmesh.planner.quota import QuotaPolicy
    from expertmesh.sim import engine

    clean = simulate(_source(), TOPO, MODEL, ["static", "quota", "eplb"])
    bad = []  # quota's traffic objects of step 2 (kept alive: compared by identity)
    route_traffic = QuotaPolicy.route_traffic

    def marked(self, ctx, placement):
        traffic = route_traffic(self, ctx, placement)
        if ctx.step == 2 and traffic is not None:
            bad.append(traffic)
        return traffic

    real = engine.step_costs

    def costs(topology, model, traffics, *args, **kwargs):
        if any(t is b for t in traffics for b in bad):
            raise ValueError("cannot cost")
        return real(topology, model, traffics, *args, **kwargs)

    monkeypatch.setattr(QuotaPolicy, "route_traffic", marked)
    monkeypatch.setattr(engine, "step_costs", costs)
    res = simulate(_source(), TOPO, MODEL, ["static", "quota", "eplb"])
    assert bad, "the planted failure never ran"
    quota = res.runs[1]
    assert quota.skipped == "failed at step 2: cannot cost"
    assert [r.step for r in quota.rows] == [0, 1]

    def modeled(rows):  # solve_seconds is measured CPU: it differs from run to run
        return [replace(r, solve_seconds=0.0) for r in rows]

    assert modeled(quota.rows) == modeled(clean.runs[1].rows[:2])
    for i in (0, 2):
        assert res.runs[i].skipped is None
        assert modeled(res.runs[i].rows) == modeled(clean.runs[i].rows)


@pytest.mark.parametrize("name", ["static", "eplb", "fastermoe", "hybrid"])
def test_fast_path_split_matches_the_policys_route(name):
    pol = make_policy(name)
    split = getattr(pol, "even_split", None) or EVEN_SPLITS[name]
    load = _trace(2)[1, 0]  # [R, E]
    model = MODEL.model_copy(update={"num_layers": 1})
    ctx = PolicyContext(TOPO, model, 0, 0, load, np.zeros((0, *load.shape), np.int64))
    lp = plan_layer(pol, ctx)
    exact = traffic_from_route(lp.route, load, TOPO, 2)
    # what the simulator charges: the policy's own view (hybrid), else its even split
    own = getattr(pol, "route_traffic", lambda *_: None)(ctx, lp.placement)
    fast = own or even_traffic(load, lp.placement, TOPO, 2, domain=split[0], remote=split[1])
    assert np.abs(exact.rank_tokens - fast.rank_tokens).max() <= np.count_nonzero(load)
    assert exact.pair_tokens.sum() == pytest.approx(fast.pair_tokens.sum(), abs=64)


def test_sweep_runs_both_kinds():
    cfg = load_sweep_config(
        {
            "policies": ["static", "hybrid"],
            "model": {"num_experts": 8, "top_k": 2, "hidden": 256, "ffn_hidden": 64},
            "trace": {"steps": 2, "tokens_per_rank": 128, "imbalance": 1.2},
            "bandwidth": {"topology": {"dcs": 2, "ranks_per_dc": 2}, "gbps": [10, 1]},
            "dcs": {"topology": {"ranks_per_dc": 2}, "counts": [2, 4]},
        }
    )
    pts = run_sweep(cfg)
    assert [(p.kind, p.x) for p in pts] == [
        ("bandwidth", 10), ("bandwidth", 1), ("dcs", 2), ("dcs", 4)
    ]  # fmt: skip
    # 8 experts fill the 4 master slots of 2 ranks: one DC is an EP group, DCs are groups
    assert pts[3].topology.num_dcs == 1 and pts[3].groups == 4
    assert pts[1].topology.inter_dc.gbps == 1 and pts[1].groups == 2
    one = load_sweep_config(cfg.model_dump() | {"bandwidth": None, "dcs": {
        "topology": {"ranks_per_dc": 2, "ep_dcs": 4}, "counts": [4]}})  # fmt: skip
    (p,) = run_sweep(one)
    assert p.groups == 1 and p.topology.num_dcs == 4
    # points side by side in two processes: the same points, in order, the same rows
    # (solve seconds are CPU time, measured anew)
    two = run_sweep(cfg, workers=2)
    assert [(q.kind, q.x, q.groups) for q in two] == [(q.kind, q.x, q.groups) for q in pts]
    for a, b in zip(pts, two, strict=True):
        for name in ("static", "hybrid"):
            ra, rb = a.result.run(name), b.result.run(name)
            assert ra is not None and rb is not None
            assert [(r.cross_dc_token_bytes, r.replicas) for r in ra.rows] == [
                (r.cross_dc_token_bytes, r.replicas) for r in rb.rows
            ]
            modeled = [r.seconds - r.exposed_seconds for r in rb.rows]  # without CPU time
            assert [r.seconds - r.exposed_seconds for r in ra.rows] == pytest.approx(
                modeled, rel=1e-5
            )


def test_sweep_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="colour"):
        load_sweep_config({"colour": 1})
    with pytest.raises(ValueError, match="counts"):
        load_sweep_config({"dcs": {"counts": []}})


def _rows(res, name):
    run = res.run(name)
    assert run is not None, [(r.name, r.skipped) for r in res.runs]
    return [
        (r.seconds, r.replicas, r.cross_dc_token_bytes, r.cross_dc_weight_bytes) for r in run.rows
    ]


def test_cost_settings_reach_policies_with_a_cost_model():
    """The simulator's cost settings are the policies' cost model unless a policy names its own.
    Case: small batches, big experts, 10 Gbit/s WAN; with gradients accumulated over 4
    microbatches a replica's sync costs a quarter per step and fastermoe shadows (10, then 5
    replicas), with the default (every microbatch) it shadows none."""
    topo = Topology.generate(3, 2, masters=2, spare=2, inter_dc_gbps=10.0)
    model = ModelSpec(num_layers=1, num_experts=8, top_k=2, hidden=1024, ffn_hidden=2048)
    trace = TraceSettings(num_ranks=topo.num_ranks, num_experts=8, num_layers=1, num_steps=2,
                          top_k=2, tokens_per_rank=128, imbalance=1.5, drift=0.1, seed=1)  # fmt: skip
    source = dense_source(generate_trace(trace).load)
    # the measured solve seconds on the critical path differ run to run: left out here
    cs = CostSettings(microbatches_per_update=4, solve_on_critical_path=False)
    names = ["fastermoe", "hybrid"]
    given_sim = simulate(source, topo, model, names, cost=cs)
    own = {name: {"cost": cs.model_dump()} for name in names}
    given_policy = simulate(source, topo, model, names, cost=cs, policy_settings=own)
    default = {name: {"cost": CostSettings().model_dump()} for name in names}
    kept_default = simulate(source, topo, model, names, cost=cs, policy_settings=default)
    for name in names:
        assert _rows(given_sim, name) == _rows(given_policy, name), name
    assert [r[1] for r in _rows(given_sim, "fastermoe")] == [10, 5]
    assert [r[1] for r in _rows(kept_default, "fastermoe")] == [0, 0]  # its own settings win


def test_cost_settings_change_the_modeled_seconds():
    """The simulator costs every step with its cost settings (static: the same placement)."""
    slow = simulate(_source(2), TOPO, MODEL, ["static"], cost=CostSettings(flops_per_second=1e9))
    fast = simulate(_source(2), TOPO, MODEL, ["static"], cost=CostSettings(flops_per_second=1e15))
    for a, b in zip(_rows(slow, "static"), _rows(fast, "static"), strict=True):
        assert a[0] > b[0] and a[1:] == b[1:]


# ---- CLI ----


def _run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generated_topology_and_trace(tmp_path, capsys):
    code, out, err = _run(
        ["sim", "--dcs", "3", "--ranks-per-dc", "2", "--masters", "2", "--experts", "8",
         "--top-k", "2", "--hidden", "256", "--ffn-hidden", "64", "--steps", "3",
         "--tokens-per-rank", "128", "--policies", "static,hybrid,nope", "--out",
         str(tmp_path), "--no-progress"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "skipped" in out
    for f in ("steps.csv", "summary.md", "step_times.png"):
        assert (tmp_path / f).stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert {r["policy"] for r in rows} == {"static", "hybrid"} and len(rows) == 6


def test_cli_trace_file(tmp_path, capsys, repo):
    load = _trace(1)  # [1, 2, R, E]
    np.savez(tmp_path / "t.npz", load=load, meta=json.dumps({"top_k": 2, "hidden": 256}))
    topo = tmp_path / "topo.yaml"
    import yaml

    topo.write_text(yaml.safe_dump(TOPO.to_dict()))
    code, _out, err = _run(
        ["sim", "--topology", str(topo), "--trace", str(tmp_path / "t.npz"), "--policies",
         "static,fastermoe", "--ffn-hidden", "64", "--out", str(tmp_path / "o"), "--no-progress"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert len(list(csv.DictReader((tmp_path / "o" / "steps.csv").open()))) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "X"], "--topology FILE or --dcs"),
        (["--dcs", "2", "--topology", "t.yaml", "--out", "X"], "not both"),
        (["--dcs", "2"], "--out"),
        (["--topology", "missing.yaml", "--out", "X"], "missing.yaml"),
        (["--dcs", "2", "--trace", "missing.npz", "--out", "X"], "missing.npz"),
        (["--dcs", "2", "--inter-dc-gbps", "-1", "--out", "X"], "inter-dc-gbps"),
        (["--dcs", "2", "--policies", ",", "--out", "X"], "empty"),
        (["--dcs", "2", "--policies", "static,static", "--out", "X"], "twice"),
        (["--dcs", "2", "--pipeline-chunks", "0", "--out", "X"], "pipeline-chunks"),
        (["--dcs", "0", "--out", "X"], "dcs"),
        (["--dcs", "2", "--imbalance", "0.5", "--out", "X"], "imbalance"),
        (["--dcs", "2", "--layers", "0", "--out", "X"], "num-layers"),
        (["--dcs", "2", "--top-k", "300", "--out", "X"], "top-k"),
        (["--dcs", "2", "--top-k", "9", "--experts", "8", "--out", "X"], "top_k 9"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(["sim", *args], capsys)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_bad_trace_files(tmp_path, capsys):
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    np.savez(tmp_path / "noload.npz", other=np.zeros(3))
    np.savez(tmp_path / "neg.npz", load=-np.ones((1, 1, 4, 8), np.int64))
    np.savez(tmp_path / "ranks.npz", load=np.ones((1, 1, 5, 8), np.int64))
    for name, message in [
        ("junk.npz", "junk.npz"),
        ("noload.npz", "load"),
        ("neg.npz", "negative"),
        ("ranks.npz", "5 ranks"),
    ]:
        code, _, err = _run(
            ["sim", "--dcs", "2", "--ranks-per-dc", "2", "--trace", str(tmp_path / name),
             "--out", str(tmp_path / "o")],
            capsys,
        )  # fmt: skip
        assert code == 2 and message in err and err.count("\n") == 1, (name, err)


def test_cli_sweep_bad_config(tmp_path, capsys):
    (tmp_path / "s.yaml").write_text("bandwidth: {gbps: [0]}\n")
    code, _, err = _run(["sim", "sweep", "--config", str(tmp_path / "s.yaml"), "--out",
                         str(tmp_path / "o")], capsys)  # fmt: skip
    assert code == 2 and "gbps" in err
    (tmp_path / "b.yaml").write_text("[: not yaml")
    code, _, err = _run(["sim", "sweep", "--config", str(tmp_path / "b.yaml"), "--out",
                         str(tmp_path / "o")], capsys)  # fmt: skip
    assert code == 2 and "YAML" in err


def test_cli_sweep_writes_tables_and_plots(tmp_path, capsys):
    (tmp_path / "s.yaml").write_text(
        "policies: [static, hybrid]\n"
        "model: {num_experts: 8, top_k: 2, hidden: 256, ffn_hidden: 64}\n"
        "trace: {steps: 2, tokens_per_rank: 64, imbalance: 1.2}\n"
        "bandwidth: {topology: {dcs: 2, ranks_per_dc: 2}, gbps: [10, 1]}\n"
        "dcs: {topology: {ranks_per_dc: 2}, counts: [2, 3]}\n"
        "regime: [{name: two, topology: {dcs: 2, ranks_per_dc: 2}, gbps: [1],"
        " microbatches_per_update: [1, 4]}]\n"
    )
    code, _out, err = _run(["sim", "sweep", "--config", str(tmp_path / "s.yaml"), "--out",
                           str(tmp_path / "o"), "--no-progress"], capsys)  # fmt: skip
    assert code == 0, err
    for f in ("sweep.csv", "sweep.md", "speedup_vs_bandwidth.png", "speedup_vs_dcs.png"):
        assert (tmp_path / "o" / f).stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "o" / "sweep.csv").open()))
    assert len(rows) == 12 and {r["kind"] for r in rows} == {"bandwidth", "dcs", "regime"}
    regime = [r for r in rows if r["kind"] == "regime"]
    assert sorted(r["microbatches_per_update"] for r in regime) == ["1", "1", "4", "4"]
    assert all(r["groups"] == "2" for r in regime)  # 8 experts fill one DC: 2 groups
    assert {r["label"] for r in regime} == {"two"}


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), domain=st.sampled_from(["dc", "node", "global"]))
def test_quota_traffic_equals_its_route_up_to_rounding(seed, domain):
    from expertmesh.planner.quota import quota_balance, quota_traffic
    from expertmesh.planner.static import static_placement

    topo = Topology.generate(3, 4, nodes_per_dc=2, masters=2, spare=2)
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 50, size=(12, 16)) * (rng.random(16) < 0.8)
    load[:, int(rng.integers(16))] += 400  # a hot expert to replicate
    dom = {"dc": topo.rank_dc, "node": topo.rank_node, "global": None}[domain]
    sol = quota_balance(load, static_placement(12, 4, 16, 2), dom)
    exact = traffic_from_route(sol.route, load, topo, 2)
    fast = quota_traffic(load, sol, topo, 2)
    bound = 2.0 * len(sol.replicas[0]) * 12 + 1e-6  # one token per (source, replica) rounding
    np.testing.assert_allclose(fast.rank_tokens, exact.rank_tokens, atol=1e-6)  # amounts exact
    assert np.abs(fast.rank_out - exact.rank_out).max() <= bound
    assert np.abs(fast.rank_in - exact.rank_in).max() <= bound
    assert fast.pair_tokens.sum() == pytest.approx(exact.pair_tokens.sum(), abs=bound)


def test_microbatch_replica_fanout_is_charged_on_the_critical_path():
    """quota's replicas are placed every microbatch: the seconds their weights take to land
    beyond the dispatch window are in the step (exposed_seconds), hand-checked here."""
    from expertmesh.planner.costmodel import migration_streams, step_cost, transfer_seconds
    from expertmesh.planner.migration import plan_migration

    topo = Topology.generate(1, 6, masters=2, spare=2)  # one DC: dispatch is short
    cost = CostSettings(solve_on_critical_path=False)
    model = MODEL.model_copy(update={"num_layers": 1, "ffn_hidden": 65536})  # heavy copies
    s = TraceSettings(num_ranks=6, num_experts=8, num_layers=1, num_steps=3, top_k=2,
                      tokens_per_rank=256, imbalance=2.0, drift=0.3, seed=3)  # fmt: skip
    load = generate_trace(s).load
    res = simulate(dense_source(load), topo, model, ["quota", "static"], cost=cost)
    assert all(r.exposed_seconds == 0.0 for r in res.run("static").rows)
    pol, prev, plans = make_policy("quota"), None, []
    for t in range(3):
        ctx = PolicyContext(topology=topo, model=model, step=t, layer=0, load=load[t, 0],
                            history=np.zeros((0, 6, 8), np.int64), previous=prev)  # fmt: skip
        prev = plan_layer(pol, ctx)
        plans.append(prev)
    checked = 0
    for t in (1, 2):
        mig = plan_migration(plans[t - 1].placement, plans[t].placement, topo, model)
        reps = [x for x in mig.transfers if x.kind != "master"]
        if not reps:
            continue
        streams = migration_streams(
            np.array([x.src_rank for x in reps]), np.array([x.dst_rank for x in reps]),
            np.full(len(reps), float(model.expert_bytes)), topo,
        )  # fmt: skip
        fan = transfer_seconds(streams, topo)
        traffic = traffic_from_route(plans[t].route, load[t, 0], topo, model.top_k)
        dispatch = step_cost(topo, model, traffic).phases["dispatch"]
        row = res.run("quota").rows[t]
        assert fan > dispatch and row.exposed_seconds == pytest.approx(fan - dispatch)
        checked += 1
    assert checked, "the trace must make quota place new replicas"


def test_ep_groups_fill_master_slots_and_divide_the_dcs():
    from expertmesh.sim.groups import auto_group_dcs

    assert auto_group_dcs(1000, 8, 256, 4) == 8  # EP64: 8 DCs x 8 ranks x 4 masters
    assert auto_group_dcs(125, 8, 256, 4) == 125  # 8 does not divide 125: one group
    assert auto_group_dcs(4, 8, 256, 4) == 4  # fewer DCs than a group needs
    assert auto_group_dcs(6, 2, 8, 2) == 2
    with pytest.raises(ValueError):
        auto_group_dcs(0, 8, 256, 4)


def test_the_world_waits_for_its_slowest_group_plus_the_gradient_all_reduce():
    from expertmesh.sim.groups import dp_seconds, simulate_groups

    group = Topology.generate(2, 2, masters=2, spare=2, inter_dc_gbps=1.0, inter_dc_latency_ms=5)
    model = MODEL.model_copy(update={"num_layers": 1})
    traces = {}

    def trace(g):
        s = TraceSettings(num_ranks=4, num_experts=8, num_layers=1, num_steps=3, top_k=2,
                          tokens_per_rank=128 * (g + 1), imbalance=1.5, seed=g)  # fmt: skip
        traces[g] = dense_source(generate_trace(s).load)
        return traces[g]

    cost = CostSettings(solve_on_critical_path=False, microbatches_per_update=2)
    world = simulate_groups(group, 3, trace, model, ["static", "hybrid"], cost=cost)
    # by hand: the most masters one DC holds (4 of 8 experts), reduce + broadcast, 2 levels
    nbytes = 4 * model.expert_params * model.grad_bytes
    dp = (2 * nbytes / (1e9 / 8) + 2 * 2 * 0.005) / 2
    assert world.dp_seconds == pytest.approx(dp) == dp_seconds(group, 3, model, cost)
    for name in ("static", "hybrid"):
        alone = [simulate(traces[g], group, model, [name], cost=cost).run(name) for g in range(3)]
        rows = world.run(name).rows
        for t in range(3):
            assert rows[t].seconds == pytest.approx(max(a.rows[t].seconds for a in alone) + dp)
            assert rows[t].cross_dc_token_bytes == pytest.approx(
                sum(a.rows[t].cross_dc_token_bytes for a in alone)
            )
    assert simulate_groups(group, 1, trace, model, ["static"], cost=cost).dp_seconds == 0.0


def test_cli_generated_world_runs_ep_groups_by_default(tmp_path, capsys):
    base = ["sim", "--dcs", "16", "--ranks-per-dc", "2", "--masters", "2", "--experts", "32",
            "--top-k", "2", "--hidden", "256", "--ffn-hidden", "64", "--steps", "2",
            "--policies", "static,hybrid", "--no-progress"]  # fmt: skip
    code, _, _ = _run([*base, "--out", str(tmp_path / "a")], capsys)
    assert code == 0
    # 32 experts fill the 2 master slots of 16 ranks: 8 DCs per group, 2 groups
    assert "2 data-parallel EP groups of 8 DCs" in (tmp_path / "a" / "summary.md").read_text()
    code, _, _ = _run([*base, "--ep-dcs", "16", "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and "EP groups" not in (tmp_path / "b" / "summary.md").read_text()
    code, _, err = _run([*base, "--ep-dcs", "3", "--out", str(tmp_path / "c")], capsys)
    assert code == 2 and "--ep-dcs 3" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("ep_dcs", ["8", "16"])  # two EP groups, and one plan of every DC
def test_cli_writes_where_the_cpu_went(tmp_path, capsys, ep_dcs):
    import csv
    import json

    args = ["sim", "--dcs", "16", "--ranks-per-dc", "2", "--masters", "2", "--experts", "32",
            "--top-k", "2", "--hidden", "256", "--ffn-hidden", "64", "--steps", "3",
            "--ep-dcs", ep_dcs, "--policies", "static,quota,hybrid",
            "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    code, out, _ = _run(args, capsys)
    assert code == 0 and "cpu.json" in out
    cpu = json.loads((tmp_path / "cpu.json").read_text())
    assert cpu["trace"] > 0
    assert set(cpu["policies"]) == {"static", "quota", "hybrid"}
    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    for name, part in cpu["policies"].items():
        solve = sum(float(r["solve_seconds"]) for r in rows if r["policy"] == name)
        assert part["solve"] == pytest.approx(solve, abs=2e-3)  # the solve column, summed
        assert part["cost"] > 0  # every step is costed, which takes some CPU
        # the cost model's parts: each timed, together within the policy's cost
        from expertmesh.sim.engine import COST_PARTS

        assert list(part["cost_parts"]) == list(COST_PARTS)
        assert min(part["cost_parts"].values()) >= 0
        assert 0 < sum(part["cost_parts"].values()) <= part["cost"] + 2e-3
