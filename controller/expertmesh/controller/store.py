"""SQLite plan store: every committed plan with its metrics, and the active settings.

Survives a controller restart: :meth:`SqlitePlanStore.recover` hands the newest
committed plan back to a fresh :class:`ControllerCore` (``core.restore``) and
re-applies the saved settings. Arrays are stored as ``np.save`` bytes and read
back with ``allow_pickle=False``: nothing in the database is ever unpickled.
Retention (``keep``) bounds how many committed plans are kept; older ones are
deleted as new ones arrive.

Tables::

    plans(version PK, step, policy, state, created_at, committed_at, num_layers,
          imbalance_before JSON [L], imbalance_after JSON [L], solve_seconds,
          migrations, migration_bytes)
    plan_layers(version, layer, phy2log npy [R, S] int32, master npy [E] int64,
                route npy [N, 4] (smallest exact integer dtype; read back as int64),
                migration npy [M, 7] int64,
                round_seconds npy [rounds] float64, kept, solve_seconds)
    settings(key PK, value JSON)
"""

from __future__ import annotations

import io
import json
import logging
import sqlite3
import threading
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from expertmesh.controller.core import (
    ControllerCore,
    ControllerSettings,
    PlanState,
    PlanVersion,
)
from expertmesh.controller.planning import compact_ints
from expertmesh.planner import LayerPlan, Migration, Placement, Transfer, TransferKind

__all__ = ["PlanSummary", "SqlitePlanStore", "arr_from_bytes", "arr_to_bytes"]

log = logging.getLogger(__name__)

