"""A placement as each serving engine's own expert map, and back (pure numpy, no I/O).

Words (the engines' own, mapped onto ours):

- physical expert ``p`` (all three engines): flat slot ``p = r * S + s`` of rank ``r``; every
  rank holds ``S`` of them, contiguous, so ``P = R * S`` and rank ``r`` holds
  ``[r * S, (r + 1) * S)``. Ours: ``phy2log[r, s]``.
- SGLang ``physical_to_logical_map`` ``[N, P]``: per *model* layer (``num_hidden_layers``,
  dense layers included) the logical expert of each physical expert; SGLang is started with
  ``--ep-num-redundant-experts P - E``. Dense layers get SGLang's trivial row
  ``arange(P) % E`` (what ``ExpertLocationMetadata.init_trivial`` builds); nothing routes there.
- TensorRT-LLM ``initial_global_assignments`` ``{model layer: [expert] * num_slots}``:
  ``num_slots = P`` (divisible by the EP size), each rank's slots contiguous.
- vLLM (``EplbModelState``): ``physical_to_logical_map`` ``[L, P]`` per MoE layer,
  ``logical_to_physical_map`` ``[L, E, P - E + 1]`` (the physical experts of each logical
  expert, ascending, ``-1`` padded; ``P - E`` is vLLM's ``num_redundant_experts``) and
  ``logical_replica_count`` ``[L, E]``.

What none of them can express, refused with :class:`ExportError` rather than written: an
empty slot (the engines fill every slot, so an engine would load *some* expert there and
route tokens to it), an expert without a copy, or an expert id outside ``[0, E)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ENGINES",
    "EngineLayout",
    "ExportError",
    "check_expressible",
    "phy2log_from_sglang",
    "phy2log_from_trtllm",
    "phy2log_from_vllm",
    "sglang_map",
    "trtllm_config",
    "vllm_maps",
]

ENGINES = ("sglang", "trtllm", "vllm")


class ExportError(ValueError):
    """The plan cannot be written in the engine's format; the message says why."""


@dataclass(frozen=True)
class EngineLayout:
    """How a plan's MoE layers sit in the engine's model.

    - ``layer_ids``: [L] the engine's (model) layer index of each plan layer, increasing
      (DeepSeek-V3: ``3, 4, ..., 60`` after its 3 dense layers).
    - ``num_model_layers``: SGLang's ``num_hidden_layers`` (default ``max(layer_ids) + 1``).
    """

    layer_ids: tuple[int, ...]
    num_model_layers: int

    @staticmethod
    def make(
        num_layers: int,
        *,
        layer_offset: int = 0,
        layer_ids: Sequence[int] | None = None,
        num_model_layers: int | None = None,
    ) -> EngineLayout:
        """The layout of ``num_layers`` MoE layers: ``layer_ids`` if given, else
        ``layer_offset + [0, L)``. ``ValueError`` on a count mismatch, negative or unsorted
        ids, or a model too small to hold them."""
        if layer_offset < 0:
            raise ExportError(f"the layer offset must be >= 0, got {layer_offset}")
        ids = (
            tuple(int(x) for x in layer_ids)
            if layer_ids is not None
            else tuple(range(layer_offset, layer_offset + num_layers))
        )
        if len(ids) != num_layers:
            raise ExportError(f"{len(ids)} engine layer ids for a plan of {num_layers} layers")
        if ids and (min(ids) < 0 or any(b <= a for a, b in itertools.pairwise(ids))):
            raise ExportError(f"engine layer ids must be >= 0 and increasing, got {list(ids)}")
        need = (max(ids) + 1) if ids else 0
        total = need if num_model_layers is None else int(num_model_layers)
        if total < need:
            raise ExportError(
                f"the model has {total} layers but the plan's layers reach layer {need - 1}"
            )
        return EngineLayout(layer_ids=ids, num_model_layers=total)


