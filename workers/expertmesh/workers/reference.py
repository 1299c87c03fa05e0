"""The single-process reference every distributed run must equal (the correctness oracle).

Written for clarity, not speed, and on purpose apart from the code it checks: its own
gate (a top-k softmax router), its own expert FFN, its own token-by-expert sum, and
``torch.optim.Adam`` instead of the ranks' hand-written step. It trains on the union of
every rank's batch, which is what expert and data parallelism together must compute:
the loss is the sum of next-byte cross entropies over every rank's tokens divided by
their number, and one optimizer holds every parameter once. The embedding, mixers and
loss head are the dense model's (the same initial weights for a seed); placement, routes
and plans do not exist here, since no plan may change what the model computes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from expertmesh.workers.model import Corpus, DenseModel, LMConfig, init_expert

__all__ = ["ReferenceLM"]


class ReferenceLM(nn.Module):
    """The demo model in one process: dense parts and every expert of every layer."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        if cfg.router != "learned":
            raise ValueError(f"the reference routes by the learned gate only, not {cfg.router!r}")
        self.cfg = cfg
        self.dense = DenseModel(cfg)
        self.w1 = nn.ParameterList()
        self.w3 = nn.ParameterList()
        self.w2 = nn.ParameterList()
        for layer in range(cfg.num_layers):
            for e in range(cfg.num_experts):
                a, b, c = init_expert(cfg, layer, e)
                self.w1.append(nn.Parameter(a.clone()))
                self.w3.append(nn.Parameter(b.clone()))
                self.w2.append(nn.Parameter(c.clone()))
        self.opt = torch.optim.Adam(self.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i = layer * self.cfg.num_experts + e
        return self.w1[i], self.w3[i], self.w2[i]

    def moe(self, layer: int, u: torch.Tensor) -> torch.Tensor:
        """``u`` [n, d]: route every token to its top-k experts, weight by the softmax of the
        chosen logits, add up."""
        gate: nn.Linear = self.dense.gates[layer]  # type: ignore[assignment]
        logits = u @ gate.weight.T  # [n, E]
        chosen, idx = logits.topk(self.cfg.top_k, dim=-1)
        weight = chosen.softmax(dim=-1)  # [n, k]
        out = torch.zeros_like(u)
        for j in range(self.cfg.top_k):
            for e in range(self.cfg.num_experts):
                rows = (idx[:, j] == e).nonzero().flatten()
                if rows.numel() == 0:
                    continue
                w1, w3, w2 = self.expert(layer, e)
                x = u[rows]
                ffn = (F.silu(x @ w1) * (x @ w3)) @ w2
                out = out.index_add(0, rows, weight[rows, j : j + 1] * ffn)
        return out

    def loss(self, corpus: Corpus, step: int, ranks: list[int]) -> torch.Tensor:
        """Mean next-byte loss over the batches ``ranks`` draw at ``step`` (every microbatch
        of the step)."""
        k = self.cfg.microbatches
        total = self.cfg.tokens_per_rank * len(ranks) * k
        out = torch.zeros(())
        for r, i in ((r, i) for i in range(k) for r in ranks):
            x, y = corpus.batch(self.cfg, step * k + i, r)
            h = self.dense.embed(x)
            for layer in range(self.cfg.num_layers):
                a, u = self.dense.mix(layer, h)
                h = a + self.moe(layer, u).reshape(a.shape)
            out = out + self.dense.loss_sum(h, y) / total
        return out

    def train_step(self, corpus: Corpus, step: int, ranks: list[int]) -> float:
        """One optimizer step on the union of ``ranks``' batches; returns the loss."""
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(corpus, step, ranks)
        loss.backward()
        self.opt.step()
        return float(loss.detach())
