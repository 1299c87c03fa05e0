"""Engine placement files: write a plan's placement in an engine's format, read one back.

| format | files | what the engine does with it |
|---|---|---|
| ``sglang`` | ``.json`` or ``.pt``: ``{"physical_to_logical_map": [N, P]}`` | ``--init-expert-location FILE`` (its loader passes every key on as an argument, so the file holds that one key) |
| ``trtllm`` | ``.yaml``: ``num_slots``, ``layer_updates_per_iter``, ``initial_global_assignments`` | ``moe_config.load_balancer: FILE`` (``moe_load_balancer:`` in older releases) |
| ``vllm`` | ``.safetensors`` or ``.json``: its three ``EplbModelState`` maps | no loader in vLLM: a patch or plugin sets them |

Readers treat the file as hostile: size limit, ``torch.load(weights_only=True)``, safetensors'
header read before any tensor, JSON and YAML depth and size bounded (``formats.read_yaml``).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from expertmesh.engines.placement import (
    EngineLayout,
    ExportError,
    phy2log_from_sglang,
    phy2log_from_trtllm,
    phy2log_from_vllm,
    sglang_map,
    trtllm_config,
    vllm_maps,
)
from expertmesh.formats import MAX_ARRAY_BYTES, read_yaml

__all__ = [
    "SUFFIXES",
    "export_bytes",
    "read_export",
    "read_json",
    "write_export",
]

SUFFIXES = {
    "sglang": (".json", ".pt"),
    "trtllm": (".yaml", ".yml"),
    "vllm": (".safetensors", ".json"),
}
MAX_FILE_BYTES = 1 << 30
VLLM_KEYS = ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count")


def _suffix(path: Path, fmt: str) -> str:
    if fmt not in SUFFIXES:
        raise ExportError(f"unknown engine format {fmt!r}; one of {', '.join(SUFFIXES)}")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES[fmt]:
        raise ExportError(
            f"a {fmt} placement file ends in {' or '.join(SUFFIXES[fmt])}, not {path.name!r}"
        )
    return suffix


def export_bytes(
    phy2log: np.ndarray,
    num_experts: int,
    fmt: str,
    layout: EngineLayout,
    *,
    suffix: str | None = None,
    layer_updates_per_iter: int = 0,
) -> bytes:
    """The file content of ``phy2log`` [L, R, S] in ``fmt`` (its first suffix unless given).
    ``ExportError`` when the engine cannot express the placement."""
    suffix = suffix or SUFFIXES.get(fmt, ("?",))[0]
    if fmt == "sglang":
        p2l = sglang_map(phy2log, num_experts, layout)
        if suffix == ".pt":
            return _torch_bytes({"physical_to_logical_map": p2l})
        return json.dumps({"physical_to_logical_map": p2l.tolist()}, separators=(",", ":")).encode()
    if fmt == "trtllm":
        config = trtllm_config(phy2log, num_experts, layout, layer_updates_per_iter)
        return yaml.safe_dump(
            config, default_flow_style=None, sort_keys=False, width=1 << 30
        ).encode()
    if fmt == "vllm":
        maps = vllm_maps(phy2log, num_experts)
        if suffix == ".safetensors":
            from safetensors.numpy import save

            return bytes(save(maps, metadata={"format": "expertmesh-vllm-eplb/1"}))
        return json.dumps({k: v.tolist() for k, v in maps.items()}, separators=(",", ":")).encode()
    raise ExportError(f"unknown engine format {fmt!r}; one of {', '.join(SUFFIXES)}")


def _torch_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, buf)
    return buf.getvalue()


def write_export(
    path: str | os.PathLike[str],
    phy2log: np.ndarray,
    num_experts: int,
    fmt: str,
    layout: EngineLayout,
    *,
    layer_updates_per_iter: int = 0,
) -> None:
    """Write ``phy2log`` [L, R, S] to ``path`` in ``fmt`` (atomically: a temporary file
    renamed into place)."""
    p = Path(path)
    data = export_bytes(
        phy2log, num_experts, fmt, layout, suffix=_suffix(p, fmt),
        layer_updates_per_iter=layer_updates_per_iter,
    )  # fmt: skip
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------
# reading back (hostile)
# ---------------------------------------------------------------------------


def _check_file(path: Path, kind: str, limit: int = MAX_FILE_BYTES) -> None:
    if not path.exists():
        raise FileNotFoundError(2, f"{kind} file not found", str(path))
    if path.is_dir():
        raise IsADirectoryError(21, f"{kind} path is a directory", str(path))
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path}: {size} bytes, more than a {kind} file may have ({limit})")


def read_json(path: Path, kind: str, limit: int = MAX_FILE_BYTES) -> Any:
    """A JSON file as hostile input: size-limited, UTF-8, nesting the parser can hold."""
    _check_file(path, kind, limit)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text, so not a {kind} JSON file") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at char {err.pos})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None


def read_torch(path: Path, kind: str) -> Any:
    """A ``.pt`` file loaded with ``weights_only=True`` (tensors and plain containers only;
    no code runs) on the CPU."""
    _check_file(path, kind)
    import zipfile

    import torch

    if zipfile.is_zipfile(path):  # torch's format: bound what its members unpack to first
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            unpacked = sum(i.file_size for i in infos)
        if len(infos) > 4096 or unpacked > MAX_ARRAY_BYTES:
            raise ValueError(f"{path}: {len(infos)} members unpacking to {unpacked} bytes, "
                             f"more than a {kind} file holds")  # fmt: skip
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # a hostile file raises many kinds (UnpicklingError, zip, EOF...)
        msg = " ".join(str(err).split())[:200] or type(err).__name__
        raise ValueError(f"{path}: not a tensor file torch can load safely ({msg})") from None


def int_array(value: Any, what: str, ndim: int) -> np.ndarray:
    """``value`` (nested lists or a tensor) as an int64 array of ``ndim`` dimensions."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        raise ValueError(f"{what} is not a rectangular array") from None
    if arr.dtype.kind not in "iu" or arr.ndim != ndim:
        raise ValueError(f"{what} must be a {ndim}-d integer array, got {arr.dtype} {arr.shape}")
    if arr.nbytes > MAX_ARRAY_BYTES:
        raise ValueError(f"{what} is {arr.nbytes} bytes, more than {MAX_ARRAY_BYTES}")
    return arr.astype(np.int64)


