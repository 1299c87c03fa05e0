"""expertmesh.sim: the trace-driven simulator (the same planner and cost model, at 1,000+ DCs).

Entry points: :func:`simulate` (policies over per-step loads), :func:`~expertmesh.sim.groups.simulate_groups`
(data-parallel EP groups), :func:`~expertmesh.sim.replay.replay` (a runtime run), :func:`run_sweep`
(bandwidth and DC-count sweeps), and the report writers in :mod:`expertmesh.sim.report`.
"""

from expertmesh.sim.engine import COLUMNS, PolicyRun, SimResult, StepRow, dense_source, simulate

__all__ = [
    "COLUMNS",
    "PolicyRun",
    "SimResult",
    "StepRow",
    "dense_source",
    "simulate",
]
