#!/usr/bin/env python3
"""``ray up`` of the expertmesh cluster file onto the emulated DCs, over real SSH.

Each DC namespace of a :mod:`netemu` emulation (built without Ray) becomes a *host*
that Ray's ``local`` provider reaches over SSH: an ``sshd`` (Debian's openssh-server)
listening only on the namespace's address, root login with a key made for the run and
nothing else. The operator's workstation is the bridge namespace, given the subnet's
last address, so ``ray up`` crosses the same bridge; its links are not shaped.

    rayup.py up [--name ru]                          # network, SSH hosts, cluster file
    rayup.py ops -- ray up -y /tmp/emu-ru/cluster.yaml  # a command on the workstation
    rayup.py run [--steps 5]                          # all of it, timed, then down
    rayup.py down [--name ru]                        # as netemu.py down: nothing left

A host is the DC's network namespace plus, for its ``sshd`` and everything started
through it, namespaces that make it a machine of its own on this one machine:

- mount: its own ``/etc`` (an overlay: ``/etc/expertmesh/dc``, root's home, the host
  key), ``/home`` (root's home is ``/home/root``: ``~/expertmesh``, ``~/expertmesh-venv``,
  ``~/.expertmesh``) and ``/tmp`` (``/tmp/ray`` of its Ray node);
- PID, with its own ``/proc``: ``ray stop`` (the cluster file's start commands, ``ray
  down``) sees and stops this host's Ray only, never the other Rays on the machine;
  ``sshd`` is the namespace's first process, so when it ends the kernel ends the rest;
- UTS: its own hostname.

The cluster file is ``deploy/cluster.yaml`` with the emulation's addresses, the run's
key, a cluster name of its own, the emulated topology for ``serve``, and setup commands
that build ``~/expertmesh-venv`` without a package registry (the namespaces reach none):
the venv sees the workstation venv's packages (torch, Ray) through a ``.pth`` file where
real machines ``pip install`` them, and the shipped checkout is installed with ``pip
install -e`` offline. Everything else (``file_mounts``, ``start-node.sh``, ``ray stop``
before each start, the autoscaler on the head starting the workers) is as on real
machines. State lives under ``/tmp/emu-<name>``; ``down`` removes it.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "deploy" / "cluster.yaml"
TOPOLOGY = REPO / "deploy" / "topologies" / "emulate.yaml"
SSHD = "/usr/sbin/sshd"
HOME = "/home/root"  # root's home on every emulated host
DEMO_REST_PORT, DEMO_GRPC_PORT = 8710, 8711  # the demo's surfaces (serve has 8700/8701)

__all__ = ["Host", "RayUp", "check_host", "cluster_config", "plan_rayup"]


def _netemu() -> ModuleType:
    if "netemu" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "netemu", Path(__file__).with_name("netemu.py")
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["netemu"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["netemu"]


netemu = _netemu()


@dataclass(frozen=True)
class Host:
    """One emulated machine: a DC's namespace with an sshd; its files under ``root``."""

    dc: str
    netns: str
    ip: str
    hostname: str
    root: str  # /tmp/emu-<name>/hosts/<dc>: etc/ (overlay upper), home/, tmp/, sshd.log


@dataclass(frozen=True)
class RayUp:
    """An emulation, its hosts, the operator's address and the run's files (pure data)."""

    em: Any  # netemu.Emulation
    hosts: tuple[Host, ...]
    operator_ip: str
    cluster_name: str
    experts: int = 0  # the demo's experts per layer: every master slot of the topology

    @property
    def workstation_tmp(self) -> str:
        """The workstation's ``/tmp`` (Ray's state and caches of ``ray up``, the run's key)."""
        return f"{self.em.temp_dir}/workstation"

    @property
    def key(self) -> str:
        """The run's SSH key, as the workstation sees it."""
        return "/tmp/expertmesh-ssh/id_ed25519"

    @property
    def cluster_file(self) -> str:
        """The cluster file, as the workstation sees it."""
        return f"/tmp/{self.cluster_name}.yaml"

    def here(self, workstation_path: str) -> str:
        """Where a file of the workstation's ``/tmp`` is on this machine."""
        return self.workstation_tmp + workstation_path.removeprefix("/tmp")

    @property
    def head(self) -> Host:
        return self.hosts[0]


