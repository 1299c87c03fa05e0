"""The simulator's history windows (sim/history.py): a view of back-to-back loads, or the
double buffer, give the same window (values, shape, dtype, strides) at every step."""

from __future__ import annotations

import numpy as np
import pytest

from expertmesh.sim.history import _History


def _windows(w: int, loads: list[np.ndarray]) -> tuple[list[np.ndarray], list[tuple]]:
    """The window before each push and at the end (copies but the last, which ``push`` may
    overwrite), and the (shape, dtype, strides) of each window itself, taken before copying
    (a copy is C-contiguous whatever the window's strides)."""
    h = _History(w)
    out, meta = [], []
    for x in loads:
        v = h.view((3, 4))
        meta.append((v.shape, v.dtype, v.strides))
        out.append(v.copy())
        assert v.flags.c_contiguous and v.shape[1:] == (3, 4)
        assert v.shape[0] == 0 or not v.flags.writeable  # policies only read their history
        h.push(x)
    v = h.view((3, 4))
    meta.append((v.shape, v.dtype, v.strides))
    out.append(v)
    return out, meta


@pytest.mark.parametrize("w", [0, 1, 3, 5])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("brk", [None, 4])
def test_a_view_of_the_loads_is_the_double_buffer(w, layers, brk):
    trace = np.arange(12 * layers * 3 * 4, dtype=np.int64).reshape(12, layers, 3, 4)
    views = [trace[t, 0] for t in range(12)]  # a dense source's steps of layer 0
    if brk is not None:  # a load from elsewhere: the window goes on in the buffer
        views[brk] = views[brk].copy()
    copies = [v.copy() for v in views]  # fresh arrays: always the double buffer
    (got, got_meta), (want, want_meta) = _windows(w, views), _windows(w, copies)
    assert len(got_meta) == len(want_meta) == 13
    for t, (a, b) in enumerate(zip(got, want, strict=True)):
        assert got_meta[t] == want_meta[t], t  # the windows themselves, not their copies
        assert a.shape == b.shape and a.dtype == b.dtype and a.strides == b.strides, t
        assert np.array_equal(a, b), t
        assert np.array_equal(b, trace[max(0, t - w) : t, 0] if w else trace[:0, 0]), t


def test_back_to_back_loads_are_not_copied():
    trace = np.arange(10 * 3 * 4, dtype=np.int64).reshape(10, 1, 3, 4)
    h = _History(4)
    for t in range(10):
        h.push(trace[t, 0])
    v = h.view((3, 4))
    assert np.shares_memory(v, trace) and not v.flags.writeable
    assert np.array_equal(v, trace[6:10, 0])
    assert h.buf is None
