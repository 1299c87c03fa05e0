"""A plain PyTorch MoE training loop (no Ray) that reports its expert load to
`expertmesh serve` over gRPC and applies the plans it receives as a log2phy remap.

Start the controller, then the trainer:

    expertmesh serve --topology examples/small-topology.yaml --layers 2 --experts 16 \
        --policy eplb --policy-settings '{"period": 1, "window": 4}' --every 5
    python examples/train_with_hook.py --target 127.0.0.1:8701 --ranks 8 --steps 60

Each of the `--ranks` model replicas stands in for one data-parallel trainer process
(in a real job every process builds one LoadHook with its own rank). The router is
deliberately skewed, so a few experts are hot; once a plan arrives, tokens go to the
physical copies the plan placed, and the printed per-rank imbalance drops.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from torch import nn

from expertmesh.workers.client import ExpertMeshClient
from expertmesh.workers.hook import LoadHook


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts)
        self.top_k = top_k
        with torch.no_grad():  # a skewed gate: low-numbered experts are hot
            self.gate.bias.copy_(torch.linspace(2.0, -2.0, num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.gate(x).softmax(-1).topk(self.top_k, dim=-1)
        return weights, ids


class MoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = Router(hidden, num_experts, top_k)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)  # [T, k]
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            out.index_add_(0, tok, weights[tok, slot, None] * self.experts[e](x[tok]))
        return x + out


class Model(nn.Module):
    def __init__(self, layers: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.moe = nn.ModuleList(MoE(hidden, num_experts, top_k) for _ in range(layers))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.moe:
            x = m(x)
        return self.head(x).squeeze(-1)


def rank_imbalance(
    hook: LoadHook, model: Model, x: torch.Tensor, layer: int, num_ranks: int
) -> tuple[float, float | None]:
    """max/mean tokens per rank for this batch: under static EP (expert e on rank e*R//E)
    and with ids remapped by the latest plan (None before any plan)."""
    plan = hook.plan
    with torch.no_grad():
        _, ids = model.moe[layer].router(x)
    static = torch.bincount((ids * num_ranks // hook.num_experts).reshape(-1), minlength=num_ranks)
    static_imb = float(static.max() / static.float().mean())
    if plan is None:
        return static_imb, None
    slots = plan.layers[layer].phy2log.shape[1]
    phys = hook.remap(layer, ids)
    per_rank = torch.bincount((phys // slots).reshape(-1), minlength=num_ranks).float()
    return static_imb, float(per_rank.max() / per_rank.mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:8701", help="gRPC address of expertmesh serve")
    p.add_argument("--token", default=os.environ.get("EXPERTMESH_TOKEN"))
    p.add_argument("--ranks", type=int, default=8, help="trainer ranks (must match the topology)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    gen = np.random.default_rng(args.seed)
    client = ExpertMeshClient(args.target, token=args.token)
    client.wait_ready(timeout=30)
    base = Model(args.layers, args.hidden, args.experts, args.top_k)
    models, hooks, opts = [], [], []
    for rank in range(args.ranks):
        m = Model(args.layers, args.hidden, args.experts, args.top_k)
        m.load_state_dict(base.state_dict())  # data-parallel replicas start equal
        h = LoadHook(client, rank=rank, num_experts=args.experts, watch=(rank == 0))
        for layer, moe in enumerate(m.moe):
            h.attach(moe.router, layer)
        models.append(m)
        hooks.append(h)
        opts.append(torch.optim.SGD(m.parameters(), lr=1e-2))
    target_w = torch.randn(args.hidden)
    try:
        for step in range(args.steps):
            losses = []
            for m, opt in zip(models, opts, strict=True):
                x = torch.from_numpy(gen.standard_normal((args.tokens, args.hidden))).float()
                loss = nn.functional.mse_loss(m(x), x @ target_w)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss))
            for h in hooks:
                h.step(step)
                if h is not hooks[0]:
                    h.plan = hooks[0].plan  # one watcher shares the plan with the replicas
            x = torch.from_numpy(gen.standard_normal((args.tokens, args.hidden))).float()
            static, planned = rank_imbalance(hooks[0], models[0], x, 0, args.ranks)
            plan = hooks[0].plan
            print(
                f"step {step:3d}  loss {np.mean(losses):8.4f}  plan "
                f"{'v' + str(plan.version) if plan else '-':>4}  layer-0 max/mean tokens per "
                f"rank: static {static:.3f}, plan {'-' if planned is None else f'{planned:.3f}'}",
                flush=True,
            )
    finally:
        for h in hooks:
            h.close()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
