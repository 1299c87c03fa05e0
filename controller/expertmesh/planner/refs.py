"""Slow, obviously-correct references for the planner's fast algorithms.

One section per algorithm; tests check fast == reference on many shapes. Plain
Python loops over lists, written to be read, not to be fast.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np

from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Migration, Placement, Transfer, TransferKind
from expertmesh.planner.topology import Topology

__all__ = [
    "best_kept_ref",
    "check_migration",
    "domain_quota_ref",
    "eplb_rebalance_ref",
    "even_route_ref",
    "inclusion_probabilities_ref",
    "kept_after_relabel_ref",
    "plan_migration_ref",
    "quota_balance_ref",
    "quota_fit_ref",
    "quota_route_ref",
    "systematic_counts_ref",
]


# ---------------------------------------------------------------------------
# eplb: DeepSeek EPLB (hierarchical and global), one layer at a time
# ---------------------------------------------------------------------------


def _f32(x: float) -> float:
    """Round to float32 (the published EPLB computes weights in float32)."""
    return float(np.float32(x))


def _ref_pack(weights: list[float], num_packs: int) -> list[tuple[int, int]]:
    """Per item ``(pack, rank_in_pack)``: heaviest item first (stable), each into the
    lightest pack that still has room (lowest pack on ties); every pack takes
    ``n / num_packs`` items. With one item per pack, item ``i`` goes to pack ``i``."""
    per_pack = len(weights) // num_packs
    if per_pack == 1:
        return [(i, 0) for i in range(len(weights))]
    load = [0.0] * num_packs
    items = [0] * num_packs
    out = [(-1, -1)] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        best = -1
        for p in range(num_packs):
            if items[p] < per_pack and (best < 0 or load[p] < load[best]):
                best = p
        out[i] = (best, items[best])
        load[best] += weights[i]
        items[best] += 1
    return out


def _ref_replicate(weights: list[float], num_phy: int) -> list[tuple[int, int]]:
    """Per physical expert ``(logical, replica rank)``: every expert once, then each
    extra copy to the expert with the largest float32 ``weight / copies`` (lowest on ties)."""
    count = [1] * len(weights)
    out = [(e, 0) for e in range(len(weights))]
    for _ in range(num_phy - len(weights)):
        best = 0
        for e in range(len(weights)):
            if _f32(weights[e] / count[e]) > _f32(weights[best] / count[best]):
                best = e
        out.append((best, count[best]))
        count[best] += 1
    return out


def eplb_rebalance_ref(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    hierarchical: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference for :func:`expertmesh.planner.eplb.rebalance` (same arguments and results).

    For each layer: pack groups onto nodes; inside each node list its experts
    (its groups in pack order, experts of a group in order), replicate them to
    the node's physical experts, and pack those onto the node's GPUs by their
    load per copy.
    """
    num_layers, num_experts = weight.shape
    if not hierarchical:
        num_groups, num_nodes = 1, 1
    group_size = num_experts // num_groups
    phy_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    phy_per_gpu = num_replicas // num_gpus
    phy2log = np.full((num_layers, num_replicas), -1, dtype=np.int64)
    phyrank = np.full((num_layers, num_replicas), -1, dtype=np.int64)
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        w = [_f32(x) for x in weight[layer].tolist()]
        group_w = [_f32(sum(w[g * group_size : (g + 1) * group_size])) for g in range(num_groups)]
        node_slots: list[list[int]] = [[] for _ in range(num_nodes)]  # groups by rank in node
        placed = _ref_pack(group_w, num_nodes)
        for node in range(num_nodes):
            ranked = sorted((r, g) for g, (n, r) in enumerate(placed) if n == node)
            node_slots[node] = [g for _, g in ranked]
        for node in range(num_nodes):
            experts = [g * group_size + j for g in node_slots[node] for j in range(group_size)]
            copies = _ref_replicate([w[e] for e in experts], phy_per_node)
            count = [sum(1 for c, _ in copies if c == i) for i in range(len(experts))]
            per_copy = [_f32(w[experts[c]] / count[c]) for c, _ in copies]
            for (local, rank), (gpu, slot) in zip(
                copies, _ref_pack(per_copy, gpus_per_node), strict=True
            ):
                p = node * phy_per_node + gpu * phy_per_gpu + slot
                phy2log[layer, p] = experts[local]
                phyrank[layer, p] = rank
            for i, e in enumerate(experts):
                logcnt[layer, e] = count[i]
    log2phy = np.full((num_layers, num_experts, int(logcnt.max())), -1, dtype=np.int64)
    for layer in range(num_layers):
        for p in range(num_replicas):
            log2phy[layer, phy2log[layer, p], phyrank[layer, p]] = p
    return phy2log, log2phy, logcnt