def _read_safetensors(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    _check_file(path, "safetensors")
    from safetensors import SafetensorError, safe_open

    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            names = set(f.keys())
            missing = [k for k in keys if k not in names]
            if missing:
                raise ValueError(f"{path}: no tensor {missing[0]!r} (has {sorted(names)[:8]})")
            for k in keys:
                sl = f.get_slice(k)
                dtype = str(sl.get_dtype())
                if dtype not in ("I8", "I16", "I32", "I64", "U8", "U16", "U32"):
                    raise ValueError(f"{path}: tensor {k!r} holds {dtype}, not integers")
                out[k] = np.asarray(f.get_tensor(k)).astype(np.int64)
    except SafetensorError as err:
        raise ValueError(f"{path}: not a valid safetensors file ({err})") from None
    return out


def read_export(
    path: str | os.PathLike[str],
    fmt: str,
    *,
    num_ranks: int,
    num_experts: int,
    layout: EngineLayout,
) -> np.ndarray:
    """``phy2log`` [L, R, S] of the plan layers in an engine placement file, checked against
    the engine's rules (``ValueError`` or ``FileNotFoundError`` with one line)."""
    p = Path(path)
    suffix = _suffix(p, fmt)
    readers: dict[str, Callable[[], np.ndarray]] = {
        "sglang": lambda: _sglang(p, suffix, num_ranks, num_experts, layout),
        "trtllm": lambda: _trtllm(p, num_ranks, num_experts, layout),
        "vllm": lambda: _vllm(p, suffix, num_ranks, num_experts),
    }
    try:
        return readers[fmt]()
    except ExportError:
        raise
    except ValueError as err:
        msg = str(err)
        raise ValueError(msg if msg.startswith(str(p)) else f"{p}: {msg}") from None


def _sglang(
    p: Path, suffix: str, num_ranks: int, num_experts: int, layout: EngineLayout
) -> np.ndarray:
    data = (
        read_torch(p, "SGLang placement") if suffix == ".pt" else read_json(p, "SGLang placement")
    )
    if not isinstance(data, dict) or set(data) != {"physical_to_logical_map"}:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"an SGLang placement holds exactly physical_to_logical_map, got {keys}")
    p2l = int_array(data["physical_to_logical_map"], "physical_to_logical_map", 2)
    return phy2log_from_sglang(p2l, num_ranks, num_experts, layout)


def _trtllm(p: Path, num_ranks: int, num_experts: int, layout: EngineLayout) -> np.ndarray:
    data = read_yaml(p, "TensorRT-LLM load balancer")
    if not isinstance(data, dict):
        raise ValueError("a TensorRT-LLM load balancer config is a mapping")
    extra = sorted(
        set(data) - {"num_slots", "layer_updates_per_iter", "initial_global_assignments"}
    )
    if extra:
        raise ValueError(f"unknown key {extra[0]!r} (the config is strict)")
    upd = data.get("layer_updates_per_iter", 0)
    if not isinstance(upd, int) or isinstance(upd, bool) or upd < 0:
        raise ValueError(f"layer_updates_per_iter must be an integer >= 0, got {upd!r}")
    return phy2log_from_trtllm(data, num_ranks, num_experts, layout)


def _vllm(p: Path, suffix: str, num_ranks: int, num_experts: int) -> np.ndarray:
    if suffix == ".safetensors":
        maps = _read_safetensors(p, VLLM_KEYS)
    else:
        data = read_json(p, "vLLM placement")
        if not isinstance(data, dict) or any(k not in data for k in VLLM_KEYS):
            raise ValueError(f"a vLLM placement holds {', '.join(VLLM_KEYS)}")
        maps = {k: int_array(data[k], k, nd) for k, nd in zip(VLLM_KEYS, (2, 3, 2), strict=True)}
    return phy2log_from_vllm(maps, num_ranks, num_experts)
