"""Files: traces (.npz), topologies (YAML) and plans (.npz), read with validation.

The formats are the public contract of README.md ("Interchange formats"). Every
reader treats its file as hostile: ``np.load(allow_pickle=False)``, array headers
checked (dtype, shape, size against a limit, truncation) before anything is
read, YAML through ``yaml.safe_load``. A bad file raises ``FileNotFoundError``
or ``ValueError`` with one line that starts with the file's path and names the
problem; the CLI prints it and exits 2.

This is the only module that touches these files; the planner stays pure.
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from expertmesh.planner.plan import check_trace
from expertmesh.planner.runner import MIGRATION_COLUMNS
from expertmesh.planner.topology import Topology

__all__ = [
    "MAX_ARRAY_BYTES",
    "MAX_RANKS",
    "PlanFile",
    "Trace",
    "read_plan",
    "read_topology",
    "read_trace",
    "read_yaml",
    "validate_plan",
    "write_plan",
    "write_topology",
    "write_trace",
]

# One array in an .npz; more is refused before reading (EXPERTMESH_MAX_ARRAY_BYTES overrides).
MAX_ARRAY_BYTES = int(os.environ.get("EXPERTMESH_MAX_ARRAY_BYTES", str(4 << 30)))
VERIFY_ABOVE_BYTES = 64 << 20  # larger members are measured before numpy allocates them
MAX_META_CHARS = 16 << 20
MAX_YAML_BYTES = 16 << 20
MAX_YAML_NODES = 1 << 20  # nodes of a YAML document with its aliases expanded
MAX_YAML_DEPTH = 64  # nested mappings and sequences
MAX_MEMBERS = 32
MAX_RANKS = 1 << 20
ROUTE_COLUMNS = ("step", "layer", "src_rank", "expert", "dst_rank", "tokens")


@dataclass(frozen=True, eq=False)
class Trace:
    """A trace file: ``load`` [T, L, R, E] int64 and its ``meta`` (a dict, maybe empty)."""

    load: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class PlanFile:
    """A plan file (README "Plan").

    - ``phy2log``: [T, L, R, S] int32, -1 empty.
    - ``route``: [N, 6] int64 ``(step, layer, src_rank, expert, dst_rank, tokens)``.
    - ``solve_seconds``: [T, L] float64.
    - ``master``: [T, L, E] int64 flat slot ``r * S + s`` of each master, or ``None``.
    - ``migration``: [M, 9] int64 rows of :data:`~expertmesh.planner.runner.MIGRATION_COLUMNS`.
    - ``migration_seconds``: [T, L] float64 (modeled).
    - ``meta``: dict (policy, settings, model, topology), maybe empty.
    """

    phy2log: np.ndarray
    route: np.ndarray
    solve_seconds: np.ndarray
    master: np.ndarray | None = None
    migration: np.ndarray = field(
        default_factory=lambda: np.zeros((0, len(MIGRATION_COLUMNS)), np.int64)
    )
    migration_seconds: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(T, L, R, S)``."""
        t, layers, r, s = self.phy2log.shape
        return int(t), int(layers), int(r), int(s)

    @property
    def policy(self) -> str:
        return str(self.meta.get("policy", "?"))

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays as :meth:`~expertmesh.planner.runner.TracePlan.to_arrays` names them."""
        out = {"phy2log": self.phy2log, "route": self.route, "solve_seconds": self.solve_seconds}
        out["migration"] = self.migration
        if self.master is not None:
            out["master"] = self.master
        if self.migration_seconds is not None:
            out["migration_seconds"] = self.migration_seconds
        return out


# ---------------------------------------------------------------------------
# npz plumbing
# ---------------------------------------------------------------------------


class _Bad(Exception):
    """A problem with a file's content; the caller adds the path."""


def _check_exists(path: Path, kind: str) -> None:
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, f"{kind} file not found", str(path))
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"{kind} path is a directory", str(path))