# Migration rows: (expert, src_rank, dst_rank, dst_slot, nbytes, round, is_master)
MIGRATION_COLUMNS = ("expert", "src_rank", "dst_rank", "dst_slot", "nbytes", "round", "is_master")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS plans (
    version INTEGER PRIMARY KEY,
    step INTEGER NOT NULL,
    policy TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    committed_at REAL,
    num_layers INTEGER NOT NULL,
    imbalance_before TEXT NOT NULL,
    imbalance_after TEXT NOT NULL,
    solve_seconds REAL NOT NULL,
    migrations INTEGER NOT NULL,
    migration_bytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS plan_layers (
    version INTEGER NOT NULL REFERENCES plans(version) ON DELETE CASCADE,
    layer INTEGER NOT NULL,
    phy2log BLOB NOT NULL,
    master BLOB NOT NULL,
    route BLOB NOT NULL,
    migration BLOB NOT NULL,
    round_seconds BLOB NOT NULL,
    kept INTEGER NOT NULL,
    solve_seconds REAL NOT NULL,
    PRIMARY KEY (version, layer)
);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def arr_to_bytes(arr: np.ndarray) -> bytes:
    """``np.save`` bytes of ``arr`` (object arrays refused)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def arr_from_bytes(data: bytes) -> np.ndarray:
    """Inverse of :func:`arr_to_bytes`; never unpickles."""
    return np.load(io.BytesIO(data), allow_pickle=False)


class PlanSummary(BaseModel):
    """A committed plan's metrics, without its arrays (the REST API serves this field list
    as ``PlanSummaryOut``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int
    step: int
    policy: str
    state: str
    created_at: float
    committed_at: float | None
    num_layers: int
    imbalance_before: list[float] = Field(description="[L] max/mean before the plan")
    imbalance_after: list[float] = Field(description="[L] max/mean under the plan")
    solve_seconds: float
    migrations: int
    migration_bytes: int


def summarize(pv: PlanVersion) -> PlanSummary:
    return PlanSummary(
        version=pv.version,
        step=pv.step,
        policy=pv.policy,
        state=str(pv.state),
        created_at=pv.created_at,
        committed_at=pv.committed_at,
        num_layers=len(pv.layers),
        imbalance_before=[float(x) for x in pv.imbalance_before],
        imbalance_after=[float(x) for x in pv.imbalance_after],
        solve_seconds=pv.solve_seconds,
        migrations=sum(lp.migration.copies for lp in pv.layers),
        migration_bytes=pv.migration_bytes,
    )


class SqlitePlanStore:
    """Committed plans in SQLite (``path`` may be ``":memory:"``). Thread-safe.

    ``keep``: how many of the newest committed plans to keep (retention).
    """

    def __init__(self, path: str | Path, *, keep: int = 1000) -> None:
        if keep < 1:
            raise ValueError(f"keep (plan retention) must be >= 1, got {keep}")
        self.path = str(path)
        self.keep = keep
        self._lock = threading.Lock()
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        with self._lock:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- writes ----

    def save(self, plan: PlanVersion) -> None:
        """Store a committed plan (idempotent: saving a version again replaces it)."""
        if plan.state != PlanState.COMMITTED:
            raise ValueError(
                f"only committed plans are stored; plan {plan.version} is {plan.state}"
            )
        s = summarize(plan)
        layer_rows = [
            (
                plan.version,
                layer,
                arr_to_bytes(lp.placement.phy2log.astype(np.int32)),
                arr_to_bytes(lp.placement.master.astype(np.int64)),
                # a route can be ~R * E rows: stored in 16 bits where its values fit
                arr_to_bytes(compact_ints(np.asarray(lp.route, np.int64).reshape(-1, 4))),
                arr_to_bytes(_migration_rows(lp.migration)),
                arr_to_bytes(np.asarray(lp.migration.round_seconds, np.float64)),
                lp.migration.kept,
                float(lp.solve_seconds),
            )
            for layer, lp in enumerate(plan.layers)
        ]
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM plan_layers WHERE version = ?", (s.version,))
                db.execute(
                    "INSERT OR REPLACE INTO plans VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        s.version,
                        s.step,
                        s.policy,
                        s.state,
                        s.created_at,
                        s.committed_at,
                        s.num_layers,
                        json.dumps(s.imbalance_before),
                        json.dumps(s.imbalance_after),
                        s.solve_seconds,
                        s.migrations,
                        s.migration_bytes,
                    ),
                )
                db.executemany("INSERT INTO plan_layers VALUES (?,?,?,?,?,?,?,?,?)", layer_rows)
                self._apply_retention()
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _apply_retention(self) -> None:
        cut = self._db.execute(
            "SELECT version FROM plans ORDER BY version DESC LIMIT 1 OFFSET ?", (self.keep,)
        ).fetchone()
        if cut is not None:
            self._db.execute("DELETE FROM plan_layers WHERE version <= ?", (cut[0],))
            self._db.execute("DELETE FROM plans WHERE version <= ?", (cut[0],))

    def save_settings(self, settings: ControllerSettings) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO settings VALUES ('controller', ?)",
                (settings.model_dump_json(),),
            )

    def note_issued(self, version: int) -> None:
        """The newest plan version handed out (offered to workers), committed or not: a
        restarted controller numbers its plans above it."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO settings VALUES ('issued_version', ?)", (str(int(version)),)
            )

    # ---- reads ----

    def issued_version(self) -> int:
        """:meth:`note_issued`'s newest version (0: none)."""
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM settings WHERE key = 'issued_version'"
            ).fetchone()
        return int(row[0]) if row is not None else 0

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM plans").fetchone()[0])

    def summaries(
        self, *, offset: int = 0, limit: int = 50, newest_first: bool = True
    ) -> list[PlanSummary]:
        """A page of committed plans' metrics."""
        if offset < 0 or limit < 0:
            raise ValueError("offset and limit must be >= 0")
        order = "DESC" if newest_first else "ASC"
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM plans ORDER BY version {order} LIMIT ? OFFSET ?",
                (limit, offset),
            ).fetchall()
        return [_summary_from_row(r) for r in rows]

    def latest_version(self) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT MAX(version) FROM plans").fetchone()
        return None if row[0] is None else int(row[0])

    def get(self, version: int) -> PlanVersion | None:
        """The stored plan ``version`` with its arrays, or None."""
        if not 0 < version < 2**63:  # SQLite integers are int64; no such plan can exist
            return None
        with self._lock:
            head = self._db.execute("SELECT * FROM plans WHERE version = ?", (version,)).fetchone()
            layers = self._db.execute(
                "SELECT * FROM plan_layers WHERE version = ? ORDER BY layer", (version,)
            ).fetchall()
        if head is None:
            return None
        s = _summary_from_row(head)
        return PlanVersion(
            version=s.version,
            step=s.step,
            policy=s.policy,
            layers=[_layer_from_row(r) for r in layers],
            imbalance_before=s.imbalance_before,
            imbalance_after=s.imbalance_after,
            state=PlanState(s.state),
            created_at=s.created_at,
            committed_at=s.committed_at,
        )

    def load_settings(self) -> ControllerSettings | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM settings WHERE key = 'controller'").fetchone()
        if row is None:
            return None
        try:
            return ControllerSettings.model_validate_json(row[0])
        except ValidationError:
            log.warning("stored controller settings are invalid; ignoring them")
            return None

    # ---- restart ----

    def recover(self, core: ControllerCore) -> PlanVersion | None:
        """Give ``core`` the saved settings and the newest committed plan; returns that plan.

        A stored plan that does not fit the core's topology or model (the operator
        changed them) is skipped with a warning rather than adopted.
        """
        settings = self.load_settings()
        if settings is not None:
            try:
                core.configure(settings)
            except ValueError as err:
                log.warning("stored settings not applied: %s", err)
        latest = self.latest_version()
        if latest is None:
            return None
        pv = self.get(latest)
        if pv is None:
            return None
        shape = (core.topology.num_ranks, core.topology.slots_per_rank)
        if len(pv.layers) != core.model.num_layers or any(
            lp.phy2log.shape != shape or lp.placement.master.shape != (core.model.num_experts,)
            for lp in pv.layers
        ):
            log.warning("stored plan %d does not fit this topology/model; not restored", latest)
            return None
        core.restore(pv)
        return pv


