"""The data plane on CUDA (skipped where no CUDA device is present: this repository's CI
has none; docs/benchmarks.md says what ran on a GPU, where and when).

- NCCL, one rank per device: with ``n`` devices, ``n`` processes (NCCL refuses two ranks
  on one device), each training the demo model with its experts on its GPU; the result
  must equal the single-process reference computed on the CPU.
- The whole SPMD check of ``test_spmd.py`` (2 and 3 DCs of 2 ranks, random plans with
  replicas, migrations between steps and in the background, the fast loop every
  microbatch) with every rank's tensors on CUDA: NCCL where there is a device per rank,
  else gloo's CUDA collectives with the ranks sharing the devices
  (``spmd_procs.cuda_backend``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertmesh.planner import Topology
from expertmesh.planner.static import static_placement
from expertmesh.workers.model import Corpus, LMConfig
from expertmesh.workers.reference import ReferenceLM
from tests.integration.test_spmd import check_training

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]

CFG = LMConfig(num_layers=2, num_experts=4, top_k=2, hidden=8, ffn_hidden=8, seq_len=8, batch=2)
CORPUS = Corpus(b"the quick brown fox jumps over the lazy dog " * 60)


def _train_on_cuda(rank: int, world: int, store: str, out: dict) -> None:
    import datetime

    import torch.distributed as dist

    from expertmesh.workers.comm import Comm, pick_backend
    from expertmesh.workers.spmd import SpmdRank

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    backend = pick_backend(dev)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    topo = Topology.generate(1, world, masters=CFG.num_experts, spare=1)
    comm = Comm(rank, topo.rank_dc, list(range(world)), device=dev)
    p = static_placement(world, topo.slots_per_rank, CFG.num_experts, topo.masters_per_rank)
    st = SpmdRank(comm, CFG, CORPUS, [p] * CFG.num_layers, balance=True)
    out[rank] = ([st.train_step(s)["loss"] for s in range(3)], backend)
    dist.destroy_process_group()


def test_nccl_training_equals_the_cpu_reference(tmp_path) -> None:
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    out = mp.Manager().dict()
    mp.spawn(_train_on_cuda, args=(world, str(tmp_path / "store"), out), nprocs=world)
    got = np.sum([out[r][0] for r in range(world)], axis=0)
    assert {out[r][1] for r in range(world)} == {"nccl"}
    ref = ReferenceLM(CFG)
    want = [ref.train_step(CORPUS, s, list(range(world))) for s in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.parametrize(
    ("dcs", "balance", "k", "background"),
    [(2, False, 1, False), (3, True, 2, False), (3, True, 2, True)],
)
def test_spmd_on_cuda_equals_the_cpu_reference(
    dcs: int, balance: bool, k: int, background: bool
) -> None:
    """Looser than on the CPU (losses rtol 1e-4, weights atol 1e-5): CUDA's kernels sum
    in another order than the CPU's; a wrong route or update is off by the learning rate
    (3e-3) times the step's direction, far above either bound."""
    check_training(dcs, balance, k, background, True, True, device="cuda", rtol=1e-4, atol=1e-5)
