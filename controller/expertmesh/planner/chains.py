"""``relieve``: after quota, shift tokens along chains of copies inside one domain.

Quota's rule (:mod:`expertmesh.planner.quota`) lets only ranks below ``T`` by their own
homes receive replicas. With few spare slots that leaves work on the table: with one
spare slot per rank and two overloaded ranks ``A``, ``B`` beside one idle ``C``, ``C``'s
one slot takes a piece of ``A``'s hot expert and ``B`` keeps its excess, though ``C``
could take more of ``A``'s expert (no new slot: it holds a copy now) and ``A``'s own free
slot could take ``B``'s excess. :func:`relieve` finds such chains: from the busiest rank,
breadth-first over *edges* ``r -> q`` for an expert ``e`` that ``r`` computes, where ``q``
computes ``e`` too (no new slot) or has a free slot (a new replica, at least ``least``
tokens), to the least loaded rank it reaches; it shifts ``delta`` tokens of each edge's
expert along the path (every rank on it but the ends keeps its load) with ``delta`` half
the gap, at most what each edge's rank computes of its expert. It stops when no path
narrows the gap, or after ``max_moves``. Deterministic (integers, ties by index).

Shapes: ``Rd`` ranks of the domain, ``E`` experts; ``comp`` is ``[Rd, E]`` tokens each
rank computes of each expert.
"""

from __future__ import annotations

import numpy as np

__all__ = ["relieve"]


def relieve(
    comp: np.ndarray,
    home: np.ndarray,
    free: np.ndarray,
    *,
    least: int = 1,
    max_moves: int | None = None,
) -> np.ndarray:
    """Even out ``comp`` [Rd, E] (tokens each rank computes of each expert; an expert's
    tokens stay on its copies and new ones) and return the new [Rd, E].

    - ``home``: [E] rank that holds each expert's home copy (``-1``: not held; an expert
      with tokens must have one); a home can always take its expert's tokens back;
    - ``free``: [Rd] free slots each rank has left (a new copy uses one; a replica that
      ends with no tokens gives its slot back);
    - ``least``: fewest tokens a new replica takes;
    - ``max_moves``: at most this many shifts (default ``4 Rd``).

    Column sums never change; no rank ends above the input's maximum. ``ValueError`` on
    shapes or negative values."""
    comp = np.asarray(comp)
    home = np.asarray(home)
    free = np.asarray(free)
    if comp.ndim != 2 or not np.issubdtype(comp.dtype, np.integer) or (comp < 0).any():
        raise ValueError("comp must be a non-negative integer [Rd, E] array")
    rd, num_experts = comp.shape
    if home.shape != (num_experts,) or free.shape != (rd,) or (free < 0).any():
        raise ValueError(f"home must be [{num_experts}], free [{rd}] >= 0")
    if ((home < -1) | (home >= rd)).any() or (comp[:, home < 0] > 0).any():
        raise ValueError("home names a rank outside the domain, or tokens have no home")
    c = [[int(x) for x in row] for row in comp.tolist()]
    has = [{e for e in range(num_experts) if c[r][e] > 0 or home[e] == r} for r in range(rd)]
    room = [int(x) for x in free.tolist()]
    load = [sum(row) for row in c]
    for _ in range(4 * rd if max_moves is None else max_moves):
        s = max(range(rd), key=lambda r: (load[r], -r))
        path = _path(s, c, has, room, load)
        if path is None:
            break
        end = path[-1][1]
        delta = (load[s] - load[end]) // 2
        for r, _, e in path:
            delta = min(delta, c[r][e])
        for r, _, e in path:  # a replica keeps none or at least ``least`` tokens
            if home[e] != r and 0 < c[r][e] - delta < least:
                delta = c[r][e] - least
        if any(e not in has[q] for _, q, e in path) and delta < least:
            delta = 0  # a new replica takes at least ``least``
        if delta <= 0:
            break
        for r, q, e in path:
            c[r][e] -= delta
            if e not in has[q]:
                has[q].add(e)
                room[q] -= 1
            c[q][e] += delta
            if c[r][e] == 0 and home[e] != r:  # a replica left empty: its slot is free
                has[r].discard(e)
                room[r] += 1
        load[s] -= delta
        load[end] += delta
    return np.asarray(c, dtype=np.int64).reshape(rd, num_experts)


def _path(
    s: int, c: list[list[int]], has: list[set[int]], room: list[int], load: list[int]
) -> list[tuple[int, int, int]] | None:
    """Breadth-first from ``s``: the least loaded rank reachable at least 2 tokens below
    ``s``, and the edges ``(r, q, e)`` to it; ``None`` if there is none."""
    parent: dict[int, tuple[int, int] | None] = {s: None}
    queue = [s]
    while queue:
        r = queue.pop(0)
        for e in sorted(has[r]):
            if c[r][e] <= 0:
                continue
            for q in range(len(c)):
                if q in parent or (e not in has[q] and room[q] <= 0):
                    continue
                parent[q] = (r, e)
                queue.append(q)
    end = min(parent, key=lambda q: (load[q], q))
    if load[s] - load[end] < 2:
        return None
    path = []
    q = end
    while parent[q] is not None:
        r, e = parent[q]  # type: ignore[misc]
        path.append((r, q, e))
        q = r
    return path[::-1]
