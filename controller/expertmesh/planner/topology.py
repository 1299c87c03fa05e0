"""Topology: data centers, nodes, ranks, slots and the links between them.

Ranks are numbered DC by DC, node by node: rank ``r`` of a topology with DCs
``[a(2 nodes x 2 ranks), b(1 node x 2 ranks)]`` is ``a:0..3, b:4..5``.

A topology is built from the YAML format of the architecture brief (parsed by
the caller; this module never touches files) with :meth:`Topology.from_dict`,
or generated for simulations with :meth:`Topology.generate`. Everything a
planner needs is derived vectorized (``rank_dc``, ``rank_node``, link
bandwidth and latency between any ranks) without ``[R, R]`` matrices, so 1,000
DCs x 8 ranks stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["DC", "Link", "LinkClass", "Topology"]


class LinkClass(IntEnum):
    """Which link a transfer between two ranks uses."""

    SAME_RANK = 0
    INTRA_NODE = 1
    INTRA_DC = 2
    INTER_DC = 3


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth in Gbit/s and one-way latency in milliseconds."""

    gbps: float
    latency_ms: float

    @property
    def bytes_per_second(self) -> float:
        return self.gbps * 1e9 / 8.0

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3

    def transfer_seconds(self, nbytes: float) -> float:
        """Latency plus serialization time of ``nbytes`` over this link."""
        return self.latency_s + nbytes / self.bytes_per_second


@dataclass(frozen=True)
class DC:
    name: str
    nodes: int
    ranks_per_node: int

    @property
    def num_ranks(self) -> int:
        return self.nodes * self.ranks_per_node


# ---- YAML schema (pydantic), converted into the frozen Topology below ----


class _LinkSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gbps: float = Field(gt=0, description="bandwidth in Gbit/s")
    latency_ms: float = Field(ge=0, description="one-way latency in ms")


class _PairSpec(_LinkSpec):
    a: str
    b: str


class _LinksSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    intra_node: _LinkSpec = _LinkSpec(gbps=3200, latency_ms=0.005)
    intra_dc: _LinkSpec = _LinkSpec(gbps=400, latency_ms=0.01)
    inter_dc: _LinkSpec = _LinkSpec(gbps=10, latency_ms=20)
    pairs: list[_PairSpec] = Field(default_factory=list)


class _DCSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    nodes: int = Field(ge=1, le=100_000)
    ranks_per_node: int = Field(ge=1, le=1024)


class _SlotsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    masters: int = Field(ge=1, le=4096)
    spare: int = Field(ge=0, le=4096)


