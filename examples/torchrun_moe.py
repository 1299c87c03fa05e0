"""A plain ``torchrun`` trainer (no Ray) of a model of its own with two expert-parallel
:class:`~expertmesh.workers.layer.MoELayer`\\s, following the plans of ``expertmesh serve``.

Start the controller, then the trainer (one process per rank of the topology):

    expertmesh serve --topology examples/small-topology.yaml --layers 2 --experts 16 \\
        --top-k 2 --policy eplb --policy-settings '{"period": 1, "window": 4}' --every 5
    torchrun --nproc-per-node 8 examples/torchrun_moe.py --target 127.0.0.1:8701 \\
        --topology examples/small-topology.yaml --experts 16 --steps 40

Every rank belongs to the DC the topology file gives it (rank ``r`` is the ``r``-th rank
of the file), so the world size must equal the file's ranks. The backend is gloo on CPU
and NCCL when CUDA is present. What the trainer does each step:

1. forward and backward through its own model: a linear stem, per layer a residual
   ``h + MoELayer(norm(h))`` whose router is deliberately skewed (low-numbered experts are
   hot), a linear head, the mean squared error against a fixed teacher;
2. queues this step's per-layer expert counts for a background thread that streams them
   to the controller (``ExpertMeshClient``; a step never waits on the network);
3. one all-reduce carries the dense gradients, the world's expert counts, the loss and
   the newest plan version every rank has received (the minimum rides along); the dense
   parameters step with the trainer's own ``torch.optim.Adam``, the experts with
   :class:`~expertmesh.workers.experts.ExpertParallel`;
4. when every rank has received a newer plan than the committed one, all switch to it at
   this step boundary: the migration moves copies and master state between ranks, then
   every layer routes by the new placement.

``--json PATH``: rank 0 writes the world's losses, the plans applied, every rank's final
plan version and report counts. A bad argument or a world that does not fit the topology:
one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from expertmesh.formats import read_topology
from expertmesh.planner import Topology
from expertmesh.planner.plan import Migration
from expertmesh.planner.rounds import migration_rounds
from expertmesh.planner.static import static_placement
from expertmesh.v1.convert import ReceivedPlan
from expertmesh.workers.client import ExpertMeshClient
from expertmesh.workers.comm import KINDS, Comm, pick_backend
from expertmesh.workers.experts import ExpertParallel
from expertmesh.workers.layer import LayerPlan, MoELayer

REPO = Path(__file__).resolve().parents[1]


class SkewedGate(nn.Linear):
    """A router whose logits carry a fixed skew: low-numbered experts are hot."""

    skew: torch.Tensor

    def __init__(self, hidden: int, num_experts: int, skew: float) -> None:
        super().__init__(hidden, num_experts, bias=False)
        self.register_buffer("skew", torch.linspace(skew, -skew, num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.skew


class MoEBlock(nn.Module):
    def __init__(self, moe: MoELayer, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.moe = moe

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


class Model(nn.Module):
    """Stem, MoE blocks, head; ``blocks[i].moe`` holds only this rank's experts."""

    def __init__(self, hidden: int, moes: list[MoELayer]) -> None:
        super().__init__()
        self.stem = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(MoEBlock(m, hidden) for m in moes)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def init_expert(
    seed: int, layer: int, expert: int, d: int, f: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W1, W3 [d, f], W2 [f, d]: the same on every rank (every copy starts equal)."""
    g = torch.Generator().manual_seed(7919 * seed + 101 * layer + expert)
    w1 = torch.randn(d, f, generator=g) / d**0.5
    w3 = torch.randn(d, f, generator=g) / d**0.5
    w2 = torch.randn(f, d, generator=g) / f**0.5 / 2
    return w1, w3, w2


class Reporter:
    """Streams per-step counts to the controller from a background thread."""

    def __init__(self, client: ExpertMeshClient, rank: int) -> None:
        self.client, self.rank = client, rank
        self.q: queue.Queue[Any] = queue.Queue(maxsize=256)
        self.queued = self.dropped = self.accepted = 0
        self.error = ""
        self.thread = threading.Thread(target=self._run, name="expertmesh-report", daemon=True)
        self.thread.start()

    def put(self, step: int, counts: np.ndarray) -> None:
        """Queue ``counts`` [L, E] of ``step``; never waits (a full queue drops the step)."""
        try:
            self.q.put_nowait((step, counts.copy()))
            self.queued += 1
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        stream = None
        try:
            stream = self.client.open_report_stream(batch=64)
            while (item := self.q.get()) is not None:
                step, counts = item
                for layer, row in enumerate(counts):
                    stream.send(step, layer, self.rank, row)
                stream.flush()
            self.accepted = stream.close()
        except Exception as err:  # the controller is gone or refused: training goes on
            self.error = f"{type(err).__name__}: {err}".splitlines()[0]
            if stream is not None:
                stream.cancel()

    def close(self, timeout: float = 30.0) -> None:
        try:
            self.q.put(None, timeout=timeout)
        except queue.Full:
            self.error = self.error or "report queue stuck"
        self.thread.join(timeout)


class Plans:
    """Plans committed by the controller, as they arrive (a background ``WatchPlans``)."""

    def __init__(self, client: ExpertMeshClient, topo: Topology, layers: int, experts: int):
        self.client, self.topo, self.layers, self.experts = client, topo, layers, experts
        self.lock = threading.Lock()
        self.got: dict[int, ReceivedPlan] = {}
        self.refused: dict[int, str] = {}
        self.received = 0  # the newest version received
        self.stop = threading.Event()
        self.watch: Any = None
        self.thread = threading.Thread(target=self._run, name="expertmesh-plans", daemon=True)
        self.thread.start()

    def fits(self, plan: ReceivedPlan) -> str:
        """Why ``plan`` cannot be applied to this model (empty: it can)."""
        shape = (self.topo.num_ranks, self.topo.slots_per_rank)
        if len(plan.layers) != self.layers:
            return f"{len(plan.layers)} layers, the model has {self.layers}"
        for lp in plan.layers:
            if lp.phy2log.shape != shape or lp.placement.master.size != self.experts:
                return (
                    f"phy2log {lp.phy2log.shape} and {lp.placement.master.size} experts, "
                    f"the model needs {shape} and {self.experts}"
                )
        return ""

    def add(self, plan: ReceivedPlan) -> None:
        why = self.fits(plan)
        with self.lock:
            if why:
                self.refused[plan.version] = why
            else:
                self.got[plan.version] = plan
                self.received = max(self.received, plan.version)

    def _run(self) -> None:
        while not self.stop.is_set():  # reconnects while the controller is away
            try:
                self.watch = self.client.watch_plans(include_route=True)
                for plan in self.watch:
                    self.add(plan)
            except Exception:
                pass
            self.stop.wait(1.0)

    def newest(self) -> int:
        with self.lock:
            return max(self.got, default=0)

    def take(self, version: int) -> ReceivedPlan:
        """Plan ``version`` (asked for when the watch skipped it); older ones are dropped."""
        with self.lock:
            plan = self.got.get(version)
            self.got = {v: p for v, p in self.got.items() if v > version}
        if plan is None:
            plan = self.client.get_plan(version, include_route=True)
            if plan is None or self.fits(plan):
                raise RuntimeError(f"plan {version} every rank agreed on is gone or does not fit")
        return plan

    def close(self) -> None:
        self.stop.set()
        if self.watch is not None:
            self.watch.cancel()
        self.thread.join(5)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:8701", help="gRPC address of expertmesh serve")
    p.add_argument("--token", default=os.environ.get("EXPERTMESH_TOKEN"))
    p.add_argument("--topology", type=Path, default=REPO / "examples" / "small-topology.yaml")
    p.add_argument("--experts", type=int, default=None, help="per layer (default: master slots)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--ffn-hidden", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--skew", type=float, default=2.0, help="router logit skew (0: none)")
    p.add_argument("--balance", action="store_true", help="the fast loop inside each DC")
    p.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="rank 0 writes the run's summary")
    args = p.parse_args(argv)
    for name in ("layers", "top_k", "hidden", "ffn_hidden", "tokens", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def setup(args: argparse.Namespace) -> tuple[Topology, int, int, torch.device]:
    """The topology, this rank, the expert count and the device; refuses a misfit world."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("RANK/WORLD_SIZE are not set: launch with torchrun")
    topo = read_topology(args.topology)
    world = int(os.environ["WORLD_SIZE"])
    if world != topo.num_ranks:
        raise ValueError(
            f"the world has {world} processes but {args.topology} has {topo.num_ranks} ranks "
            f"({', '.join(f'{d.name}: {d.num_ranks}' for d in topo.dcs)}); "
            f"use --nproc-per-node {topo.num_ranks} or another topology"
        )
    experts = args.experts or topo.num_ranks * topo.masters_per_rank
    if not args.top_k <= experts <= topo.num_ranks * topo.masters_per_rank:
        raise ValueError(
            f"--experts {experts}: needs top-k {args.top_k} <= experts <= "
            f"{topo.num_ranks * topo.masters_per_rank} master slots of {args.topology}"
        )
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return topo, int(os.environ["RANK"]), experts, device


def train(args: argparse.Namespace, topo: Topology, rank: int, experts: int, device: Any) -> None:
    timeout = datetime.timedelta(seconds=args.timeout_s)
    dist.init_process_group(pick_backend(device), timeout=timeout)
    comm = Comm(rank, topo.rank_dc, list(range(topo.num_ranks)), device=device,
                timeout_s=args.timeout_s)  # fmt: skip
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the dense model starts equal on every rank
    d, f, L, E = args.hidden, args.ffn_hidden, args.layers, experts
    current = [
        static_placement(topo.num_ranks, topo.slots_per_rank, E, topo.masters_per_rank)
    ] * L  # the controller's baseline before its first plan
    moes = []
    for layer in range(L):
        plan = LayerPlan(current[layer], np.zeros((0, 4), np.int64))
        mine = {e: init_expert(args.seed, layer, e, d, f) for e in plan.held_by(rank)}
        moes.append(MoELayer(
            comm, plan, mine, top_k=args.top_k, ffn_hidden=f, gate=SkewedGate(d, E, args.skew),
            balance=args.balance,
        ))  # fmt: skip
    model = Model(d, moes).to(device)
    expert_ids = {id(p) for m in moes for p in m.experts.values()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    opt = torch.optim.Adam(dense, lr=args.lr)
    ep = ExpertParallel(comm, moes, lr=args.lr)
    teacher = torch.Generator().manual_seed(10_000 + args.seed)
    a = (torch.randn(d, d, generator=teacher) / d**0.5).to(device)
    b = (torch.randn(d, d, generator=teacher) / d**0.5).to(device)

    client = ExpertMeshClient(args.target, token=args.token)
    reporter, plans = Reporter(client, rank), Plans(client, topo, L, E)
    R = topo.num_ranks
    losses, imbalance, applied = [], [], []
    t0 = time.perf_counter()
    try:
        for step in range(args.steps):
            offer = plans.newest()
            g = torch.Generator().manual_seed(1_000_003 * args.seed + 1009 * step + rank)
            x = torch.randn(args.tokens, d, generator=g).to(device)
            y = torch.tanh(x @ a) @ b
            opt.zero_grad(set_to_none=True)
            for m in moes:
                for p in m.experts.values():
                    p.grad = None
            loss = ((model(x) - y) ** 2).sum() / (args.tokens * R * d)
            loss.backward()
            for m in moes:  # the fast loop's replicas' gradients back home (no-op without)
                m.return_replica_grads()
            counts = np.stack([m.counts for m in moes])  # [L, E] this rank's assignments
            reporter.put(step, counts)
            computed = np.zeros((L, R), np.float32)
            computed[:, rank] = [m.computed for m in moes]
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in dense]
                + [torch.from_numpy(np.concatenate([counts.reshape(-1).astype(np.float32),
                                                    computed.reshape(-1)])).to(device),
                   loss.detach().reshape(1), torch.tensor([float(offer)], device=device)]
            )  # fmt: skip
            # summed inside each DC, across the DC leaders once, then back inside the DC;
            # the offered plan version takes the minimum
            comm.all_reduce(flat, comm.my_dc, min_tail=1)
            if comm.leaders.size > 1 and rank == comm.leader:
                comm.all_reduce(flat, comm.leaders, min_tail=1)
            comm.broadcast(flat, comm.leader, comm.my_dc)
            at = 0
            for p in dense:
                p.grad = flat[at : at + p.numel()].reshape(p.shape).clone()
                at += p.numel()
            opt.step()
            tail = flat[at:].cpu().numpy()
            world_counts = np.rint(tail[: L * E]).astype(np.int64).reshape(L, E)
            per_rank = tail[L * E : L * E + L * R].reshape(L, R)
            ep.step(world_counts)
            losses.append(float(tail[-2]))
            imbalance.append(float((per_rank.max(1) / np.maximum(per_rank.mean(1), 1)).max()))
            agreed = int(tail[-1])
            if agreed > ep.version:  # every rank has it: switch at this boundary, together
                received = plans.take(agreed)
                new = [lp.placement for lp in received.layers]
                rounds = migration_rounds(current, new, [Migration()] * L, topo)
                layers = [
                    (p.phy2log, p.master, lp.route)
                    for p, lp in zip(new, received.layers, strict=True)
                ]
                sent = ep.apply_plan(agreed, layers, rounds)
                current = new
                applied.append({
                    "step": step, "version": agreed,
                    "transfers": sum(len(r) for r in rounds),  # copies and master states moved
                    "cross_dc_bytes_rank0": int(sent.sum()) if rank == 0 else None,
                })  # fmt: skip
            if rank == 0:
                print(
                    f"step {step:3d}  loss {losses[-1]:.5f}  plan v{ep.version}  max/mean "
                    f"assignments per rank {imbalance[-1]:.2f}",
                    flush=True,
                )
    finally:
        plans.close()
        reporter.close()
        client.close()
    seconds = time.perf_counter() - t0
    row = np.array([ep.version, reporter.queued, reporter.accepted, reporter.dropped,
                     plans.received, len(applied)], np.int64)  # fmt: skip
    rows = comm.all_gather_rows(row, comm.world)  # [R, 6]
    if rank == 0:
        if reporter.error:
            print(f"rank 0: load reports failed: {reporter.error}", file=sys.stderr)
        summary = {
            "backend": pick_backend(device),
            "device": str(device),
            "world_size": R,
            "dcs": [dc.name for dc in topo.dcs],
            "rank_dc": topo.rank_dc.tolist(),
            "layers": L,
            "experts": E,
            "steps": args.steps,
            "losses": losses,
            "imbalance": imbalance,
            "applied": applied,
            "final_versions": rows[:, 0].tolist(),
            "reports_queued": rows[:, 1].tolist(),
            "reports_accepted": rows[:, 2].tolist(),
            "reports_dropped": rows[:, 3].tolist(),
            "newest_received": rows[:, 4].tolist(),
            "plans_refused": plans.refused,
            "cross_dc_bytes_rank0": dict(zip(KINDS, comm.bytes.sum(axis=(1, 2)).tolist(), strict=True)),
            "seconds": seconds,
        }  # fmt: skip
        if args.json is not None:
            args.json.write_text(json.dumps(summary, indent=1))
        print(
            f"done: {args.steps} steps in {seconds:.1f} s, loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}, plans applied {[a['version'] for a in applied]}",
            flush=True,
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        topo, rank, experts, device = setup(args)
    except (ValueError, OSError) as err:
        print(f"torchrun_moe: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    train(args, topo, rank, experts, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
