"""The expert checkpoint on disk: every master's weights and Adam moments, written
atomically, loaded without unpickling, corrupt files refused.

Layout of a checkpoint directory (``RuntimeSettings.checkpoint_dir``)::

    ckpt-000007/                one checkpoint (the 7th this directory has seen)
        manifest.json           format, run, step, plan version, experts, sha256 of the data,
                                and optionally ``extra`` (JSON) naming ``extra_arrays``
        experts.npz             arrays "<layer>.<expert>.<w|m|v><i>" and "x.<name>" (numpy,
                                no pickle)

The extra part is what a new driver needs to resume the run (dense weights and Adam
state, the committed plan, counters, settings: :mod:`expertmesh.runtime.resume`); expert
recovery needs only the experts.

A checkpoint is written into a hidden temporary directory (files fsynced) and renamed into
place, so a reader sees a whole checkpoint or none; only the newest ``keep`` are kept.
Loading checks the manifest, the data file's size and sha256, then every array's presence,
dtype and shape; anything else is refused with :class:`CheckpointError`, and
:meth:`CheckpointDir.load_latest` falls back to the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMAT", "Checkpoint", "CheckpointDir", "CheckpointError", "ExpertState"]

log = logging.getLogger(__name__)
FORMAT = "expertmesh-expert-checkpoint/1"
_NAME = re.compile(r"^ckpt-(\d{6,})$")
_DATA = "experts.npz"
_MANIFEST = "manifest.json"
_MAX_MANIFEST_BYTES = 16 << 20
# (weights, adam m, adam v): three lists of arrays of one expert, the same shapes each
ExpertState = tuple[Sequence[Any], Sequence[Any], Sequence[Any]]
_PARTS = ("w", "m", "v")
_EXTRA_NAME = re.compile(r"^[A-Za-z0-9_.]{1,200}$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, truncated, corrupt, another format)."""


@dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint. ``experts``: ``(layer, expert) -> (weights, m, v)``, each a
    list of float arrays (an expert's W1 [d, f], W3 [d, f], W2 [f, d] and their moments)."""

    path: Path
    seq: int
    run: str
    step: int  # the last step trained before it was taken (-1: before training)
    plan_version: int
    experts: dict[tuple[int, int], tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]]
    nbytes: int
    extra: dict[str, Any] | None = None  # the manifest's "extra" (JSON), when written
    arrays: dict[str, np.ndarray] | None = None  # the extra arrays by name


