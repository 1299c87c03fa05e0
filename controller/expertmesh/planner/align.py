"""Alignment: lay a new placement over the old one so every copy that can stay in its
slot stays (step 1 of :mod:`expertmesh.planner.migration`, which re-exports
:func:`align_placement`; docs/migration.md has the equations), and the validation of a
pair of placements both steps share."""

from __future__ import annotations

import numpy as np

from expertmesh.planner import relabel
from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology

__all__ = ["align_placement"]

# ---------------------------------------------------------------- validation


def _check_pair(
    old: Placement, new: Placement, topology: Topology, check_old: bool = True
) -> tuple[int, int, int]:
    """Validate two placements of the same shape on ``topology`` (``old``'s values only with
    ``check_old``: its shapes always); returns ``(R, S, E)``."""
    if old.phy2log.ndim != 2 or old.phy2log.shape != new.phy2log.shape:
        raise ValueError(
            f"old and new phy2log must both be [R, S], got {old.phy2log.shape} and "
            f"{new.phy2log.shape}"
        )
    num_ranks, num_slots = new.phy2log.shape
    if num_ranks != topology.num_ranks:
        raise ValueError(
            f"placements have {num_ranks} ranks, the topology has {topology.num_ranks}"
        )
    if old.master.shape != new.master.shape or old.master.ndim != 1:
        raise ValueError(f"old and new master must both be [E], got {old.master.shape} and "
                         f"{new.master.shape}")  # fmt: skip
    num_experts = int(new.master.shape[0])
    experts = np.arange(num_experts)
    for name, p in (("old", old), ("new", new)) if check_old else (("new", new),):
        if p.phy2log.size and (p.phy2log.min() < -1 or p.phy2log.max() >= num_experts):
            raise ValueError(f"{name} phy2log holds an expert id outside [-1, {num_experts})")
        m = p.master
        if m.size and (m.min() < 0 or m.max() >= num_ranks * num_slots):
            raise ValueError(f"{name} master slot index out of range")
        if not (p.phy2log.ravel()[m] == experts).all():  # [E] both (shapes checked above)
            raise ValueError(f"{name}: a master slot does not hold its expert")
    return num_ranks, num_slots, num_experts


# ---------------------------------------------------------------- alignment


def _occurrence(phy2log: np.ndarray, first: np.ndarray | None = None) -> np.ndarray:
    """[R, S] int64: for each slot, how many slots of the same rank holding the same
    expert come before it. Order inside a rank: slots flagged in ``first`` [R, S]
    bool, then slot index. Gives every copy a key ``(rank, expert, occurrence)``
    that is unique even when a rank holds several copies of one expert. Counted over
    every pair of a rank's slots ([R, S, S]: a rank has a handful of slots)."""
    slot = np.arange(phy2log.shape[1])
    # order[r, j, i]: slot j comes before slot i on rank r
    order = slot[:, None] < slot[None, :]  # [S, S] (broadcast over ranks)
    if first is not None:
        fj, fi = first[:, :, None], first[:, None, :]
        order = (fj & ~fi) | ((fj == fi) & order)
    same = phy2log[:, :, None] == phy2log[:, None, :]  # [R, S (j), S (i)]
    return (same & order).sum(axis=1, dtype=np.int64)