def plan_rayup(
    topology: dict[str, Any], *, name: str = "ru", subnet: str = "10.213.0.0/24"
) -> RayUp:
    """The emulation (netemu, no Ray), one host per DC and the operator's address.

    The operator (the workstation that runs ``ray up``) takes the subnet's last address.
    ValueError as :func:`netemu.plan_emulation`, or when the subnet has no address left."""
    em = netemu.plan_emulation(topology, name=name, subnet=subnet)
    net = ipaddress.ip_network(subnet, strict=True)
    operator = str(list(net.hosts())[-1])
    if operator in {n.ip for n in em.nodes}:
        raise ValueError(f"--subnet {subnet} has no address left for the operator")
    hosts = tuple(
        Host(n.dc, n.netns, n.ip, f"{name}-{n.dc}", f"{em.temp_dir}/hosts/{n.dc}") for n in em.nodes
    )
    from expertmesh.planner import Topology

    topo = Topology.from_dict(topology)
    experts = topo.num_ranks * topo.masters_per_rank
    return RayUp(em, hosts, operator, f"expertmesh-emu-{name}", experts)


def _venv_base_python() -> str:
    """The interpreter the workstation's venv was made from (the hosts make theirs with it)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def setup_commands(python: str, site_packages: str) -> list[str]:
    """deploy/cluster.yaml's setup commands for hosts without a package registry.

    Where real machines ``pip install`` torch and the ``cluster`` extra from the registry,
    the host's venv sees ``site_packages`` (the workstation venv's) through a ``.pth``
    file and gets Ray's ``ray`` command as pip would write it; the shipped checkout is
    installed with ``pip install -e`` offline (its build backend from ``site_packages``)."""
    venv = "~/expertmesh-venv"
    pth = f"{venv}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    ray_script = "import sys\\nfrom ray.scripts.scripts import main\\nsys.exit(main())\\n"
    return [
        f"test -x {venv}/bin/python || {shlex.quote(python)} -m venv {venv}",
        f"echo {shlex.quote(site_packages)} > {pth}/zz-emulated-host-packages.pth",
        f"{venv}/bin/python -m pip install --quiet --no-index --no-deps --no-build-isolation"
        ' -e "$HOME/expertmesh"',
        f"printf '#!%s\\n{ray_script}' $HOME/expertmesh-venv/bin/python > {venv}/bin/ray"
        f" && chmod +x {venv}/bin/ray",
        "grep -q expertmesh-venv ~/.bashrc || "
        "echo 'export PATH=$HOME/expertmesh-venv/bin:$PATH' >> ~/.bashrc",
        "chmod +x ~/expertmesh/deploy/scripts/start-node.sh",
    ]


def cluster_config(
    base: dict[str, Any],
    ru: RayUp,
    *,
    repo: str,
    topology_rel: str,
    python: str,
    site_packages: str,
) -> dict[str, Any]:
    """``base`` (deploy/cluster.yaml) for the emulated hosts; pure.

    Changes only: the cluster name, the provider's IPs, the SSH user and key, the
    worker counts, ``file_mounts`` (the checkout by absolute path), the setup commands
    (:func:`setup_commands`) and the topology ``serve`` plans for (``EXPERTMESH_TOPOLOGY``,
    as docs/operations.md tells a user). ValueError when ``base`` lacks what is changed."""
    cfg = copy.deepcopy(base)
    if cfg.get("provider", {}).get("type") != "local":
        raise ValueError("the base cluster file must use Ray's local provider")
    heads = cfg.get("head_start_ray_commands", [])
    at = [i for i, c in enumerate(heads) if "start-node.sh head" in c]
    if len(at) != 1:
        raise ValueError("the base cluster file must run start-node.sh head once")
    cfg["cluster_name"] = ru.cluster_name
    workers = [h.ip for h in ru.hosts[1:]]
    cfg["provider"] = {"type": "local", "head_ip": ru.head.ip, "worker_ips": workers}
    cfg["auth"] = {"ssh_user": "root", "ssh_private_key": ru.key}
    cfg["min_workers"] = cfg["max_workers"] = len(workers)
    cfg["file_mounts"] = {"~/expertmesh": repo}
    # Certificates in the checkout name your machines, not the emulated ones: the rehearsal
    # runs in clear (`netemu.py up --tls` rehearses Ray's TLS).
    cfg["rsync_exclude"] = [*cfg.get("rsync_exclude", []), "deploy/tls"]
    cfg["setup_commands"] = setup_commands(python, site_packages)
    topo = f"EXPERTMESH_TOPOLOGY=~/expertmesh/{topology_rel} "
    cmd = heads[at[0]]
    script = cmd.index("~/expertmesh/deploy/scripts/start-node.sh head")
    heads[at[0]] = cmd[:script] + topo + cmd[script:]
    return cfg


def sshd_config(host: Host) -> str:
    """sshd_config of one host: its address only, root by key only, nothing forwarded."""
    return "\n".join(
        [
            f"ListenAddress {host.ip}:22",
            "HostKey /etc/ssh/expertmesh_host_ed25519_key",
            "PidFile none",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "AuthorizedKeysFile .ssh/authorized_keys",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "X11Forwarding no",
            "AllowAgentForwarding no",
            "PrintMotd no",
            "MaxStartups 64",
            "MaxSessions 64",
            "",
        ]
    )


# The host's first process: its own /etc, /home, /tmp and hostname, then sshd (as PID 1).
_INIT = r"""set -eu
h=$1
mount -t overlay expertmesh-etc -o "lowerdir=/etc,upperdir=$h/etc,workdir=$h/etc-work" /etc
mount --bind "$h/home" /home
mount --bind "$h/tmp" /tmp
hostname "$2"
exec /usr/sbin/sshd -D -e -f /etc/ssh/expertmesh_sshd_config
"""


def check_host() -> str | None:
    """Why SSH hosts cannot be made here, or None (netemu's checks, sshd, rsync, overlay)."""
    why = netemu.check_host()
    if why:
        return why
    for what, path in (("checkout", REPO), ("python", Path(sys.executable))):
        if Path(path).resolve().is_relative_to("/tmp"):  # every host gets its own /tmp
            return f"the {what} lives under /tmp ({path}), which each emulated host replaces"
    for tool, pkg in ((SSHD, "openssh-server"), ("ssh", "openssh-client"), ("rsync", "rsync")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install {pkg})"
    if shutil.which("unshare") is None:
        return "`unshare` not found (apt-get install util-linux)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay filesystem"
    with tempfile.TemporaryDirectory(prefix="expertmesh-hostcheck-") as d:
        for sub in ("lower", "upper", "work", "merged"):
            Path(d, sub).mkdir()
        probe = (  # what a host's first process does: overlay, bind, its own /proc
            f"mount -t overlay probe -o lowerdir={d}/lower,upperdir={d}/upper,workdir={d}/work "
            f"{d}/merged && mount --bind {d}/upper {d}/lower && test -d /proc/1"
        )
        got = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
             "--uts", "sh", "-c", probe],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    if got.returncode != 0:
        return f"mount/PID namespaces with overlayfs do not work here: {got.stderr.strip()}"
    return None


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _keygen(path: Path, comment: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    netemu._run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


def _host_files(ru: RayUp, host: Host, *, dc_file: bool) -> None:
    """Everything a host's namespaces mount: its /etc layer, home, /tmp."""
    root = Path(host.root)
    etc, home = root / "etc", root / "home" / "root"
    (root / "etc-work").mkdir(parents=True)
    (root / "tmp").mkdir(parents=True)
    (root / "tmp").chmod(0o1777)
    (root / "home").mkdir(mode=0o755)
    passwd = []
    for line in Path("/etc/passwd").read_text().splitlines():
        f = line.split(":")
        if f[0] == "root" and len(f) == 7:
            f[5] = HOME
        passwd.append(":".join(f))
    _write(etc / "passwd", "\n".join(passwd) + "\n")
    names = "".join(f"{h.ip}\t{h.hostname}\n" for h in ru.hosts)
    _write(etc / "hosts", f"127.0.0.1\tlocalhost\n{ru.operator_ip}\toperator\n{names}")
    _write(etc / "hostname", host.hostname + "\n")
    if dc_file:
        _write(etc / "expertmesh" / "dc", host.dc + "\n")
    _write(etc / "ssh" / "expertmesh_sshd_config", sshd_config(host))
    _keygen(etc / "ssh" / "expertmesh_host_ed25519_key", host.hostname)
    home.mkdir(parents=True, mode=0o700)
    for skel in (".bashrc", ".profile"):  # a fresh machine's root has these
        if Path("/etc/skel", skel).is_file():
            shutil.copy(Path("/etc/skel", skel), home / skel)
    _write(home / ".ssh" / "authorized_keys", Path(ru.here(ru.key) + ".pub").read_text(), 0o600)
    (home / ".ssh").chmod(0o700)


def hosts_up(ru: RayUp, *, no_dc_file: frozenset[str] = frozenset(), timeout: float = 30.0) -> None:
    """Build the network (no Ray), then an sshd host per DC and the cluster file.

    ``no_dc_file``: DCs whose host gets no ``/etc/expertmesh/dc`` (its DC must then come
    from ``deploy/dc-map.yaml``, which does not list the emulation's addresses). On any
    failure, tears everything down."""
    em = ru.em
    netemu.up(em, ray=False)
    try:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        Path(ru.workstation_tmp).mkdir()
        Path(ru.workstation_tmp).chmod(0o1777)
        _keygen(Path(ru.here(ru.key)), f"expertmesh-emulation-{em.name}")
        br = em.bridge_netns
        netemu._run(f"ip -n {br} addr add {ru.operator_ip}/{em.prefixlen} dev br0".split())
        init = Path(em.temp_dir, "host-init.sh")
        _write(init, _INIT)
        for h in ru.hosts:
            _host_files(ru, h, dc_file=h.dc not in no_dc_file)
            log = open(Path(h.root, "sshd.log"), "ab")  # noqa: SIM115 (the child keeps it)
            with log:
                subprocess.Popen(
                    ["ip", "netns", "exec", h.netns, "unshare", "--mount", "--propagation",
                     "private", "--pid", "--fork", "--mount-proc", "--uts",
                     "bash", str(init), h.root, h.hostname],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                )  # fmt: skip
        for h in ru.hosts:
            _wait_listening(h, timeout)
        _write(Path(ru.here(ru.cluster_file)), yaml.safe_dump(_cluster(ru), sort_keys=False))
    except BaseException:
        netemu.down(em.name)
        raise


def _cluster(ru: RayUp) -> dict[str, Any]:
    return cluster_config(
        yaml.safe_load(CLUSTER_YAML.read_text()),
        ru,
        repo=str(REPO),
        topology_rel=str(TOPOLOGY.relative_to(REPO)),
        python=_venv_base_python(),
        site_packages=sysconfig.get_paths()["purelib"],
    )


def _wait_listening(h: Host, timeout: float) -> None:
    log = Path(h.root, "sshd.log")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if f"Server listening on {h.ip} port 22" in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise RuntimeError(f"sshd on {h.hostname} did not start: {log.read_text()[-1000:]}")


def ops_env() -> dict[str, str]:
    """The workstation's environment: this venv's ``ray`` first, Ray's auth off."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.pop("RAY_ADDRESS", None)
    return env


def ops_argv(ru: RayUp, argv: list[str]) -> list[str]:
    """``argv`` on the operator's workstation: the bridge namespace, its own ``/tmp``."""
    bind = 'mount --bind "$0" /tmp && exec "$@"'
    return [
        *("ip", "netns", "exec", ru.em.bridge_netns, "unshare", "--mount", "--propagation"),
        *("private", "sh", "-c", bind, ru.workstation_tmp, *argv),
    ]


def ops(ru: RayUp, argv: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` on the operator's workstation (:func:`ops_argv`), from the repo root."""
    return subprocess.run(
        ops_argv(ru, argv),
        cwd=REPO,
        env=ops_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def fetch(ru: RayUp, url: str, *, timeout: float = 10.0) -> dict[str, Any]:
    """GET ``url`` from the workstation: ``{"status", "content_type", "body"}``."""
    code = (
        "import json, sys, urllib.request\n"
        "try:\n"
        "    r = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))\n"
        "    out = {'status': r.status, 'content_type': r.headers.get('content-type', ''),\n"
        "           'body': r.read().decode('utf-8', 'replace')}\n"
        "except Exception as e:\n"
        "    out = {'status': getattr(e, 'code', 0), 'content_type': '', 'body': repr(e)}\n"
        "print(json.dumps(out))\n"
    )
    got = ops(ru, [sys.executable, "-c", code, url, str(timeout)], timeout=timeout + 30)
    if got.returncode != 0:
        raise RuntimeError(f"fetch {url}: {got.stderr.strip()[-500:]}")
    return json.loads(got.stdout)


def host_pids(ru: RayUp) -> dict[str, list[int]]:
    """Processes running on each host (its network namespace), by DC."""
    return {h.dc: netemu._netns_pids(h.netns) for h in ru.hosts}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def down(name: str) -> list[str]:
    """As ``netemu.py down``: every process on the hosts (sshd too), namespaces, files."""
    return netemu.down(name)


# ---------------------------------------------------------------- the run, step by step

_WAIT_NODES = """
import json, sys, time, ray
ray.init(address="auto", log_to_driver=False)
want, end = sorted(json.loads(sys.argv[1])), time.time() + float(sys.argv[2])
while True:
    got = sorted([n["NodeManagerAddress"], n["Labels"].get("dc", "")] for n in ray.nodes() if n["Alive"])
    if got == want or time.time() > end:
        break
    time.sleep(1)
print("alive nodes (ip, dc):", json.dumps(got))
sys.exit(0 if got == want else 1)
"""

_WATCH = """
import json, re, sys, time, urllib.request
base, end = sys.argv[1], time.time() + float(sys.argv[2])
def get(path):
    try:
        r = urllib.request.urlopen(base + path, timeout=5)
        return {"status": r.status, "content_type": r.headers.get("content-type", ""),
                "body": r.read().decode("utf-8", "replace")}
    except Exception as e:
        return {"status": getattr(e, "code", 0), "content_type": "", "body": repr(e)}
step = -1.0
while time.time() < end:
    m = get("/metrics")
    found = re.search(r"^expertmesh_step (\\S+)$", m["body"], re.M) if m["status"] == 200 else None
    step = float(found.group(1)) if found else -1.0
    if step >= 1:
        break
    time.sleep(0.3)
out = {"step": step}
if step >= 1:
    out.update({p: get(p) for p in ("/", "/api/v1/topology", "/api/v1/dashboard", "/metrics")})
print(json.dumps(out))
"""


def remote(ru: RayUp, command: str, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """``ray exec <cluster file> command`` from the workstation (runs on the head)."""
    ray = str(Path(sys.executable).with_name("ray"))
    return ops(ru, [ray, "exec", ru.cluster_file, command], timeout=timeout)


def wait_nodes(ru: RayUp, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """Until Ray on the head lists one alive node per host, at its address with its DC label
    (``ray exec``, as docs/operations.md "Start" step 4); returncode 0 when it does."""
    want = json.dumps([[h.ip, h.dc] for h in ru.hosts])
    cmd = shlex.join(["python", "-c", _WAIT_NODES, want, str(timeout)])
    return remote(ru, cmd, timeout=timeout + 120)


def watch_surfaces(
    ru: RayUp, port: int, *, timeout: float, until_exit: subprocess.Popen[str] | None = None
) -> dict[str, Any]:
    """Poll the head's ``/metrics`` on ``port`` from the workstation until a step is recorded,
    then GET the dashboard, REST and ``/metrics``: ``{"step", "/": {...}, ...}``. Gives up
    after ``timeout`` s, or 10 s after ``until_exit`` (the process serving them) ended."""
    base = f"http://{ru.head.ip}:{port}"
    watch = subprocess.Popen(
        ops_argv(ru, [sys.executable, "-c", _WATCH, base, str(timeout)]),
        env=ops_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    end, gone = time.monotonic() + timeout + 60, None
    while watch.poll() is None and time.monotonic() < end:
        if until_exit is not None and until_exit.poll() is not None:
            gone = gone or time.monotonic()
            if time.monotonic() - gone > 10:
                break
        time.sleep(0.5)
    if watch.poll() is None:
        watch.kill()
    out_, err = watch.communicate()
    if watch.returncode != 0:
        return {"step": -1.0, "error": err.strip()[-500:] or f"stopped ({watch.returncode})"}
    out: dict[str, Any] = json.loads(out_)
    return out


def demo_command(ru: RayUp, steps: int) -> str:
    """What ``ray exec`` runs on the head: the demo on the ``ray up`` cluster (``--address
    auto``), its surfaces on the head's address with the bearer token start-node.sh made."""
    topo = f"~/expertmesh/{TOPOLOGY.relative_to(REPO)}"
    return (
        "EXPERTMESH_TOKEN=$(cat ~/.expertmesh/token) expertmesh demo --address auto --exit "
        f"--steps {steps} --topology {topo} --experts {ru.experts} --no-shaper --host {ru.head.ip} "
        f"--rest-port {DEMO_REST_PORT} --grpc-port {DEMO_GRPC_PORT}"
    )


TEARDOWN = (
    "~/expertmesh/deploy/scripts/start-node.sh stop-serve",
    "~/expertmesh/deploy/scripts/start-node.sh stop-workers",
)


def leftovers(ru: RayUp, sshd_pids: dict[str, set[int]]) -> dict[str, list[str]]:
    """Per DC, the processes on the host other than its sshd listener and init (and SSH
    sessions that are closing): what ``ray down`` left running."""
    out = {}
    for dc, pids in host_pids(ru).items():
        rest = [
            f"{p} {cmdline(p)[:160]}"
            for p in pids
            if p not in sshd_pids[dc] and not cmdline(p).startswith("sshd: ") and netemu.alive(p)
        ]
        if rest:
            out[dc] = rest
    return out


def _ops_popen(ru: RayUp, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ops_argv(ru, argv),
        cwd=REPO,
        env=ops_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _check(ok: bool, what: str, out: str = "") -> None:
    if not ok:
        raise RuntimeError(what + (f"\n{out.strip()[-3000:]}" if out.strip() else ""))


def _dcs_of(topology_json: str) -> list[str]:
    return [d["name"] for d in json.loads(topology_json)["dcs"]]


def _check_surfaces(ru: RayUp, got: dict[str, Any], where: str) -> None:
    _check(got.get("step", -1) >= 1, f"{where}: no training step in /metrics", json.dumps(got))
    for path in ("/", "/api/v1/topology", "/api/v1/dashboard", "/metrics"):
        _check(got[path]["status"] == 200, f"{where}{path}: {got[path]}")
    _check("<title>expertmesh controller</title>" in got["/"]["body"], f"{where}/: no dashboard")
    dcs = _dcs_of(got["/api/v1/topology"]["body"])
    _check(dcs == [h.dc for h in ru.hosts], f"{where}/api/v1/topology: DCs {dcs}")


def rehearse(
    ru: RayUp, *, steps: int = 20, no_dc_file: frozenset[str] = frozenset(), log: Any = print
) -> dict[str, Any]:
    """The whole rehearsal: hosts, ``ray up``, nodes, ``serve``, the demo through ``ray exec``
    with its surfaces read from the workstation, teardown (``stop-serve``, ``stop-workers``,
    ``ray down``), what was left, then :func:`down`. RuntimeError at the first step that
    fails (after ``down``); else a report of times (seconds) and observations."""
    ray = str(Path(sys.executable).with_name("ray"))
    rep: dict[str, Any] = {"cluster_file": ru.cluster_file}
    t0 = time.monotonic()
    hosts_up(ru, no_dc_file=no_dc_file)
    rep["hosts_up_s"] = time.monotonic() - t0
    base = {dc: set(pids) for dc, pids in host_pids(ru).items()}  # init + sshd per host
    log(f"hosts up in {rep['hosts_up_s']:.1f}s: " + ", ".join(f"{h.dc} {h.ip}" for h in ru.hosts))
    try:
        t = time.monotonic()
        up = ops(ru, [ray, "up", "-y", "--disable-usage-stats", ru.cluster_file], timeout=900)
        rep["ray_up_s"] = time.monotonic() - t
        _check(up.returncode == 0, f"ray up failed ({up.returncode})", up.stdout + up.stderr)
        log(f"ray up: {rep['ray_up_s']:.1f}s")
        t = time.monotonic()
        nodes = wait_nodes(ru, timeout=300)
        rep["workers_joined_s"] = time.monotonic() - t
        _check(
            nodes.returncode == 0, "not every host joined with its DC", nodes.stdout + nodes.stderr
        )
        log(f"every node alive with its DC label {rep['workers_joined_s']:.1f}s after ray up")
        serve = {
            p: fetch(ru, f"http://{ru.head.ip}:8700{p}")
            for p in ("/api/v1/health", "/", "/metrics")
        }
        for p, r in serve.items():
            _check(r["status"] == 200, f"serve {p}: {r}")
        rep["serve"] = {p: r["status"] for p, r in serve.items()}
        log(f"serve on the head: {rep['serve']}")
        t = time.monotonic()
        demo = _ops_popen(ru, [ray, "exec", ru.cluster_file, demo_command(ru, steps)])
        try:
            seen = watch_surfaces(ru, DEMO_REST_PORT, timeout=600, until_exit=demo)
            out, _ = demo.communicate(timeout=900)
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait()
        rep["demo_s"] = time.monotonic() - t
        _check(demo.returncode == 0, f"ray exec demo failed ({demo.returncode})", out)
        _check_surfaces(ru, seen, f"demo http://{ru.head.ip}:{DEMO_REST_PORT}")
        rep["demo_surfaces"] = {p: v["status"] for p, v in seen.items() if p.startswith("/")}
        rep["demo_step_seen"] = seen["step"]
        log(
            f"demo: {steps} steps through ray exec in {rep['demo_s']:.1f}s; surfaces {rep['demo_surfaces']}"
        )
        t = time.monotonic()
        for cmd in TEARDOWN:
            got = remote(ru, cmd, timeout=300)
            _check(got.returncode == 0, f"{cmd} failed", got.stdout + got.stderr)
        down_ = ops(ru, [ray, "down", "-y", ru.cluster_file], timeout=600)
        _check(down_.returncode == 0, "ray down failed", down_.stdout + down_.stderr)
        end = time.monotonic() + 60  # SSH sessions close; nothing else may stay
        while (left := leftovers(ru, base)) and time.monotonic() < end:
            time.sleep(1)
        rep["teardown_s"] = time.monotonic() - t
        rep["left_after_ray_down"] = left
        _check(not left, "processes left on the hosts after ray down", json.dumps(left, indent=1))
        log(f"torn down in {rep['teardown_s']:.1f}s; nothing left on the hosts but sshd")
    finally:
        sshd = [p for pids in base.values() for p in pids]
        rep["removed"] = down(ru.em.name)
        rep["sshd_alive_after_down"] = [p for p in sshd if netemu.alive(p)]
        rep["namespaces_after_down"] = netemu._our_namespaces(ru.em.name)
    return rep


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    sys.path[:0] = [str(REPO / d) for d in ("controller", "workers", "proto")]
    p = argparse.ArgumentParser(prog="rayup.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for c, h in (
        ("up", "network, an SSH host per DC and the cluster file (no Ray)"),
        ("run", "the whole rehearsal, timed: up, ray up, demo, surfaces, ray down, down"),
        ("down", "every process on the hosts, namespaces, files (never `ray stop`)"),
        ("ops", "run a command on the operator's workstation (the bridge namespace)"),
        ("check", "can this machine make SSH hosts? (exit 0 yes, 1 no)"),
    ):
        sp = sub.add_parser(c, help=h)
        sp.add_argument("--name", default="ru", help="emulation name (default ru)")
        if c in ("up", "run"):
            sp.add_argument("--topology", type=Path, default=TOPOLOGY, help="topology YAML")
            sp.add_argument("--subnet", default="10.213.0.0/24")
            sp.add_argument("--no-dc-file", action="append", default=[], metavar="DC",
                            help="give this DC's host no /etc/expertmesh/dc")  # fmt: skip
        if c == "run":
            sp.add_argument("--steps", type=int, default=20, help="demo steps (default 20)")
            sp.add_argument("--json", type=Path, help="write the report here")
        if c == "ops":
            sp.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = p.parse_args(argv)
    try:
        return _dispatch(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"rayup: {err}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> RayUp:
    return plan_rayup(yaml.safe_load(args.topology.read_text()), name=args.name, subnet=args.subnet)


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "check":
        why = check_host()
        print(why or "ok: namespaces, sshd, rsync and overlay work here")
        return 1 if why else 0
    if args.cmd == "down":
        removed = down(args.name)
        print("down: removed " + (", ".join(removed) if removed else "nothing (not up)"))
        return 0
    if args.cmd == "ops":
        state = netemu._load(args.name)
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not cmd:
            raise ValueError("ops: give a command after --")
        ru = RayUp(state, (), "", "")
        os.chdir(REPO)
        os.execvpe("ip", ops_argv(ru, cmd), ops_env())
    why = check_host()
    if why:
        raise RuntimeError(f"cannot emulate hosts here: {why}")
    ru = _plan(args)
    if args.cmd == "up":
        hosts_up(ru, no_dc_file=frozenset(args.no_dc_file))
        print(f"up: {len(ru.hosts)} SSH hosts; the workstation is {ru.operator_ip}")
        for h in ru.hosts:
            print(f"  {h.dc:<12} root@{h.ip:<15} {h.hostname}")
        print(f"cluster file: {ru.cluster_file}\nthen: {Path(__file__).name} ops --name "
              f"{ru.em.name} -- ray up -y {ru.cluster_file}")  # fmt: skip
        return 0
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    rep = rehearse(ru, steps=args.steps, no_dc_file=frozenset(args.no_dc_file))
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))
    print(json.dumps({k: v for k, v in rep.items() if k.endswith("_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