# ---------------------------------------------------------------------------
# traffic.even_traffic: the fractional even split, one (rank, expert) at a time
# ---------------------------------------------------------------------------


def even_route_ref(
    load: np.ndarray, placement: Placement, topology: Topology, domain: str, remote: str
) -> np.ndarray:
    """Float route [N, 4] of :func:`expertmesh.planner.traffic.even_traffic`'s split.

    For each ``(r, e)``: the copies (slots) of ``e`` in ``r``'s domain share ``load[r, e]``
    equally; with none there, every copy shares it (``spread``) or the master takes it.
    """
    key = {
        "rank": np.arange(topology.num_ranks),
        "node": topology.rank_node,
        "dc": topology.rank_dc,
        "global": np.zeros(topology.num_ranks, dtype=np.int64),
    }[domain]
    rows: list[tuple[float, float, float, float]] = []
    num_ranks, num_experts = load.shape
    mrank = placement.master_rank()
    for r in range(num_ranks):
        for e in range(num_experts):
            if load[r, e] == 0:
                continue
            copies = [
                q
                for q in range(num_ranks)
                for s in range(placement.slots_per_rank)
                if placement.phy2log[q, s] == e
            ]
            mine = [q for q in copies if key[q] == key[r]] if domain != "global" else []
            if mine:
                targets = mine
            elif remote == "master":
                targets = [int(mrank[e])]
            else:
                targets = copies
            for q in targets:
                rows.append((r, e, q, load[r, e] / len(targets)))
    return np.array(rows, dtype=np.float64).reshape(-1, 4)


# ---------------------------------------------------------------------------
# trace: inclusion probabilities and systematic top-k sampling, token by token
# ---------------------------------------------------------------------------


def inclusion_probabilities_ref(weights: np.ndarray, top_k: int) -> np.ndarray:
    """[E] ``pi = min(1, c * weights)`` with ``sum(pi) == top_k``, by repeated capping:
    scale the uncapped experts to the budget left, cap those above 1, repeat."""
    w = [float(x) for x in weights]
    capped = [False] * len(w)
    while True:
        budget = top_k - sum(capped)
        free = sum(x for x, c in zip(w, capped, strict=True) if not c)
        pi = [1.0 if c else budget * x / free for x, c in zip(w, capped, strict=True)]
        over = [i for i, p in enumerate(pi) if p > 1.0 + 1e-12 and not capped[i]]
        if not over:
            return np.array(pi)
        for i in over:
            capped[i] = True


def systematic_counts_ref(q: np.ndarray, u: np.ndarray) -> np.ndarray:
    """[R, K] tokens choosing each item under Madow's systematic design.

    ``q``: [R, K] inclusion probabilities (each < 1) of the items in each row's order,
    each row summing to an integer ``k``; ``u``: [R, n] one uniform in [0, 1) per token.
    A token takes the item ``i`` with ``C[i] <= u + j < C[i + 1]`` for each ``j < k``,
    where ``C`` is the running sum of ``q`` (``C[K] = k``).
    """
    num_rows, num_items = q.shape
    out = np.zeros((num_rows, num_items), dtype=np.int64)
    for r in range(num_rows):
        k = round(float(q[r].sum()))
        bounds = [0.0]
        for x in q[r]:
            bounds.append(bounds[-1] + float(x))
        bounds[-1] = float(k)
        for token_u in u[r]:
            for j in range(k):
                x = float(token_u) + j
                for i in range(num_items):
                    if bounds[i] <= x < bounds[i + 1]:
                        out[r, i] += 1
                        break
    return out


