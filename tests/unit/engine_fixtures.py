"""Engine statistics written as the engines write them (TensorRT-LLM's ExpertStatistic)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

E, R, K = 12, 4, 2
LAYERS = (3, 4, 5)  # a model with 3 dense layers first (DeepSeek-V3 style)
ITERS = range(100, 104)


def topk(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """[tokens, K] distinct experts per token, skewed towards low ids."""
    p = 1.0 / np.arange(1, E + 1)
    return np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(tokens)])


def write_trtllm(d: Path, seed: int = 0) -> np.ndarray:
    """TensorRT-LLM's EXPERT_STATISTIC_PATH as its ExpertStatistic writes it: meta_info.json
    from rank 0, rank{r}.safetensors with an int32 bincount per '{iter}_{layer}', and the
    co-occurrence / token files beside them (which the importer must ignore). Returns the
    expected load [T, L, R, E]."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    (d / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": K}))
    want = np.zeros((len(ITERS), len(LAYERS), R, E), np.int64)
    for r in range(R):
        records, tokens = {}, {}
        for t, it in enumerate(ITERS):
            for j, layer in enumerate(LAYERS):
                ids = torch.from_numpy(topk(rng, 16 + r))
                records[f"{it}_{layer}"] = torch.bincount(ids.flatten(), minlength=E).to(
                    torch.int32
                )
                tokens[f"{it}_{layer}"] = ids.to(torch.int32)
                np.add.at(want[t, j, r], ids.numpy().ravel(), 1)
        save_file(records, str(d / f"rank{r}.safetensors"))
        save_file(
            {"100_3": torch.zeros(E, E, dtype=torch.int32)},
            str(d / f"cooccurrence_rank{r}.safetensors"),
        )
        save_file(tokens, str(d / f"token_selected_experts_rank{r}.safetensors"))
    return want
