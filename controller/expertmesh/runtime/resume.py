"""Resuming a run from its checkpoint directory (``expertmesh demo --resume DIR``).

Every checkpoint the SPMD driver writes carries, besides every master's weights and Adam
state (what a worker's recovery needs), what a new driver needs to go on where the run
stopped (the checkpoint's ``extra`` part, :func:`resume_payload`):

- the dense weights and their Adam state (the same on every rank: data parallel);
- the committed plan: version, and per layer ``phy2log``, ``master`` and ``route``, and
  the dtypes its expert copies travel in (a replica holds its master's weights rounded
  to them);
- the step counters (the last step trained, the dense and the experts' Adam steps);
- the data position: the next step. Batches are a pure function of (seed, step, rank)
  (:meth:`Corpus.batch`) and training draws no other random numbers, so the next step
  *is* the data and RNG position; the corpus's sha256 is kept to refuse another corpus;
- the settings the run trained with; a resume must train the same model on the same
  topology and corpus (:data:`MUST_MATCH`), the rest (policy, trigger, checkpointing,
  surfaces) may change.

:func:`load_resume` finds the newest checkpoint in a directory that loads and holds this
part, checks it against the new settings and every array against the model's shapes, and
raises :class:`CheckpointError` (a ``ValueError``: one line, exit 2 in the CLI) otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from expertmesh.planner import Topology
from expertmesh.runtime.checkpoint import Checkpoint, CheckpointDir, CheckpointError
from expertmesh.workers.model import Corpus, DenseModel

__all__ = ["MUST_MATCH", "RESUME_FORMAT", "ResumeState", "load_resume", "resume_payload"]

RESUME_FORMAT = "expertmesh-resume/1"
MUST_MATCH = ("topology", "lm", "corpus", "corpus_bytes")  # settings a resume cannot change
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.lru_cache(maxsize=4)
def corpus_digest(path: str | None, max_bytes: int) -> str:
    """sha256 of the corpus the settings train on."""
    return hashlib.sha256(Corpus.load(path, max_bytes).data.tobytes()).hexdigest()


def _np(t: Any) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy() if hasattr(t, "detach") else t)


def resume_payload(
    state: dict[str, Any], settings: Any, members: list[int] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(extra, arrays)`` of a checkpoint from one rank's ``export_state`` (taken at the
    same step boundary as the masters), the run's settings and the ranks training then
    (None: every rank)."""
    arrays: dict[str, Any] = {}
    for i, t in enumerate(state["dense"]):
        arrays[f"dense.w{i}"] = _np(t)
    for i, (m, v) in enumerate(state["dense_state"]):
        arrays[f"dense.m{i}"], arrays[f"dense.v{i}"] = _np(m), _np(v)
    for layer, (p2l, master, route) in enumerate(state["layers"]):
        arrays[f"plan.{layer}.phy2log"] = np.asarray(p2l, np.int64)
        arrays[f"plan.{layer}.master"] = np.asarray(master, np.int64)
        arrays[f"plan.{layer}.route"] = np.asarray(route, np.int64).reshape(-1, 4)
    wire = state["wire"]
    extra = {
        "format": RESUME_FORMAT,
        "step": int(state["step"]),
        "next_step": int(state["step"]) + 1,  # the data position (module docstring)
        "opt_step": int(state["opt_step"]),
        "expert_step": int(state["expert_step"]),
        "plan_version": int(state["version"]),
        "wire": [str(wire.weights).removeprefix("torch."), str(wire.grads).removeprefix("torch.")],
        "dense_tensors": len(state["dense"]),
        "settings": settings.model_dump(mode="json"),
        "corpus_sha256": corpus_digest(settings.corpus, settings.corpus_bytes),
        "members": sorted(members) if members is not None else None,
    }
    return extra, arrays


@dataclass(frozen=True)
class ResumeState:
    """A checkpoint a run can resume from (:func:`load_resume`)."""

    path: str
    run: str
    step: int  # the last step trained
    version: int  # the committed plan
    layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # (phy2log, master, route)
    checkpoint: Checkpoint
    extra: dict[str, Any]

    def worker_state(self) -> dict[str, Any]:
        """What every worker adopts (the form of ``SpmdRank.export_state``)."""
        from expertmesh.workers.wire import WireFormat

        a, n = self.checkpoint.arrays or {}, int(self.extra["dense_tensors"])
        w, g = self.extra["wire"]
        return {
            "dense": [torch.from_numpy(a[f"dense.w{i}"].copy()) for i in range(n)],
            "dense_state": [
                (
                    torch.from_numpy(a[f"dense.m{i}"].copy()),
                    torch.from_numpy(a[f"dense.v{i}"].copy()),
                )
                for i in range(n)
            ],
            "step": self.step,
            "opt_step": int(self.extra["opt_step"]),
            "expert_step": int(self.extra["expert_step"]),
            "version": self.version,
            "wire": WireFormat(_DTYPES[w], _DTYPES[g]),
            "layers": self.layers,
        }

    def seeds(self, rank: int) -> dict[tuple[int, int], Any]:
        """``(layer, expert) -> (weights, m, v)`` of every expert ``rank`` holds under the
        committed plan (the master's; a replica rounds the weights to the wire's dtype)."""
        out = {}
        for layer, (p2l, _, _) in enumerate(self.layers):
            for e in sorted({int(x) for x in p2l[rank] if x >= 0}):
                out[(layer, e)] = self.checkpoint.experts[(layer, e)]
        return out