# ---------------------------------------------------------------------------
# migration: what plan_migration promises (check_migration), brute-force alignment,
# and the scheduler's rules one transfer at a time
# ---------------------------------------------------------------------------


def _holders(p2l: np.ndarray) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for r, row in enumerate(p2l.tolist()):
        for e in row:
            if e >= 0:
                out.setdefault(e, set()).add(r)
    return out


def check_migration(
    old: Placement, new: Placement, migration: Migration, topology: Topology, model: ModelSpec
) -> None:
    """Raise ``ValueError`` unless ``migration`` turns ``old`` into ``new`` correctly:

    - applying it (each transfer writes its expert into ``(dst_rank, dst_slot)``, a MASTER
      transfer makes ``dst_rank`` the expert's master rank, slots empty in ``new`` are
      freed) yields ``new.phy2log`` and ``new``'s master ranks, one master per expert;
    - a slot gets at most one transfer and a kept slot none, except a MASTER;
    - ``kept`` counts slots with the same non-empty content in old and new;
    - every transfer's source holds the expert in ``old`` or received it in an earlier
      round; a MASTER comes from the old master rank;
    - per round: each rank sends <= 1 and receives <= 1 transfer over a link, each
      ordered DC pair carries <= 1 (local copies, ``src == dst``, are exempt);
    - bytes: REPLICA over a link ``expert_bytes``, local 0; MASTER ``master_bytes``,
      or ``master_bytes - expert_bytes`` if ``dst_rank`` already had a copy in ``old``;
    - ``round_seconds[k]`` is the max over round ``k`` of latency + nbytes / bandwidth;
    - a REPLICA over a link comes from a nearest holder of that round.
    """
    num_slots = new.phy2log.shape[1]
    p2l = old.phy2log.copy()
    master_rank = (old.master // num_slots).tolist()
    written: set[tuple[int, int]] = set()
    masters_moved: set[int] = set()
    old_holders = _holders(old.phy2log)
    for t in migration.transfers:
        if (t.dst_rank, t.dst_slot) in written:
            raise ValueError(f"two transfers write slot ({t.dst_rank}, {t.dst_slot})")
        written.add((t.dst_rank, t.dst_slot))
        kept = old.phy2log[t.dst_rank, t.dst_slot] == new.phy2log[t.dst_rank, t.dst_slot]
        if kept and t.kind != TransferKind.MASTER:
            raise ValueError(f"a replica transfer writes the kept slot {(t.dst_rank, t.dst_slot)}")
        p2l[t.dst_rank, t.dst_slot] = t.expert
        if t.kind == TransferKind.MASTER:
            if t.expert in masters_moved:
                raise ValueError(f"expert {t.expert}: two master transfers")
            if t.src_rank != old.master[t.expert] // num_slots:
                raise ValueError(f"expert {t.expert}: master not sent from its old master rank")
            masters_moved.add(t.expert)
            master_rank[t.expert] = t.dst_rank
    p2l[new.phy2log < 0] = -1
    if not np.array_equal(p2l, new.phy2log):
        raise ValueError("applying the transfers to old does not give new.phy2log")
    if master_rank != (new.master // num_slots).tolist():
        raise ValueError("applying the transfers to old does not give new's master ranks")
    kept = int(((old.phy2log == new.phy2log) & (new.phy2log >= 0)).sum())
    if migration.kept != kept:
        raise ValueError(f"kept is {migration.kept}, expected {kept}")

    by_round: dict[int, list[Transfer]] = {}
    for t in migration.transfers:
        by_round.setdefault(t.round, []).append(t)
    num_rounds = max(by_round, default=-1) + 1
    if len(migration.round_seconds) != num_rounds:
        raise ValueError(f"{len(migration.round_seconds)} round times for {num_rounds} rounds")
    holders = {e: set(rs) for e, rs in old_holders.items()}
    dc = topology.rank_dc
    for k in range(num_rounds):
        sends: Counter[int] = Counter()
        recvs: Counter[int] = Counter()
        pairs: Counter[tuple[int, int]] = Counter()
        worst = 0.0
        for t in by_round.get(k, []):
            have = holders.get(t.expert, set())
            if t.src_rank not in have:
                raise ValueError(f"round {k}: rank {t.src_rank} sends expert {t.expert} it lacks")
            if t.kind == TransferKind.MASTER:
                full = t.dst_rank not in old_holders.get(t.expert, set())
                want = model.master_bytes if full else model.master_bytes - model.expert_bytes
            else:
                want = 0 if t.src_rank == t.dst_rank else model.expert_bytes
            if t.nbytes != want:
                raise ValueError(f"round {k}: transfer of expert {t.expert} has {t.nbytes} bytes, "
                                 f"expected {want}")  # fmt: skip
            if t.src_rank == t.dst_rank:
                continue
            if t.kind == TransferKind.REPLICA:
                hs = np.array(sorted(have))
                near = float(topology.distance(hs, np.full_like(hs, t.dst_rank)).min())
                if _distance(topology, t.src_rank, t.dst_rank) > near * (1 + 1e-9):
                    raise ValueError(f"round {k}: expert {t.expert} to rank {t.dst_rank} is not "
                                     "sent from a nearest holder")  # fmt: skip
            sends[t.src_rank] += 1
            recvs[t.dst_rank] += 1
            if dc[t.src_rank] != dc[t.dst_rank]:
                pairs[(int(dc[t.src_rank]), int(dc[t.dst_rank]))] += 1
            lat = float(topology.latency_s(np.array([t.src_rank]), np.array([t.dst_rank]))[0])
            bw = float(topology.bandwidth_Bps(np.array([t.src_rank]), np.array([t.dst_rank]))[0])
            worst = max(worst, lat + t.nbytes / bw)
        for what, c in (("rank sends", sends), ("rank receives", recvs)):
            if c and max(c.values()) > 1:
                raise ValueError(f"round {k}: a {what} {max(c.values())} transfers")
        if pairs and max(pairs.values()) > 1:
            raise ValueError(f"round {k}: a DC pair carries {max(pairs.values())} transfers")
        if not np.isclose(migration.round_seconds[k], worst, rtol=1e-9, atol=0.0):
            raise ValueError(f"round {k}: {migration.round_seconds[k]} s, expected {worst} s")
        for t in by_round.get(k, []):
            holders.setdefault(t.expert, set()).add(t.dst_rank)


def _distance(topology: Topology, a: int, b: int) -> float:
    return float(topology.distance(np.array([a]), np.array([b]))[0])


def best_kept_ref(old_p2l: np.ndarray, new_p2l: np.ndarray) -> int:
    """Most copies any slot permutation of each rank of ``new_p2l`` keeps, by trying
    every permutation of every rank (tiny ``S`` only)."""
    total = 0
    for old_row, new_row in zip(old_p2l.tolist(), new_p2l.tolist(), strict=True):
        total += max(
            sum(1 for a, b in zip(old_row, p, strict=True) if a == b and a >= 0)
            for p in itertools.permutations(new_row)
        )
    return total


def kept_after_relabel_ref(old_p2l: np.ndarray, new_p2l: np.ndarray, topology: Topology) -> int:
    """Most copies kept over every relabel :func:`align_placement` may use (whole nodes
    inside a DC, ranks inside a node), by enumeration (tiny topologies only)."""

    def kept(o: list[int], n: list[int]) -> int:
        co, cn = Counter(x for x in o if x >= 0), Counter(x for x in n if x >= 0)
        return sum(min(co[e], cn[e]) for e in cn)

    old_rows, new_rows = old_p2l.tolist(), new_p2l.tolist()
    total = 0
    start = 0
    for d in topology.dcs:
        p = d.ranks_per_node
        nodes = [list(range(start + i * p, start + (i + 1) * p)) for i in range(d.nodes)]
        best = 0
        for node_perm in itertools.permutations(range(d.nodes)):
            s = 0
            for a, c in enumerate(node_perm):
                s += max(
                    sum(kept(old_rows[nodes[c][i]], new_rows[nodes[a][rp[i]]]) for i in range(p))
                    for rp in itertools.permutations(range(p))
                )
            best = max(best, s)
        total += best
        start += d.num_ranks
    return total


def plan_migration_ref(
    old: Placement, new: Placement, topology: Topology, model: ModelSpec
) -> Migration:
    """The same rules as :func:`plan_migration`, one transfer at a time: each round,
    walk the open transfers in priority order (cross-DC first, masters, experts with
    more copies to make, expert, rank) and give each the lowest-numbered free nearest
    holder that breaks no rule of the round (see ``check_migration``; at most one
    transfer of an expert enters a node, or a DC, from outside per round)."""
    num_slots = new.phy2log.shape[1]
    num_experts = new.master.shape[0]
    old_h = _holders(old.phy2log)
    node, dc = topology.rank_node, topology.rank_dc
    # master moves: (expert, dst, slot, src, nbytes)
    jobs: list[dict[str, int]] = []
    master_to: dict[tuple[int, int], int] = {}
    for e in range(num_experts):
        a, b = int(old.master[e]) // num_slots, int(new.master[e]) // num_slots
        if a != b:
            full = b not in old_h.get(e, set())
            nb = model.master_bytes if full else model.master_bytes - model.expert_bytes
            jobs.append({"e": e, "dst": b, "slot": int(new.master[e]) % num_slots, "src": a,
                         "bytes": nb, "master": 1})  # fmt: skip
            master_to[(b, e)] = int(new.master[e]) % num_slots
    local: list[tuple[int, int, int, str]] = []  # (expert, rank, slot, "now" or "after")
    for r in range(new.phy2log.shape[0]):
        for s in range(num_slots):
            e = int(new.phy2log[r, s])
            if e < 0 or e == old.phy2log[r, s] or master_to.get((r, e)) == s:
                continue
            if r in old_h.get(e, set()):
                local.append((e, r, s, "now"))
            elif (r, e) in master_to or any(j["e"] == e and j["dst"] == r for j in jobs):
                local.append((e, r, s, "after"))
            else:
                jobs.append({"e": e, "dst": r, "slot": s, "src": -1,
                             "bytes": model.expert_bytes, "master": 0})  # fmt: skip
    fanout = Counter(j["e"] for j in jobs)
    holders = {e: set(rs) for e, rs in old_h.items()}
    done: dict[int, tuple[int, int]] = {}  # job index -> (src, round)
    k = 0
    while len(done) < len(jobs):
        open_jobs = []
        for i, j in enumerate(jobs):
            if i in done:
                continue
            if j["src"] >= 0:
                cands = [j["src"]]
            else:
                near = min(_distance(topology, h, j["dst"]) for h in holders[j["e"]])
                cands = sorted(
                    h
                    for h in holders[j["e"]]
                    if _distance(topology, h, j["dst"]) <= near * 1.000001
                )
            level = int(topology.link_class(np.array([cands[0]]), np.array([j["dst"]]))[0])
            key = (-level, -j["master"], -fanout[j["e"]], j["e"], j["dst"])
            open_jobs.append((key, i, cands))
        open_jobs.sort()
        sent: set[int] = set()
        got: set[int] = set()
        entries: set[tuple[str, int, int]] = set()
        for _, i, cands in open_jobs:
            j = jobs[i]
            if j["dst"] in got:
                continue
            for h in cands:
                if h in sent:
                    continue
                need: set[tuple[str, int, int]] = set()
                if node[h] != node[j["dst"]]:
                    need.add(("node", j["e"], int(node[j["dst"]])))
                if dc[h] != dc[j["dst"]]:
                    need.add(("dc", j["e"], int(dc[j["dst"]])))
                    need.add(("pair", int(dc[h]), int(dc[j["dst"]])))
                if need & entries:
                    continue
                entries |= need
                sent.add(h)
                got.add(j["dst"])
                done[i] = (h, k)
                break
        for i, (_, rk) in done.items():
            if rk == k:
                holders.setdefault(jobs[i]["e"], set()).add(jobs[i]["dst"])
        k += 1
    transfers = []
    arrival: dict[tuple[int, int], int] = {}
    for i, j in enumerate(jobs):
        h, rk = done[i]
        kind = TransferKind.MASTER if j["master"] else TransferKind.REPLICA
        transfers.append(Transfer(j["e"], h, j["dst"], j["slot"], j["bytes"], rk, kind))
        arrival[(j["dst"], j["e"])] = rk
    for e, r, s, when in local:
        rk = 0 if when == "now" else arrival[(r, e)] + 1
        transfers.append(Transfer(e, r, r, s, 0, rk, TransferKind.REPLICA))
    num_rounds = max((t.round for t in transfers), default=-1) + 1
    seconds = [0.0] * num_rounds
    for t in transfers:
        if t.src_rank != t.dst_rank:
            lat = float(topology.latency_s(np.array([t.src_rank]), np.array([t.dst_rank]))[0])
            bw = float(topology.bandwidth_Bps(np.array([t.src_rank]), np.array([t.dst_rank]))[0])
            seconds[t.round] = max(seconds[t.round], lat + t.nbytes / bw)
    kept = int(((old.phy2log == new.phy2log) & (new.phy2log >= 0)).sum())
    transfers.sort(key=lambda t: (t.round, t.dst_rank, t.dst_slot))
    return Migration(transfers=tuple(transfers), round_seconds=tuple(seconds), kept=kept)


# ---------------------------------------------------------------------------
# quota: the rule for one quota, the smallest quota by linear scan, the split
# ---------------------------------------------------------------------------


def quota_fit_ref(
    demand: dict[int, int],
    master_rank: dict[int, int],
    ranks: list[int],
    free: dict[int, int],
    quota: int,
    *,
    max_replicas: int | None = None,
) -> list[tuple[int, int, int]] | None:
    """One domain: the replicas ``(expert, rank, tokens)`` the rule of
    :mod:`expertmesh.planner.quota` places for ``quota``, in line order, or ``None``
    when the rule fails. ``demand``/``master_rank``: the domain's experts;
    ``ranks``: the domain's ranks; ``free``: free slots per rank. With ``max_replicas``,
    the capped rule."""
    on_rank = {r: 0 for r in ranks}
    for e, r in master_rank.items():
        on_rank[r] += demand[e]
    if max_replicas is not None:
        return _quota_fit_capped_ref(demand, master_rank, free, quota, on_rank, cap=max_replicas)
    pieces = []  # (tokens, expert)
    for r in ranks:
        excess = on_rank[r] - quota
        for e in sorted((e for e in demand if master_rank[e] == r), key=lambda e: (-demand[e], e)):
            give = min(excess, demand[e])
            if give > 0:
                pieces.append((give, e))
                excess -= give
    pieces.sort(key=lambda p: (-p[0], p[1]))
    receivers = [  # [rank, capacity, slots]
        [r, quota - on_rank[r], free[r]]
        for r in sorted(ranks, key=lambda r: (on_rank[r], r))
        if free[r] > 0 and on_rank[r] < quota
    ]
    out = []
    q = 0
    for amount, e in pieces:
        used, tokens = 0, amount
        while tokens > 0:
            if q == len(receivers):
                return None
            rank, cap, _ = receivers[q]
            take = min(tokens, cap)
            out.append((e, rank, take))
            used += 1
            tokens -= take
            receivers[q][1] -= take
            receivers[q][2] -= 1
            if receivers[q][1] == 0 or receivers[q][2] == 0:
                q += 1  # full, or out of slots: the rest of its capacity is unused
        if max_replicas is not None and used > max_replicas:
            return None
    return out


def _quota_fit_capped_ref(
    demand: dict[int, int],
    master_rank: dict[int, int],
    free: dict[int, int],
    quota: int,
    on_rank: dict[int, int],
    *,
    cap: int,
) -> list[tuple[int, int, int]] | None:
    """The capped rule (``quota``'s module doc), one step at a time: overloaded ranks by
    load descending; each sheds its excess from its experts, largest first, each expert
    offering what is left of the excess to the ``cap`` receivers with the most
    room (a free slot each), which take what they can."""
    ranks = list(on_rank)  # the domain's ranks
    room = {r: quota - on_rank[r] for r in ranks if free[r] > 0 and on_rank[r] < quota}
    slots = {r: free[r] for r in room}
    out = []
    for r in sorted((r for r in ranks if on_rank[r] > quota), key=lambda r: (-on_rank[r], r)):
        excess = on_rank[r] - quota
        for e in sorted((e for e in demand if master_rank[e] == r), key=lambda e: (-demand[e], e)):
            if excess == 0:
                break
            if demand[e] == 0:
                continue
            want = min(excess, demand[e])
            open_ = [q for q in room if room[q] > 0 and slots[q] > 0]
            for q in sorted(open_, key=lambda q: (-room[q], q))[:cap]:
                if want == 0:
                    break
                take = min(want, room[q])
                out.append((e, q, take))
                room[q] -= take
                slots[q] -= 1
                want -= take
                excess -= take
        if excess > 0:
            return None
    return out


def quota_route_ref(
    load: np.ndarray, expert: int, copies: list[tuple[int, int]]
) -> list[tuple[int, int, int, int]]:
    """Route rows ``(src, expert, dst, tokens)`` of one expert over ``copies``
    ``[(rank, tokens)]`` (replicas in line order, the master last): own rank first,
    then each replica in turn splits what it still needs among the sources' remaining
    tokens by largest remainder (lower rank on ties); the master takes the rest."""
    num_ranks = load.shape[0]
    left = [int(load[r, expert]) for r in range(num_ranks)]
    need = [tokens for _, tokens in copies]
    take = [[0] * num_ranks for _ in copies]
    for c, (rank, _) in enumerate(copies):
        own = min(need[c], left[rank])
        take[c][rank] += own
        left[rank] -= own
        need[c] -= own
    for c in range(len(copies) - 1):
        total = sum(left)
        if need[c] == 0:
            continue
        share = [need[c] * left[r] // total for r in range(num_ranks)]
        rem = [need[c] * left[r] % total for r in range(num_ranks)]
        short = need[c] - sum(share)
        for r in sorted(range(num_ranks), key=lambda r: (-rem[r], r))[:short]:
            share[r] += 1
        for r in range(num_ranks):
            take[c][r] += share[r]
            left[r] -= share[r]
    for r in range(num_ranks):
        take[-1][r] += left[r]
    return [
        (r, expert, rank, take[c][r])
        for c, (rank, _) in enumerate(copies)
        for r in range(num_ranks)
        if take[c][r] > 0
    ]


def quota_balance_ref(
    load: np.ndarray,
    masters: Placement,
    rank_domain: np.ndarray,
    max_replicas: int | None = None,
    quotas: list[int] | None = None,
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """``quota`` the slow way: per domain (in order of domain id), the smallest quota
    from the ceiling of the domain mean upward for which :func:`quota_fit_ref`
    succeeds (or the given ``quotas``, which must succeed); replicas in the lowest
    free slot of their rank; the route of :func:`quota_route_ref`.
    Returns (quota per domain, phy2log [R, S], route [N, 4])."""
    num_ranks, num_slots = masters.phy2log.shape
    num_experts = load.shape[1]
    phy2log = np.full((num_ranks, num_slots), -1, dtype=np.int32)
    master_rank, free = {}, {r: num_slots for r in range(num_ranks)}
    for e in range(num_experts):
        slot = int(masters.master[e])
        phy2log[slot // num_slots, slot % num_slots] = e
        master_rank[e] = slot // num_slots
        free[slot // num_slots] -= 1
    quotas_out: list[int] = []
    rows = []
    copies: dict[int, list[tuple[int, int]]] = {}
    for d in sorted(set(rank_domain.tolist())):
        ranks = [r for r in range(num_ranks) if rank_domain[r] == d]
        experts = [e for e in range(num_experts) if master_rank[e] in ranks]
        demand = {e: int(load[:, e].sum()) for e in experts}
        mr = {e: master_rank[e] for e in experts}
        if quotas is None:
            quota = -(-sum(demand.values()) // len(ranks))
            while (
                fit := quota_fit_ref(demand, mr, ranks, free, quota, max_replicas=max_replicas)
            ) is None:
                quota += 1
        else:
            quota = quotas[len(quotas_out)]
            if (
                fit := quota_fit_ref(demand, mr, ranks, free, quota, max_replicas=max_replicas)
            ) is None:
                raise ValueError(f"quota {quota} fails in domain {d}")
        quotas_out.append(quota)
        for e, rank, tokens in fit:
            s = next(s for s in range(num_slots) if phy2log[rank, s] < 0)
            phy2log[rank, s] = e
            copies.setdefault(e, []).append((rank, tokens))
        for e in experts:
            reps = copies.get(e, [])
            master = (master_rank[e], demand[e] - sum(t for _, t in reps))
            rows.extend(quota_route_ref(load, e, [*reps, master]))
    return quotas_out, phy2log, np.array(rows, dtype=np.int64).reshape(-1, 4)


# ---------------------------------------------------------------------------
# domainquota: quota inside every DC on fixed holder sets, one (rank, expert) at a time
# ---------------------------------------------------------------------------


def domain_quota_ref(
    load: np.ndarray, base: Placement, topology: Topology
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """:func:`expertmesh.planner.domainquota.domain_quota` and its route the slow way:
    holders of each expert DC by DC; each source's tokens for ``e`` stay in its DC when it
    holds ``e``, else go whole to holder ``(k + e) mod h`` in DC order, ``k`` counting the
    sources without ``e`` in their DC before it; one virtual expert per held ``(DC,
    expert)`` mastered at the base's copy; :func:`quota_balance_ref` with the DC as domain.
    Returns (quota per DC, phy2log [R, S] with real experts, route [N, 4])."""
    num_ranks, num_slots = base.phy2log.shape
    num_experts = load.shape[1]
    rank_dc = [int(d) for d in topology.rank_dc]
    home: dict[tuple[int, int], tuple[int, int]] = {}  # (dc, expert) -> (rank, slot)
    for r in range(num_ranks):
        for s in range(num_slots):
            e = int(base.phy2log[r, s])
            if e >= 0:
                home[(rank_dc[r], e)] = (r, s)
    held = sorted(home, key=lambda de: (de[1], de[0]))  # by expert, then DC
    vid = {de: v for v, de in enumerate(held)}
    vload = np.zeros((num_ranks, len(held)), dtype=np.int64)
    for e in range(num_experts):
        holders = [d for d, x in held if x == e]
        k = 0  # sources so far whose DC lacks e
        for r in range(num_ranks):
            if (rank_dc[r], e) in vid:
                vload[r, vid[(rank_dc[r], e)]] += int(load[r, e])
                continue
            if holders:
                vload[r, vid[(holders[(k + e) % len(holders)], e)]] += int(load[r, e])
            k += 1
    v_p2l = np.full((num_ranks, num_slots), -1, dtype=np.int64)
    v_master = np.zeros(len(held), dtype=np.int64)
    for (d, e), (r, s) in home.items():
        v_p2l[r, s] = vid[(d, e)]
        v_master[vid[(d, e)]] = r * num_slots + s
    quotas, p2l, route = quota_balance_ref(vload, Placement(v_p2l, v_master), topology.rank_dc)
    expert_of = [e for _, e in held]
    real = np.array([[expert_of[v] if v >= 0 else -1 for v in row] for row in p2l.tolist()])
    rows = [[src, expert_of[v], dst, tok] for src, v, dst, tok in route.tolist()]
    return quotas, real.reshape(num_ranks, num_slots), np.array(rows, np.int64).reshape(-1, 4)
