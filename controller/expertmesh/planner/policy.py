"""The policy interface and registry.

A policy turns what the planner knows about one layer at one step (exact load,
a history window, the previous plan) into a :class:`Placement` and a route.
Policies are pure: same context, same answer. Settings are pydantic models with
bounds, one per policy, so a policy is configured from a CLI, REST or YAML the
same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import LayerPlan, Placement, check_load
from expertmesh.planner.topology import Topology

__all__ = [
    "Policy",
    "PolicyContext",
    "PolicySettings",
    "available_policies",
    "make_policy",
    "register",
]


class PolicySettings(BaseModel):
    """Base of every policy's settings (frozen, unknown keys refused)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


@dataclass(frozen=True, eq=False)
class PolicyContext:
    """What a policy sees for one layer at one step.

    - ``load``: [R, E] exact load of this microbatch (the ``quota`` policy plans on it;
      history-based policies must not peek at it, as their real deployments cannot).
    - ``history``: [W, R, E] loads of the previous ``W`` microbatches of this layer,
      oldest first; ``W`` may be 0 at the first step.
    - ``previous``: the plan this layer ran at the previous step, or ``None``.
    - ``dead_ranks``: ranks that take no copy and no token (a dead worker, a DC cut off);
      :func:`expertmesh.planner.runner.plan_layer` plans them out for every policy
      (:mod:`expertmesh.planner.membership`); a policy itself never sees any.
    """

    topology: Topology
    model: ModelSpec
    step: int
    layer: int
    load: np.ndarray
    history: np.ndarray
    previous: LayerPlan | None = None
    dead_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Every policy may rely on these; ValueError here instead of an IndexError deep inside.
        num_ranks, num_experts = self.topology.num_ranks, self.model.num_experts
        object.__setattr__(self, "load", check_load(self.load, num_ranks, num_experts))
        hist = np.asarray(self.history)
        if hist.ndim != 3 or hist.shape[1:] != (num_ranks, num_experts):
            raise ValueError(
                f"history must be [W, {num_ranks}, {num_experts}], got shape {hist.shape}"
            )
        if hist.dtype.kind not in "iu":
            raise ValueError(f"history must hold integer token counts, got dtype {hist.dtype}")
        if hist.size and hist.min() < 0:
            raise ValueError("history has negative token counts")
        dead = tuple(sorted({int(r) for r in self.dead_ranks}))
        if dead and (dead[0] < 0 or dead[-1] >= num_ranks or len(dead) == num_ranks):
            raise ValueError(f"dead_ranks must be some of the {num_ranks} ranks, got {dead}")
        object.__setattr__(self, "dead_ranks", dead)
        prev = self.previous
        if prev is not None and (
            prev.phy2log.shape != (num_ranks, self.topology.slots_per_rank)
            or prev.placement.master.shape != (num_experts,)
        ):
            raise ValueError(
                f"previous plan is [{prev.phy2log.shape[0]}, {prev.phy2log.shape[1]}] slots for "
                f"{prev.placement.master.shape[0]} experts; this layer has "
                f"[{num_ranks}, {self.topology.slots_per_rank}] for {num_experts}"
            )


class Policy(ABC):
    """Decides placement and routing for one layer at one step.

    Subclasses set ``name`` and ``Settings`` and implement :meth:`place` and
    :meth:`route`; they are registered with :func:`register`.
    """

    name: ClassVar[str]
    Settings: ClassVar[type[PolicySettings]] = PolicySettings

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings if settings is not None else self.Settings()

    @abstractmethod
    def place(self, ctx: PolicyContext) -> Placement:
        """The placement this layer runs at ``ctx.step``. Callers (the simulator, the
        controller) may memoize what they derive from a returned placement by its identity:
        never change its arrays in place afterwards, return a new one."""

    @abstractmethod
    def route(self, ctx: PolicyContext, placement: Placement) -> np.ndarray:
        """Route [N, 4] of ``ctx.load`` over ``placement``."""

    def history_window(self) -> int:
        """How many past microbatches the policy wants in ``ctx.history``."""
        return 0


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available by its ``name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    """Names of every registered policy, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


def make_policy(name: str, settings: dict[str, Any] | None = None) -> Policy:
    """Instantiate policy ``name``; ``ValueError`` for an unknown name or bad settings."""
    _load_builtin()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(_REGISTRY))}")
    try:
        parsed = cls.Settings.model_validate(settings or {})
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise ValueError(f"policy {name}: setting {where}: {e['msg']}") from None
    return cls(parsed)


def _load_builtin() -> None:
    # Import the built-in policy modules so their @register runs. Lazy, so importing
    # this module has no side effects and no import cycles.
    import importlib

    for mod in ("static", "eplb", "quota", "hybrid", "fastermoe"):
        try:
            importlib.import_module(f"expertmesh.planner.{mod}")
        except ModuleNotFoundError as err:
            if err.name != f"expertmesh.planner.{mod}":
                raise
