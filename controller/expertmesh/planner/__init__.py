"""expertmesh.planner: pure functions that decide where MoE experts live.

No Ray, gRPC, FastAPI or file I/O here; numpy, scipy and pydantic only.

Glossary (the words of the architecture brief, used as identifiers):

- DC: data center, a group of nodes joined by fast links; DCs are joined by slow WAN links.
- domain: a set of ranks inside which moving tokens or weights is cheap (a node or a DC).
- rank: one accelerator (or CPU worker); holds ``S`` expert slots, ``R`` ranks in all.
- logical expert: expert ``e`` of a layer, ``0 <= e < E``.
- physical expert / slot: a copy of a logical expert in a slot of a rank.
- master: the copy that owns the expert's optimizer state; exactly one per logical expert.
- replica: any other copy; its gradients are reduced back into the master.
- load: ``load[r, e]`` tokens (top-k assignments) source rank ``r`` sends to expert ``e``
  in one microbatch of one layer; a trace is ``[T, L, R, E]``.
- phy2log: ``[R, S]`` logical expert in each slot, ``-1`` if empty. log2phy: the inverse,
  the slots of each logical expert; logcnt: ``[E]`` copies of each logical expert.
- route: how many of ``load[r, e]`` go to each rank holding ``e``: ``[N, 4]`` rows
  ``(src_rank, expert, dst_rank, tokens)``.
- plan: per layer, ``phy2log``, route and the migrations from the previous placement.
- imbalance: max over ranks of tokens computed / mean (1.0 ideal); balancedness = 1 / imbalance.
- straggler: max - mean tokens per rank.

Entry points: :class:`Topology`, :class:`ModelSpec`, :class:`LayerPlan`,
:func:`make_policy`, :func:`plan_trace`.
"""

from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import (
    LayerPlan,
    Migration,
    Placement,
    Transfer,
    TransferKind,
    balancedness_stats,
    check_layer_plan,
    check_load,
    check_trace,
    imbalance,
    rank_tokens,
    straggler,
)
from expertmesh.planner.policy import (
    Policy,
    PolicyContext,
    PolicySettings,
    available_policies,
    make_policy,
    register,
)
from expertmesh.planner.runner import TracePlan, plan_layer, plan_trace
from expertmesh.planner.topology import DC, Link, LinkClass, Topology

__all__ = [
    "DC",
    "LayerPlan",
    "Link",
    "LinkClass",
    "Migration",
    "ModelSpec",
    "Placement",
    "Policy",
    "PolicyContext",
    "PolicySettings",
    "Topology",
    "TracePlan",
    "Transfer",
    "TransferKind",
    "available_policies",
    "balancedness_stats",
    "check_layer_plan",
    "check_load",
    "check_trace",
    "imbalance",
    "make_policy",
    "plan_layer",
    "plan_trace",
    "rank_tokens",
    "register",
    "straggler",
]
