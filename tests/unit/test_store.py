import sqlite3
from dataclasses import replace

import numpy as np
import pytest

from expertmesh.controller.core import ControllerCore, ControllerSettings, PlanState
from expertmesh.controller.store import SqlitePlanStore, arr_from_bytes, arr_to_bytes
from expertmesh.planner import ModelSpec, Topology


def _core(store=None, policy="static") -> ControllerCore:
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=8)
    settings = ControllerSettings(policy=policy, trigger={"mode": "every_step"})
    return ControllerCore(topo, model, settings, store=store)


def _commit(core: ControllerCore, step: int) -> None:
    rng = np.random.default_rng(step)
    for layer in range(core.model.num_layers):
        core.report_layer(step, layer, rng.integers(0, 50, (4, 8)))
    core.commit(core.plan(step).version)


def test_arrays_round_trip_without_pickle():
    a = np.arange(12, dtype=np.int32).reshape(3, 4) - 1
    b = arr_from_bytes(arr_to_bytes(a))
    assert b.dtype == a.dtype and np.array_equal(a, b)
    with pytest.raises(ValueError):
        arr_to_bytes(np.array([object()], dtype=object))


def test_committed_plans_round_trip_and_survive_a_restart(tmp_path):
    path = tmp_path / "plans.sqlite"
    store = SqlitePlanStore(path)
    core = _core(store)
    for step in range(3):
        _commit(core, step)
    assert store.count() == 3
    want = core.committed
    store.close()

    store2 = SqlitePlanStore(path)
    fresh = _core(store2)
    got = store2.recover(fresh)
    assert got is not None and fresh.committed is got
    assert got.version == want.version == 3 and got.state == PlanState.COMMITTED
    assert got.imbalance_after == pytest.approx(want.imbalance_after)
    for a, b in zip(want.layers, got.layers, strict=True):
        assert np.array_equal(a.phy2log, b.phy2log)
        assert np.array_equal(a.placement.master, b.placement.master)
        assert np.array_equal(a.route, b.route) and b.route.dtype == np.int64
        assert a.migration == b.migration
    # versions continue after the restored one
    _commit(fresh, 10)
    assert fresh.committed.version == 4 and store2.count() == 4


def test_summaries_page_newest_first_and_retention(tmp_path):
    store = SqlitePlanStore(tmp_path / "p.sqlite", keep=2)
    core = _core(store)
    for step in range(4):
        _commit(core, step)
    assert store.count() == 2
    assert [s.version for s in store.summaries()] == [4, 3]
    assert [s.version for s in store.summaries(offset=1, limit=5)] == [3]
    assert [s.version for s in store.summaries(newest_first=False)] == [3, 4]
    assert store.get(1) is None and store.get(4) is not None
    with sqlite3.connect(tmp_path / "p.sqlite") as db:  # old layers are gone too
        assert db.execute("SELECT COUNT(*) FROM plan_layers").fetchone()[0] == 4


def test_only_committed_plans_are_stored():
    store = SqlitePlanStore(":memory:")
    core = _core()
    core.report_layer(0, 0, np.ones((4, 8), int))
    core.report_layer(0, 1, np.ones((4, 8), int))
    with pytest.raises(ValueError, match="only committed"):
        store.save(core.plan(0))
    assert store.count() == 0
    with pytest.raises(ValueError):
        SqlitePlanStore(":memory:", keep=0)


def test_settings_are_saved_and_recovered(tmp_path):
    store = SqlitePlanStore(tmp_path / "s.sqlite")
    store.save_settings(ControllerSettings(policy="static", window=7))
    core = _core()
    for step in range(10):
        core.report_layer(step, 0, np.full((4, 8), step))
    assert store.recover(core) is None
    assert core.settings.window == 7
    assert core.window(0)[:, 0, 0].tolist() == [3, 4, 5, 6, 7, 8, 9]


def test_a_plan_for_another_topology_is_not_restored(tmp_path):
    store = SqlitePlanStore(tmp_path / "t.sqlite")
    _commit(_core(store), 0)
    topo = Topology.generate(dcs=1, ranks_per_dc=2, masters=4, spare=0)
    other = ControllerCore(topo, ModelSpec(num_layers=2, num_experts=8))
    assert store.recover(other) is None and other.committed is None


def test_routes_are_stored_small_and_exact(tmp_path):
    store = SqlitePlanStore(tmp_path / "plans.sqlite")
    core = _core(store)
    _commit(core, 0)
    pv = core.committed
    blob = store._db.execute("SELECT route FROM plan_layers WHERE layer = 0").fetchone()[0]
    stored = arr_from_bytes(blob)
    assert stored.dtype.itemsize <= 2  # token counts and ranks fit in 16 bits
    assert np.array_equal(stored, pv.layers[0].route)
    # counts beyond 16 bits stay exact
    big = pv.layers[0].route.copy()
    big[:, 3] += 2**40
    layer = replace(pv.layers[0], route=big)
    store.save(replace(pv, version=2, layers=[layer, pv.layers[1]]))
    got = store.get(2)
    assert got is not None and got.layers[0].route.dtype == np.int64
    assert np.array_equal(got.layers[0].route, big)
