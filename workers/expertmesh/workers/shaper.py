"""Link shaper: make a one-machine cluster behave like DCs joined by slow WAN links.

Every byte that crosses a DC pair (tokens, gradients, weights, both directions)
asks the shaper for its slot on that pair's link. Each ordered DC pair
``(a, b)`` is a token bucket without burst, i.e. a FIFO link: a message of
``nbytes`` starts when the link is free, occupies it for ``nbytes /
bandwidth`` seconds, and arrives ``latency`` later. The sender sleeps until
arrival, so throughput over a pair never exceeds the topology's bandwidth
however many ranks send at once, and a message never arrives before its
latency. Bandwidth and latency come from :class:`Topology` (``dc_gbps``,
``dc_latency_ms``). Traffic inside a DC is not shaped (``intra_dc`` links
are three orders of magnitude faster than the WAN in every topology here).
Off (``enabled=False``) the shaper only counts bytes, for real DCs.

Every rank of a DC pair must book on the same buckets. Inside one process the
buckets are numpy arrays behind a lock; across the processes of a one-machine
cluster (``path=``) they live in a small shared file (``mmap``) and the lock is
an ``flock`` on it, so booking costs microseconds and no message to a central
actor (such a message per packet cost more than the traffic it shaped). The
shared form needs every rank on one machine, which is what the shaper emulates;
on real DCs it is off.

A DC pair can be *cut* (:meth:`LinkShaper.cut`, both directions) and healed
(:meth:`LinkShaper.heal`): a message booked on a cut pair raises :class:`LinkDown`
(whether shaping is on or off), as a send on a dead WAN link would fail. Cuts live in
the shared file too, so a cut made by the driver reaches every rank at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from expertmesh.planner.topology import Topology

__all__ = ["LinkDown", "LinkShaper"]


class LinkDown(ConnectionError):
    """A message was booked on a DC pair that is cut (:meth:`LinkShaper.cut`)."""


class LinkShaper:
    """FIFO token buckets per ordered DC pair. Thread- and process-safe; clock injectable.

    ``bandwidth_Bps`` [D, D] bytes/s and ``latency_s`` [D, D] seconds per ordered pair;
    the diagonal is ignored (never shaped). ``path``: a file (created with zeros when
    missing or of the wrong size) that holds the buckets and counters, shared by every
    :class:`LinkShaper` opened on it; ``None`` keeps them in this process.
    """

    def __init__(
        self,
        bandwidth_Bps: np.ndarray,
        latency_s: np.ndarray,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.time,
        path: str | None = None,
    ) -> None:
        bw = np.asarray(bandwidth_Bps, dtype=np.float64)
        lat = np.asarray(latency_s, dtype=np.float64)
        if bw.ndim != 2 or bw.shape[0] != bw.shape[1] or lat.shape != bw.shape:
            raise ValueError(f"bandwidth and latency must be [D, D], got {bw.shape}, {lat.shape}")
        off = ~np.eye(bw.shape[0], dtype=bool)
        if (bw[off] <= 0).any() or (lat[off] < 0).any():
            raise ValueError("bandwidth must be > 0 and latency >= 0 between DCs")
        self.bandwidth_Bps, self.latency_s = bw, lat
        self.enabled = enabled
        self._clock = clock
        self._lock = threading.Lock()
        self.path = path
        d2 = bw.size
        self._fd: int | None = None
        if path is None:
            buf: Any = bytearray(4 * 8 * d2)
        else:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            with self._locked():
                if os.fstat(self._fd).st_size != 4 * 8 * d2:
                    os.ftruncate(self._fd, 4 * 8 * d2)
            buf = mmap.mmap(self._fd, 4 * 8 * d2)
        self._buf = buf
        # [D, D] each: when each link is next free, bytes and messages sent per pair
        self._free_at = np.frombuffer(buf, np.float64, d2, 0).reshape(bw.shape)
        self.bytes = np.frombuffer(buf, np.int64, d2, 8 * d2).reshape(bw.shape)
        self.messages = np.frombuffer(buf, np.int64, d2, 16 * d2).reshape(bw.shape)
        self._cut = np.frombuffer(buf, np.int64, d2, 24 * d2).reshape(bw.shape)  # 1: cut

    @classmethod
    def from_topology(
        cls,
        topology: Topology,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.time,
        path: str | None = None,
    ) -> LinkShaper:
        return cls(
            topology.dc_gbps * 1e9 / 8.0,
            topology.dc_latency_ms / 1e3,
            enabled=enabled,
            clock=clock,
            path=path,
        )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            if self._fd is None:
                yield
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def reset(self) -> None:
        """Empty every link and zero the counters (for every process sharing them)."""
        with self._locked():
            self._free_at[:] = 0.0
            self.bytes[:] = 0
            self.messages[:] = 0
            self._cut[:] = 0

    def totals(self) -> np.ndarray:
        """[D, D] bytes sent per ordered DC pair so far (a copy)."""
        with self._locked():
            return self.bytes.copy()

    def close(self) -> None:
        """Release the shared file (the arrays become invalid); a no-op in-process."""
        if self._fd is None:
            return
        self._free_at = np.zeros((0, 0))
        self.bytes = self.messages = self._cut = np.zeros((0, 0), np.int64)
        self._buf.close()
        os.close(self._fd)
        self._fd = None

    @property
    def num_dcs(self) -> int:
        return int(self.bandwidth_Bps.shape[0])

    def _pair(self, a: int, b: int) -> None:
        if not (0 <= a < self.num_dcs and 0 <= b < self.num_dcs) or a == b:
            raise ValueError(f"({a}, {b}) is not a pair of two of the {self.num_dcs} DCs")

    def cut(self, a: int, b: int) -> None:
        """Drop the link between DCs ``a`` and ``b`` (both directions) until :meth:`heal`."""
        self._pair(a, b)
        with self._locked():
            self._cut[a, b] = self._cut[b, a] = 1

    def heal(self, a: int, b: int) -> None:
        """Bring the link between DCs ``a`` and ``b`` back."""
        self._pair(a, b)
        with self._locked():
            self._cut[a, b] = self._cut[b, a] = 0

    def links_up(self) -> np.ndarray:
        """[D, D] bool: whether each DC pair's link works (the diagonal always does)."""
        with self._locked():
            return np.asarray(self._cut == 0)

    def reserve(self, src_dc: int, dst_dc: int, nbytes: int) -> float:
        """Book ``nbytes`` on link ``src_dc -> dst_dc``; returns the clock time at which the
        message has arrived (now, if the shaper is off or both ends are in one DC).
        :class:`LinkDown` if the pair is cut."""
        if not (0 <= src_dc < self.num_dcs and 0 <= dst_dc < self.num_dcs):
            raise ValueError(f"unknown DC pair ({src_dc}, {dst_dc})")
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        with self._locked():
            now = self._clock()
            if src_dc == dst_dc:
                return now
            if self._cut[src_dc, dst_dc]:
                raise LinkDown(f"the link between DC {src_dc} and DC {dst_dc} is cut")
            self.bytes[src_dc, dst_dc] += nbytes
            self.messages[src_dc, dst_dc] += 1
            if not self.enabled:
                return now
            start = max(now, float(self._free_at[src_dc, dst_dc]))
            done = start + nbytes / float(self.bandwidth_Bps[src_dc, dst_dc])
            self._free_at[src_dc, dst_dc] = done
            return done + float(self.latency_s[src_dc, dst_dc])

    def send(
        self, src_dc: int, dst_dc: int, nbytes: int, sleep: Callable[[float], None] = time.sleep
    ) -> float:
        """:meth:`reserve`, then sleep the caller until arrival; returns seconds slept."""
        wait = self.reserve(src_dc, dst_dc, nbytes) - self._clock()
        if wait > 0:
            sleep(wait)
        return max(wait, 0.0)
