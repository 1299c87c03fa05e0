"""``deploy/emulate/netemu.py`` as a module: it is a stand-alone script, not part of the
package, and the emulation tests and their in-namespace driver all call into it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

NETEMU = Path(__file__).resolve().parents[2] / "deploy" / "emulate" / "netemu.py"


def load_netemu() -> ModuleType:
    """Import netemu.py once per process (registered as ``netemu``)."""
    if "netemu" in sys.modules:
        return sys.modules["netemu"]
    spec = importlib.util.spec_from_file_location("netemu", NETEMU)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["netemu"] = mod
    spec.loader.exec_module(mod)
    return mod


def load_rayup() -> ModuleType:
    """``deploy/emulate/rayup.py`` the same way (registered as ``rayup``; it loads netemu)."""
    load_netemu()
    if "rayup" in sys.modules:
        return sys.modules["rayup"]
    spec = importlib.util.spec_from_file_location("rayup", NETEMU.with_name("rayup.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rayup"] = mod
    spec.loader.exec_module(mod)
    return mod


def start_nodes(em: Any, tmp_path: Path, topology: Path, **extra: str) -> dict[str, str]:
    """Run deploy/scripts/start-node.sh in each DC namespace of ``em`` as `ray up` would on
    each machine (the head first, then workers joining it), the DC found from an IP-to-DC
    map; ``extra``: more environment (e.g. ``EXPERTMESH_TLS_DIR``). Returns the environment
    the nodes ran with (without the node's own IP and state directory)."""
    netemu = load_netemu()
    dc_map = tmp_path / "dc-map.yaml"
    dc_map.write_text("".join(f"{n.ip}/32: {n.dc}\n" for n in em.nodes))
    env = netemu.env_for_namespace(em)
    env.pop("RAY_ADDRESS")
    for var in ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
        env.pop(var, None)  # start-node.sh sets them itself, from EXPERTMESH_TLS_DIR
    env.update(
        EXPERTMESH_VENV=str(Path(sys.executable).parent.parent),
        EXPERTMESH_DC_MAP=str(dc_map),
        EXPERTMESH_DC_FILE=str(tmp_path / "none"),
        EXPERTMESH_TOPOLOGY=str(topology),
        HOME=str(tmp_path),
        **extra,
    )
    script = str(NETEMU.parents[1] / "scripts" / "start-node.sh")
    for n in em.nodes:
        args = ["head"] if n.index == 0 else ["worker", em.head.ip]
        node_env = {**env, "EXPERTMESH_NODE_IP": n.ip, "EXPERTMESH_STATE": str(tmp_path / n.dc)}
        run = subprocess.run(
            ["ip", "netns", "exec", n.netns, "bash", script, *args],
            env=node_env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert run.returncode == 0, run.stderr[-2000:]
    return env