def check_expressible(phy2log: np.ndarray, num_experts: int, engine: str) -> None:
    """``ExportError`` unless ``phy2log`` [L, R, S] fills every slot with an expert in
    ``[0, E)`` and gives every expert at least one copy in every layer."""
    if phy2log.ndim != 3 or 0 in phy2log.shape:
        raise ExportError(f"a placement is [L, R, S], got shape {phy2log.shape}")
    if num_experts < 1:
        raise ExportError(f"the model needs >= 1 expert, got {num_experts}")
    num_layers, num_ranks, num_slots = phy2log.shape
    empty = np.argwhere(phy2log < 0)
    if len(empty):
        layer, r, s = (int(x) for x in empty[0])
        raise ExportError(
            f"{engine} fills every expert slot, but the plan leaves {len(empty)} of "
            f"{phy2log.size} slots empty (first: layer {layer}, rank {r}, slot {s}); plan with "
            "a policy that fills every slot (eplb) or with no spare slots"
        )
    if int(phy2log.max()) >= num_experts:
        raise ExportError(f"the plan places expert ids >= the model's {num_experts} experts")
    for layer in range(num_layers):
        missing = np.setdiff1d(np.arange(num_experts), phy2log[layer].ravel())
        if missing.size:
            raise ExportError(
                f"layer {layer}: expert {int(missing[0])} has no copy ({missing.size} experts "
                "without one); every engine needs every expert placed"
            )
    if num_ranks * num_slots < num_experts:  # implied by the loop; stated for the reader
        raise ExportError(f"{num_ranks * num_slots} slots cannot hold {num_experts} experts")


def _flat(phy2log: np.ndarray) -> np.ndarray:
    num_layers = phy2log.shape[0]
    return phy2log.reshape(num_layers, -1).astype(np.int64)  # [L, P], p = r * S + s


def sglang_map(phy2log: np.ndarray, num_experts: int, layout: EngineLayout) -> np.ndarray:
    """SGLang's ``physical_to_logical_map`` [N, P] int64 for ``phy2log`` [L, R, S]: row
    ``layout.layer_ids[l]`` is layer ``l``'s placement, other rows SGLang's trivial layout."""
    check_expressible(phy2log, num_experts, "SGLang")
    flat = _flat(phy2log)
    num_physical = flat.shape[1]
    out = np.tile(
        np.arange(num_physical, dtype=np.int64) % num_experts, (layout.num_model_layers, 1)
    )
    out[list(layout.layer_ids)] = flat  # [N, P]
    return out


def trtllm_config(
    phy2log: np.ndarray, num_experts: int, layout: EngineLayout, layer_updates_per_iter: int = 0
) -> dict[str, Any]:
    """TensorRT-LLM's MoE load balancer config for ``phy2log`` [L, R, S]: ``num_slots``
    (``R * S``), ``layer_updates_per_iter`` (0: the placement stays) and
    ``initial_global_assignments`` {model layer: [expert of each slot]}."""
    check_expressible(phy2log, num_experts, "TensorRT-LLM")
    if layer_updates_per_iter < 0:
        raise ExportError(f"layer_updates_per_iter must be >= 0, got {layer_updates_per_iter}")
    flat = _flat(phy2log)
    return {
        "num_slots": int(flat.shape[1]),
        "layer_updates_per_iter": int(layer_updates_per_iter),
        "initial_global_assignments": {
            int(lid): [int(x) for x in row] for lid, row in zip(layout.layer_ids, flat, strict=True)
        },
    }


