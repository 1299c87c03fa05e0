#!/usr/bin/env python3
"""A one-machine multi-DC Ray cluster on a real, shaped network.

One network namespace per DC of a topology YAML, each holding one Ray node
labeled ``dc=<name>``; the namespaces hang off one Linux bridge that lives in
a namespace of its own, so nothing is added to the host's interfaces or
routes. Every ordered DC pair ``(a, b)`` is shaped on ``a``'s egress with an
``htb`` class at the topology's bandwidth (``Topology.dc_gbps``, times
``--scale``); this kernel has no ``netem``, so latency stays in the
in-process link shaper (run the demo with the shaper off to measure the real
network alone, or on to add latency).

    netemu.py up --topology deploy/topologies/emulate.yaml   # network + Ray
    netemu.py up --topology ... --tls                        # ... with Ray's own TLS
    netemu.py status                                       # namespaces, rates, Ray PIDs
    netemu.py exec us-east -- expertmesh demo --address auto --no-shaper ...
    netemu.py measure us-east eu-west                       # TCP goodput vs configured
    netemu.py cut eu-west ap-south                          # the pair's link goes down
    netemu.py heal eu-west ap-south                         # ... and comes back
    netemu.py down                                          # leaves nothing behind

A *cut* drops every IP packet between two DCs, both directions, silently (as a dead WAN
link does: no reset, no ICMP; connections hang, new ones time out): each DC's htb class
towards the other gets a ``pfifo limit 0`` leaf qdisc, which drops whatever it is given.
The DCs' links to every other DC (and the Ray head) stay as they were. ``heal`` deletes the
two leaf qdiscs (the classes get their default queue back); ``down`` deletes the
namespaces, cuts included. The cuts are read back from ``tc`` (``status``), not stored.

Names: namespaces ``expertmesh-<name>-br`` (bridge) and ``expertmesh-<name>-dc<i>``;
inside a DC namespace the interface is ``eth0`` with ``<subnet>.<i + 1>``. State
(namespaces, recorded Ray PIDs, Ray's temp dir) is in ``/tmp/emu-<name>/state.json``;
``down`` kills exactly the recorded PIDs and any process left inside the
namespaces it created (never ``ray stop``), then deletes the namespaces (which
deletes their veths and the bridge) and the temp dir.

``--tls`` turns Ray's own TLS on (``RAY_USE_TLS``): a private CA and one certificate per
DC naming its address (``expertmesh certs``) in ``<temp dir>/tls``; every ``ray start``
and every ``exec`` gets its DC's ``RAY_TLS_SERVER_CERT``/``_KEY`` and ``RAY_TLS_CA_CERT``.

Needs root (``ip netns``), iproute2 (``ip``, ``tc``) and the ``sch_htb`` /
``cls_u32`` kernel modules.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().with_name("tcpprobe.py")
PREFIX = "expertmesh"
RAY_PORT = 6379
METRICS_PORT = 8080  # Ray's per-node Prometheus endpoint (each namespace has its own ports)
MAX_SHAPED_GBPS = 4.0  # veth + htb on a small machine tracks rates up to a few Gbit/s

__all__ = ["Emulation", "Node", "Shape", "cut", "cuts", "heal", "plan_emulation"]


@dataclass(frozen=True)
class Node:
    """One DC: its namespace, address and the bridge-side end of its veth."""

    dc: str
    index: int
    netns: str
    ip: str
    bridge_port: str  # veth end inside the bridge namespace


@dataclass(frozen=True)
class Shape:
    """The ``htb`` class that limits traffic from DC ``src`` to DC ``dst`` (indices)."""

    src: int
    dst: int
    mbit: float
    classid: str


@dataclass(frozen=True)
class Emulation:
    """Everything ``up`` creates for one topology; pure data (build with :func:`plan_emulation`)."""

    name: str
    bridge_netns: str
    prefixlen: int
    nodes: tuple[Node, ...]
    shapes: tuple[Shape, ...]
    temp_dir: str
    ray_port: int = RAY_PORT
    pids: list[int] = field(default_factory=list)
    tls_dir: str = ""  # Ray's own TLS: CA and per-DC certificates here ("" = off)

    @property
    def namespaces(self) -> list[str]:
        return [n.netns for n in self.nodes] + [self.bridge_netns]

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        """The Ray address (GCS) of the emulated cluster."""
        return f"{self.head.ip}:{self.ray_port}"

    def node(self, dc: str) -> Node:
        """The node of DC ``dc`` (by name, or by index as a string)."""
        for n in self.nodes:
            if dc in (n.dc, str(n.index)):
                return n
        raise ValueError(f"no DC {dc!r}; DCs: {', '.join(n.dc for n in self.nodes)}")

    def shape(self, src: int, dst: int) -> Shape:
        return next(s for s in self.shapes if (s.src, s.dst) == (src, dst))

    def cut_commands(self, a: str, b: str, *, heal: bool = False) -> list[list[str]]:
        """``tc`` argv lists that cut (or ``heal``) the link between DCs ``a`` and ``b``.

        A cut gives each side's htb class towards the other a ``pfifo limit 0`` leaf (it
        drops every packet); healing deletes those leaves. ValueError on an unknown DC or
        ``a == b``."""
        na, nb = self.node(a), self.node(b)
        if na.index == nb.index:
            raise ValueError(f"cut needs two different DCs, got {a!r} twice")
        cmds = []
        for src, dst in ((na, nb), (nb, na)):
            parent = ["parent", self.shape(src.index, dst.index).classid]
            tc = ["tc", "-n", src.netns, "qdisc"]
            cmds.append(
                [*tc, "del", "dev", "eth0", *parent]
                if heal
                else [*tc, "replace", "dev", "eth0", *parent, "pfifo", "limit", "0"]
            )
        return cmds

    def network_commands(self) -> list[list[str]]:
        """``ip``/``tc`` argv lists that build the network; each names one of our namespaces."""
        br = self.bridge_netns
        cmds = [["ip", "netns", "add", ns] for ns in self.namespaces]
        cmds += [
            ["ip", "-n", br, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", br, "link", "set", "br0", "up"],
            ["ip", "-n", br, "link", "set", "lo", "up"],
        ]
        for n in self.nodes:
            ns = n.netns
            cmds += [
                f"ip -n {br} link add {n.bridge_port} type veth peer name eth0 netns {ns}".split(),
                f"ip -n {br} link set {n.bridge_port} master br0 up".split(),
                f"ip -n {ns} link set lo up".split(),
                f"ip -n {ns} addr add {n.ip}/{self.prefixlen} dev eth0".split(),
                f"ip -n {ns} link set eth0 up".split(),
            ]
        for n in self.nodes:
            mine = [s for s in self.shapes if s.src == n.index]
            if not mine:
                continue
            # Unclassified traffic (ARP) goes direct: htb's default class 0 does not exist.
            tc = f"tc -n {n.netns}"
            cmds.append(f"{tc} qdisc add dev eth0 root handle 1: htb".split())
            for s in mine:
                rate = f"{s.mbit:.6g}mbit"
                quantum = int(min(200_000, max(1514, s.mbit * 1e6 / 8 / 10)))
                cmds.append(
                    f"{tc} class add dev eth0 parent 1: classid {s.classid} htb rate {rate} "
                    f"ceil {rate} quantum {quantum}".split()
                )
                cmds.append(
                    f"{tc} filter add dev eth0 parent 1: protocol ip prio 1 u32 "
                    f"match ip dst {self.nodes[s.dst].ip}/32 flowid {s.classid}".split()
                )
        return cmds

    def ray_start_commands(
        self, ray_bin: str, cpus: float, *, max_inline_bytes: int | None = None
    ) -> list[tuple[str, list[str]]]:
        """``(namespace, argv)`` of each ``ray start``: the head in DC 0, then the others.

        ``max_inline_bytes``: Ray's ``max_direct_call_object_size`` for the whole cluster
        (task results up to this size travel through their owner, larger ones node to node
        through the object store); None keeps Ray's default (100 KiB)."""
        if max_inline_bytes is not None and max_inline_bytes < 0:
            raise ValueError(f"--max-inline-bytes must be >= 0, got {max_inline_bytes}")
        out = []
        for n in self.nodes:
            argv = [ray_bin, "start", f"--node-ip-address={n.ip}", f"--labels=dc={n.dc}"]
            argv += [f"--num-cpus={cpus:g}", f"--metrics-export-port={METRICS_PORT}"]
            argv += ["--disable-usage-stats", f"--temp-dir={self.temp_dir}/ray"]
            if n.index == 0:
                argv += ["--head", f"--port={self.ray_port}", "--include-dashboard=false"]
                if max_inline_bytes is not None:
                    config = {"max_direct_call_object_size": max_inline_bytes}
                    argv.append(f"--system-config={json.dumps(config)}")
            else:
                argv += [f"--address={self.address}"]
            out.append((n.netns, argv))
        return out

    def tls_env(self, index: int) -> dict[str, str]:
        """Ray's TLS variables for processes in DC ``index`` (its certificate names its
        address); empty without TLS. Every Ray process and driver needs them."""
        if not self.tls_dir:
            return {}
        return {
            "RAY_USE_TLS": "1",
            "RAY_TLS_SERVER_CERT": f"{self.tls_dir}/dc{index}.pem",
            "RAY_TLS_SERVER_KEY": f"{self.tls_dir}/dc{index}.key",
            "RAY_TLS_CA_CERT": f"{self.tls_dir}/ca.pem",
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Emulation:
        d = json.loads(text)
        d["nodes"] = tuple(Node(**n) for n in d["nodes"])
        d["shapes"] = tuple(Shape(**s) for s in d["shapes"])
        return cls(**d)


def plan_emulation(
    topology: dict[str, Any],
    *,
    name: str = "em",
    subnet: str = "10.213.0.0/24",
    scale: float = 1.0,
    tls: bool = False,
) -> Emulation:
    """The namespaces, addresses and shaped pairs that emulate ``topology`` (YAML structure).

    One namespace and address per DC (``subnet`` host ``i + 1`` for DC ``i``); one
    :class:`Shape` per ordered DC pair at ``dc_gbps[a, b] * scale * 1000`` Mbit/s.
    ValueError on a bad name, subnet or scale, or a subnet too small for the DCs.
    """
    from expertmesh.planner import Topology

    if not name.isascii() or not name.replace("-", "").isalnum() or len(name) > 16:
        raise ValueError(f"--name {name!r}: use up to 16 letters, digits or '-'")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"--scale must be > 0, got {scale}")
    topo = Topology.from_dict(topology)
    net = ipaddress.ip_network(subnet, strict=True)
    if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
        raise ValueError(f"--subnet {subnet!r}: use a private IPv4 subnet")
    if net.num_addresses - 2 < topo.num_dcs:
        raise ValueError(f"--subnet {subnet} has no room for {topo.num_dcs} DCs")
    if topo.num_dcs > 99:
        raise ValueError(f"at most 99 DCs on one machine, the topology has {topo.num_dcs}")
    hosts = list(net.hosts())
    nodes = tuple(
        Node(dc.name, i, f"{PREFIX}-{name}-dc{i}", str(hosts[i]), f"v{i}")
        for i, dc in enumerate(topo.dcs)
    )
    gbps = topo.dc_gbps * scale  # [D, D]
    shapes = tuple(
        Shape(a, b, float(gbps[a, b]) * 1000.0, f"1:{b + 10:x}")
        for a in range(topo.num_dcs)
        for b in range(topo.num_dcs)
        if a != b
    )
    return Emulation(
        name=name,
        bridge_netns=f"{PREFIX}-{name}-br",
        prefixlen=net.prefixlen,
        nodes=nodes,
        shapes=shapes,
        temp_dir=f"/tmp/emu-{name}",
        tls_dir=f"/tmp/emu-{name}/tls" if tls else "",
    )


