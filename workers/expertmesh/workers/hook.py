"""A torch hook for a plain PyTorch training loop: count top-k expert ids, stream them,
and hand back the latest plan as a ``log2phy`` remap.

Attach it to the router (gate) module of each MoE layer::

    hook = LoadHook(client, rank=rank, num_experts=E)
    for layer, moe in enumerate(model.moe_layers):
        hook.attach(moe.router, layer)
    for step, batch in enumerate(data):
        loss = model(batch) ...
        hook.step(step)                  # sends this step's [E] counts per layer
        remap = hook.log2phy(layer)      # [E, max copies] physical slot ids, -1 padded

The router's output may be integer top-k ids, a tuple holding them (e.g.
``(weights, ids)``), or float logits ``[T, E]`` (then ``top_k`` picks the ids);
pass ``extract=`` for anything else. Counting is ``torch.bincount`` on the ids,
under ``no_grad``, so the hook does not touch autograd.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from expertmesh.v1.convert import ReceivedPlan
from expertmesh.workers.client import ClientTls, ExpertMeshClient, ReportStream

__all__ = ["LoadHook", "log2phy_from_phy2log", "topk_ids_from_output"]

log = logging.getLogger(__name__)


def topk_ids_from_output(output: Any, top_k: int | None) -> torch.Tensor:
    """The top-k expert ids in a router's output: an integer tensor, the first integer
    tensor of a tuple/list, or ``topk`` of float logits ``[..., E]`` (needs ``top_k``)."""
    if isinstance(output, (tuple, list)):
        for x in output:
            if isinstance(x, torch.Tensor) and not x.is_floating_point():
                return x
        output = next((x for x in output if isinstance(x, torch.Tensor)), None)
    if not isinstance(output, torch.Tensor):
        raise ValueError("router output holds no tensor; pass extract= to LoadHook")
    if not output.is_floating_point():
        return output
    if top_k is None:
        raise ValueError("router returns logits: pass top_k= to LoadHook")
    return output.topk(top_k, dim=-1).indices


def log2phy_from_phy2log(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``phy2log`` [R, S] -> (``log2phy`` [E, C] flat physical slot ids ``r * S + s`` of each
    expert's copies, -1 padded, C = max copies; ``logcnt`` [E] copies per expert)."""
    flat = np.asarray(phy2log).ravel()
    slots = np.flatnonzero(flat >= 0)
    experts = flat[slots]
    if experts.size and experts.max() >= num_experts:
        raise ValueError("phy2log holds an expert id >= num_experts")
    logcnt = np.bincount(experts, minlength=num_experts)
    width = max(1, int(logcnt.max()) if logcnt.size else 1)
    out = np.full((num_experts, width), -1, np.int64)
    order = np.argsort(experts, kind="stable")
    e_sorted, s_sorted = experts[order], slots[order]
    first = np.concatenate([[0], np.cumsum(logcnt)[:-1]])
    col = np.arange(e_sorted.size) - first[e_sorted]
    out[e_sorted, col] = s_sorted
    return out, logcnt


