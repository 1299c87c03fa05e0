"""A plan's transfer encoding as the workers apply it (workers/wire.py ``WireFormat``)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.planner.costmodel import TransferEncoding
from expertmesh.workers.wire import WireFormat

BF16 = TransferEncoding(weight_bytes=2, grad_bytes=2)


def test_wire_format_of_an_encoding() -> None:
    assert WireFormat.of(None) == WireFormat() == WireFormat.of(TransferEncoding())
    assert WireFormat.of(BF16) == WireFormat(torch.bfloat16, torch.bfloat16)
    assert WireFormat.of(TransferEncoding(grad_bytes=2)) == WireFormat(grads=torch.bfloat16)
    with pytest.raises(ValueError, match="4 \\(float32\\) or 2"):
        WireFormat.of(TransferEncoding(weight_bytes=1))
    with pytest.raises(ValueError, match="changed_fraction"):
        WireFormat.of(TransferEncoding(changed_fraction=0.5))