class CheckpointDir:
    """The checkpoints of a run in directory ``root`` (created when missing); the newest
    ``keep`` >= 1 survive each write."""

    def __init__(self, root: str | os.PathLike[str], keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    def _found(self) -> list[tuple[int, Path]]:
        """``(sequence number, directory)`` of every checkpoint, newest first."""
        found = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)

    def paths(self) -> list[Path]:
        """Checkpoint directories, newest first (temporary ones excluded)."""
        return [p for _, p in self._found()]

    def write(
        self,
        experts: Mapping[tuple[int, int], ExpertState],
        *,
        step: int,
        plan_version: int,
        run: str,
        extra: dict[str, Any] | None = None,
        arrays: Mapping[str, Any] | None = None,
    ) -> Checkpoint:
        """Write ``experts`` (``(layer, expert) -> (weights, m, v)``, arrays or CPU tensors)
        as the newest checkpoint, then drop all but the newest ``keep``. ``extra`` (JSON)
        and ``arrays`` (name -> array, numeric) ride along. Returns it (its ``experts``
        empty: what was written is the caller's)."""
        found = self._found()
        seq = found[0][0] + 1 if found else 1
        arrays_out: dict[str, Any] = {}
        keys = sorted(experts)
        for layer, e in keys:
            state = experts[(layer, e)]
            if len(state) != 3:
                raise ValueError(f"expert {layer}/{e}: need (weights, m, v)")
            for part, ts in zip(_PARTS, state, strict=True):
                for i, t in enumerate(ts):
                    arrays_out[f"{layer}.{e}.{part}{i}"] = _array(t)
        for name, t in (arrays or {}).items():
            if not _EXTRA_NAME.match(name):
                raise ValueError(f"bad extra array name {name!r}")
            arrays_out[f"x.{name}"] = _array(t)
        tmp = self.root / f".tmp-ckpt-{seq:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            data = tmp / _DATA
            with open(data, "wb") as f:
                np.savez(f, allow_pickle=False, **arrays_out)
                f.flush()
                os.fsync(f.fileno())
            nbytes = data.stat().st_size
            manifest = {
                "format": FORMAT,
                "run": run,
                "step": int(step),
                "plan_version": int(plan_version),
                "written_unix": time.time(),
                "experts": [[int(a), int(b)] for a, b in keys],
                "arrays_per_part": len(experts[keys[0]][0]) if keys else 0,
                "data": {"file": _DATA, "bytes": nbytes, "sha256": _sha256(data)},
            }
            if extra is not None or arrays:
                manifest["extra"] = extra if extra is not None else {}
                manifest["extra_arrays"] = sorted(arrays or {})
            with open(tmp / _MANIFEST, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            final = self.root / f"ckpt-{seq:06d}"
            os.rename(tmp, final)  # atomic: a reader sees the whole checkpoint or none
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(self.root)
        for old in self.paths()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        return Checkpoint(final, seq, run, int(step), int(plan_version), {}, nbytes)

    def load(self, path: str | os.PathLike[str]) -> Checkpoint:
        """The checkpoint in ``path``; :class:`CheckpointError` when it cannot be trusted."""
        path = Path(path)
        m = _NAME.match(path.name)
        if m is None:
            raise CheckpointError(f"{path}: not a checkpoint directory (ckpt-NNNNNN)")
        man = _read_manifest(path)
        data = path / str(man["data"]["file"])
        if data.name != _DATA:
            raise CheckpointError(f"{path}: unexpected data file {data.name!r}")
        try:
            size = data.stat().st_size
        except OSError as err:
            raise CheckpointError(f"{path}: {data.name} is missing ({err.strerror})") from None
        want = int(man["data"]["bytes"])
        if size != want:
            raise CheckpointError(
                f"{path}: {data.name} has {size} bytes, the manifest {want} (truncated?)"
            )
        if _sha256(data) != man["data"]["sha256"]:
            raise CheckpointError(f"{path}: {data.name} does not match its sha256 (corrupt)")
        n = int(man["arrays_per_part"])
        experts = {}
        try:
            with np.load(data, allow_pickle=False) as z:
                names = set(z.files)
                for layer, e in man["experts"]:
                    parts = []
                    for part in _PARTS:
                        ts = []
                        for i in range(n):
                            key = f"{layer}.{e}.{part}{i}"
                            if key not in names:
                                raise CheckpointError(f"{path}: array {key} is missing")
                            ts.append(z[key])
                        parts.append(ts)
                    w, mo, v = parts
                    if any(a.dtype.kind != "f" for a in w + mo + v) or [a.shape for a in w] != [
                        a.shape for a in mo
                    ] or [a.shape for a in w] != [a.shape for a in v]:  # fmt: skip
                        raise CheckpointError(f"{path}: expert {layer}/{e} has bad arrays")
                    experts[(int(layer), int(e))] = (w, mo, v)
                extra_arrays = {}
                for name in man.get("extra_arrays", []):
                    if f"x.{name}" not in names:
                        raise CheckpointError(f"{path}: array x.{name} is missing")
                    a = z[f"x.{name}"]
                    if a.dtype.kind not in "fiub":
                        raise CheckpointError(f"{path}: array x.{name} is not numeric")
                    extra_arrays[name] = a
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, EOFError) as err:  # zip and npy readers
            raise CheckpointError(f"{path}: {data.name} cannot be read: {err}") from None
        return Checkpoint(path, int(m.group(1)), str(man["run"]), int(man["step"]),
                          int(man["plan_version"]), experts, size, man.get("extra"),
                          extra_arrays if "extra" in man else None)  # fmt: skip

    def load_latest(self, run: str | None = None) -> Checkpoint:
        """The newest checkpoint that loads (of run ``run`` when given); each refused one
        is logged and the previous one tried. :class:`CheckpointError` when none loads."""
        refused = []
        for path in self.paths():
            try:
                ck = self.load(path)
            except CheckpointError as err:
                log.error("checkpoint refused, trying the previous one: %s", err)
                refused.append(str(err))
                continue
            if run is None or ck.run == run:
                return ck
        why = f" (refused: {'; '.join(refused)})" if refused else ""
        raise CheckpointError(f"no usable checkpoint in {self.root}{why}")


def _read_manifest(path: Path) -> dict[str, Any]:
    f = path / _MANIFEST
    try:
        if f.stat().st_size > _MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{path}: {_MANIFEST} is too large")
        man = json.loads(f.read_text(encoding="utf-8"))
    except OSError as err:
        raise CheckpointError(f"{path}: {_MANIFEST} is missing ({err.strerror})") from None
    except (ValueError, RecursionError) as err:  # JSON or UTF-8
        raise CheckpointError(f"{path}: {_MANIFEST} is not valid JSON ({err})") from None
    ok = (
        isinstance(man, dict)
        and man.get("format") == FORMAT
        and isinstance(man.get("run"), str)
        and all(isinstance(man.get(k), int) for k in ("step", "plan_version", "arrays_per_part"))
        and isinstance(man.get("experts"), list)
        and all(isinstance(x, list) and len(x) == 2 and all(isinstance(i, int) for i in x)
                for x in man["experts"])
        and isinstance(man.get("data"), dict)
        and isinstance(man["data"].get("file"), str)
        and isinstance(man["data"].get("bytes"), int)
        and isinstance(man["data"].get("sha256"), str)
        and ("extra" not in man or isinstance(man["extra"], dict))
        and isinstance(man.get("extra_arrays", []), list)
        and all(isinstance(x, str) and _EXTRA_NAME.match(x) for x in man.get("extra_arrays", []))
    )  # fmt: skip
    if not ok:
        raise CheckpointError(f"{path}: {_MANIFEST} is not a {FORMAT} manifest")
    return man


def _array(t: Any) -> np.ndarray:
    """A CPU tensor or array as a contiguous numpy array."""
    if hasattr(t, "detach"):
        t = t.detach().cpu().numpy()
    return np.ascontiguousarray(t)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
