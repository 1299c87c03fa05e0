"""The demo's MoE language model: byte tokens, a causal convolution mixer, MoE layers.

Every rank holds the same *dense* part (embedding, mixers, gates, norms; data
parallel, gradients all-reduced) and the expert FFNs of the slots it holds
(expert parallel). An expert is a gated FFN ``(silu(x W1) * (x W3)) W2`` with
``3 * hidden * ffn_hidden`` parameters, the size :class:`ModelSpec` assumes.
Gating is top-k over a linear router, the weights a softmax over the k chosen
logits; there is no auxiliary loss.

Shapes: ``n`` tokens on a rank (``batch * seq``), ``d`` hidden, ``f`` expert
FFN width, ``E`` experts, ``k`` top-k.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional as F

from expertmesh.planner.model import ModelSpec

__all__ = [
    "VOCAB",
    "BalancedGate",
    "Corpus",
    "DenseModel",
    "ExpertWeights",
    "LMConfig",
    "expert_forward",
    "init_expert",
    "stdlib_corpus",
]

VOCAB = 256  # byte-level tokens


class LMConfig(BaseModel):
    """Sizes and training settings of the demo model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(default=2, ge=1, le=64, description="MoE layers")
    num_experts: int = Field(default=12, ge=1, le=4096, description="experts per layer, E")
    top_k: int = Field(default=2, ge=1, le=16, description="experts per token")
    hidden: int = Field(default=32, ge=4, le=4096, description="model width d")
    ffn_hidden: int = Field(default=64, ge=4, le=16384, description="expert FFN width f")
    kernel: int = Field(default=4, ge=1, le=64, description="causal conv mixer width")
    seq_len: int = Field(default=64, ge=2, le=8192, description="tokens per sequence")
    batch: int = Field(default=16, ge=1, le=4096, description="sequences per rank per microbatch")
    microbatches: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="microbatches per optimizer step (gradients accumulate; replicas sync "
        "and plans switch once per step)",
    )
    lr: float = Field(default=3e-3, gt=0, le=1.0, description="Adam learning rate")
    router: Literal["learned", "balanced"] = Field(
        default="learned",
        description="learned: each token's top-k of the gate's logits; balanced (for "
        "benchmarks, as Megatron's force load balancing): assignment j of a rank's token t "
        "goes to expert (t * k + j) mod E whatever the logits, so every expert gets the "
        "same count on every rank, weighted by the softmax of the gate's logits of the "
        "experts it goes to (the reference supports learned only)",
    )
    seed: int = Field(default=0, ge=0, description="weights and data seed")

    @property
    def tokens_per_rank(self) -> int:
        return self.batch * self.seq_len

    def spec(self) -> ModelSpec:
        """The planner's view: fp32 weights, grads and activations; Adam keeps m and v."""
        return ModelSpec(
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden=self.hidden,
            ffn_hidden=self.ffn_hidden,
            weight_bytes=4,
            grad_bytes=4,
            act_bytes=4,
            optimizer_bytes=8,
            training=True,
        )


ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # W1 [d, f], W3 [d, f], W2 [f, d]


def init_expert(cfg: LMConfig, layer: int, expert: int) -> ExpertWeights:
    """The initial weights of ``expert`` in ``layer``: the same on every rank for a seed."""
    g = torch.Generator().manual_seed(1_000_003 * (cfg.seed + 1) + 1009 * layer + expert)
    d, f = cfg.hidden, cfg.ffn_hidden
    w1 = torch.randn(d, f, generator=g) / math.sqrt(d)
    w3 = torch.randn(d, f, generator=g) / math.sqrt(d)
    w2 = torch.randn(f, d, generator=g) / math.sqrt(f) / math.sqrt(2 * cfg.num_layers)
    return w1, w3, w2


def expert_forward(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """[m, d] -> [m, d] through one gated expert FFN."""
    w1, w3, w2 = w
    return (F.silu(x @ w1) * (x @ w3)) @ w2


class _RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _ConvMixer(nn.Module):
    """Causal depthwise convolution over time, then a pointwise projection."""

    def __init__(self, d: int, kernel: int) -> None:
        super().__init__()
        self.norm = _RMSNorm(d)
        self.conv = nn.Conv1d(d, d, kernel, groups=d)
        self.proj = nn.Linear(d, d)
        self.kernel = kernel

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, d]
        x = self.norm(h).transpose(1, 2)  # [B, d, T]
        x = F.pad(x, (self.kernel - 1, 0))
        return h + self.proj(F.silu(self.conv(x).transpose(1, 2)))


