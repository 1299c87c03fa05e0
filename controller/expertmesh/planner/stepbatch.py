"""The batched step cost: :func:`~expertmesh.planner.costmodel.step_cost` of many items
(the simulator's EP groups, one step of one policy each) in one pass of array operations.
Called through :func:`~expertmesh.planner.costmodel.step_costs`, whose docstring says
what it returns; this module only holds its implementation (costmodel.py stays under 800
lines).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from expertmesh.planner.costmodel import (
    _NIC_IN,
    _NIC_OUT,
    _NODE_IN,
    _NODE_OUT,
    CostSettings,
    ExpertStreams,
    StepCost,
    _index,
    crossings,
    expected_crossings,
)
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import TokenTraffic

__all__ = ["batch_step_costs"]


def batch_step_costs(
    topology: Topology,
    model: ModelSpec,
    traffics: Sequence[TokenTraffic],
    streams: Sequence[ExpertStreams],
    settings: CostSettings | None = None,
) -> list[StepCost]:
    """:func:`~expertmesh.planner.costmodel.step_costs` (its reference and docs)."""
    settings = settings or CostSettings()
    n = len(traffics)
    num_ranks, num_dcs = topology.num_ranks, topology.num_dcs
    if len(streams) != n:
        raise ValueError("step_costs needs one ExpertStreams per TokenTraffic")
    if any(t.num_ranks != num_ranks for t in traffics):
        raise ValueError(f"every traffic must have the topology's {num_ranks} ranks")
    if any(s.port_tail.shape != (num_ranks, 4) for s in streams):
        raise ValueError(f"expert streams must have ports [{num_ranks}, 4]")
    if n == 0:
        return []
    tb = float(model.token_bytes)

    # ---- ordered DC pairs of every item: key = item * D^2 + src * D + dst ----
    dd = num_dcs * num_dcs
    sizes = [t.pair_src.size for t in traffics]
    item_p = np.repeat(np.arange(n), sizes)  # [P]
    item_q = np.repeat(np.arange(n), [s.pair_src.size for s in streams])  # [Q]
    src = np.concatenate([t.pair_src for t in traffics])
    dst = np.concatenate([t.pair_dst for t in traffics])
    x = _crossings_all(traffics, item_p * num_dcs + src, model.top_k, settings.hierarchical)
    x_ends = np.cumsum(sizes).tolist()  # item i's pairs: x_ends[i - 1]:x_ends[i]
    fwd_key = item_p * dd + src * num_dcs + dst
    rev_key = item_p * dd + dst * num_dcs + src
    exp_key = item_q * dd + np.concatenate([s.pair_src * num_dcs + s.pair_dst for s in streams])
    keys, inv = _index(np.concatenate([fwd_key, rev_key, exp_key]), n * dd)
    p = fwd_key.size
    inv_f, inv_r, inv_e = inv[:p], inv[p : 2 * p], inv[2 * p :]

    def on_keys(idx: np.ndarray, vals: np.ndarray) -> np.ndarray:
        return np.bincount(idx, weights=vals, minlength=keys.size)

    kitem, kpair = keys // dd, keys % dd
    ksrc, kdst = kpair // num_dcs, kpair % num_dcs
    bw = topology.dc_gbps[ksrc, kdst] * 1e9 / 8.0  # [K] bytes/s
    lat = topology.dc_latency_ms[ksrc, kdst] / 1e3
    disp = on_keys(inv_f, x * tb)
    comb = on_keys(inv_r, x * tb)
    gtail = on_keys(inv_e, np.concatenate([s.pair_tail for s in streams]))
    gback = on_keys(inv_e, np.concatenate([s.pair_background for s in streams]))

    def per_item_max(vals: np.ndarray) -> np.ndarray:
        # [n] the largest of each item's keys (-inf where it has none)
        out = np.full(n, -np.inf)
        np.maximum.at(out, kitem, vals)
        return out

    def link_phase(nbytes: np.ndarray) -> np.ndarray:
        t = per_item_max(np.where(nbytes > 0, lat + nbytes / bw, -np.inf))
        return np.where(t > -np.inf, t, 0.0)

    # ---- rank ports [n, R] ----
    out_t = _stack([t.rank_out for t in traffics]) * tb  # [n, R, 3]
    in_t = _stack([t.rank_in for t in traffics]) * tb
    pair_tokens = np.concatenate([t.pair_tokens for t in traffics])
    assign_out = np.bincount(item_p * num_dcs + src, weights=pair_tokens, minlength=n * num_dcs)
    cross_out = np.bincount(item_p * num_dcs + src, weights=x, minlength=n * num_dcs)
    dedup = np.ones(n * num_dcs)  # [n * D]
    np.divide(cross_out, assign_out, out=dedup, where=assign_out > 0)
    node_out, node_in = out_t[:, :, 0], in_t[:, :, 0]
    nic_out = out_t[:, :, 1] + out_t[:, :, 2] * dedup.reshape(n, num_dcs)[:, topology.rank_dc]
    nic_in = in_t[:, :, 1] + in_t[:, :, 2]
    node, nic = topology.intra_node, topology.intra_dc

    def busiest(out: np.ndarray, inp: np.ndarray, bw: float, lat: float) -> np.ndarray:
        busy = np.maximum(out.max(axis=1), inp.max(axis=1))  # [n]
        return np.where(busy > 0, lat + busy / bw, 0.0)

    def port_phase(n_out: np.ndarray, n_in: np.ndarray, c_out: np.ndarray, c_in: np.ndarray):
        return np.maximum(
            busiest(n_out, n_in, node.bytes_per_second, node.latency_s),
            busiest(c_out, c_in, nic.bytes_per_second, nic.latency_s),
        )

    pt = _stack([s.port_tail for s in streams])  # [n, R, 4]
    pb = _stack([s.port_background for s in streams])
    chunks = settings.pipeline_chunks
    msg = settings.message_seconds * chunks
    ports = port_phase(node_out, node_in, nic_out, nic_in)
    dispatch = np.maximum(link_phase(disp), ports) + msg
    combine = np.maximum(link_phase(comb), ports) + msg

    # ---- compute ----
    rank_tokens = _stack([t.rank_tokens for t in traffics])  # [n, R]
    most = rank_tokens.max(axis=1)
    compute_fwd = most * (2.0 * model.expert_params) / settings.flops_per_second
    mean_tokens = rank_tokens.sum(axis=1) / num_ranks
    imbalance = np.ones(n)
    np.divide(most, mean_tokens, out=imbalance, where=mean_tokens > 0)

    chain = _pipe_all((dispatch, compute_fwd, combine), chunks)
    train = model.training
    if train:
        compute_bwd = 2.0 * compute_fwd
        tail = msg + np.maximum(
            link_phase(comb + gtail),
            port_phase(
                node_in + pt[:, :, _NODE_OUT],
                node_out + pt[:, :, _NODE_IN],
                nic_in + pt[:, :, _NIC_OUT],
                nic_out + pt[:, :, _NIC_IN],
            ),
        )
        chain = chain + (_pipe_all((dispatch, compute_bwd, combine), chunks) + (tail - combine))
    cps = 2.0 if train else 1.0

    # ---- resource bound ----
    link_total = cps * (disp + comb) + gtail + gback
    link_busy = np.where(link_total > 0, link_total / bw, 0.0)
    port_busy = np.maximum(
        np.maximum(
            cps * (node_out + node_in) + pt[:, :, 0] + pb[:, :, 0],
            cps * (node_in + node_out) + pt[:, :, 1] + pb[:, :, 1],
        ) / node.bytes_per_second,
        np.maximum(
            cps * (nic_out + nic_in) + pt[:, :, 2] + pb[:, :, 2],
            cps * (nic_in + nic_out) + pt[:, :, 3] + pb[:, :, 3],
        ) / nic.bytes_per_second,
    )  # [n, R]  # fmt: skip
    link_most = np.maximum(per_item_max(link_busy), 0.0)  # 0 for an item without links
    port_most = np.maximum(port_busy.max(axis=1), 0.0)
    resource = np.maximum(link_most, port_most)

    bounds = np.searchsorted(kitem, np.arange(n + 1))  # item i's keys: bounds[i]:bounds[i+1]
    # per item as Python floats (the same values as float() of each element)
    dispatch_l, combine_l, fwd_l = dispatch.tolist(), combine.tolist(), compute_fwd.tolist()
    bwd_l, tail_l = (compute_bwd.tolist(), tail.tolist()) if train else ([], [])
    chain_l, resource_l, imbalance_l = chain.tolist(), resource.tolist(), imbalance.tolist()
    weight_bytes: dict[int, float] = {}  # per ExpertStreams (items often share one)
    out = []
    lo = 0
    for i in range(n):
        hi = x_ends[i]
        phases = {"dispatch": dispatch_l[i], "compute_fwd": fwd_l[i], "combine": combine_l[i]}
        if train:
            phases |= {"combine_bwd": dispatch_l[i], "compute_bwd": bwd_l[i],
                       "dispatch_bwd": tail_l[i]}  # fmt: skip
        if resource_l[i] > chain_l[i]:
            a, b = bounds[i], bounds[i + 1]
            if b > a and link_most[i] >= port_most[i]:
                k = a + int(np.argmax(link_busy[a:b]))
                s, d = topology.dcs[int(ksrc[k])].name, topology.dcs[int(kdst[k])].name
                bottleneck = f"link {s}->{d}"
            else:
                bottleneck = f"port of rank {int(np.argmax(port_busy[i]))}"
        else:
            bottleneck = "chain: " + max(phases, key=lambda k: phases[k])
        si = streams[i]
        wb = weight_bytes.get(id(si))
        if wb is None:
            wb = weight_bytes[id(si)] = si.cross_dc_bytes
        out.append(
            StepCost(
                seconds=max(chain_l[i], resource_l[i]),
                chain_seconds=chain_l[i],
                resource_seconds=resource_l[i],
                phases=phases,
                imbalance=imbalance_l[i],
                cross_dc_token_bytes=2.0 * cps * float(x[lo:hi].sum()) * tb,
                cross_dc_weight_bytes=wb,
                bottleneck=bottleneck,
            )
        )
        lo = hi
    return out


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    """``np.stack(arrays)`` of same-shape arrays: one concatenate, then a reshape."""
    return np.concatenate(arrays).reshape(len(arrays), *arrays[0].shape)


def _crossings_all(
    traffics: Sequence[TokenTraffic], src: np.ndarray, top_k: int, hierarchical: bool
) -> np.ndarray:
    """[P] :func:`crossings` of every item's pairs, concatenated (``src`` [P]: each pair's
    source DC numbered over all items, ``item * D + dc``); one
    :func:`expected_crossings` call when they all need the estimate."""
    if hierarchical and top_k > 1 and all(t.pair_crossings is None for t in traffics):
        n = np.concatenate([t.dc_tokens for t in traffics])[src]
        return expected_crossings(n, np.concatenate([t.pair_tokens for t in traffics]), top_k)
    return np.concatenate([crossings(t, top_k, hierarchical) for t in traffics])


def _pipe_all(parts: tuple[np.ndarray, ...], chunks: int) -> np.ndarray:
    """:func:`_pipe` of every item: ``parts`` [n] each."""
    longest = np.maximum.reduce(parts)
    return longest + (parts[0] + parts[1] + parts[2] - longest) / chunks
