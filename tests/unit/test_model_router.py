"""The forced, balanced router (``LMConfig.router="balanced"``, a benchmark's ideal): every
expert gets the same count on every rank whatever the logits, the weights are the
softmax of the learned logits of the experts each token goes to, and the gate still
learns (its gradient flows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertmesh.workers.model import BalancedGate, DenseModel, LMConfig
from expertmesh.workers.reference import ReferenceLM

CFG = LMConfig(num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)


def test_every_expert_gets_the_same_count_and_the_learned_weights() -> None:
    dense = DenseModel(CFG.model_copy(update={"router": "balanced"}))
    gate = dense.gates[0]
    assert isinstance(gate, BalancedGate)
    u = torch.randn(CFG.tokens_per_rank, CFG.hidden) * 5  # any logits
    with torch.no_grad():
        gate.weight[0] += 3.0  # a router that prefers expert 0 by far
    idx, w = dense.gate(0, u)
    counts = np.bincount(idx.reshape(-1).numpy(), minlength=CFG.num_experts)
    assert counts.tolist() == [CFG.tokens_per_rank * CFG.top_k // CFG.num_experts] * 8
    t = torch.arange(CFG.tokens_per_rank)
    want = torch.stack([(t * 2) % 8, (t * 2 + 1) % 8], 1)
    assert torch.equal(idx.sort(-1).values, want.sort(-1).values)
    learned = u @ gate.weight.T  # [n, E] the gate's own logits
    expect = torch.softmax(learned.gather(1, idx), -1)
    torch.testing.assert_close(w, expect, rtol=1e-5, atol=1e-6)
    (w * torch.arange(2.0)).sum().backward()  # the weights are the learned logits':
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0  # it trains


def test_learned_is_the_default_and_the_reference_refuses_balanced() -> None:
    assert type(DenseModel(CFG).gates[0]) is torch.nn.Linear
    with pytest.raises(ValueError, match="learned gate only"):
        ReferenceLM(CFG.model_copy(update={"router": "balanced"}))
