"""``deploy/emulate/netemu.py`` as a module: it is a stand-alone script, not part of the
package, and the emulation tests and their in-namespace driver all call into it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