def _align_slots(
    old_p2l: np.ndarray, old_master: np.ndarray, new_p2l: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Permute the slots of each rank of ``new_p2l`` [R, S] so every copy also in
    ``old_p2l`` [R, S] (same rank, counted with multiplicity) stays in its old slot.

    Returns ``aligned`` [R, S] and ``dest`` [R, S]: new slot ``(r, s)`` moved to
    ``(r, dest[r, s])``. Copies that stay: for each rank and expert,
    ``min(old count, new count)``, which is the most any slot permutation keeps: the
    ``k``-th new copy of an expert on a rank (slot order) stays in the slot of its ``k``-th
    old copy (``old_master`` [E] flat master slots first, then slot order; see
    :func:`_occurrence`). The rest fill the free slots of their rank in slot order.

    Matched rank by rank ([R, S, S] pairs of slots: a rank has a handful). Where no
    expert has more than one copy on a rank in both placements, every pair of slots
    holding one expert is a match and the occurrences are not counted.
    """
    num_slots = new_p2l.shape[1]
    size = new_p2l.size
    new_flat = new_p2l.ravel()
    # pairs of one rank's slots holding one expert: new slot (r, i), old slot (r, j)
    pair = np.flatnonzero(new_p2l[:, :, None] == old_p2l[:, None, :])  # (r * S + i) * S + j
    at_new = pair // num_slots
    at_old = at_new - at_new % num_slots + pair % num_slots
    held = new_flat[at_new] >= 0
    at_new, at_old = at_new[held], at_old[held]
    hit = np.zeros(size, dtype=bool)  # the new copy stays
    hit[at_new] = True
    taken = np.zeros(size, dtype=bool)  # the old slot keeps its copy
    taken[at_old] = True
    if at_new.size != np.count_nonzero(hit) or at_new.size != np.count_nonzero(taken):
        # a rank holds an expert several times in one placement and at least once in
        # the other: pair the copies by occurrence
        first = np.zeros(size, dtype=bool)
        first[old_master] = True
        occ_old = _occurrence(old_p2l, first.reshape(old_p2l.shape)).ravel()
        occ_new = _occurrence(new_p2l).ravel()
        same = occ_new[at_new] == occ_old[at_old]
        at_new, at_old = at_new[same], at_old[same]
        hit[:] = False
        hit[at_new] = True
        taken[:] = False
        taken[at_old] = True
    dest_flat = np.empty(size, dtype=np.int64)
    dest_flat[at_new] = at_old
    # the rest fill the free slots of their rank in slot order (same count per rank)
    dest_flat[~hit] = np.flatnonzero(~taken)
    aligned = np.empty(size, dtype=new_p2l.dtype)
    aligned[dest_flat] = new_flat
    return aligned.reshape(new_p2l.shape), (dest_flat % num_slots).reshape(new_p2l.shape)


def _choose_masters(
    aligned: np.ndarray, old: Placement, policy_master: np.ndarray, masters_per_rank: int
) -> np.ndarray:
    """[E] flat master slot of each expert on the aligned placement.

    Start from the policy's masters (``policy_master`` [E], flat slots of ``aligned``),
    then move a master back to its old rank whenever ``aligned`` holds the expert there
    and that rank has room: at most ``max(masters_per_rank, policy's masters there)``
    masters per rank (the optimizer-state budget). Moves repeat until none is possible.
    On its rank, a master prefers its old slot, then a slot whose copy stayed.
    """
    num_ranks, num_slots = aligned.shape
    num_experts = policy_master.size
    experts = np.arange(num_experts)
    old_rank = old.master // num_slots
    cur = policy_master // num_slots
    if (cur == old_rank).all() and (aligned.ravel()[old.master] == experts).all():
        return old.master.astype(np.int64)  # every master stays on its rank, in its old slot
    wants = (aligned[old_rank] == experts[:, None]).any(axis=1) & (cur != old_rank)
    cap = np.maximum(masters_per_rank, np.bincount(cur, minlength=num_ranks))
    count = np.bincount(cur, minlength=num_ranks)
    for _ in range(num_experts):
        cand = np.flatnonzero(wants & (cur != old_rank))
        if cand.size == 0:
            break
        tgt = old_rank[cand]
        order = np.lexsort((cand, tgt))
        cand, tgt = cand[order], tgt[order]
        first = np.searchsorted(tgt, tgt)
        ok = (np.arange(cand.size) - first) < (cap - count)[tgt]
        if not ok.any():
            break
        moved = cand[ok]
        count -= np.bincount(cur[moved], minlength=num_ranks)
        count += np.bincount(old_rank[moved], minlength=num_ranks)
        cur[moved] = old_rank[moved]
    rows = aligned[cur]  # [E, S]
    holds = rows == experts[:, None]
    slot = np.arange(num_slots)
    old_slot = (cur == old_rank)[:, None] & (slot == (old.master % num_slots)[:, None])
    stayed = old.phy2log[cur] == experts[:, None]
    policy_slot = (cur == policy_master // num_slots)[:, None] & (
        slot == (policy_master % num_slots)[:, None]
    )
    score = 4 * old_slot + 2 * stayed + policy_slot  # [E, S]
    best = np.argmax(np.where(holds, score, -1), axis=1)
    return cur * num_slots + best


def align_placement(
    old: Placement,
    new: Placement,
    topology: Topology,
    relabel_ranks: bool = False,
    *,
    old_checked: bool = False,
) -> Placement:
    """Lay ``new`` over ``old`` so every copy that can stay in its slot stays.

    - ``old``, ``new``: placements on ``topology``; ``phy2log`` [R, S], ``master`` [E].
    - ``relabel_ranks``: the policy's balance does not depend on which rank of a DC
      gets which of its ranks' contents (its ``relabel_ranks`` class attribute). Then
      whole nodes of a DC may trade contents, and ranks inside a node may, whichever
      keeps most copies (an assignment problem; masters staying break ties). Ranks
      never trade across DCs, and nodes only with nodes of the same DC, so per-rank,
      per-node and per-DC contents, everything a policy balances, are unchanged.
    - ``old_checked``: ``old`` has been checked already (a result of this function, or a
      ``new`` it checked): only its shapes are checked again, not its values.

    Returns a placement with, on every rank, the same multiset of experts as ``new``
    (or as the ``new`` rank relabeled onto it), slots permuted so that each rank keeps
    ``min(old count, new count)`` copies of every expert in their old slots, and masters
    chosen by :func:`_choose_masters` (old rank when it still holds the expert and has
    room in its ``masters_per_rank`` budget, else the policy's rank).
    """
    _, num_slots, _ = _check_pair(old, new, topology, check_old=not old_checked)
    new_p2l, master = new.phy2log, new.master.astype(np.int64)
    if relabel_ranks:
        num_ranks = new_p2l.shape[0]
        perm = relabel.relabel_ranks(  # copies that stay first, masters that stay break ties
            old.phy2log, old.master // num_slots, new_p2l, topology,
            copy_weight=float(num_ranks * num_slots + 1), master_weight=1.0,
        )  # fmt: skip
        moved = np.empty_like(new_p2l)
        moved[perm] = new_p2l
        new_p2l = moved
        master = perm[master // num_slots] * num_slots + master % num_slots
    aligned, dest = _align_slots(old.phy2log, old.master, new_p2l)
    policy_master = (master // num_slots) * num_slots + dest.ravel()[master]
    master = _choose_masters(aligned, old, policy_master, topology.masters_per_rank)
    return Placement(phy2log=aligned, master=master)
