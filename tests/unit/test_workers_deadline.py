"""The step deadline (workers/engine.py step_deadline_seconds): a bound on one training
step that grows with the bytes a step may put on the slowest DC link."""

from __future__ import annotations

import pytest

from expertmesh.planner import Topology
from expertmesh.workers.engine import step_deadline_seconds
from expertmesh.workers.model import LMConfig

LM = LMConfig(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)


def test_small_steps_get_the_floor_and_one_dc_needs_no_link() -> None:
    topo = Topology.generate(3, 2, masters=2, spare=2)
    assert step_deadline_seconds(topo, LM, floor_s=30.0) == 30.0
    assert step_deadline_seconds(Topology.generate(1, 4, masters=2, spare=2), LM) == 60.0


def test_slower_links_and_bigger_steps_get_longer_deadlines() -> None:
    big = LM.model_copy(update={"batch": 256, "seq_len": 512, "hidden": 256})
    fast = Topology.generate(2, 2, masters=2, spare=2).with_inter_dc(10.0, 20.0)
    slow = fast.with_inter_dc(0.1, 20.0)
    t_fast = step_deadline_seconds(fast, big, floor_s=0.0)
    t_slow = step_deadline_seconds(slow, big, floor_s=0.0)
    assert t_slow > 50 * t_fast > 0
    # every token of a DC crossing the link four times a layer, at least, times the factor
    tokens = 2 * big.tokens_per_rank * big.hidden * 4 * 4 * big.num_layers
    assert t_slow >= 20 * tokens * 8 / 0.1e9
    assert step_deadline_seconds(slow, big, factor=40.0, floor_s=0.0) == pytest.approx(2 * t_slow)


@pytest.mark.parametrize("kw", [{"factor": 0.0}, {"floor_s": -1.0}])
def test_bad_arguments_are_value_errors(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        step_deadline_seconds(Topology.generate(2, 2, masters=2, spare=2), LM, **kw)