def _read_npz(
    path: Path, kind: str, required: tuple[str, ...], optional: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """Arrays of an .npz after checking member names, dtypes, sizes and truncation."""
    _check_exists(path, kind)
    try:
        if not zipfile.is_zipfile(path):
            raise _Bad(f"not a {kind} .npz file (not a zip archive, or truncated)")
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            if len(infos) > MAX_MEMBERS:
                raise _Bad(f"{len(infos)} members, more than a {kind} file has")
            members: dict[str, zipfile.ZipInfo] = {}
            for info in infos:
                if not info.filename.endswith(".npy"):
                    raise _Bad(f"member {info.filename!r} is not an .npy array")
                members[info.filename[:-4]] = info
            missing = [k for k in required if k not in members]
            if missing:
                raise _Bad(
                    f"missing array {missing[0]!r} (a {kind} file has {', '.join(required)})"
                )
            extra = sorted(set(members) - set(required) - set(optional))
            if extra:
                allowed = ", ".join(required + optional)
                raise _Bad(f"unexpected array {extra[0]!r} (a {kind} file has {allowed})")
            for key, info in members.items():
                _check_member(zf, info, key)
        with np.load(path, allow_pickle=False) as npz:
            return {key: np.asarray(npz[key]) for key in members}
    except _Bad as err:
        raise ValueError(f"{path}: {err}") from None
    except MemoryError:
        raise ValueError(f"{path}: a {kind} array does not fit in memory") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, KeyError) as err:
        msg = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"{path}: corrupt or truncated {kind} file ({msg})") from None


def _check_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str) -> None:
    with zf.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise _Bad(f"array {key!r} uses .npy version {version}, not 1.0 or 2.0")
        except ValueError as err:
            raise _Bad(f"array {key!r} has a bad .npy header ({err})") from None
        header = f.tell()
    if dtype.hasobject:
        raise _Bad(f"array {key!r} holds Python objects (dtype {dtype}); they are never loaded")
    nbytes = math.prod(shape) * dtype.itemsize
    limit = MAX_META_CHARS * 4 if key == "meta" else MAX_ARRAY_BYTES
    if nbytes > limit:
        raise _Bad(
            f"array {key!r} of shape {tuple(shape)} needs {nbytes} bytes, more than the "
            f"limit of {limit}"
        )
    if info.file_size < header + nbytes:
        raise _Bad(f"array {key!r} is truncated ({info.file_size - header} of {nbytes} bytes)")
    if nbytes > VERIFY_ABOVE_BYTES:
        # numpy allocates the declared size before reading; the zip header's sizes may lie,
        # so count what the member really holds (streamed, nothing kept) before that
        real = 0
        with zf.open(info) as f:
            while chunk := f.read(1 << 20):
                real += len(chunk)
        if real < header + nbytes:
            raise _Bad(f"array {key!r} is truncated ({real - header} of {nbytes} bytes)")


