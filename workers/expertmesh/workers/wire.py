"""What a packet is on the wire: numpy arrays, and the precision expert streams travel in.

Packets travel between ranks as numpy arrays (pickling a numpy array costs a small
fraction of pickling a torch tensor). numpy has no bfloat16, so a bfloat16 tensor
travels as its raw 16-bit pattern (:class:`Bf16Bits`) and is a bfloat16 tensor again on
arrival; :func:`payload_nbytes` counts what crosses, so the link shaper books the real
bytes.

:class:`WireFormat` is a plan's transfer encoding
(:class:`~expertmesh.planner.costmodel.TransferEncoding`) as the runtime applies it to
the *expert streams*: replica refreshes and migration copies (weights), replica
gradients (gradients). 4 bytes: float32, sent as held (bit for bit); 2 bytes: bfloat16,
cast (round to nearest even) by the sender and widened to float32 by the receiver, which
accumulates and stores in float32. Masters, their Adam state and the dense model's
gradients always stay float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from expertmesh.planner.costmodel import TransferEncoding

__all__ = ["Bf16Bits", "WireFormat", "from_wire", "payload_nbytes", "to_wire", "widen"]

_DTYPES = {4: torch.float32, 2: torch.bfloat16}  # bytes per value on the wire -> dtype


@dataclass(frozen=True)
class Bf16Bits:
    """A bfloat16 tensor on the wire: ``bits`` int16 with the tensor's shape."""

    bits: np.ndarray


def to_wire(obj: Any) -> Any:
    """A packet with every tensor as a numpy array (only the viewed rows, never the whole
    storage a view shares); bfloat16 tensors as :class:`Bf16Bits`."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.dtype == torch.bfloat16:
            return Bf16Bits(t.contiguous().view(torch.int16).numpy())
        return t.numpy()
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_wire(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_wire(v) for v in obj)
    return obj


def from_wire(obj: Any) -> Any:
    """Inverse of :func:`to_wire`: arrays back to (writable) tensors."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj if obj.flags.writeable else obj.copy())
    if isinstance(obj, Bf16Bits):
        bits = obj.bits if obj.bits.flags.writeable else obj.bits.copy()
        return torch.from_numpy(bits).view(torch.bfloat16)
    if isinstance(obj, dict):
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_wire(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_wire(v) for v in obj)
    return obj


def payload_nbytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in a packet (what crosses the wire)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, Bf16Bits):
        return int(obj.bits.nbytes)
    if isinstance(obj, dict):
        return sum(payload_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(payload_nbytes(v) for v in obj)
    return 8


@dataclass(frozen=True)
class WireFormat:
    """The dtypes expert ``weights`` (refreshes, migration copies) and replica ``grads``
    travel in."""

    weights: torch.dtype = torch.float32
    grads: torch.dtype = torch.float32

    @classmethod
    def of(cls, encoding: TransferEncoding | None, model_bytes: int = 4) -> WireFormat:
        """The runtime's form of ``encoding`` (None: float32) for a model holding
        ``model_bytes`` per value. ``ValueError`` for what the runtime cannot send: bytes
        other than 4 (float32) or 2 (bfloat16), or a changed-bytes-only refresh
        (``changed_fraction < 1``: every weight changes at every Adam step here)."""
        if encoding is None:
            return cls()
        if encoding.changed_fraction < 1.0:
            raise ValueError(
                "the runtime sends whole tensors: changed_fraction must be 1 "
                f"(got {encoding.changed_fraction})"
            )
        dtypes = []
        for what, nbytes in (("weight", encoding.weight_bytes), ("grad", encoding.grad_bytes)):
            b = model_bytes if nbytes is None else nbytes
            if b not in _DTYPES:
                raise ValueError(
                    f"the runtime sends 4 (float32) or 2 (bfloat16) bytes per {what}, not {b:g}"
                )
            dtypes.append(_DTYPES[int(b)])
        return cls(dtypes[0], dtypes[1])

    @property
    def lossy_weights(self) -> bool:
        return self.weights != torch.float32

    def send_weights(self, ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Expert weights as they leave (copies: the sender may change its own later)."""
        return _cast(ts, self.weights)

    def send_grads(self, ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Replica gradients as they leave."""
        return _cast(ts, self.grads)


def _cast(ts: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.detach().clone() if t.dtype == dtype else t.detach().to(dtype) for t in ts]


def widen(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Received expert tensors in float32 (float32 ones unchanged, no copy)."""
    return [t.float() for t in ts]
