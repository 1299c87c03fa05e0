"""A rank's side of recovery: undo a failed step, hand over masters, rejoin after a pause.

:class:`RankRecovery` is a mixin of :class:`expertmesh.workers.rank.RankState` (kept apart
to keep that module readable); the runtime drives it
(:mod:`expertmesh.runtime.faults`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from expertmesh.planner.plan import Placement
from expertmesh.workers.model import DenseModel, ExpertWeights, LMConfig

__all__ = ["RankRecovery"]


class RankRecovery:
    """Snapshots, rollback, checkpoints and rejoining, over :class:`RankState`'s fields."""

    rank: int
    cfg: LMConfig
    step: int
    opt_step: int
    version: int
    dense: DenseModel
    dense_state: list[tuple[torch.Tensor, torch.Tensor]]
    experts: list[dict[int, ExpertWeights]]
    opt: list[dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]]
    layers: list[Any]
    _pending: dict[str, Any] | None
    _snap: dict[str, Any] | None
    wire: Any  # WireFormat of the committed plan

    def _dparams(self) -> list[torch.Tensor]:
        return list(self.dense.parameters())

    @staticmethod
    def _param(w: Any) -> ExpertWeights:
        a, b, c = (t.detach().clone().requires_grad_(True) for t in w)
        return a, b, c

    def _reset_step(self) -> None:
        raise NotImplementedError

    def _snapshot(self) -> dict[str, Any]:
        """Copies of everything a step changes (weights, optimizer state, step counters)."""

        def cl(ts: Any) -> list[torch.Tensor]:
            return [t.detach().clone() for t in ts]

        return {
            "step": self.step,
            "opt_step": self.opt_step,
            "dense": cl(self._dparams()),
            "dense_state": [(m.clone(), v.clone()) for m, v in self.dense_state],
            "experts": [{e: cl(w) for e, w in mine.items()} for mine in self.experts],
            "opt": [{e: (cl(m), cl(v)) for e, (m, v) in o.items()} for o in self.opt],
        }

    def rollback_step(self) -> int:
        """Undo the step begun last (it failed on another rank): weights, optimizer state and
        the step counter go back to before it, so the step can run again. Returns the step
        number now committed (a no-op when no step was begun since the last rollback)."""
        snap, self._snap = self._snap, None
        if snap is None:
            return self.step
        with torch.no_grad():
            for p, t in zip(self._dparams(), snap["dense"], strict=True):
                p.copy_(t)
                p.grad = None
        self.dense_state = snap["dense_state"]
        self.experts = [
            {e: self._param((w[0], w[1], w[2])) for e, w in mine.items()}
            for mine in snap["experts"]
        ]
        self.opt = snap["opt"]
        self.step, self.opt_step = snap["step"], snap["opt_step"]
        self._reset_step()
        return int(self.step)

    def checkpoint(self) -> dict[tuple[int, int], tuple[Any, Any, Any]]:
        """The masters this rank holds: ``(layer, expert) -> (weights, adam m, adam v)``,
        each a list of numpy copies (cheaper to ship than tensors)."""
        out = {}
        for lyr, o in enumerate(self.opt):
            for e, (m, v) in o.items():
                w = self.experts[lyr][e]
                out[(lyr, e)] = (
                    [t.detach().numpy().copy() for t in w],
                    [t.numpy().copy() for t in m],
                    [t.numpy().copy() for t in v],
                )
        return out

    def expert_weights(self, layer: int, expert: int) -> list[np.ndarray] | None:
        """This rank's copy of ``expert`` of ``layer`` (numpy), or None."""
        w = self.experts[layer].get(expert)
        return None if w is None else [t.detach().numpy().copy() for t in w]

    def seed(self, weights: dict[tuple[int, int], Any], opt: dict[tuple[int, int], Any]) -> None:
        """Recovery: expert weights and master Adam states (from a checkpoint; arrays or
        tensors) for the plan being prepared, as if a migration had delivered them."""
        pend = self._pending
        if pend is None:
            raise ValueError("no plan is being prepared")

        def tensors(ts: Any) -> list[torch.Tensor]:  # numpy (from disk) or tensors
            return [torch.tensor(np.asarray(t)) if not torch.is_tensor(t) else t for t in ts]

        pend["w"].update({k: tensors(w) for k, w in weights.items()})
        pend["opt"].update({k: (tensors(m), tensors(v)) for k, (m, v) in opt.items()})

    def export_dense(self) -> dict[str, Any]:
        """What a rank rejoining after a pause takes from a live one: dense weights and Adam
        state, the step counters and the committed plan."""
        return {
            "dense": [p.detach().clone() for p in self._dparams()],
            "dense_state": [(m.clone(), v.clone()) for m, v in self.dense_state],
            "opt_step": self.opt_step,
            "step": self.step,
            "version": self.version,
            "wire": self.wire,
            "layers": [(ls.placement.phy2log, ls.placement.master, ls.route) for ls in self.layers],
        }

    def adopt(self, state: dict[str, Any]) -> None:
        """Rejoin with a live rank's :meth:`export_dense`: its dense state, counters and
        committed plan; no experts (the committed plan gives this rank none; the next plan
        sends it copies)."""
        from expertmesh.workers.rank import LayerState  # rank.py imports this module

        layers = [
            LayerState(Placement(np.asarray(p2l), np.asarray(m)), np.asarray(route))
            for p2l, m, route in state["layers"]
        ]
        if len(layers) != self.cfg.num_layers:
            raise ValueError(f"state has {len(layers)} layers, the model {self.cfg.num_layers}")
        if any(ls.holds[self.rank].any() for ls in layers):
            raise ValueError(f"the committed plan gives rejoining rank {self.rank} copies")
        with torch.no_grad():
            for p, t in zip(self._dparams(), state["dense"], strict=True):
                p.copy_(t)
        self.dense_state = [(m.clone(), v.clone()) for m, v in state["dense_state"]]
        self.opt_step, self.step, self.version = state["opt_step"], state["step"], state["version"]
        self.wire = state["wire"]
        self.layers = layers
        self.experts = [{} for _ in layers]
        self.opt = [{} for _ in layers]
        self._pending, self._snap = None, None
        self._reset_step()
