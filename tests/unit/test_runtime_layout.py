"""The runtime's initial layouts (RuntimeSettings.layout): static EP, and the replicated
layout the SPMD step model's per-copy constant is calibrated on: static's masters, every
DC holding every expert in its empty slots, each expert once per rank."""

from __future__ import annotations

import numpy as np
import pytest

from expertmesh.planner import Topology
from expertmesh.planner.static import static_placement
from expertmesh.runtime.settings import initial_placements, replicated_placement
from expertmesh.workers.model import LMConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dcs", [2, 3])
def test_replicated_layout_keeps_the_masters_and_fills_every_dc(dcs: int) -> None:
    lm = LMConfig()  # 12 experts, 2 layers
    ranks = 2 * dcs
    masters = lm.num_experts // ranks
    topo = Topology.generate(dcs, 2, masters=masters, spare=lm.num_experts // 2 - masters)
    static = initial_placements(topo, lm)
    rep = initial_placements(topo, lm, "replicated")
    assert len(rep) == lm.num_layers
    for s, r in zip(static, rep, strict=True):
        np.testing.assert_array_equal(r.master, s.master)
        np.testing.assert_array_equal(r.master_rank(), s.master_rank())
        # the masters' slots unchanged
        kept = s.phy2log >= 0
        np.testing.assert_array_equal(r.phy2log[kept], s.phy2log[kept])
        holds = r.holds()
        for d in range(dcs):
            assert holds[np.asarray(topo.rank_dc) == d].any(axis=0).all()
        # one copy of an expert per DC (no rank holds one twice): 12 per DC
        assert holds.sum() == dcs * lm.num_experts
        assert (r.phy2log >= 0).sum() == dcs * lm.num_experts


def test_replicated_layout_needs_the_slots() -> None:
    p = static_placement(4, 1, 4, 1)  # no spare slot
    with pytest.raises(ValueError, match="empty slots"):
        replicated_placement(p, np.array([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="layout"):
        initial_placements(Topology.generate(2, 2, masters=3, spare=3), LMConfig(), "other")
