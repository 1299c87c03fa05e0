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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from expertmesh.planner.topology import Topology

__all__ = ["LinkShaper"]


class LinkShaper:
    """FIFO token buckets per ordered DC pair. Thread-safe; clock injectable for tests.

    ``bandwidth_Bps`` [D, D] bytes/s and ``latency_s`` [D, D] seconds per ordered pair;
    the diagonal is ignored (never shaped).
    """

    def __init__(
        self,
        bandwidth_Bps: np.ndarray,
        latency_s: np.ndarray,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.time,
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
        self._free_at = np.zeros_like(bw)  # [D, D] when each link is next free
        self.bytes = np.zeros(bw.shape, dtype=np.int64)  # [D, D] bytes sent per pair
        self.messages = np.zeros(bw.shape, dtype=np.int64)

    @classmethod
    def from_topology(
        cls, topology: Topology, *, enabled: bool = True, clock: Callable[[], float] = time.time
    ) -> LinkShaper:
        return cls(
            topology.dc_gbps * 1e9 / 8.0, topology.dc_latency_ms / 1e3, enabled=enabled, clock=clock
        )

    @property
    def num_dcs(self) -> int:
        return int(self.bandwidth_Bps.shape[0])

    def reserve(self, src_dc: int, dst_dc: int, nbytes: int) -> float:
        """Book ``nbytes`` on link ``src_dc -> dst_dc``; returns the clock time at which the
        message has arrived (now, if the shaper is off or both ends are in one DC)."""
        if not (0 <= src_dc < self.num_dcs and 0 <= dst_dc < self.num_dcs):
            raise ValueError(f"unknown DC pair ({src_dc}, {dst_dc})")
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        with self._lock:
            now = self._clock()
            if src_dc == dst_dc:
                return now
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