def _migration_rows(m: Migration) -> np.ndarray:
    rows = [
        (t.expert, t.src_rank, t.dst_rank, t.dst_slot, t.nbytes, t.round, t.kind == "master")
        for t in m.transfers
    ]
    return np.array(rows, np.int64).reshape(-1, len(MIGRATION_COLUMNS))


def _summary_from_row(r: tuple) -> PlanSummary:
    return PlanSummary(
        version=int(r[0]),
        step=int(r[1]),
        policy=str(r[2]),
        state=str(r[3]),
        created_at=float(r[4]),
        committed_at=None if r[5] is None else float(r[5]),
        num_layers=int(r[6]),
        imbalance_before=[float(x) for x in json.loads(r[7])],
        imbalance_after=[float(x) for x in json.loads(r[8])],
        solve_seconds=float(r[9]),
        migrations=int(r[10]),
        migration_bytes=int(r[11]),
    )


def _layer_from_row(r: tuple) -> LayerPlan:
    mig = arr_from_bytes(r[5])
    transfers = tuple(
        Transfer(
            expert=int(e),
            src_rank=int(s),
            dst_rank=int(d),
            dst_slot=int(slot),
            nbytes=int(nb),
            round=int(rnd),
            kind=TransferKind.MASTER if is_master else TransferKind.REPLICA,
        )
        for e, s, d, slot, nb, rnd, is_master in mig
    )
    return LayerPlan(
        placement=Placement(phy2log=arr_from_bytes(r[2]), master=arr_from_bytes(r[3])),
        route=arr_from_bytes(r[4]).astype(np.int64),
        migration=Migration(
            transfers=transfers,
            round_seconds=tuple(float(x) for x in arr_from_bytes(r[6])),
            kept=int(r[7]),
        ),
        solve_seconds=float(r[8]),
    )