class LoadHook:
    """Counts top-k expert ids of hooked router modules per step; streams them; follows plans.

    - ``client``: an :class:`ExpertMeshClient` (None: count only, e.g. for a dry run).
    - ``rank``: this trainer's rank (the row ``r`` of ``load[r, e]`` it reports).
    - ``watch``: follow ``WatchPlans`` in a background thread (the latest plan is
      :attr:`plan`); otherwise call :meth:`refresh_plan` yourself.
    """

    def __init__(
        self,
        client: ExpertMeshClient | None,
        *,
        rank: int,
        num_experts: int,
        top_k: int | None = None,
        extract: Callable[[Any], torch.Tensor] | None = None,
        watch: bool = True,
        batch: int = 64,
    ) -> None:
        if num_experts < 1 or rank < 0:
            raise ValueError("num_experts must be >= 1 and rank >= 0")
        self.client, self.rank, self.num_experts, self.top_k = client, rank, num_experts, top_k
        self._extract = extract or (lambda out: topk_ids_from_output(out, self.top_k))
        self._counts: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._stream: ReportStream | None = None
        self._batch = batch
        self.plan: ReceivedPlan | None = None
        self._remaps: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._watch_thread: threading.Thread | None = None
        self._watch: Any = None
        self._own_client = False
        if client is not None and watch:
            self._start_watch()

    @classmethod
    def connect(
        cls,
        target: str,
        *,
        rank: int,
        num_experts: int,
        token: str | None = None,
        tls: ClientTls | None = None,
        **kwargs: Any,
    ) -> LoadHook:
        """A hook with a client of its own for ``target`` (closed by :meth:`close`): over TLS
        when ``tls`` is given (the server verified with ``tls.ca``, ``tls.cert`` presented
        for mutual TLS). ``kwargs``: the constructor's (``top_k``, ``watch``, ...)."""
        client = ExpertMeshClient(target, token=token, tls=tls)
        try:
            hook = cls(client, rank=rank, num_experts=num_experts, **kwargs)
        except BaseException:
            client.close()
            raise
        hook._own_client = True
        return hook

    # ---- counting ----

    def attach(self, module: torch.nn.Module, layer: int) -> None:
        """Count the top-k ids that ``module`` (a router) outputs, as MoE layer ``layer``."""
        if layer < 0:
            raise ValueError("layer must be >= 0")

        def on_forward(_mod: torch.nn.Module, _inp: Any, out: Any) -> None:
            self.count(layer, self._extract(out))

        self._handles.append(module.register_forward_hook(on_forward))

    def count(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add ``topk_ids`` (any shape, ids in [0, E)) to this step's counts of ``layer``."""
        with torch.no_grad():
            ids = topk_ids.detach().reshape(-1).to("cpu", torch.int64)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
                raise ValueError(f"expert id outside [0, {self.num_experts}) in layer {layer}")
            c = torch.bincount(ids, minlength=self.num_experts)
        with self._lock:
            prev = self._counts.get(layer)
            self._counts[layer] = c if prev is None else prev + c

    def step(self, step: int) -> dict[int, np.ndarray]:
        """End microbatch ``step``: send each hooked layer's [E] counts, reset; returns them."""
        with self._lock:
            counts = {layer: c.numpy().copy() for layer, c in sorted(self._counts.items())}
            self._counts.clear()
        if self.client is not None and counts:
            if self._stream is None:
                self._stream = self.client.open_report_stream(self._batch)
            for layer, c in counts.items():
                self._stream.send(step, layer, self.rank, c)
            self._stream.flush()
        return counts

    # ---- plans ----

    def _start_watch(self) -> None:
        def run() -> None:
            client = self.client
            if client is None:
                return
            self._watch = client.watch_plans()
            try:
                for plan in self._watch:
                    self._set_plan(plan)
            except Exception:
                log.exception("plan watch ended")

        self._watch_thread = threading.Thread(target=run, name="expertmesh-plans", daemon=True)
        self._watch_thread.start()

    def _set_plan(self, plan: ReceivedPlan) -> None:
        with self._lock:
            if self.plan is None or plan.version > self.plan.version:
                self.plan = plan

    def refresh_plan(self) -> ReceivedPlan | None:
        """Fetch the committed plan now (without the watch thread)."""
        if self.client is not None:
            plan = self.client.get_plan()
            if plan is not None:
                self._set_plan(plan)
        return self.plan

    def log2phy(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(``log2phy`` [E, C] int64 physical slot ids ``r * S + s``, -1 padded; ``logcnt`` [E])
        of ``layer`` under the latest plan, or None before any plan."""
        plan = self.plan
        if plan is None:
            return None
        if not 0 <= layer < len(plan.layers):
            raise ValueError(f"the plan has no layer {layer}")
        key = (plan.version, layer)
        got = self._remaps.get(key)
        if got is None:
            table, cnt = log2phy_from_phy2log(plan.layers[layer].phy2log, self.num_experts)
            got = (torch.from_numpy(table), torch.from_numpy(cnt))
            self._remaps = {k: v for k, v in self._remaps.items() if k[0] == plan.version}
            self._remaps[key] = got
        return got

    def remap(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids -> physical slot ids under the latest plan; copies of an expert
        take turns by token position. Before any plan: the ids unchanged (static EP)."""
        maps = self.log2phy(layer)
        if maps is None:
            return topk_ids
        table, cnt = maps
        ids = topk_ids.to(torch.int64)
        flat = ids.reshape(-1)
        turn = torch.arange(flat.numel(), device=flat.device) % cnt[flat].clamp(min=1)
        return table[flat, turn].reshape(ids.shape)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._watch is not None:
            self._watch.cancel()
        try:
            if self._stream is not None:
                try:
                    self._stream.close()
                finally:
                    self._stream = None
        finally:
            if self._own_client and self.client is not None:
                self.client.close()