# ---------------------------------------------------------------- side effects


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.returncode}")
    return out


def _state_path(name: str) -> Path:
    return Path(f"/tmp/emu-{name}") / "state.json"


def _load(name: str) -> Emulation:
    path = _state_path(name)
    if not path.is_file():
        raise FileNotFoundError(2, f"emulation {name!r} is not up (no state file)", str(path))
    return Emulation.from_json(path.read_text())


def _save(em: Emulation) -> None:
    path = _state_path(em.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(em.to_json())


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", netns], check=False, capture_output=True, text=True
    )
    return [int(x) for x in out.stdout.split()] if out.returncode == 0 else []


def _our_namespaces(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    mine = [ln.split()[0] for ln in out.stdout.splitlines() if ln.strip()]
    return [ns for ns in mine if ns.startswith(f"{PREFIX}-{name}-")]


def env_for_namespace(em: Emulation, dc: int = 0) -> dict[str, str]:
    """Environment for processes inside the emulation (in DC ``dc``): this checkout first,
    the Ray address, and Ray's TLS variables when the emulation has TLS."""
    env = dict(os.environ)
    roots = [str(REPO / d) for d in ("controller", "workers", "proto")]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(roots + ([old] if old else []))
    env["RAY_ADDRESS"] = em.address
    env["RAY_TMPDIR"] = em.temp_dir  # drivers' session files go under our temp dir, not /tmp/ray
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(em.tls_env(dc))
    return env


def make_tls(em: Emulation) -> None:
    """A CA and one certificate per DC naming the DC's address (``expertmesh certs``)."""
    from expertmesh.controller.certs import make_certs

    make_certs(Path(em.tls_dir), {f"dc{n.index}": [n.ip] for n in em.nodes})


def check_host() -> str | None:
    """Why namespaces cannot be made here, or None when they can (makes and removes one)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install iproute2)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], check=False, capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        htb = subprocess.run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb"],
            check=False,
            capture_output=True,
            text=True,
        )
        if htb.returncode != 0:
            return f"`tc ... htb` failed: {htb.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def up(
    em: Emulation,
    *,
    ray: bool = True,
    cpus: float = 1.0,
    timeout: float = 120.0,
    max_inline_bytes: int | None = None,
) -> None:
    """Build the network and start Ray; on any failure, tear down what was made."""
    if _state_path(em.name).exists() or _our_namespaces(em.name):
        raise ValueError(f"emulation {em.name!r} is already up; run `down --name {em.name}` first")
    for s in em.shapes:
        if s.mbit > MAX_SHAPED_GBPS * 1000:
            print(
                f"warning: {em.nodes[s.src].dc} -> {em.nodes[s.dst].dc} at {s.mbit / 1000:g} Gbit/s "
                f"is more than one machine shapes accurately; try --scale",
                file=sys.stderr,
            )
    _save(em)
    try:
        for argv in em.network_commands():
            _run(argv)
        if ray:
            start_ray(em, cpus=cpus, timeout=timeout, max_inline_bytes=max_inline_bytes)
    except BaseException:
        down(em.name)
        raise


def start_ray(
    em: Emulation, *, cpus: float, timeout: float, max_inline_bytes: int | None = None
) -> None:
    """``ray start`` in each DC namespace; wait until every node is alive; record the PIDs."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    env = env_for_namespace(em)
    env.pop("RAY_ADDRESS")  # `ray start --head` must not join an existing cluster
    Path(em.temp_dir, "ray").mkdir(parents=True, exist_ok=True)
    if em.tls_dir:
        make_tls(em)
    starts = em.ray_start_commands(ray_bin, cpus, max_inline_bytes=max_inline_bytes)
    for node, (netns, argv) in zip(em.nodes, starts, strict=True):
        try:
            node_env = {**env, **em.tls_env(node.index)}
            _run(["ip", "netns", "exec", netns, *argv], env=node_env, timeout=timeout)
        finally:
            em.pids[:] = sorted({p for n in em.nodes for p in _netns_pids(n.netns)})
            _save(em)
    wait_nodes(em, timeout=timeout)
    em.pids[:] = sorted({p for n in em.nodes for p in _netns_pids(n.netns)})
    _save(em)


def wait_nodes(em: Emulation, *, timeout: float) -> None:
    """Block until Ray reports one alive node per DC with the right ``dc`` label."""
    want = sorted(n.dc for n in em.nodes)
    code = (
        "import ray, sys, time, json\n"
        "ray.init(address=sys.argv[1], log_to_driver=False)\n"
        "end = time.time() + float(sys.argv[2])\n"
        "while True:\n"
        "    got = sorted(n['Labels'].get('dc', '') for n in ray.nodes() if n['Alive'])\n"
        "    if got == json.loads(sys.argv[3]) or time.time() > end: break\n"
        "    time.sleep(0.5)\n"
        "sys.exit(0 if got == json.loads(sys.argv[3]) else 1)\n"
    )
    argv = [sys.executable, "-c", code, em.address, str(timeout), json.dumps(want)]
    out = subprocess.run(
        ["ip", "netns", "exec", em.head.netns, *argv],
        check=False,
        env=env_for_namespace(em),
        capture_output=True,
        text=True,
        timeout=timeout + 60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"Ray nodes {want} did not all join: {out.stderr.strip()[-500:]}")


def down(name: str, *, grace: float = 10.0) -> list[str]:
    """Kill what runs in our namespaces, delete them and the temp dir. Idempotent.

    Returns what was removed. Only touches namespaces named ``expertmesh-<name>-*``
    and PIDs recorded in the state file or living inside those namespaces.
    """
    removed: list[str] = []
    path = _state_path(name)
    recorded: list[int] = []
    temp_dir = f"/tmp/emu-{name}"
    if path.is_file():
        em = Emulation.from_json(path.read_text())
        recorded, temp_dir = list(em.pids), em.temp_dir
    namespaces = _our_namespaces(name)
    pids = set(recorded)
    for ns in namespaces:
        pids.update(_netns_pids(ns))
    _kill(sorted(pids), grace)
    if pids:
        removed.append(f"{len(pids)} processes")
    for ns in sorted(namespaces, key=lambda s: s.endswith("-br")):  # bridge namespace last
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        removed.append(ns)
    if Path(temp_dir).exists():
        shutil.rmtree(temp_dir, ignore_errors=True)
        removed.append(temp_dir)
    return removed


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    except PermissionError:
        return True
    return not stat.rsplit(") ", 1)[-1].startswith("Z")


def _kill(pids: list[int], grace: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(alive(p) for p in pids):
            time.sleep(0.1)
        pids = [p for p in pids if alive(p)]
        if not pids:
            return


def measure(em: Emulation, src: str, dst: str, *, seconds: float = 3.0) -> dict[str, float]:
    """TCP goodput from DC ``src`` to DC ``dst`` over ``seconds`` (bounded), vs configured.

    Returns ``{"configured_mbit", "measured_mbit", "ratio"}``; measured is the
    receiver's steady rate after the first 0.5 s (the htb bucket's initial burst).
    """
    a, b = em.node(src), em.node(dst)
    env = env_for_namespace(em)
    work = Path(em.temp_dir, f"probe-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    ready, result = work / "port", work / "result.json"
    py = [sys.executable, str(PROBE)]
    recv = subprocess.Popen(
        ["ip", "netns", "exec", b.netns, *py, "recv", b.ip, str(ready), str(result)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + 30
        while not (ready.exists() and ready.read_text().strip()):
            if recv.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"receiver did not start: {recv.stderr and recv.stderr.read()}")
            time.sleep(0.05)
        port = ready.read_text().strip()
        _run(
            ["ip", "netns", "exec", a.netns, *py, "send", b.ip, port, str(seconds)],
            env=env,
            timeout=seconds + 60,
        )
        recv.wait(timeout=60)
        measured = float(json.loads(result.read_text())["steady_mbit"])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
        shutil.rmtree(work, ignore_errors=True)
    configured = em.shape(a.index, b.index).mbit
    return {
        "configured_mbit": configured,
        "measured_mbit": measured,
        "ratio": measured / configured,
    }


def cut(em: Emulation, a: str, b: str) -> None:
    """Drop every packet between DCs ``a`` and ``b`` (both directions) until :func:`heal`."""
    for argv in em.cut_commands(a, b):
        _run(argv)


def heal(em: Emulation, a: str, b: str) -> None:
    """Undo :func:`cut` of DCs ``a`` and ``b`` (a no-op on a pair that is not cut)."""
    for argv in em.cut_commands(a, b, heal=True):
        if _cut_leaf(em, argv[2], argv[-1]):
            _run(argv)


def _cut_leaf(em: Emulation, netns: str, classid: str) -> bool:
    """Whether ``classid`` in ``netns`` has the dropping leaf of a cut."""
    out = subprocess.run(
        ["tc", "-n", netns, "qdisc", "show", "dev", "eth0", "parent", classid],
        check=False,
        capture_output=True,
        text=True,
    ).stdout
    return any(ln.startswith("qdisc pfifo") and "limit 0p" in ln for ln in out.splitlines())


def cuts(em: Emulation) -> list[tuple[str, str]]:
    """The DC pairs ``(a, b)`` (``a`` before ``b`` in the topology) cut in either direction."""
    out = set()
    for s in em.shapes:
        if _cut_leaf(em, em.nodes[s.src].netns, s.classid):
            out.add((min(s.src, s.dst), max(s.src, s.dst)))
    return [(em.nodes[a].dc, em.nodes[b].dc) for a, b in sorted(out)]


def status(em: Emulation) -> dict[str, Any]:
    """Namespaces, addresses, live PIDs, per-pair htb byte counters and the cut pairs."""
    nodes = []
    for n in em.nodes:
        classes = subprocess.run(
            ["tc", "-n", n.netns, "-s", "class", "show", "dev", "eth0"],
            check=False,
            capture_output=True,
            text=True,
        ).stdout
        nodes.append(
            {
                "dc": n.dc,
                "netns": n.netns,
                "ip": n.ip,
                "pids": _netns_pids(n.netns),
                "shaped_mbit": {em.nodes[s.dst].dc: s.mbit for s in em.shapes if s.src == n.index},
                "tc": classes.strip(),
            }
        )
    return {
        "name": em.name,
        "address": em.address,
        "bridge_netns": em.bridge_netns,
        "cut": [list(p) for p in cuts(em)],
        "nodes": nodes,
    }


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    # This checkout's expertmesh first (the planner reads the topology).
    sys.path[:0] = [str(REPO / d) for d in ("controller", "workers", "proto")]
    p = argparse.ArgumentParser(prog="netemu.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="create the namespaces, links and shaping; start Ray")
    u.add_argument("--topology", type=Path, required=True, help="topology YAML")
    u.add_argument("--subnet", default="10.213.0.0/24", help="private subnet inside the namespaces")
    u.add_argument("--scale", type=float, default=1.0, help="multiply every inter-DC bandwidth")
    u.add_argument("--cpus-per-dc", type=float, default=1.0, help="CPUs each DC's Ray node offers")
    u.add_argument("--no-ray", action="store_true", help="network only")
    u.add_argument(
        "--tls",
        action="store_true",
        help="Ray's own TLS (RAY_USE_TLS): a CA and per-DC certificates in the temp dir; "
        "`exec` sets the variables for drivers",
    )
    u.add_argument(
        "--max-inline-bytes",
        type=int,
        help="Ray's max_direct_call_object_size: results up to this size go through their "
        "owner, larger ones node to node (default Ray's, 100 KiB)",
    )
    for sp in [
        u,
        *(
            sub.add_parser(c, help=h)
            for c, h in (
                (
                    "down",
                    "stop Ray processes started here, delete namespaces, veths, bridge, temp dir",
                ),
                ("status", "print the emulation's namespaces, addresses, rates and PIDs (JSON)"),
            )
        ),
    ]:
        sp.add_argument("--name", default="em", help="emulation name (default em)")
    e = sub.add_parser("exec", help="run a command inside a DC's namespace (RAY_ADDRESS set)")
    e.add_argument("--name", default="em")
    e.add_argument("dc", help="DC name or index")
    e.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    m = sub.add_parser("measure", help="TCP goodput between two DCs vs the configured rate")
    m.add_argument("--name", default="em")
    m.add_argument("src")
    m.add_argument("dst")
    m.add_argument("--seconds", type=float, default=3.0)
    for c, h in (
        ("cut", "drop every packet between two DCs (both directions) until heal"),
        ("heal", "undo cut: the two DCs' link carries packets again"),
    ):
        cp = sub.add_parser(c, help=h)
        cp.add_argument("--name", default="em")
        cp.add_argument("a", help="DC name or index")
        cp.add_argument("b", help="DC name or index")
    sub.add_parser("check", help="can this machine make namespaces? (exit 0 yes, 1 no)")
    args = p.parse_args(argv)
    try:
        return _dispatch(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"netemu: {err}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "check":
        why = check_host()
        print(why or "ok: network namespaces, veth and htb work here")
        return 1 if why else 0
    if args.cmd == "up":
        em = plan_emulation(
            yaml.safe_load(args.topology.read_text()),
            name=args.name,
            subnet=args.subnet,
            scale=args.scale,
            tls=args.tls,
        )
        up(
            em,
            ray=not args.no_ray,
            cpus=args.cpus_per_dc,
            max_inline_bytes=args.max_inline_bytes,
        )
        print(
            f"up: {len(em.nodes)} DCs, Ray at {em.address}"
            + (" (no Ray)" if args.no_ray else "")
            + (" over TLS" if em.tls_dir else "")
        )
        for n in em.nodes:
            rates = ", ".join(
                f"{em.nodes[s.dst].dc} {s.mbit:g} Mbit/s" for s in em.shapes if s.src == n.index
            )
            print(f"  {n.dc:<12} {n.netns:<24} {n.ip:<15} -> {rates}")
        print(f"run inside: {Path(__file__).name} exec {em.head.dc} -- <command>")
        return 0
    if args.cmd == "down":
        removed = down(args.name)
        print("down: removed " + (", ".join(removed) if removed else "nothing (not up)"))
        return 0
    em = _load(args.name)
    if args.cmd == "status":
        print(json.dumps(status(em), indent=1))
        return 0
    if args.cmd == "measure":
        print(json.dumps(measure(em, args.src, args.dst, seconds=args.seconds)))
        return 0
    if args.cmd in ("cut", "heal"):
        (cut if args.cmd == "cut" else heal)(em, args.a, args.b)
        print(f"{args.cmd}: {em.node(args.a).dc} <-> {em.node(args.b).dc}; cut now: {cuts(em)}")
        return 0
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise ValueError("exec: give a command after --")
    node = em.node(args.dc)
    env = env_for_namespace(em, node.index)
    os.execvpe("ip", ["ip", "netns", "exec", node.netns, *cmd], env)


if __name__ == "__main__":
    sys.exit(main())