def vllm_maps(phy2log: np.ndarray, num_experts: int) -> dict[str, np.ndarray]:
    """vLLM's three maps for ``phy2log`` [L, R, S]: ``physical_to_logical_map`` [L, P],
    ``logical_to_physical_map`` [L, E, P - E + 1] (ascending physical ids, -1 padded),
    ``logical_replica_count`` [L, E]; all int64."""
    check_expressible(phy2log, num_experts, "vLLM")
    flat = _flat(phy2log)  # [L, P]
    num_layers, num_physical = flat.shape
    width = num_physical - num_experts + 1  # one copy each, plus every redundant slot
    count = np.zeros((num_layers, num_experts), np.int64)
    l2p = np.full((num_layers, num_experts, width), -1, np.int64)
    for layer in range(num_layers):
        order = np.argsort(flat[layer], kind="stable")  # physical ids grouped by expert
        experts = flat[layer][order]
        count[layer] = np.bincount(experts, minlength=num_experts)
        start = np.concatenate(([0], np.cumsum(count[layer])[:-1]))  # [E]
        rank_in_expert = np.arange(num_physical) - start[experts]
        l2p[layer, experts, rank_in_expert] = order
    return {
        "physical_to_logical_map": flat,
        "logical_to_physical_map": l2p,
        "logical_replica_count": count,
    }


# ---------------------------------------------------------------------------
# back to phy2log (what a file says, checked)
# ---------------------------------------------------------------------------


def _check_flat(flat: np.ndarray, num_ranks: int, num_experts: int, what: str) -> np.ndarray:
    if flat.ndim != 2:
        raise ValueError(f"{what} must be [layers, P], got shape {flat.shape}")
    if flat.shape[1] % num_ranks:
        raise ValueError(
            f"{what} has {flat.shape[1]} physical experts, not divisible by {num_ranks} ranks"
        )
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"{what} has expert ids outside [0, {num_experts})")
    return flat.reshape(flat.shape[0], num_ranks, -1).astype(np.int32)  # [L, R, S]


def phy2log_from_sglang(
    p2l: np.ndarray, num_ranks: int, num_experts: int, layout: EngineLayout
) -> np.ndarray:
    """``phy2log`` [L, R, S] of the plan layers in SGLang's ``physical_to_logical_map``."""
    if p2l.ndim != 2 or p2l.shape[0] != layout.num_model_layers:
        raise ValueError(
            f"physical_to_logical_map must be [{layout.num_model_layers}, P], got {p2l.shape}"
        )
    return _check_flat(
        p2l[list(layout.layer_ids)], num_ranks, num_experts, "physical_to_logical_map"
    )


def phy2log_from_trtllm(
    config: dict[str, Any], num_ranks: int, num_experts: int, layout: EngineLayout
) -> np.ndarray:
    """``phy2log`` [L, R, S] of the plan layers in a TensorRT-LLM load balancer config."""
    slots = config.get("num_slots")
    assign = config.get("initial_global_assignments")
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise ValueError(f"num_slots must be a positive integer, got {slots!r}")
    if slots % num_ranks:
        raise ValueError(f"num_slots {slots} is not divisible by the EP size {num_ranks}")
    if not isinstance(assign, dict) or set(assign) != set(layout.layer_ids):
        have = sorted(assign) if isinstance(assign, dict) else assign
        raise ValueError(
            f"initial_global_assignments must have the layers {list(layout.layer_ids)}, got {have}"
        )
    rows = []
    for lid in layout.layer_ids:
        row = assign[lid]
        if not isinstance(row, list) or len(row) != slots:
            raise ValueError(f"layer {lid}: {len(row) if isinstance(row, list) else row!r} "
                             f"assignments, num_slots is {slots}")  # fmt: skip
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in row):
            raise ValueError(f"layer {lid}: assignments must be integers")
        rows.append(row)
    return _check_flat(np.array(rows, np.int64), num_ranks, num_experts, "assignments")


def phy2log_from_vllm(maps: dict[str, np.ndarray], num_ranks: int, num_experts: int) -> np.ndarray:
    """``phy2log`` [L, R, S] from vLLM's maps, after checking the three agree."""
    p2l = maps["physical_to_logical_map"]
    phy2log = _check_flat(p2l, num_ranks, num_experts, "physical_to_logical_map")
    want = vllm_maps(phy2log, num_experts)
    for key in ("logical_to_physical_map", "logical_replica_count"):
        got = maps[key]
        if got.shape != want[key].shape or not np.array_equal(got, want[key]):
            raise ValueError(f"{key} does not agree with physical_to_logical_map")
    return phy2log