class BalancedGate(nn.Linear):
    """A gate whose top-k is forced (``LMConfig.router="balanced"``): the learned logits
    ``[n, E]`` plus, on the k experts ``(t * k + j) mod E`` of token ``t``, more than the
    row's range, so top-k picks them and their softmax weights are the learned logits'."""

    def __init__(self, d: int, num_experts: int, top_k: int) -> None:
        super().__init__(d, num_experts, bias=False)
        self.top_k = top_k

    def forward(self, u: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, E]
        logits = super().forward(u)
        n, num_experts = logits.shape
        forced = torch.zeros_like(logits, dtype=torch.bool)
        slots = torch.arange(n * self.top_k, device=u.device)
        forced.view(-1)[(slots // self.top_k) * num_experts + slots % num_experts] = True
        with torch.no_grad():
            lift = (logits.amax(-1, keepdim=True) - logits.amin(-1, keepdim=True)) + 1.0
        return logits + forced * lift


class DenseModel(nn.Module):
    """Everything but the experts. Same initial weights on every rank for a seed."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        d = cfg.hidden
        self.embed = nn.Embedding(VOCAB, d)
        nn.init.normal_(self.embed.weight, std=0.5)
        self.mixers = nn.ModuleList(_ConvMixer(d, cfg.kernel) for _ in range(cfg.num_layers))
        self.moe_norms = nn.ModuleList(_RMSNorm(d) for _ in range(cfg.num_layers))
        self.gates = nn.ModuleList(
            BalancedGate(d, cfg.num_experts, cfg.top_k)
            if cfg.router == "balanced"
            else nn.Linear(d, cfg.num_experts, bias=False)
            for _ in range(cfg.num_layers)
        )
        self.final_norm = _RMSNorm(d)

    def mix(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixer of ``layer`` on ``h`` [B, T, d]: returns the residual stream ``a`` [B, T, d]
        and the MoE input ``u`` [B*T, d]."""
        a = self.mixers[layer](h)
        return a, self.moe_norms[layer](a).reshape(-1, self.cfg.hidden)

    def gate(self, layer: int, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k gating of ``u`` [n, d]: experts ``idx`` [n, k] int64 and weights [n, k]."""
        logits = self.gates[layer](u)  # [n, E]
        top, idx = torch.topk(logits, self.cfg.top_k, dim=-1)
        return idx, torch.softmax(top, dim=-1)

    def loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed next-byte cross entropy of ``h`` [B, T, d] against ``targets`` [B, T]."""
        logits = self.final_norm(h) @ self.embed.weight.T / math.sqrt(self.cfg.hidden)  # [B, T, V]
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


def stdlib_corpus(max_bytes: int = 4_000_000) -> bytes:
    """Text that ships with Python: the standard library's ``.py`` files, sorted by path,
    concatenated up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[bytes] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if not out:
        raise FileNotFoundError(f"no .py files under {root}")
    return b"".join(out)[:max_bytes]


class Corpus:
    """Byte corpus and the deterministic batches every rank draws from it."""

    def __init__(self, data: bytes) -> None:
        if len(data) < 16:
            raise ValueError(f"the corpus has {len(data)} bytes; need at least 16")
        self.data = np.frombuffer(data, dtype=np.uint8)

    @classmethod
    def load(cls, path: str | None, max_bytes: int = 4_000_000) -> Corpus:
        """``path`` (any file, read as bytes) or, for ``None``, :func:`stdlib_corpus`."""
        return cls(stdlib_corpus(max_bytes) if path is None else Path(path).read_bytes())

    def batch(
        self, cfg: LMConfig, step: int, rank: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets [batch, seq_len] int64 of ``rank`` at ``step``.

        The last tenth of the corpus is ``split="val"``. Same arguments, same batch.
        """
        if len(self.data) < cfg.seq_len + 2:
            raise ValueError(f"the corpus ({len(self.data)} bytes) is shorter than seq_len + 2")
        cut = int(len(self.data) * 0.9)
        lo, hi = (0, cut) if split == "train" else (cut, len(self.data))
        hi = max(hi - cfg.seq_len - 1, lo + 1)
        rng = np.random.default_rng([cfg.seed, step, rank, 0 if split == "train" else 1])
        starts = rng.integers(lo, hi, size=cfg.batch)
        rows = np.stack([self.data[s : s + cfg.seq_len + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
