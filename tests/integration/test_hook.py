"""The torch hook and the example trainer against live surfaces (no Ray)."""

import importlib.util

import numpy as np
import pytest
import torch

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import ModelSpec, Topology
from expertmesh.workers.client import ExpertMeshClient
from expertmesh.workers.hook import LoadHook, log2phy_from_phy2log, topk_ids_from_output

R, E, L = 4, 8, 2


def test_log2phy_inverts_phy2log():
    phy2log = np.array([[0, 1, -1], [2, 0, 3], [1, -1, 0]])
    table, cnt = log2phy_from_phy2log(phy2log, 4)
    assert cnt.tolist() == [3, 2, 1, 1]
    flat = phy2log.ravel()
    for e in range(4):
        slots = [s for s in table[e] if s >= 0]
        assert sorted(slots) == sorted(np.flatnonzero(flat == e).tolist())


def test_topk_ids_from_router_outputs():
    ids = torch.tensor([[1, 2], [0, 3]])
    assert topk_ids_from_output((torch.rand(2, 2), ids), None) is ids
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.0]])
    assert topk_ids_from_output(logits, 2).tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="top_k"):
        topk_ids_from_output(logits, None)


def test_hook_counts_streams_and_remaps(tmp_path):
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    core = ControllerCore(
        topo,
        ModelSpec(num_layers=L, num_experts=E, hidden=16, ffn_hidden=8),
        ControllerSettings(trigger={"mode": "every_step"}),
    )
    with Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0)) as s:
        client = ExpertMeshClient(s.grpc_target)
        base = [torch.nn.Linear(4, E) for _ in range(L)]
        hooks = [LoadHook(client, rank=r, num_experts=E, top_k=2, watch=False) for r in range(R)]
        replicas = []  # one set of routers per rank, as in data-parallel training
        for h in hooks:
            routers = [torch.nn.Linear(4, E) for _ in range(L)]
            for layer, router in enumerate(routers):
                router.load_state_dict(base[layer].state_dict())
                h.attach(router, layer)
            replicas.append(routers)
        x = torch.randn(32, 4)
        want = torch.bincount(base[0](x).topk(2).indices.reshape(-1), minlength=E)
        for h, routers in zip(hooks, replicas, strict=True):
            for router in routers:
                router(x)
            sent = h.step(0)
            assert np.array_equal(sent[0], want.numpy()) and sorted(sent) == [0, 1]
        for h in hooks:
            h.close()  # ends the report streams: everything sent has been applied
        assert core.reports_received == R * L and core.reports_rejected == 0
        assert core.window(0)[0].sum() == R * 32 * 2
        pv = core.commit(core.plan(0).version)
        hook = hooks[0]
        assert hook.remap(0, torch.tensor([1, 2])).tolist() == [1, 2]  # no plan: unchanged
        assert hook.refresh_plan().version == pv.version
        ids = torch.arange(E).repeat(3)
        phys = hook.remap(0, ids)
        flat = pv.layers[0].phy2log.ravel()
        assert np.array_equal(flat[phys.numpy()], ids.numpy())  # every id lands on a copy of it
        client.close()


def test_example_trainer_runs_against_serve(repo, capsys):
    spec = importlib.util.spec_from_file_location(
        "train_with_hook", repo / "examples/train_with_hook.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    topo = Topology.generate(dcs=2, ranks_per_dc=4, masters=2, spare=1)
    core = ControllerCore(
        topo,
        ModelSpec(num_layers=2, num_experts=16, top_k=2, hidden=32, ffn_hidden=64),
        ControllerSettings(trigger={"mode": "every_step"}),
    )
    from expertmesh.cli.serve import PlanLoop

    with Surfaces(core, SurfaceSettings(rest_port=0, grpc_port=0)) as s:
        loop = PlanLoop(core)
        import threading

        stop = threading.Event()

        def run_loop():
            while not stop.is_set():
                loop.tick()
                stop.wait(0.02)

        t = threading.Thread(target=run_loop)
        t.start()
        try:
            assert mod.main(["--target", s.grpc_target, "--steps", "8", "--tokens", "32"]) == 0
        finally:
            stop.set()
            t.join(5)
    out = capsys.readouterr().out
    assert "step   7" in out and core.committed is not None
    assert core.reports_rejected == 0 and core.reports_received == 8 * 8 * 2