class _TopologySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dcs: list[_DCSpec] = Field(min_length=1)
    slots_per_rank: _SlotsSpec
    links: _LinksSpec = _LinksSpec()

    @field_validator("dcs")
    @classmethod
    def _unique_names(cls, dcs: list[_DCSpec]) -> list[_DCSpec]:
        names = [d.name for d in dcs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate DC names: {', '.join(dup)}")
        return dcs


def _first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or "topology"
    return f"{where}: {e['msg']}"


@dataclass(frozen=True, eq=False)
class Topology:
    """DCs, slots per rank and links. Build with :meth:`from_dict` or :meth:`generate`.

    ``pairs`` maps an unordered DC-name pair (stored sorted) to its link; pairs
    not listed use ``inter_dc``.
    """

    dcs: tuple[DC, ...]
    masters_per_rank: int
    spare_per_rank: int
    intra_node: Link = Link(3200, 0.005)
    intra_dc: Link = Link(400, 0.01)
    inter_dc: Link = Link(10, 20)
    pairs: dict[tuple[str, str], Link] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.dcs:
            raise ValueError("a topology needs at least one DC")
        if self.masters_per_rank < 1 or self.spare_per_rank < 0:
            raise ValueError("slots_per_rank: masters must be >= 1 and spare >= 0")
        names = {d.name for d in self.dcs}
        if len(names) != len(self.dcs):
            raise ValueError("DC names must be unique")
        for a, b in self.pairs:
            if a not in names or b not in names:
                raise ValueError(f"links.pairs: unknown DC in pair ({a}, {b})")
            if a == b:
                raise ValueError(f"links.pairs: a pair needs two different DCs, got ({a}, {b})")

    # ---- construction ----

    @classmethod
    def from_dict(cls, data: Any) -> Topology:
        """Validate the brief's YAML structure (already parsed) and build a topology.

        Raises ``ValueError`` with a one-line message naming the bad key.
        """
        if not isinstance(data, dict):
            raise ValueError("topology: expected a mapping with keys dcs, slots_per_rank, links")
        try:
            spec = _TopologySpec.model_validate(data)
        except ValidationError as err:
            raise ValueError(f"topology: {_first_error(err)}") from None
        names = {d.name for d in spec.dcs}
        pairs: dict[tuple[str, str], Link] = {}
        for p in spec.links.pairs:
            if p.a not in names or p.b not in names:
                unknown = p.a if p.a not in names else p.b
                raise ValueError(f"topology: links.pairs names unknown DC {unknown!r}")
            if p.a == p.b:
                raise ValueError(f"topology: links.pairs pairs DC {p.a!r} with itself")
            key = (min(p.a, p.b), max(p.a, p.b))
            if key in pairs:
                raise ValueError(f"topology: links.pairs lists ({p.a}, {p.b}) twice")
            pairs[key] = Link(p.gbps, p.latency_ms)
        lk = spec.links
        return cls(
            dcs=tuple(DC(d.name, d.nodes, d.ranks_per_node) for d in spec.dcs),
            masters_per_rank=spec.slots_per_rank.masters,
            spare_per_rank=spec.slots_per_rank.spare,
            intra_node=Link(lk.intra_node.gbps, lk.intra_node.latency_ms),
            intra_dc=Link(lk.intra_dc.gbps, lk.intra_dc.latency_ms),
            inter_dc=Link(lk.inter_dc.gbps, lk.inter_dc.latency_ms),
            pairs=pairs,
        )

    @classmethod
    def generate(
        cls,
        dcs: int,
        ranks_per_dc: int,
        *,
        nodes_per_dc: int = 1,
        masters: int = 4,
        spare: int = 2,
        inter_dc_gbps: float = 10.0,
        inter_dc_latency_ms: float = 20.0,
        intra_dc: Link = Link(400, 0.01),
        intra_node: Link = Link(3200, 0.005),
    ) -> Topology:
        """A uniform topology: ``dcs`` DCs named ``dc0000..``, each of ``ranks_per_dc`` ranks."""
        if dcs < 1 or ranks_per_dc < 1 or nodes_per_dc < 1:
            raise ValueError("dcs, ranks_per_dc and nodes_per_dc must be >= 1")
        if ranks_per_dc % nodes_per_dc:
            raise ValueError("ranks_per_dc must be a multiple of nodes_per_dc")
        width = max(4, len(str(dcs - 1)))
        return cls(
            dcs=tuple(
                DC(f"dc{i:0{width}d}", nodes_per_dc, ranks_per_dc // nodes_per_dc)
                for i in range(dcs)
            ),
            masters_per_rank=masters,
            spare_per_rank=spare,
            intra_node=intra_node,
            intra_dc=intra_dc,
            inter_dc=Link(inter_dc_gbps, inter_dc_latency_ms),
        )

    def to_dict(self) -> dict[str, Any]:
        """The YAML structure of the brief; ``from_dict(t.to_dict())`` rebuilds ``t``."""

        def link(lk: Link) -> dict[str, float]:
            return {"gbps": lk.gbps, "latency_ms": lk.latency_ms}

        return {
            "dcs": [
                {"name": d.name, "nodes": d.nodes, "ranks_per_node": d.ranks_per_node}
                for d in self.dcs
            ],
            "slots_per_rank": {"masters": self.masters_per_rank, "spare": self.spare_per_rank},
            "links": {
                "intra_node": link(self.intra_node),
                "intra_dc": link(self.intra_dc),
                "inter_dc": link(self.inter_dc),
                "pairs": [{"a": a, "b": b, **link(lk)} for (a, b), lk in self.pairs.items()],
            },
        }

    def with_spare(self, spare: int) -> Topology:
        """The same topology with ``spare`` spare slots per rank."""
        if spare < 0:
            raise ValueError("spare slots per rank must be >= 0")
        return Topology(
            self.dcs,
            self.masters_per_rank,
            spare,
            self.intra_node,
            self.intra_dc,
            self.inter_dc,
            dict(self.pairs),
        )

    def with_inter_dc(self, gbps: float, latency_ms: float | None = None) -> Topology:
        """The same topology with every inter-DC link (pairs included) set to ``gbps``."""
        lat = self.inter_dc.latency_ms if latency_ms is None else latency_ms
        return Topology(
            self.dcs,
            self.masters_per_rank,
            self.spare_per_rank,
            self.intra_node,
            self.intra_dc,
            Link(gbps, lat),
            {},
        )

    # ---- sizes ----

    @property
    def num_dcs(self) -> int:
        return len(self.dcs)

    @property
    def slots_per_rank(self) -> int:
        """``S``: masters + spare slots on every rank."""
        return self.masters_per_rank + self.spare_per_rank

    @cached_property
    def num_ranks(self) -> int:
        """``R``."""
        return sum(d.num_ranks for d in self.dcs)

    @cached_property
    def num_nodes(self) -> int:
        return sum(d.nodes for d in self.dcs)

    @cached_property
    def dc_index(self) -> dict[str, int]:
        return {d.name: i for i, d in enumerate(self.dcs)}

    # ---- rank maps (all [R] int64) ----

    @cached_property
    def rank_dc(self) -> np.ndarray:
        """[R] index of the DC of each rank."""
        return np.repeat(np.arange(self.num_dcs), [d.num_ranks for d in self.dcs])

    @cached_property
    def rank_node(self) -> np.ndarray:
        """[R] global index of the node of each rank."""
        per_node = np.repeat([d.ranks_per_node for d in self.dcs], [d.nodes for d in self.dcs])
        return np.repeat(np.arange(self.num_nodes), per_node)

    @cached_property
    def dc_ranks(self) -> tuple[np.ndarray, ...]:
        """Per DC, the [n] ranks it holds (contiguous)."""
        bounds = np.cumsum([0] + [d.num_ranks for d in self.dcs])
        return tuple(np.arange(bounds[i], bounds[i + 1]) for i in range(self.num_dcs))

    # ---- links ----

    @cached_property
    def dc_gbps(self) -> np.ndarray:
        """[D, D] inter-DC bandwidth in Gbit/s (diagonal: ``intra_dc``)."""
        return self._dc_matrix(lambda lk: lk.gbps, self.intra_dc.gbps)

    @cached_property
    def dc_latency_ms(self) -> np.ndarray:
        """[D, D] inter-DC one-way latency in ms (diagonal: ``intra_dc``)."""
        return self._dc_matrix(lambda lk: lk.latency_ms, self.intra_dc.latency_ms)

    def _dc_matrix(self, attr: Any, diag: float) -> np.ndarray:
        d = self.num_dcs
        m = np.full((d, d), attr(self.inter_dc), dtype=np.float64)
        for (a, b), lk in self.pairs.items():
            i, j = self.dc_index[a], self.dc_index[b]
            m[i, j] = m[j, i] = attr(lk)
        np.fill_diagonal(m, diag)
        return m

    def dc_link(self, a: int, b: int) -> Link:
        """The link between DC indices ``a`` and ``b`` (``intra_dc`` if equal)."""
        if a == b:
            return self.intra_dc
        return Link(float(self.dc_gbps[a, b]), float(self.dc_latency_ms[a, b]))

    def link_class(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """[N] :class:`LinkClass` between rank arrays ``src`` and ``dst`` (both [N])."""
        src, dst = np.asarray(src), np.asarray(dst)
        cls = np.full(np.broadcast(src, dst).shape, LinkClass.INTER_DC, dtype=np.int64)
        same_dc = self.rank_dc[src] == self.rank_dc[dst]
        cls[same_dc] = LinkClass.INTRA_DC
        cls[self.rank_node[src] == self.rank_node[dst]] = LinkClass.INTRA_NODE
        cls[src == dst] = LinkClass.SAME_RANK
        return cls

    def bandwidth_Bps(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """[N] bytes/s between ranks ``src`` and ``dst`` (``inf`` on the same rank)."""
        return self.links(src, dst)[1]

    def latency_s(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """[N] one-way latency in seconds between ranks ``src`` and ``dst`` (0 on the same rank)."""
        return self.links(src, dst)[0]

    def links(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(latency_s, bandwidth_Bps)`` between ranks ``src`` and ``dst``, [N] each, with
        their link class worked out once."""
        cls = self.link_class(src, dst)
        a, b = self.rank_dc[src], self.rank_dc[dst]
        node, same = cls == LinkClass.INTRA_NODE, cls == LinkClass.SAME_RANK
        ms = np.where(node, self.intra_node.latency_ms, self.dc_latency_ms[a, b])
        gbps = np.where(node, self.intra_node.gbps, self.dc_gbps[a, b])
        return np.where(same, 0.0, ms) / 1e3, np.where(same, np.inf, gbps) * 1e9 / 8.0

    def distance(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """[N] seconds to send one byte-ish unit: latency + 1 MB / bandwidth. Used to rank
        holders by nearness (smaller is nearer); same rank is 0."""
        latency, bandwidth = self.links(src, dst)
        return latency + 1e6 / bandwidth
