"""`ray up` cluster files pass Ray's own config validation; nodes find their DC label."""

from __future__ import annotations

import copy
import ipaddress
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from expertmesh.planner import Topology

REPO = Path(__file__).resolve().parents[2]
START = REPO / "deploy/scripts/start-node.sh"


def _load(rel: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / rel).read_text())


def _ray_validate(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` does to a config before it contacts any machine or cloud."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.mark.parametrize("rel", ["deploy/cluster.yaml", "deploy/cluster-aws.yaml"])
def test_cluster_files_pass_ray_validation(rel: str) -> None:
    prepared = _ray_validate(_load(rel))
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_validation_can_fail() -> None:
    bad = _load("deploy/cluster-aws.yaml")
    bad["available_node_types"]["dc-us-east-1a"]["labels"] = {"dc": 1}  # labels are strings
    with pytest.raises(jsonschema.ValidationError):
        _ray_validate(bad)


@pytest.mark.parametrize("rel", ["deploy/cluster.yaml", "deploy/cluster-aws.yaml"])
def test_setup_installs_pinned_torch_before_the_project(rel: str) -> None:
    cmds = _load(rel)["setup_commands"]
    torch = next(i for i, c in enumerate(cmds) if '"torch==2.13.0"' in c)
    project = next(
        i for i, c in enumerate(cmds) if 'install --quiet -e "$HOME/expertmesh[cluster]"' in c
    )
    assert torch < project
    assert not any("torch" in c and "torch==2.13.0" not in c for c in cmds)


def _dc_map() -> list[tuple[ipaddress.IPv4Network, str]]:
    out = []
    for raw in (REPO / "deploy/dc-map.yaml").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            key, _, dc = line.rpartition(":")
            out.append((ipaddress.ip_network(key.strip()), dc.strip()))
    return out


def test_local_cluster_machines_match_the_dc_map_and_topology() -> None:
    provider = _load("deploy/cluster.yaml")["provider"]
    topo = Topology.from_dict(_load("deploy/topologies/onprem-3dc.yaml"))
    dc_map = _dc_map()
    per_dc: dict[str, int] = {}
    for ip in [provider["head_ip"], *provider["worker_ips"]]:
        dc = next(d for net, d in dc_map if ipaddress.ip_address(ip) in net)
        per_dc[dc] = per_dc.get(dc, 0) + 1
    assert per_dc == {d.name: d.nodes for d in topo.dcs}


def test_aws_node_types_are_one_zone_each_labeled_with_a_topology_dc() -> None:
    cfg = _load("deploy/cluster-aws.yaml")
    topo = Topology.from_dict(_load("deploy/topologies/aws-3az.yaml"))
    zones = set(cfg["provider"]["availability_zone"].split(","))
    workers = {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}
    labels = set()
    for nt in cfg["available_node_types"].values():
        zone = nt["node_config"]["Placement"]["AvailabilityZone"]
        assert zone in zones and nt["labels"] == {"dc": zone}
    for nt in workers.values():
        labels.add(nt["labels"]["dc"])
    assert labels == {d.name for d in topo.dcs}
    for dc in topo.dcs:
        nt = workers[f"dc-{dc.name}"]
        assert nt["min_workers"] == dc.nodes


def _start_node(tmp_path: Path, *args: str, **env: str) -> tuple[int, list[list[str]]]:
    log = tmp_path / "cmds"
    log.unlink(missing_ok=True)
    full = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "EXPERTMESH_STATE": str(tmp_path / "state"),
        "EXPERTMESH_DC_FILE": str(tmp_path / "no-such-file"),
        "EXPERTMESH_DRY_RUN": str(log),
        **env,
    }
    run = subprocess.run(
        ["bash", str(START), *args], env=full, capture_output=True, text=True, check=False
    )
    cmds = [shlex.split(x) for x in log.read_text().splitlines()] if log.exists() else []
    return run.returncode, cmds


def test_worker_starts_ray_with_its_dc_from_the_ip_map(tmp_path: Path) -> None:
    rc, cmds = _start_node(tmp_path, "worker", "10.0.1.10", EXPERTMESH_NODE_IP="10.0.2.11")
    assert rc == 0
    (ray,) = cmds
    assert ray[1:3] == ["start", "--address=10.0.1.10:6379"]
    assert "--labels=dc=eu-west" in ray and "--node-ip-address=10.0.2.11" in ray
    assert "stop" not in ray


def test_head_starts_ray_then_serve(tmp_path: Path) -> None:
    rc, cmds = _start_node(tmp_path, "head", EXPERTMESH_NODE_IP="10.0.1.10")
    assert rc == 0
    ray, serve = cmds[0], cmds[-1]
    assert "--head" in ray and "--labels=dc=us-east" in ray
    assert serve[0].endswith("/expertmesh") and serve[1] == "serve"
    assert serve[serve.index("--host") + 1] == "10.0.1.10"
    assert serve[serve.index("--topology") + 1].endswith("deploy/topologies/onprem-3dc.yaml")


def test_dc_resolution_order(tmp_path: Path) -> None:
    per_host = tmp_path / "dc"
    per_host.write_text("from-file\n")
    ip = {"EXPERTMESH_NODE_IP": "10.0.3.10"}
    both = {**ip, "EXPERTMESH_DC_FILE": str(per_host)}
    labels = {**both, "RAY_OVERRIDE_LABELS": '{"dc": "from-labels", "x": "y"}'}
    for env, want in [
        (ip, "ap-south"),
        (both, "from-file"),
        (labels, "from-labels"),
        ({**labels, "EXPERTMESH_DC": "from-env"}, "from-env"),
    ]:
        rc, cmds = _start_node(tmp_path, "worker", "10.0.1.10", **env)
        assert rc == 0 and f"--labels=dc={want}" in cmds[0], (env, cmds)


def test_unknown_ip_fails_without_starting_ray(tmp_path: Path) -> None:
    rc, cmds = _start_node(tmp_path, "worker", "10.0.1.10", EXPERTMESH_NODE_IP="192.168.9.9")
    assert rc != 0 and cmds == []


def test_stop_workers_runs_ray_stop_on_each_worker_of_the_bootstrap_config(tmp_path: Path) -> None:
    """`ray down` (local provider) stops the head only; stop-workers covers the workers."""
    config = tmp_path / "ray_bootstrap_config.yaml"
    config.write_text(
        yaml.safe_dump(
            {"auth": {"ssh_user": "ubuntu"}, "provider": {"worker_ips": ["10.0.2.10", "10.0.3.10"]}}
        )
    )
    rc, cmds = _start_node(tmp_path, "stop-workers")
    assert rc == 0
    assert [c[0] for c in cmds] == ["ssh", "ssh"]
    assert [c[-2:] for c in cmds] == [
        ["ubuntu@10.0.2.10", "~/expertmesh-venv/bin/ray stop"],
        ["ubuntu@10.0.3.10", "~/expertmesh-venv/bin/ray stop"],
    ]
    assert all(c[c.index("-i") + 1] == str(tmp_path / "ray_bootstrap_key.pem") for c in cmds)
    config.unlink()
    rc, cmds = _start_node(tmp_path, "stop-workers")
    assert rc == 2 and cmds == []


def test_the_head_runs_the_v1_autoscaler() -> None:
    """Ray 2.60's autoscaler v2 started one of two local-provider workers (docs/operations.md)."""
    (start,) = [c for c in _load("deploy/cluster.yaml")["head_start_ray_commands"] if "head" in c]
    assert "RAY_enable_autoscaler_v2=0 ~/expertmesh/deploy/scripts/start-node.sh head" in start


def _rayup() -> Any:
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from integration.netemu_module import load_rayup

    return load_rayup()


def test_emulated_cluster_file_is_cluster_yaml_with_the_emulation_filled_in() -> None:
    rayup = _rayup()
    ru = rayup.plan_rayup(_load("deploy/topologies/emulate.yaml"), name="unit")
    base = _load("deploy/cluster.yaml")
    cfg = rayup.cluster_config(
        base, ru, repo="/src", topology_rel="deploy/topologies/emulate.yaml",
        python="/usr/bin/python3.11", site_packages="/venv/lib/python3.11/site-packages",
    )  # fmt: skip
    _ray_validate(cfg)
    changed = {k for k in base if base[k] != cfg[k]}
    assert changed == {
        "cluster_name", "provider", "auth", "min_workers", "max_workers", "file_mounts",
        "setup_commands", "head_start_ray_commands", "rsync_exclude",
    }  # fmt: skip
    assert cfg["rsync_exclude"] == [*base["rsync_exclude"], "deploy/tls"]  # certs name real hosts
    assert ru.experts == 12  # the demo's experts: every master slot (6 ranks x 2)
    assert cfg["provider"] == {
        "type": "local",
        "head_ip": "10.213.0.1",
        "worker_ips": ["10.213.0.2", "10.213.0.3"],
    }
    assert cfg["min_workers"] == cfg["max_workers"] == 2
    assert cfg["auth"]["ssh_user"] == "root"
    assert cfg["worker_start_ray_commands"] == base["worker_start_ray_commands"]
    head = cfg["head_start_ray_commands"]
    assert head[0] == base["head_start_ray_commands"][0]  # `ray stop` first, as on real machines
    assert head[1].endswith(
        "EXPERTMESH_TOPOLOGY=~/expertmesh/deploy/topologies/emulate.yaml "
        "~/expertmesh/deploy/scripts/start-node.sh head"
    )
    assert not any("pip install" in c and "--no-index" not in c for c in cfg["setup_commands"])
    bad = copy.deepcopy(base)
    bad["provider"]["type"] = "aws"
    with pytest.raises(ValueError, match="local provider"):
        rayup.cluster_config(
            bad, ru, repo="/", topology_rel="t.yaml", python="p", site_packages="s"
        )


def test_sshd_listens_on_the_host_address_only_root_by_key() -> None:
    rayup = _rayup()
    ru = rayup.plan_rayup(_load("deploy/topologies/emulate.yaml"), name="unit")
    conf = dict(line.split(" ", 1) for line in rayup.sshd_config(ru.hosts[1]).splitlines() if line)
    assert conf["ListenAddress"] == "10.213.0.2:22"
    assert conf["PermitRootLogin"] == "prohibit-password"
    assert conf["PasswordAuthentication"] == conf["KbdInteractiveAuthentication"] == "no"
    assert ru.operator_ip == "10.213.0.254"
    with pytest.raises(ValueError, match="no address left"):
        rayup.plan_rayup(_load("deploy/topologies/two-dc.yaml"), subnet="10.9.0.0/30")


def test_with_certificates_ray_and_serve_run_over_tls(tmp_path: Path) -> None:
    from expertmesh.controller.certs import make_certs

    tls = tmp_path / "tls"
    make_certs(tls, {"us-east": ["10.0.1.10"], "eu-west": ["10.0.2.11"]})
    env = {"EXPERTMESH_TLS_DIR": str(tls)}
    rc, cmds = _start_node(tmp_path, "head", EXPERTMESH_NODE_IP="10.0.1.10", **env)
    assert rc == 0
    ray, serve = cmds[0], cmds[-1]
    want = [
        "env",
        "RAY_USE_TLS=1",
        f"RAY_TLS_SERVER_CERT={tls}/us-east.pem",
        f"RAY_TLS_SERVER_KEY={tls}/us-east.key",
        f"RAY_TLS_CA_CERT={tls}/ca.pem",
    ]
    assert ray[:5] == want and ray[6] == "start" and "--head" in ray
    assert serve[serve.index("--tls-cert") + 1] == f"{tls}/us-east.pem"
    assert serve[serve.index("--tls-key") + 1] == f"{tls}/us-east.key"
    assert "--tls-client-ca" not in serve
    rc, cmds = _start_node(
        tmp_path, "head", EXPERTMESH_NODE_IP="10.0.1.10", EXPERTMESH_TLS_MUTUAL="1", **env
    )
    assert rc == 0 and cmds[-1][cmds[-1].index("--tls-client-ca") + 1] == f"{tls}/ca.pem"
    rc, cmds = _start_node(tmp_path, "worker", "10.0.1.10", EXPERTMESH_NODE_IP="10.0.2.11", **env)
    assert rc == 0 and cmds[0][:3] == [
        "env",
        "RAY_USE_TLS=1",
        f"RAY_TLS_SERVER_CERT={tls}/eu-west.pem",
    ]
    # tls-env: the variables a driver on this machine needs
    run = subprocess.run(
        ["bash", str(START), "tls-env"],
        env={
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            "EXPERTMESH_NODE_IP": "10.0.2.11",
            "EXPERTMESH_DC_FILE": str(tmp_path / "none"),
            **env,
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0 and f"RAY_TLS_SERVER_CERT={tls}/eu-west.pem" in run.stdout
    # a CA without this DC's certificate: refused before anything starts
    rc, cmds = _start_node(tmp_path, "worker", "10.0.1.10", EXPERTMESH_NODE_IP="10.0.3.10", **env)
    assert rc != 0 and cmds == []


def test_rayup_cli_refuses_bad_input_with_one_line() -> None:
    import sys

    for argv in (["ops", "--name", f"nx{os.getpid()}", "--", "true"], ["run", "--steps", "x"]):
        got = subprocess.run(
            [sys.executable, str(REPO / "deploy/emulate/rayup.py"), *argv],
            capture_output=True,
            text=True,
            check=False,
        )
        assert got.returncode == 2, got
        assert got.stderr.strip().splitlines()[-1].startswith(("rayup: ", "rayup.py run: error")), (
            got
        )
