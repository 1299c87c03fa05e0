"""The simulator's history windows: the last ``w`` loads of one layer, oldest first, as one
C-contiguous [n, R, E] array (what a policy's ``PolicyContext.history`` holds).

A dense source's steps of a one-layer trace lie back to back in one array: then the window
is a read-only view of those loads themselves and a step costs no copy. Otherwise (loads
from anywhere else, or the steps of a many-layer trace, which are not contiguous) the loads
are copied into a double buffer, each written twice so the last ``w`` are always one
contiguous slice. Either way the window is read-only, with the same values, shape, dtype
and strides, as long as the source keeps its loads as the simulator's ``LoadSource``
contract asks (the simulator keeps them for its deferred costing too).
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["_History"]


class _History:
    """Last ``w`` loads of one layer, oldest first (module doc)."""

    def __init__(self, w: int) -> None:
        self.w, self.n, self.pos = w, 0, 0
        self.buf: np.ndarray | None = None
        #: the loads of the window while they lie back to back in one array, else None
        self.run: deque[np.ndarray] | None = deque(maxlen=max(w, 1))

    def push(self, load: np.ndarray) -> None:
        if self.w == 0:
            return
        run = self.run
        if run is not None:
            if _follows(run[-1] if run else None, load):
                run.append(load)
                return
            self.run = None  # from now on the double buffer, which takes the window so far
            for x in run:
                self._write(x)
        self._write(load)

    def _write(self, load: np.ndarray) -> None:
        if self.buf is None:
            self.buf = np.zeros((2 * self.w, *load.shape), dtype=load.dtype)
        buf = self.buf
        buf[self.pos] = load
        buf[self.pos + self.w] = load
        self.pos = (self.pos + 1) % self.w
        self.n = min(self.n + 1, self.w)

    def view(self, shape: tuple[int, ...]) -> np.ndarray:
        run = self.run
        if run is not None:
            if not run:
                return np.zeros((0, *shape), dtype=np.int64)
            first = run[0]
            out: np.ndarray = np.lib.stride_tricks.as_strided(
                first, (len(run), *first.shape), (first.nbytes, *first.strides), writeable=False
            )
            return out
        if self.buf is None or self.n == 0:
            return np.zeros((0, *shape), dtype=np.int64)
        end = self.pos + self.w
        window = self.buf[end - self.n : end]
        window.flags.writeable = False  # as the view's: policies read their history only
        return window


def _follows(last: np.ndarray | None, load: np.ndarray) -> bool:
    """``load`` is C-contiguous and part of a larger array (a view), and, after ``last``
    (if any), of the same array, shape and dtype and right behind it in memory."""
    if not load.flags.c_contiguous or load.base is None:
        return False
    if last is None:
        return True
    return (
        load.base is last.base
        and load.shape == last.shape
        and load.dtype == last.dtype
        and load.__array_interface__["data"][0] == last.__array_interface__["data"][0] + last.nbytes
    )
