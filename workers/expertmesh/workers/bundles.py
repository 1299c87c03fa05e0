"""The MoE layer's token bundles on the wire: per destination rank, its distinct tokens
``x`` [u, d], then the assignments' gate weights ``w`` [m], then their int32 metadata
[m, cols] travelling bit for bit inside the float32 buffer (column 0 a token's row in the
bundle; the others what the stage needs: expert, destination rank). One layout for the
sender (:func:`pack`) and the receiver (:func:`unpack`), so the two cannot disagree;
autograd flows through ``x`` and ``w`` (the metadata carries no gradient). Expert tensors
(weights, gradients, Adam state) travel laid end to end; :func:`unflatten` cuts them out."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ix", "lengths", "pack", "unflatten", "unpack"]


def ix(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as an int64 index tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def _bits(meta: np.ndarray, device: torch.device) -> torch.Tensor:
    """int32 metadata travelling inside a float32 buffer (bit for bit, no gradient)."""
    return torch.from_numpy(meta.astype(np.int32)).view(torch.float32).to(device)


def _ints(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int32).numpy().astype(np.int64)


def lengths(sizes: np.ndarray, d: int, cols: int) -> list[int]:
    """Floats of each bundle: ``sizes`` [G, 2] (tokens, assignments) per peer."""
    return [int(s[0]) * d + int(s[1]) * (1 + cols) for s in sizes]


def pack(
    x: torch.Tensor,
    w: torch.Tensor,
    bundles: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    dev: torch.device,
) -> list[torch.Tensor]:
    """The parts of one buffer holding ``bundles`` in order, each ``(rows, ids, meta)``:
    the tokens ``x[rows]`` ([u] rows of ``x`` [n, d]), the weights ``w[ids]`` ([m] of
    ``w`` [M]) and ``meta`` [m, cols] int; index tensors on ``dev``."""
    parts: list[torch.Tensor] = []
    for rows, ids, meta in bundles:
        parts += [x[ix(rows, dev)].reshape(-1), w[ix(ids, dev)], _bits(meta.reshape(-1), dev)]
    return parts


def unpack(
    buf: torch.Tensor, got: np.ndarray, d: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The bundles in ``buf`` from each peer in order, ``got`` [G, 2] (tokens, assignments)
    per peer: their tokens ``x`` [U, d] and weights ``w`` [M] concatenated, and ``meta``
    [M, cols] whose column 0 is each assignment's row of ``x`` (the bundle's row plus the
    rows of the bundles before it)."""
    xs, ws, metas = [], [], []
    row = at = 0
    for nu, nm in got.tolist():
        xs.append(buf[at : at + nu * d].reshape(nu, d))
        ws.append(buf[at + nu * d : at + nu * d + nm])
        meta = _ints(buf[at + nu * d + nm : at + nu * d + nm * (1 + cols)]).reshape(nm, cols)
        meta[:, 0] += row
        metas.append(meta)
        row, at = row + nu, at + nu * d + nm * (1 + cols)
    x = torch.cat(xs) if xs else buf.new_zeros(0, d)
    w = torch.cat(ws) if ws else buf.new_zeros(0)
    return x, w, np.concatenate(metas) if metas else np.zeros((0, cols), np.int64)


def unflatten(
    flat: torch.Tensor, shapes: list[torch.Size], count: int, *, clone: bool
) -> list[list[torch.Tensor]]:
    """``count`` groups of tensors of ``shapes`` laid end to end in ``flat`` (views, or
    copies with ``clone``)."""
    out, at = [], 0
    for _ in range(count):
        ts = []
        for s in shapes:
            n = int(np.prod(s))
            t = flat[at : at + n].reshape(s)
            ts.append(t.clone() if clone else t)
            at += n
        out.append(ts)
    return out
