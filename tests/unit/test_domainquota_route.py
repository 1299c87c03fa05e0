"""domain_route refuses a load of fractional tokens instead of truncating it."""

from __future__ import annotations

import numpy as np
import pytest

from expertmesh.planner.domainquota import domain_quota, domain_route
from expertmesh.planner.static import static_placement
from expertmesh.planner.topology import Topology


def test_domain_route_refuses_fractional_tokens():
    topo = Topology.generate(2, 2, masters=2, spare=2)
    base = static_placement(topo.num_ranks, topo.slots_per_rank, 8, 2)
    load = np.random.default_rng(0).integers(0, 30, size=(topo.num_ranks, 8))
    sol = domain_quota(load, base, topo)
    route = domain_route(load, sol, topo)
    assert route[:, 3].sum() == load.sum()  # every token routed, whole
    with pytest.raises(ValueError, match="integer token counts"):
        domain_route(load + 0.5, sol, topo)
