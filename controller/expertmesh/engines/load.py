"""Expert-load statistics the engines record, read as a trace (``load`` [T, L, R, E]).

| format | what it reads | steps ``T`` | source ranks ``R`` |
|---|---|---|---|
| ``trtllm`` | TensorRT-LLM's ``EXPERT_STATISTIC_PATH`` directory: ``meta_info.json`` (``num_experts``, ``num_experts_per_token``, optional ``ep_size``) and ``rank{r}.safetensors``, one ``[E]`` token count per key ``"{iter}_{layer}"`` | iterations | the files' ranks |
| ``sglang`` | SGLang's expert distribution recorder dump (``.pt`` or ``.json``): ``logical_count`` ``[L, E]`` or ``[buckets, L, E]``, summed over ranks | buckets (all-zero ones, an unfilled ring buffer, dropped) | ``--ranks``: each count split evenly (largest remainder) |
| ``routing`` | a per-token routing table: ``.npy`` ``[N, L, K]`` expert ids (-1: none), ``.npz`` with ``topk_ids`` ``[N, L, K]`` and optional ``step``/``rank`` ``[N]``, or Parquet with ``token``, ``layer``, ``experts`` (list) and optional ``step``, ``rank`` | ``step`` column, else ``--tokens-per-step`` blocks, else one | ``rank`` column, else ``--ranks`` contiguous blocks of each step's tokens |

Layers that no token reached (the dense layers of a model whose recorder spans every layer)
are dropped; the engine's index of each kept layer is in ``meta["engine"]["layers"]`` and
``plan export`` maps plan layers back through it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from expertmesh.engines.files import int_array, read_json, read_torch
from expertmesh.formats import MAX_ARRAY_BYTES, MAX_RANKS

__all__ = ["IMPORT_FORMATS", "ImportedTrace", "import_trace"]

IMPORT_FORMATS = ("trtllm", "sglang", "routing")
MAX_EXPERTS = 1 << 16
MAX_LAYERS = 4096
MAX_TOP_K = 1024  # experts per token in a routing table
MAX_FILES = 65_536
_RANK_FILE = re.compile(r"rank(\d+)\.safetensors")
_STAT_KEY = re.compile(r"(\d+)_(\d+)")


@dataclass(frozen=True, eq=False)
class ImportedTrace:
    """``load`` [T, L, R, E] int64 and the trace ``meta`` to store with it."""

    load: np.ndarray
    meta: dict[str, Any]


class _Bad(ValueError):
    pass


def import_trace(
    path: str | os.PathLike[str],
    fmt: str,
    *,
    num_ranks: int | None = None,
    tokens_per_step: int | None = None,
    num_experts: int | None = None,
) -> ImportedTrace:
    """Read ``path`` in engine format ``fmt`` as a trace. ``ValueError`` (one line, starting
    with the path) or ``FileNotFoundError`` on a bad file or missing option."""
    p = Path(path)
    if fmt not in IMPORT_FORMATS:
        raise ValueError(f"unknown load format {fmt!r}; one of {', '.join(IMPORT_FORMATS)}")
    if num_ranks is not None and not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"--ranks must be in [1, {MAX_RANKS}], got {num_ranks}")
    if tokens_per_step is not None and tokens_per_step < 1:
        raise ValueError(f"--tokens-per-step must be >= 1, got {tokens_per_step}")
    if num_experts is not None and not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"--experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if not p.exists():
        raise FileNotFoundError(2, f"{fmt} load file not found", str(p))
    try:
        if fmt == "trtllm":
            out = _trtllm(p, num_ranks)
        elif fmt == "sglang":
            out = _sglang(p, num_ranks)
        else:
            out = _routing(p, num_ranks, tokens_per_step, num_experts)
    except _Bad as err:
        raise ValueError(f"{p}: {err}") from None
    except ValueError as err:
        msg = " ".join(str(err).split())
        raise ValueError(msg if msg.startswith(str(p)) else f"{p}: {msg}") from None
    out.meta["engine"]["source"] = str(p)
    return out


def _check_size(*dims: int) -> None:
    nbytes = math.prod(dims) * 8
    if nbytes > MAX_ARRAY_BYTES:
        raise _Bad(f"the trace would be {' x '.join(map(str, dims))} = {nbytes} bytes, "
                   f"more than the limit of {MAX_ARRAY_BYTES}")  # fmt: skip


def _positive(meta: dict[str, Any], key: str, required: bool = True) -> int | None:
    v = meta.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise _Bad(f"meta_info.json: {key} must be a positive integer, got {v!r}")
    return v


def _keep_layers(load: np.ndarray, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """Drop layers no token reached ([T, L, R, E] -> [T, L', R, E])."""
    used = load.sum(axis=(0, 2, 3)) > 0  # [L]
    if not used.any():
        raise _Bad("no token reached any expert: the statistics are empty")
    return load[:, used], [i for i, u in zip(ids, used, strict=True) if u]


# ---------------------------------------------------------------------------
# TensorRT-LLM
# ---------------------------------------------------------------------------


def _trtllm(p: Path, num_ranks: int | None) -> ImportedTrace:
    if not p.is_dir():
        raise _Bad("TensorRT-LLM statistics are a directory (EXPERT_STATISTIC_PATH)")
    meta = read_json(p / "meta_info.json", "TensorRT-LLM meta_info", 1 << 20)
    if not isinstance(meta, dict):
        raise _Bad("meta_info.json must be a JSON object")
    num_experts = _positive(meta, "num_experts")
    top_k = _positive(meta, "num_experts_per_token")
    ep_size = _positive(meta, "ep_size", required=False)
    assert num_experts is not None and top_k is not None
    if num_experts > MAX_EXPERTS or top_k > num_experts:
        raise _Bad(f"meta_info.json: {num_experts} experts, top-{top_k}: out of range")
    files: dict[int, Path] = {}
    for n, child in enumerate(p.iterdir()):
        if n > MAX_FILES:
            raise _Bad(f"more than {MAX_FILES} files in the directory")
        m = _RANK_FILE.fullmatch(child.name)
        if m:
            files[int(m.group(1))] = child
    if not files:
        raise _Bad("no rank{r}.safetensors files")
    ranks = len(files)
    if sorted(files) != list(range(ranks)):
        raise _Bad(f"rank files must be rank0 .. rank{ranks - 1}, got ranks {sorted(files)[:8]}")
    for name, want in (("ep_size in meta_info.json", ep_size), ("--ranks", num_ranks)):
        if want is not None and want != ranks:
            raise _Bad(f"{name} says {want} ranks but there are {ranks} rank files")
    counts = {r: _trtllm_rank(files[r], num_experts) for r in range(ranks)}
    keys = sorted(set().union(*(c.keys() for c in counts.values())))
    iters = sorted({i for i, _ in keys})
    layers = sorted({layer for _, layer in keys})
    if len(layers) > MAX_LAYERS:
        raise _Bad(f"{len(layers)} layers, more than {MAX_LAYERS}")
    if len(keys) != len(iters) * len(layers):
        raise _Bad(f"the keys do not cover every iteration x layer ({len(keys)} keys for "
                   f"{len(iters)} iterations x {len(layers)} layers)")  # fmt: skip
    _check_size(len(iters), len(layers), ranks, num_experts)
    load = np.zeros((len(iters), len(layers), ranks, num_experts), np.int64)
    ti = {it: t for t, it in enumerate(iters)}
    li = {layer: j for j, layer in enumerate(layers)}
    for r, c in counts.items():
        for (it, layer), row in c.items():
            load[ti[it], li[layer], r] = row
    load, kept = _keep_layers(load, layers)
    return ImportedTrace(load, {
        "top_k": top_k,
        "engine": {"format": "trtllm", "layers": kept, "iterations": [iters[0], iters[-1]]},
    })  # fmt: skip


def _trtllm_rank(path: Path, num_experts: int) -> dict[tuple[int, int], np.ndarray]:
    from safetensors import SafetensorError, safe_open

    if path.stat().st_size > MAX_ARRAY_BYTES:
        raise _Bad(f"{path.name} is larger than {MAX_ARRAY_BYTES} bytes")
    out: dict[tuple[int, int], np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _STAT_KEY.fullmatch(key)
                if not m:
                    raise _Bad(f"{path.name}: key {key!r} is not '{{iter}}_{{layer}}'")
                sl = f.get_slice(key)
                dtype, shape = str(sl.get_dtype()), list(sl.get_shape())
                if dtype not in ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"):
                    raise _Bad(f"{path.name}: {key!r} holds {dtype}, not token counts")
                if shape != [num_experts]:
                    raise _Bad(f"{path.name}: {key!r} has shape {shape}, not [{num_experts}] "
                               "(num_experts in meta_info.json)")  # fmt: skip
                row = np.asarray(f.get_tensor(key))
                if row.dtype == np.uint64 and row.size and row.max() > np.iinfo(np.int64).max:
                    raise _Bad(f"{path.name}: {key!r} has counts beyond int64")
                row = row.astype(np.int64)
                if row.size and row.min() < 0:
                    raise _Bad(f"{path.name}: {key!r} has negative token counts")
                out[(int(m.group(1)), int(m.group(2)))] = row
    except SafetensorError as err:
        raise _Bad(f"{path.name} is not a valid safetensors file ({err})") from None
    return out


# ---------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------


def _sglang(p: Path, num_ranks: int | None) -> ImportedTrace:
    if num_ranks is None:
        raise _Bad("SGLang's logical_count is summed over ranks: give --ranks (or --topology)")
    if p.suffix == ".pt":
        data = read_torch(p, "SGLang expert distribution")
    elif p.suffix == ".json":
        data = read_json(p, "SGLang expert distribution")
    else:
        raise _Bad("an SGLang expert distribution dump is a .pt or .json file")
    if not isinstance(data, dict) or "logical_count" not in data:
        keys = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise _Bad(f"no 'logical_count' (got {keys}); was the recorder in 'stat' mode?")
    raw = data["logical_count"]
    two_d = (hasattr(raw, "dim") and raw.dim() == 2) or (isinstance(raw, list) and _depth(raw) == 2)
    if two_d:  # [L, E]: one bucket
        raw = [raw.tolist() if hasattr(raw, "tolist") else raw]
    counts = int_array(raw, "logical_count", 3)  # [B, L, E]
    buckets, num_layers, num_experts = counts.shape
    if 0 in counts.shape or num_layers > MAX_LAYERS or num_experts > MAX_EXPERTS:
        raise _Bad(f"logical_count has shape {counts.shape}")
    if counts.min() < 0:
        raise _Bad("logical_count has negative token counts")
    counts = counts[counts.sum(axis=(1, 2)) > 0]  # an unfilled ring buffer is all zeros
    if not len(counts):
        raise _Bad("logical_count holds no tokens")
    _check_size(len(counts), num_layers, num_ranks, num_experts)
    base, rem = np.divmod(counts, num_ranks)  # [T, L, E]
    extra = np.arange(num_ranks)[None, None, :, None] < rem[:, :, None, :]  # [T, L, R, E]
    load = base[:, :, None, :] + extra
    load, kept = _keep_layers(load, list(range(num_layers)))
    return ImportedTrace(load, {"engine": {
        "format": "sglang", "layers": kept, "buckets": int(buckets),
        "empty_buckets_dropped": int(buckets - len(counts)), "ranks_split": "even",
    }})  # fmt: skip


def _depth(x: Any) -> int:
    d = 0
    while isinstance(x, list) and x:
        d, x = d + 1, x[0]
    return d


# ---------------------------------------------------------------------------
# routing tables
# ---------------------------------------------------------------------------


def _routing(
    p: Path, num_ranks: int | None, tokens_per_step: int | None, num_experts: int | None
) -> ImportedTrace:
    step = rank = None
    layer_ids: list[int]
    if p.suffix == ".npy":
        topk = _read_npy(p)
    elif p.suffix == ".npz":
        from expertmesh.formats import _read_npz

        arrays = _read_npz(p, "routing table", ("topk_ids",), ("step", "rank"))
        topk, step, rank = arrays["topk_ids"], arrays.get("step"), arrays.get("rank")
    elif p.suffix == ".parquet":
        return _routing_parquet(p, num_ranks, tokens_per_step, num_experts)
    else:
        raise _Bad("a routing table is a .npy, .npz or .parquet file")
    if topk.dtype.kind not in "iu" or topk.ndim != 3 or 0 in topk.shape:
        raise _Bad(
            f"topk_ids must be [tokens, layers, top_k] integers, got {topk.dtype} {topk.shape}"
        )
    n, num_layers, top_k = topk.shape
    layer_ids = list(range(num_layers))
    token = np.repeat(np.arange(n, dtype=np.int64), num_layers)  # [N * L]
    layer = np.tile(np.arange(num_layers, dtype=np.int64), n)
    experts = topk.reshape(n * num_layers, top_k).astype(np.int64)
    per_token = {}
    for name, col in (("step", step), ("rank", rank)):
        if col is not None:
            if col.dtype.kind not in "iu" or col.shape != (n,):
                raise _Bad(f"{name!r} must be [{n}] integers, got {col.dtype} {col.shape}")
            per_token[name] = np.repeat(col.astype(np.int64), num_layers)
    return _count(
        token, layer, experts, layer_ids, step=per_token.get("step"), rank=per_token.get("rank"),
        num_ranks=num_ranks, tokens_per_step=tokens_per_step, num_experts=num_experts,
    )  # fmt: skip


def _read_npy(p: Path) -> np.ndarray:
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)  # the header only, checked
    except (ValueError, OSError, EOFError) as err:
        raise _Bad(f"not a readable .npy array ({' '.join(str(err).split())[:160]})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.hasobject:
        raise _Bad("not a plain numeric .npy array")
    if arr.nbytes > MAX_ARRAY_BYTES:
        raise _Bad(f"{arr.nbytes} bytes, more than the limit of {MAX_ARRAY_BYTES}")
    return np.array(arr)


def _routing_parquet(
    p: Path, num_ranks: int | None, tokens_per_step: int | None, num_experts: int | None
) -> ImportedTrace:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
        schema = pf.schema_arrow
        rows = pf.metadata.num_rows
    except (pa.ArrowException, OSError) as err:
        raise _Bad(f"not a readable Parquet file ({' '.join(str(err).split())[:160]})") from None
    for name in ("token", "layer", "experts"):
        if name not in schema.names:
            raise _Bad(f"no column {name!r} (a routing table has token, layer, experts)")
    for name in ("token", "layer", "step", "rank"):
        if name in schema.names and not pa.types.is_integer(schema.field(name).type):
            raise _Bad(f"column {name!r} must hold integers, got {schema.field(name).type}")
    etype = schema.field("experts").type
    if not (pa.types.is_list(etype) or pa.types.is_large_list(etype) or
            pa.types.is_fixed_size_list(etype)) or not pa.types.is_integer(etype.value_type):  # fmt: skip
        raise _Bad(f"column 'experts' must be a list of integers, got {etype}")
    # values per column from the footer, before anything is decoded: run-length encoding
    # packs millions of values in a few bytes, so the file size says nothing
    meta = pf.metadata
    values = sum(
        meta.row_group(g).column(c).num_values
        for g in range(meta.num_row_groups)
        for c in range(meta.num_columns)
    )
    if (
        rows * 64 > MAX_ARRAY_BYTES
        or values * 8 > MAX_ARRAY_BYTES
        or values > rows * (MAX_TOP_K + 8)
    ):
        raise _Bad(
            f"{rows} rows holding {values} values: more than a routing table this reader takes"
        )
    cols = [c for c in ("token", "layer", "experts", "step", "rank") if c in schema.names]
    try:
        table = pf.read(columns=cols)
    except (pa.ArrowException, OSError) as err:
        raise _Bad(f"corrupt Parquet data ({' '.join(str(err).split())[:160]})") from None
    ex = table.column("experts").combine_chunks()
    lengths = pc.list_value_length(ex).to_numpy(zero_copy_only=False)
    if table.num_rows == 0 or ex.null_count or len(set(lengths.tolist())) != 1:
        raise _Bad("column 'experts' must hold lists of one length (top_k), without nulls")
    top_k = int(lengths[0])
    if top_k < 1:
        raise _Bad("column 'experts' holds empty lists")
    flat = pc.list_flatten(ex).to_numpy(zero_copy_only=False)
    if flat.dtype.kind not in "iu":
        raise _Bad("column 'experts' has null expert ids")
    experts = flat.astype(np.int64).reshape(-1, top_k)

    def col(name: str) -> np.ndarray | None:
        if name not in table.column_names:
            return None
        c = table.column(name)
        if c.null_count:
            raise _Bad(f"column {name!r} has nulls")
        return np.asarray(c.to_numpy(), dtype=np.int64)

    layer_raw = col("layer")
    token = col("token")
    assert layer_raw is not None and token is not None
    if layer_raw.min() < 0:
        raise _Bad("column 'layer' has negative layer indices")
    layer_ids_arr, layer = np.unique(layer_raw, return_inverse=True)
    if len(layer_ids_arr) > MAX_LAYERS:
        raise _Bad(f"{len(layer_ids_arr)} layers, more than {MAX_LAYERS}")
    return _count(
        token, layer.astype(np.int64), experts, [int(x) for x in layer_ids_arr],
        step=col("step"), rank=col("rank"), num_ranks=num_ranks,
        tokens_per_step=tokens_per_step, num_experts=num_experts,
    )  # fmt: skip


def _count(
    token: np.ndarray,
    layer: np.ndarray,
    experts: np.ndarray,
    layer_ids: list[int],
    *,
    step: np.ndarray | None,
    rank: np.ndarray | None,
    num_ranks: int | None,
    tokens_per_step: int | None,
    num_experts: int | None,
) -> ImportedTrace:
    """Count rows (token, layer index, top-k experts [N, K]) into ``load`` [T, L, R, E]."""
    if token.size and token.min() < 0:
        raise _Bad("token indices must be >= 0")
    valid = experts >= 0
    top = int(experts.max()) if valid.any() else -1
    if top < 0:
        raise _Bad("no expert id >= 0: the table routes nothing")
    if experts[~valid].size and experts[~valid].min() < -1:
        raise _Bad("expert ids below -1 (-1 marks no expert)")
    e_count = num_experts if num_experts is not None else top + 1
    if top >= e_count:
        raise _Bad(f"expert id {top} is out of range for --experts {e_count}")
    if step is None:
        step = token // tokens_per_step if tokens_per_step else np.zeros_like(token)
    if step.size and step.min() < 0:
        raise _Bad("step indices must be >= 0")
    steps, step = np.unique(step, return_inverse=True)
    if rank is None:
        if num_ranks is None:
            raise _Bad(
                "no 'rank' column: give --ranks (tokens of a step split into contiguous blocks)"
            )
        span = tokens_per_step or int(token.max()) + 1
        rank = (token % span) * num_ranks // span
    else:
        if rank.size and rank.min() < 0:
            raise _Bad("rank indices must be >= 0")
        hi = int(rank.max()) + 1
        if num_ranks is not None and hi > num_ranks:
            raise _Bad(f"rank {hi - 1} is out of range for --ranks {num_ranks}")
        num_ranks = num_ranks or hi
    assert num_ranks is not None
    shape = (len(steps), len(layer_ids), num_ranks, e_count)
    _check_size(*shape)
    k = experts.shape[1]
    idx = np.ravel_multi_index(
        (np.repeat(step, k), np.repeat(layer, k), np.repeat(rank, k), experts.ravel()),
        shape, mode="clip",
    )  # fmt: skip
    load = np.bincount(idx[valid.ravel()], minlength=math.prod(shape)).reshape(shape)
    load, kept = _keep_layers(load.astype(np.int64), layer_ids)
    meta: dict[str, Any] = {"top_k": k, "engine": {"format": "routing", "layers": kept,
                                                    "tokens": len(np.unique(token))}}  # fmt: skip
    if k > e_count:
        meta.pop("top_k")
    return ImportedTrace(load, meta)
