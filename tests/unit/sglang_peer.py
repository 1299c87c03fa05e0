"""SGLang's own placement loader (``sglang/srt/eplb/expert_location.py``), run on the CPU.

The module is taken from the sglang wheel on PyPI (``pip download --no-deps``, cached in
``.cache/peers``; ``EXPERTMESH_SGLANG_WHEEL`` points at a wheel already here) and never
copied into the project. A full ``pip install sglang`` needs CUDA torch 2.14.1 and dozens of
GPU packages, so no dependency group can install it beside the pinned CPU torch; the loader
module itself needs torch only, plus ``sglang.srt.runtime_context`` (the server's settings),
which is stubbed here (with elastic EP off) with the settings an SGLang server started with
``--init-expert-location FILE --ep-size R --ep-num-redundant-experts P-E`` would have.
``ModelConfigForExpertLocation.from_model_config`` (it loads the model class) is replaced by
the model's ``num_hidden_layers`` and expert count. Everything else is SGLang's code: the file
parsing (``torch.load(weights_only=True)`` / ``json``), ``init_by_mapping(**data)``, the
logical-to-physical maps and the static dispatch table.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

SGLANG_VERSION = "0.5.23"  # the release whose formats docs/engines.md follows
MODULE = "sglang/srt/eplb/expert_location.py"


def module_path(cache: Path) -> tuple[Path | None, str]:
    """Where the extracted loader module is, and why not if it is not."""
    out = cache / f"sglang_{SGLANG_VERSION}_expert_location.py"
    if out.is_file():
        return out, ""
    wheel = os.environ.get("EXPERTMESH_SGLANG_WHEEL")
    if not wheel:
        wheels = cache / "wheels"
        found = glob.glob(str(wheels / f"sglang-{SGLANG_VERSION}-*.whl"))
        if not found:
            wheels.mkdir(parents=True, exist_ok=True)
            try:
                run = subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                     "--only-binary=:all:", "-d", str(wheels), f"sglang=={SGLANG_VERSION}"],
                    check=False, capture_output=True, text=True, timeout=600,
                )  # fmt: skip
            except (OSError, subprocess.TimeoutExpired) as err:
                return None, f"pip download sglang failed: {err}"
            found = glob.glob(str(wheels / f"sglang-{SGLANG_VERSION}-*.whl"))
            if run.returncode != 0 or not found:
                return None, f"pip download sglang failed: {run.stderr.strip()[-300:]}"
        wheel = found[0]
    try:
        with zipfile.ZipFile(wheel) as z:
            out.write_bytes(z.read(MODULE))
    except (OSError, KeyError, zipfile.BadZipFile) as err:
        return None, f"{wheel}: no {MODULE} ({err})"
    return out, ""


def load_module(path: Path) -> ModuleType:
    """The loader module, importable without the rest of sglang."""
    settings: dict[str, Any] = {}
    ctx = ModuleType("sglang.srt.runtime_context")
    ctx.get_exec = lambda: settings["exec"]  # type: ignore[attr-defined]
    ctx.get_parallel = lambda: settings["parallel"]  # type: ignore[attr-defined]
    ctx.get_device = lambda: SimpleNamespace(device="cpu")  # type: ignore[attr-defined]
    ctx.get_resources = lambda: SimpleNamespace(expert_location_metadata=None)  # type: ignore[attr-defined]
    elastic = ModuleType("sglang.srt.elastic_ep.elastic_ep")  # no elastic EP here
    elastic.elastic_expanded_world_enabled = lambda: False  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.elastic_ep"):
        sys.modules.setdefault(name, ModuleType(name))
    sys.modules["sglang.srt.runtime_context"] = ctx
    sys.modules["sglang.srt.elastic_ep.elastic_ep"] = elastic
    spec = importlib.util.spec_from_file_location("sglang_expert_location_peer", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    mod._expertmesh_settings = settings  # type: ignore[attr-defined]
    return mod


def load_placement(
    mod: ModuleType,
    file: Path,
    *,
    ep_size: int,
    num_experts: int,
    num_layers: int,
    num_physical: int,
) -> Any:
    """SGLang's ``ExpertLocationMetadata`` for ``--init-expert-location file`` on a model with
    ``num_layers`` hidden layers and ``num_experts`` routed experts."""
    mod._expertmesh_settings["exec"] = SimpleNamespace(
        moe=SimpleNamespace(
            init_expert_location=str(file),
            ep_num_redundant_experts=num_physical - num_experts,
            ep_dispatch_algorithm="static",
            moe_a2a_backend="none",
            ep_join_mode=None,
            eplb_algorithm="auto",
        )
    )
    mod._expertmesh_settings["parallel"] = SimpleNamespace(
        ep_size=ep_size, elastic_ep_initial_size=None, nnodes=1, tp_size=ep_size,
        ep_join_rank_offset=0,
    )  # fmt: skip
    cfg = mod.ModelConfigForExpertLocation(num_layers=num_layers, num_logical_experts=num_experts)
    mod.ModelConfigForExpertLocation.from_model_config = staticmethod(lambda _model_config: cfg)
    return mod.compute_initial_expert_location_metadata(model_config=None, moe_ep_rank=0)
