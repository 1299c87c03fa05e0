"""Per-step load sources for the simulator: a trace file's array, or loads generated
step by step so a 1,000-DC run never holds the whole ``[T, L, R, E]`` trace."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SyntheticSource"]


@dataclass(frozen=True)
class SyntheticSource:
    """Seeded synthetic loads, generated one step at a time.

    Expert popularity per layer is Zipf-like (``p_e ~ 1 / (i + 1) ** zipf`` over a seeded
    permutation ``i`` of the experts) and drifts: every ``1 / drift`` steps the hot set
    moves one expert along the permutation. Each rank draws ``tokens_per_rank * top_k``
    assignments from it (multinomial). ``step(t)`` depends only on ``(seed, t)``.
    """

    num_steps: int
    num_layers: int
    num_ranks: int
    num_experts: int
    top_k: int = 8
    tokens_per_rank: int = 8192
    zipf: float = 1.0
    drift: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_steps", "num_layers", "num_ranks", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.tokens_per_rank < 0 or self.zipf < 0 or self.drift < 0:
            raise ValueError("tokens_per_rank, zipf and drift must be >= 0")

    def popularity(self, t: int) -> np.ndarray:
        """[L, E] expert probabilities at step ``t``."""
        rng = np.random.default_rng(self.seed)
        weights = 1.0 / np.arange(1, self.num_experts + 1) ** self.zipf
        out = np.empty((self.num_layers, self.num_experts))
        shift = int(t * self.drift)
        for layer in range(self.num_layers):
            perm = rng.permutation(self.num_experts)
            out[layer, np.roll(perm, shift)] = weights
        return out / out.sum(axis=1, keepdims=True)

    def step(self, t: int) -> np.ndarray:
        """[L, R, E] int64 load of step ``t``."""
        if not 0 <= t < self.num_steps:
            raise ValueError(f"step {t} outside [0, {self.num_steps})")
        p = self.popularity(t)
        rng = np.random.default_rng([self.seed, t])
        n = self.tokens_per_rank * self.top_k
        return np.stack(
            [rng.multinomial(n, p[layer], size=self.num_ranks) for layer in range(self.num_layers)]
        ).astype(np.int64)
