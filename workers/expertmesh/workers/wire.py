"""The precision expert streams travel in.

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

import torch

from expertmesh.planner.costmodel import TransferEncoding

__all__ = ["WireFormat"]

_DTYPES = {4: torch.float32, 2: torch.bfloat16}  # bytes per value on the wire -> dtype


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