def load_resume(directory: str | Path, settings: Any) -> ResumeState:
    """The newest checkpoint in ``directory`` that loads and can be resumed from with
    ``settings``; :class:`CheckpointError` with the reason otherwise."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"--resume {root}: no such directory")
    paths = CheckpointDir(root).paths()
    if not paths:
        raise CheckpointError(f"--resume {root}: no checkpoint (ckpt-NNNNNN) in this directory")
    refused = []
    for path in paths:
        try:
            ck = CheckpointDir(root).load(path)
            return _checked(ck, settings)
        except CheckpointError as err:
            refused.append(str(err))
    raise CheckpointError(f"--resume {root}: no checkpoint can be resumed from: {refused[0]}")


def _checked(ck: Checkpoint, settings: Any) -> ResumeState:
    x = ck.extra
    if x is None or x.get("format") != RESUME_FORMAT:
        raise CheckpointError(f"{ck.path}: holds no resume state (experts only)")
    ints = ("step", "next_step", "opt_step", "expert_step", "plan_version", "dense_tensors")
    if not all(isinstance(x.get(k), int) and x[k] >= -1 for k in ints) or not (
        isinstance(x.get("settings"), dict)
        and isinstance(x.get("wire"), list)
        and len(x["wire"]) == 2
        and all(w in _DTYPES for w in x["wire"])
        and x["step"] == ck.step
        and x["plan_version"] == ck.plan_version
    ):
        raise CheckpointError(f"{ck.path}: its resume state is malformed")
    _check_settings(ck, x, settings)
    ranks = Topology.from_dict(settings.topology).num_ranks
    if x.get("members") is not None and x["members"] != list(range(ranks)):
        out = sorted(set(range(ranks)) - set(x["members"]))
        raise CheckpointError(
            f"{ck.path}: taken while ranks {out} were out of the run (dead without replacement "
            "or cut off); a resume starts every rank (use a checkpoint from before)"
        )
    a = ck.arrays or {}
    lm, want = settings.lm, [tuple(p.shape) for p in DenseModel(settings.lm).parameters()]
    if x["dense_tensors"] != len(want):
        raise CheckpointError(
            f"{ck.path}: {x['dense_tensors']} dense tensors, the model has {len(want)}"
        )
    for i, shape in enumerate(want):
        for part in "wmv":
            t = a.get(f"dense.{part}{i}")
            if t is None or t.dtype.kind != "f" or t.shape != shape:
                raise CheckpointError(f"{ck.path}: dense tensor {part}{i} is missing or misshaped")
    d, f = lm.hidden, lm.ffn_hidden
    for layer in range(lm.num_layers):
        for e in range(lm.num_experts):
            w = ck.experts.get((layer, e))
            if w is None or [t.shape for t in w[0]] != [(d, f), (d, f), (f, d)]:
                raise CheckpointError(f"{ck.path}: expert {layer}/{e} is missing or misshaped")
    topo = Topology.from_dict(settings.topology)
    layers = [_plan_layer(ck, a, layer, topo, lm.num_experts) for layer in range(lm.num_layers)]
    return ResumeState(str(ck.path), ck.run, ck.step, ck.plan_version, layers, ck, x)


def _check_settings(ck: Checkpoint, x: dict[str, Any], settings: Any) -> None:
    now = json.loads(settings.model_dump_json())
    for key in MUST_MATCH:
        then = x["settings"].get(key)
        if then != now.get(key):
            what = key
            if isinstance(then, dict) and isinstance(now.get(key), dict):
                diff = sorted(
                    k for k in then.keys() | now[key].keys() if then.get(k) != now[key].get(k)
                )
                what = f"{key}.{diff[0]}" if diff else key
                then, here = (
                    then.get(diff[0]) if diff else then,
                    now[key].get(diff[0]) if diff else now[key],
                )
            else:
                here = now.get(key)
            raise CheckpointError(
                f"{ck.path}: trained with {what}={_short(then)}, this run has {_short(here)} "
                "(resume with the settings the run trained with)"
            )
    if x.get("corpus_sha256") != corpus_digest(settings.corpus, settings.corpus_bytes):
        raise CheckpointError(f"{ck.path}: trained on another corpus (its sha256 differs)")


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _plan_layer(
    ck: Checkpoint, a: dict[str, np.ndarray], layer: int, topo: Any, num_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p2l, master, route = (a.get(f"plan.{layer}.{k}") for k in ("phy2log", "master", "route"))
    bad = CheckpointError(f"{ck.path}: the committed plan of layer {layer} is malformed")
    r, s = topo.num_ranks, topo.slots_per_rank
    if p2l is None or master is None or route is None:
        raise bad
    if p2l.dtype.kind != "i" or master.dtype.kind != "i" or route.dtype.kind != "i":
        raise bad
    if p2l.shape != (r, s) or master.shape != (num_experts,) or route.ndim != 2:
        raise bad
    if route.shape[1] != 4 or p2l.min() < -1 or p2l.max() >= num_experts:
        raise bad
    if master.size and (master.min() < 0 or master.max() >= r * s):
        raise bad
    if (p2l.reshape(-1)[master] != np.arange(num_experts)).any():
        raise bad
    if route.size:
        src, ex, dst, tok = route.T
        if (src < 0).any() or (src >= r).any() or (ex < 0).any() or (ex >= num_experts).any():
            raise bad
        if (dst < 0).any() or (dst >= r).any() or (tok < 0).any():
            raise bad
        holds = np.zeros((r, num_experts), bool)
        rr, ss = np.nonzero(p2l >= 0)
        holds[rr, p2l[rr, ss]] = True
        if not holds[dst, ex].all():
            raise bad
    return p2l.astype(np.int64), master.astype(np.int64), route.astype(np.int64)