def _write_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` as an .npz (deflate level 1: most of the size win at a fraction of
    ``np.savez_compressed``'s time), atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with (
            open(tmp, "xb") as f,  # the umask's permissions (mkstemp would give 0600)
            zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf,
        ):
            for key, arr in arrays.items():
                with zf.open(f"{key}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asanyarray(arr), allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _meta_array(meta: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    if not meta:
        return {}
    return {"meta": np.array(json.dumps(dict(meta), sort_keys=True))}


def _parse_meta(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    if "meta" not in arrays:
        return {}
    m = arrays["meta"]
    if m.shape != () or m.dtype.kind not in "US":
        raise _Bad(f"'meta' must be one JSON string, got dtype {m.dtype} shape {m.shape}")
    text = m.item()
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if len(text) > MAX_META_CHARS:
        raise _Bad(f"'meta' is {len(text)} characters, more than {MAX_META_CHARS}")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        raise _Bad(f"'meta' is not valid JSON ({err.msg} at char {err.pos})") from None
    except RecursionError:
        raise _Bad("'meta' JSON is nested too deeply") from None
    if not isinstance(meta, dict):
        raise _Bad(f"'meta' must be a JSON object, got {type(meta).__name__}")
    return meta


def _int_array(a: np.ndarray, key: str, ndim: int, cols: int | None = None) -> np.ndarray:
    if a.dtype.kind not in "iu":
        raise _Bad(f"{key!r} must hold integers, got dtype {a.dtype}")
    if a.ndim != ndim or (cols is not None and a.shape[1] != cols):
        want = f"[N, {cols}]" if cols is not None else f"{ndim} dimensions"
        raise _Bad(f"{key!r} must be {want}, got shape {a.shape}")
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        raise _Bad(f"{key!r} has values beyond int64")
    return a.astype(np.int64, copy=False)


def _float_array(a: np.ndarray, key: str, shape: tuple[int, ...]) -> np.ndarray:
    if a.dtype.kind != "f":
        raise _Bad(f"{key!r} must hold floats, got dtype {a.dtype}")
    if a.shape != shape:
        raise _Bad(f"{key!r} must have shape {shape}, got {a.shape}")
    if a.size and not (np.isfinite(a).all() and a.min() >= 0):
        raise _Bad(f"{key!r} has negative or non-finite values")
    return a.astype(np.float64, copy=False)


# ---------------------------------------------------------------------------
# traces
# ---------------------------------------------------------------------------


# Most tokens one trace cell (rank -> expert, one microbatch, one layer) may hold: the bound
# REST and gRPC load reports have. And most tokens a whole trace may hold: every plan of it
# then routes fewer than 2**53 tokens in all, which `plan inspect` (validate_plan) needs to
# count them exactly; half of that leaves room for the rounding of a float64 sum.
MAX_TRACE_CELL = 2**40
MAX_TRACE_TOKENS = 2**52


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace file (``load`` [T, L, R, E] non-negative integers, at most
    :data:`MAX_TRACE_CELL` per cell and :data:`MAX_TRACE_TOKENS` in all, ``meta``)."""
    p = Path(path)
    arrays = _read_npz(p, "trace", ("load",), ("meta",))
    try:
        load = arrays["load"]
        if load.dtype.kind not in "iu":
            raise _Bad(f"'load' must hold integer token counts, got dtype {load.dtype}")
        if load.dtype == np.uint64 and load.size and load.max() > np.iinfo(np.int64).max:
            raise _Bad("'load' has counts beyond int64")
        if load.ndim != 4:
            raise _Bad(f"'load' must be [T, L, R, E], got shape {load.shape}")
        if 0 in load.shape:
            raise _Bad(f"'load' is empty, shape {load.shape}")
        if load.min() < 0:
            t, layer, r, e = np.unravel_index(int(np.argmin(load)), load.shape)
            raise _Bad(
                f"'load' has negative token counts (first: step {t}, layer {layer}, "
                f"rank {r}, expert {e})"
            )
        if load.max() > MAX_TRACE_CELL:
            t, layer, r, e = np.unravel_index(int(np.argmax(load)), load.shape)
            raise _Bad(
                f"'load' has a count above 2**40 tokens (step {t}, layer {layer}, rank {r}, "
                f"expert {e}: {int(load[t, layer, r, e])})"
            )
        total = float(load.sum(dtype=np.float64))
        if total > MAX_TRACE_TOKENS:
            raise _Bad(f"'load' holds {total:.3g} tokens in all, more than 2**52")
        meta = _parse_meta(arrays)
        _check_trace_meta(meta, load.shape)
    except _Bad as err:
        raise ValueError(f"{p}: {err}") from None
    return Trace(load=check_trace(load), meta=meta)


def _check_trace_meta(meta: dict[str, Any], shape: tuple[int, ...]) -> None:
    for key, dim in zip(
        ("num_steps", "num_layers", "num_ranks", "num_experts"), shape, strict=True
    ):
        if key in meta and meta[key] != dim:
            raise _Bad(f"meta says {key} = {meta[key]!r} but 'load' has {dim} (shape {shape})")
    for key in ("top_k", "hidden", "ffn_hidden", "tokens_per_rank"):
        v = meta.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise _Bad(f"meta {key} must be a positive integer, got {v!r}")
    if "top_k" in meta and meta["top_k"] > shape[3]:
        raise _Bad(f"meta top_k = {meta['top_k']} exceeds the {shape[3]} experts")
    rpd = meta.get("ranks_per_dc")
    if rpd is not None:
        ok = isinstance(rpd, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in rpd
        )
        if not ok or sum(rpd) != shape[2]:
            raise _Bad(f"meta ranks_per_dc {rpd!r} does not add up to the {shape[2]} ranks")


def write_trace(
    path: str | os.PathLike[str], load: np.ndarray, meta: Mapping[str, Any] | None = None
) -> None:
    """Write ``load`` [T, L, R, E] (validated, stored int64) and ``meta`` (JSON) to ``path``."""
    load = check_trace(load)
    _write_npz(Path(path), {"load": load, **_meta_array(meta)})


# ---------------------------------------------------------------------------
# topologies
# ---------------------------------------------------------------------------


def read_yaml(path: str | os.PathLike[str], kind: str = "YAML") -> Any:
    """Read a YAML file as hostile: at most ``MAX_YAML_BYTES``, UTF-8, ``yaml.safe_load``'s
    types only, at most ``MAX_YAML_NODES`` nodes once aliases are expanded (a "billion
    laughs" file is refused before anything walks it) and nesting that the parser can hold.
    ``ValueError`` (or ``FileNotFoundError``) with one line that starts with the path."""
    p = Path(path)
    _check_exists(p, kind)
    size = p.stat().st_size
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{p}: {size} bytes, more than a {kind} file may have")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not a UTF-8 text file, so not a {kind} file") from None
    loader = yaml.SafeLoader(text)
    try:
        _check_depth(text)
        node = loader.get_single_node()
        if node is None:
            return None
        nodes = _expanded_nodes(node)
        if nodes > MAX_YAML_NODES:
            raise ValueError(
                f"{nodes} YAML nodes once aliases are expanded, more than the limit of "
                f"{MAX_YAML_NODES} (an alias bomb?)"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ValueError(f"{p}: not valid YAML: {problem}{where}") from None
    except RecursionError:
        raise ValueError(f"{p}: YAML nested too deeply") from None
    except ValueError as err:
        raise ValueError(f"{p}: {err}") from None
    finally:
        loader.dispose()


def _check_depth(text: str) -> None:
    # The parser is a state machine, the composer recurses: measure nesting on the events
    # first so that no document reaches Python's recursion limit.
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise ValueError(f"YAML nested deeper than {MAX_YAML_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _expanded_nodes(root: yaml.Node) -> int:
    """Nodes of the document with every alias expanded (aliases share node objects), counted
    without expanding them: per distinct node, 1 + its children's counts (memoized, iterative;
    capped so the count itself stays small)."""
    cap = MAX_YAML_NODES + 1
    memo: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in memo:
            continue
        if isinstance(node, yaml.MappingNode):
            kids = [x for pair in node.value for x in pair]
        elif isinstance(node, yaml.SequenceNode):
            kids = list(node.value)
        else:
            kids = []
        if done:
            memo[id(node)] = min(cap, 1 + sum(memo[id(k)] for k in kids))
        else:
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in memo)
    return memo[id(root)]


def read_topology(path: str | os.PathLike[str]) -> Topology:
    """Read a topology YAML file (:func:`read_yaml`) into a validated :class:`Topology`."""
    p = Path(path)
    data = read_yaml(p, "topology")
    try:
        topo = Topology.from_dict(data)
    except ValueError as err:
        raise ValueError(f"{p}: {' '.join(str(err).split())}") from None
    if topo.num_ranks > MAX_RANKS:
        raise ValueError(f"{p}: {topo.num_ranks} ranks, more than the limit of {MAX_RANKS}")
    return topo


def write_topology(path: str | os.PathLike[str], topology: Topology) -> None:
    """Write ``topology`` as the YAML of the brief."""
    Path(path).write_text(yaml.safe_dump(topology.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------
# plans
# ---------------------------------------------------------------------------

_PLAN_REQUIRED = ("phy2log", "route", "solve_seconds")
_PLAN_OPTIONAL = ("master", "migration", "migration_seconds", "meta")


def write_plan(
    path: str | os.PathLike[str],
    arrays: Mapping[str, np.ndarray],
    meta: Mapping[str, Any] | None = None,
) -> None:
    """Write plan ``arrays`` (:meth:`TracePlan.to_arrays`) and ``meta`` (JSON) to ``path``."""
    missing = [k for k in _PLAN_REQUIRED if k not in arrays]
    if missing:
        raise ValueError(f"plan arrays lack {', '.join(missing)}")
    _write_npz(Path(path), {**arrays, **_meta_array(meta)})


def read_plan(path: str | os.PathLike[str]) -> PlanFile:
    """Read a plan file and check it is self-consistent (shapes, dtypes, index ranges).

    Whether it routes a given trace is :func:`validate_plan`'s job.
    """
    p = Path(path)
    a = _read_npz(p, "plan", _PLAN_REQUIRED, _PLAN_OPTIONAL)
    try:
        return _plan_from_arrays(a)
    except _Bad as err:
        raise ValueError(f"{p}: {err}") from None


def _plan_from_arrays(a: dict[str, np.ndarray]) -> PlanFile:
    phy2log = _int_array(a["phy2log"], "phy2log", 4)
    if 0 in phy2log.shape:
        raise _Bad(f"'phy2log' is empty, shape {phy2log.shape}")
    num_steps, num_layers, num_ranks, num_slots = phy2log.shape
    if phy2log.min() < -1:
        raise _Bad("'phy2log' has expert ids below -1")
    route = _int_array(a["route"], "route", 2, len(ROUTE_COLUMNS))
    solve = _float_array(a["solve_seconds"], "solve_seconds", (num_steps, num_layers))
    meta = _parse_meta(a)
    if route.size:
        step, layer, src, exp, dst, tok = route.T
        for name, col, hi in (("step", step, num_steps), ("layer", layer, num_layers),
                              ("src_rank", src, num_ranks), ("dst_rank", dst, num_ranks)):  # fmt: skip
            if col.min() < 0 or col.max() >= hi:
                raise _Bad(f"'route' has a {name} outside [0, {hi})")
        if exp.min() < 0:
            raise _Bad("'route' has a negative expert id")
        if tok.min() < 0:
            raise _Bad("'route' has negative token counts")
    master = None
    if "master" in a:
        master = _int_array(a["master"], "master", 3)
        if master.shape[:2] != (num_steps, num_layers):
            raise _Bad(f"'master' must be [{num_steps}, {num_layers}, E], got {master.shape}")
        num_experts = master.shape[2]
        if master.size and (master.min() < 0 or master.max() >= num_ranks * num_slots):
            raise _Bad("'master' has a slot index outside [0, R * S)")
        flat = phy2log.reshape(num_steps, num_layers, -1)
        held = np.take_along_axis(flat, master, axis=2)  # [T, L, E]
        if not (held == np.arange(num_experts)).all():
            raise _Bad("'master' points at a slot that does not hold its expert")
        if phy2log.max() >= num_experts:
            raise _Bad(f"'phy2log' has expert ids >= {num_experts}, the experts of 'master'")
    migration = np.zeros((0, len(MIGRATION_COLUMNS)), np.int64)
    if "migration" in a:
        migration = _int_array(a["migration"], "migration", 2, len(MIGRATION_COLUMNS))
        if migration.size:
            m = {c: migration[:, i] for i, c in enumerate(MIGRATION_COLUMNS)}
            for name, hi in (("step", num_steps), ("layer", num_layers),
                             ("src_rank", num_ranks), ("dst_rank", num_ranks)):  # fmt: skip
                if m[name].min() < 0 or m[name].max() >= hi:
                    raise _Bad(f"'migration' has a {name} outside [0, {hi})")
            if m["nbytes"].min() < 0 or m["expert"].min() < 0 or m["round"].min() < 0:
                raise _Bad("'migration' has negative experts, bytes or rounds")
    mig_s = None
    if "migration_seconds" in a:
        mig_s = _float_array(a["migration_seconds"], "migration_seconds", (num_steps, num_layers))
    return PlanFile(
        phy2log=phy2log.astype(np.int32),
        route=route,
        solve_seconds=solve,
        master=master,
        migration=migration,
        migration_seconds=mig_s,
        meta=meta,
    )


def validate_plan(plan: PlanFile, load: np.ndarray, plan_name: str, trace_name: str) -> None:
    """``ValueError`` unless ``plan`` routes trace ``load`` [T, L, R, E]: same steps, layers
    and ranks; every ``load[t, l, r, e]`` routed in full, only to ranks holding ``e``."""
    num_steps, num_layers, num_ranks, _ = plan.shape
    num_experts = load.shape[3]
    if load.shape[:3] != (num_steps, num_layers, num_ranks):
        raise ValueError(
            f"{plan_name} is a plan for {num_steps} steps x {num_layers} layers x {num_ranks} "
            f"ranks, {trace_name} has {load.shape[0]} x {load.shape[1]} x {load.shape[2]}"
        )
    if plan.phy2log.max() >= num_experts:
        raise ValueError(f"{plan_name} places expert ids beyond the {num_experts} of {trace_name}")
    if plan.master is not None and plan.master.shape[2] != num_experts:
        raise ValueError(
            f"{plan_name} has masters for {plan.master.shape[2]} experts, "
            f"{trace_name} has {num_experts}"
        )
    step, layer, src, exp, dst, tok = plan.route.T
    if exp.size and exp.max() >= num_experts:
        raise ValueError(f"{plan_name} routes to expert ids beyond the {num_experts} experts")
    holds = np.zeros(load.shape, dtype=bool)  # [T, L, R, E]
    t, lay, r, s = np.nonzero(plan.phy2log >= 0)
    holds[t, lay, r, plan.phy2log[t, lay, r, s]] = True
    bad = ~holds[step, layer, dst, exp]
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"{plan_name} sends tokens of expert {exp[i]} to rank {dst[i]}, which does not "
            f"hold it (step {step[i]}, layer {layer[i]})"
        )
    cell = np.ravel_multi_index((step, layer, src, exp), load.shape)  # [N]
    if float(tok.sum(dtype=np.float64)) >= 2.0**53:  # the float bincount below is exact
        raise ValueError(f"{plan_name} routes more than 2**53 tokens in all")
    routed = np.bincount(cell, weights=tok, minlength=load.size)  # exact below 2**53
    diff = routed.reshape(load.shape) != load
    if diff.any():
        t0, l0, r0, e0 = (int(x) for x in np.unravel_index(int(np.argmax(diff)), load.shape))
        raise ValueError(
            f"{plan_name} does not route {trace_name}: step {t0}, layer {l0}, rank {r0}, "
            f"expert {e0} sends {load[t0, l0, r0, e0]} tokens in the trace, "
            f"{int(routed.reshape(load.shape)[t0, l0, r0, e0])} in the plan"
        )
