"""deploy/kuberay.yaml: one worker group per DC, zone-pinned and dc-labeled; controller ports exposed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from expertmesh.planner import Topology

REPO = Path(__file__).resolve().parents[2]
ZONE = "topology.kubernetes.io/zone"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    loaded = list(yaml.safe_load_all((REPO / "deploy/kuberay.yaml").read_text()))
    by_kind = {d["kind"]: d for d in loaded}
    assert len(by_kind) == len(loaded) == 3
    return by_kind


def _labels(params: dict[str, str]) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in params["labels"].split(","))


def test_one_worker_group_per_dc_pinned_to_its_zone_and_labeled(docs: dict) -> None:
    topo = Topology.from_dict(yaml.safe_load(docs["ConfigMap"]["data"]["topology.yaml"]))
    groups = docs["RayCluster"]["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == [f"dc-{d.name}" for d in topo.dcs]
    for g, dc in zip(groups, topo.dcs, strict=True):
        assert _labels(g["rayStartParams"]) == {"dc": dc.name}
        assert g["template"]["spec"]["nodeSelector"][ZONE] == dc.name
        assert g["minReplicas"] <= dc.nodes == g["replicas"] <= g["maxReplicas"]
        (c,) = g["template"]["spec"]["containers"]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == dc.ranks_per_node


def test_head_is_in_a_dc_and_runs_the_controller(docs: dict) -> None:
    head = docs["RayCluster"]["spec"]["headGroupSpec"]
    dc = _labels(head["rayStartParams"])["dc"]
    assert head["template"]["spec"]["nodeSelector"][ZONE] == dc
    containers = {c["name"]: c for c in head["template"]["spec"]["containers"]}
    assert {p["containerPort"] for p in containers["ray-head"]["ports"]} >= {6379, 8265, 8080}
    ctl = containers["expertmesh-controller"]
    assert ctl["command"] == ["expertmesh", "serve"]
    assert "--host=0.0.0.0" in ctl["args"]
    assert {p["name"]: p["containerPort"] for p in ctl["ports"]} == {"rest": 8700, "grpc": 8701}
    mounts = {m["name"]: m["mountPath"] for m in ctl["volumeMounts"]}
    assert "--topology=" + mounts["topology"] + "/topology.yaml" in ctl["args"]
    assert ctl["readinessProbe"]["httpGet"]["path"] == "/api/v1/ready"


def test_controller_service_exposes_rest_and_grpc_of_the_head(docs: dict) -> None:
    svc = docs["Service"]["spec"]
    assert svc["selector"] == {"ray.io/cluster": "expertmesh", "ray.io/node-type": "head"}
    assert docs["RayCluster"]["metadata"]["name"] == svc["selector"]["ray.io/cluster"]
    assert {p["name"]: p["port"] for p in svc["ports"]} == {"rest": 8700, "grpc": 8701}


def test_ray_version_and_images_match(docs: dict) -> None:
    spec = docs["RayCluster"]["spec"]
    assert spec["rayVersion"] == ray.__version__
    images = {c["image"] for c in spec["headGroupSpec"]["template"]["spec"]["containers"]}
    for g in spec["workerGroupSpecs"]:
        images |= {c["image"] for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1
    assert "ray:" + ray.__version__ in (REPO / "deploy/Dockerfile").read_text()


def test_probe_paths_answer_on_the_rest_api(docs: dict) -> None:
    from fastapi.testclient import TestClient

    from expertmesh.controller.api import create_app
    from expertmesh.controller.core import ControllerCore, ControllerSettings
    from expertmesh.controller.store import SqlitePlanStore
    from expertmesh.controller.telemetry import Telemetry
    from expertmesh.planner import ModelSpec

    topo = Topology.from_dict(yaml.safe_load(docs["ConfigMap"]["data"]["topology.yaml"]))
    model = ModelSpec(num_layers=1, num_experts=8, top_k=2, hidden=16, ffn_hidden=8)
    store = SqlitePlanStore(":memory:")
    core = ControllerCore(topo, model, ControllerSettings(), store=store)
    client = TestClient(create_app(core, Telemetry(core), store))
    head = docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    ctl = next(c for c in head if c["name"] == "expertmesh-controller")
    for probe in ("readinessProbe", "livenessProbe"):
        assert client.get(ctl[probe]["httpGet"]["path"]).status_code == 200, probe


def _pods(docs: dict) -> list[dict]:
    spec = docs["RayCluster"]["spec"]
    return [spec["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in spec["workerGroupSpecs"]
    ]


def test_every_ray_container_runs_ray_tls_with_the_certificate_its_init_container_makes(
    docs: dict, tmp_path: Path
) -> None:
    from expertmesh.cli.main import main
    from expertmesh.controller.certs import make_certs

    ca_dir = tmp_path / "ca"
    make_certs(ca_dir, {"unused": []})  # what the operator turns into the Secret
    for pod in _pods(docs):
        (init,) = pod["initContainers"]
        mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        secret = {v["name"]: v for v in pod["volumes"]}["expertmesh-ca"]["secret"]
        assert secret["secretName"] == "expertmesh-ca"
        out = tmp_path / "tls"
        # run the init container's command, its paths mapped into tmp_path
        argv = [
            a.replace(mounts["expertmesh-ca"], str(ca_dir)).replace(mounts["tls"], str(out))
            for a in init["command"][1:] + init["args"]
        ]
        argv = [a.replace("$(POD_IP)", "10.1.2.3").replace("$(POD_NAMESPACE)", "ns")
                .replace("$(POD_NAME)", "pod-x") for a in argv]  # fmt: skip
        assert main(argv) == 0
        for c in pod["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if c["name"].startswith("ray-"):
                assert env["RAY_USE_TLS"] == "1"
                for var in ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
                    assert (out / Path(env[var]).relative_to(mounts["tls"])).is_file(), var
            tls_mount = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
            if c["name"].startswith("ray-") or "--tls-cert=/etc/ray/tls/pod.pem" in c.get(
                "args", []
            ):
                assert tls_mount["tls"] == mounts["tls"]
    ctl = {c["name"]: c for c in _pods(docs)[0]["containers"]}["expertmesh-controller"]
    assert "--tls-key=/etc/ray/tls/pod.key" in ctl["args"]
    assert ctl["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert ctl["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
