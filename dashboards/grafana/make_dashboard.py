#!/usr/bin/env python3
"""Writes dashboards/grafana/expertmesh.json: a Grafana dashboard over the controller's metrics.

    python dashboards/grafana/make_dashboard.py          # rewrite the JSON
    python dashboards/grafana/make_dashboard.py --check  # exit 1 if the JSON is stale

One panel (or more) per metric family the controller exports on /metrics
(controller/expertmesh/controller/telemetry.py); tests/integration/test_grafana.py checks
every queried metric against a live /metrics and every exported family against the panels.
Import it in Grafana (Dashboards > New > Import) and pick the Prometheus data source.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("expertmesh.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = '{job=~"$job"}'

# (title, description, unit, kind, [(expr, legend)]); width 12 unless a stat (6).
ROWS: list[tuple[str, list[tuple[str, str, str, str, list[tuple[str, str]]]]]] = [
    (
        "Training",
        [
            ("Step", "Newest step recorded", "none", "stat", [(f"expertmesh_step{SEL}", "step")]),
            (
                "Loss",
                "Loss of the newest step",
                "none",
                "stat",
                [(f"expertmesh_step_loss{SEL}", "loss")],
            ),
            (
                "Workers up",
                "Ranks whose worker is up / ranks known",
                "none",
                "stat",
                [
                    (f"sum(expertmesh_worker_up{SEL})", "up"),
                    (f"count(expertmesh_worker_up{SEL})", "known"),
                ],
            ),
            (
                "Plan version",
                "Committed and newest prepared plan",
                "none",
                "stat",
                [
                    (f"expertmesh_plan_version{SEL}", "committed"),
                    (f"expertmesh_plan_prepared_version{SEL}", "prepared"),
                ],
            ),
            (
                "Step time",
                "Training step time: median, p95 and mean over 5 minutes",
                "s",
                "timeseries",
                [
                    (
                        "histogram_quantile(0.5, sum by (le) "
                        f"(rate(expertmesh_step_seconds_bucket{SEL}[5m])))",
                        "p50",
                    ),
                    (
                        "histogram_quantile(0.95, sum by (le) "
                        f"(rate(expertmesh_step_seconds_bucket{SEL}[5m])))",
                        "p95",
                    ),
                    (
                        f"rate(expertmesh_step_seconds_sum{SEL}[5m]) / "
                        f"rate(expertmesh_step_seconds_count{SEL}[5m])",
                        "mean",
                    ),
                ],
            ),
            (
                "Loss over time",
                "Loss of the newest step",
                "none",
                "timeseries",
                [(f"expertmesh_step_loss{SEL}", "loss")],
            ),
            (
                "Tokens per second",
                "Tokens computed by all ranks",
                "short",
                "timeseries",
                [(f"rate(expertmesh_tokens_total{SEL}[1m])", "tokens/s")],
            ),
            (
                "Tokens per rank",
                "Tokens each rank computed in the newest step",
                "short",
                "timeseries",
                [(f"expertmesh_rank_tokens{SEL}", "rank {{rank}}")],
            ),
        ],
    ),
    (
        "Balance",
        [
            (
                "Layer imbalance (max/mean)",
                "Each layer's newest load under the committed placement (1.0 is ideal)",
                "none",
                "timeseries",
                [(f"expertmesh_layer_imbalance_ratio{SEL}", "layer {{layer}}")],
            ),
            (
                "Layer balancedness (mean/max)",
                "1 / imbalance of each layer's newest load",
                "percentunit",
                "timeseries",
                [(f"expertmesh_layer_balancedness_ratio{SEL}", "layer {{layer}}")],
            ),
            (
                "Balancedness over layers (vLLM's min, p50, p90, avg)",
                "Mean/max tokens per rank per layer, summarized over layers as vLLM's "
                "vllm:eplb_balancedness_{min,p50,p90,avg}; add those to this panel to compare "
                "(docs/engines.md)",
                "percentunit",
                "timeseries",
                [(f"expertmesh_eplb_balancedness_ratio{SEL}", "{{stat}}")],
            ),
            (
                "Committed plan: imbalance before and after",
                "Max/mean tokens per rank of the load the plan was made for",
                "none",
                "timeseries",
                [(f"expertmesh_plan_imbalance_ratio{SEL}", "layer {{layer}} {{when}}")],
            ),
            (
                "Worker up per rank",
                "1 if the worker of a rank is up",
                "none",
                "timeseries",
                [(f"expertmesh_worker_up{SEL}", "rank {{rank}}")],
            ),
        ],
    ),
    (
        "Fast loop (SPMD data plane, measured)",
        [
            (
                "Measured vs the planner's level vs static EP imbalance (max/mean)",
                "Newest step: max over microbatches and layers of max/mean tokens each rank "
                "computed, beside the planner's level (its own split by DC and quota solved "
                "on the same exact counts under the same plan) and what static EP would have "
                "had on the same tokens",
                "none",
                "timeseries",
                [
                    (f"expertmesh_measured_imbalance_ratio{SEL}", "measured"),
                    (f"expertmesh_planner_imbalance_ratio{SEL}", "planner's level"),
                    (f"expertmesh_static_imbalance_ratio{SEL}", "static EP"),
                ],
            ),
            (
                "The planner's level per microbatch and layer (max/mean)",
                "Newest step: max/mean tokens per rank the planner's split by DC and quota "
                "reach on each microbatch's exact counts, per layer",
                "none",
                "timeseries",
                [
                    (
                        f"expertmesh_planner_microbatch_imbalance_ratio{SEL}",
                        "microbatch {{microbatch}} layer {{layer}}",
                    )
                ],
            ),
            (
                "Measured balancedness per layer (mean/max)",
                "Mean/max tokens computed per rank in the newest step (vLLM's "
                "vllm:eplb_balancedness meaning), measured, not planned",
                "percentunit",
                "timeseries",
                [(f"expertmesh_measured_balancedness_ratio{SEL}", "layer {{layer}}")],
            ),
            (
                "Fast-loop replicas and fan-out",
                "Replicas added per second (over layers and domains) and replica weights "
                "fetched inside domains",
                "short",
                "timeseries",
                [
                    (f"rate(expertmesh_fast_loop_replicas_total{SEL}[1m])", "replicas/s"),
                    (f"rate(expertmesh_fast_loop_fanout_bytes_total{SEL}[1m])", "fan-out B/s"),
                ],
            ),
            (
                "Fast-loop time per step",
                "Exposed fast-loop time (counts exchange + quota solve + replica-fetch wait "
                "not hidden by compute), max over ranks: p50 and p95 over 5 minutes, beside "
                "the mean step time",
                "s",
                "timeseries",
                [
                    (
                        "histogram_quantile(0.5, sum by (le) "
                        f"(rate(expertmesh_fast_loop_seconds_bucket{SEL}[5m])))",
                        "p50",
                    ),
                    (
                        "histogram_quantile(0.95, sum by (le) "
                        f"(rate(expertmesh_fast_loop_seconds_bucket{SEL}[5m])))",
                        "p95",
                    ),
                    (
                        f"rate(expertmesh_step_seconds_sum{SEL}[5m]) / "
                        f"rate(expertmesh_step_seconds_count{SEL}[5m])",
                        "step (mean)",
                    ),
                ],
            ),
        ],
    ),
    (
        "Plans",
        [
            (
                "Plans committed and rolled back",
                "Per 10 minutes",
                "short",
                "timeseries",
                [
                    (f"increase(expertmesh_plan_commits_total{SEL}[10m])", "committed"),
                    (f"increase(expertmesh_plan_rollbacks_total{SEL}[10m])", "rolled back"),
                ],
            ),
            (
                "Planner solve time per layer",
                "Median and p99 over 5 minutes",
                "s",
                "timeseries",
                [
                    (
                        "histogram_quantile(0.5, sum by (le) "
                        f"(rate(expertmesh_planner_solve_seconds_bucket{SEL}[5m])))",
                        "p50",
                    ),
                    (
                        "histogram_quantile(0.99, sum by (le) "
                        f"(rate(expertmesh_planner_solve_seconds_bucket{SEL}[5m])))",
                        "p99",
                    ),
                    (f"rate(expertmesh_planner_solve_seconds_count{SEL}[5m])", "solves/s"),
                ],
            ),
            (
                "Load reports",
                "Received and rejected per second (REST, gRPC, actors)",
                "reqps",
                "timeseries",
                [
                    (f"rate(expertmesh_load_reports_received_total{SEL}[1m])", "received"),
                    (f"rate(expertmesh_load_reports_rejected_total{SEL}[1m])", "rejected"),
                ],
            ),
        ],
    ),
    (
        "Cross-DC traffic",
        [
            (
                "Cross-DC traffic by pair and kind",
                "Bits per second from src_dc to dst_dc, as tokens or as weights",
                "bps",
                "timeseries",
                [
                    (
                        "8 * sum by (src_dc, dst_dc, kind) "
                        f"(rate(expertmesh_cross_dc_bytes_total{SEL}[1m]))",
                        "{{src_dc}} → {{dst_dc}} {{kind}}",
                    )
                ],
            ),
            (
                "Tokens vs weights across DCs",
                "Share of cross-DC bytes by kind",
                "bps",
                "timeseries",
                [
                    (
                        f"8 * sum by (kind) (rate(expertmesh_cross_dc_bytes_total{SEL}[1m]))",
                        "{{kind}}",
                    )
                ],
            ),
            (
                "Migrations (expert copies moved)",
                "Per 10 minutes, by DC pair",
                "short",
                "timeseries",
                [
                    (
                        f"increase(expertmesh_migrations_total{SEL}[10m])",
                        "{{src_dc}} → {{dst_dc}}",
                    )
                ],
            ),
            (
                "Migration bytes",
                "Bytes moved by committed plans, per 10 minutes, by DC pair",
                "bytes",
                "timeseries",
                [
                    (
                        f"increase(expertmesh_migration_bytes_total{SEL}[10m])",
                        "{{src_dc}} → {{dst_dc}}",
                    )
                ],
            ),
        ],
    ),
]


def _panel(pid: int, x: int, y: int, spec: tuple[str, str, str, str, list[tuple[str, str]]]) -> dict[str, Any]:  # fmt: skip
    title, desc, unit, kind, targets = spec
    w = 6 if kind == "stat" else 12
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"h": 4 if kind == "stat" else 8, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (schemaVersion 39)."""
    panels: list[dict[str, Any]] = []
    y = 0
    pid = 1
    for row_title, specs in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x = pid + 1, y + 1, 0
        height = 0
        for spec in specs:
            p = _panel(pid, x, y, spec)
            w, h = p["gridPos"]["w"], p["gridPos"]["h"]
            if x + w > 24:
                x, y = 0, y + height
                p["gridPos"].update(x=0, y=y)
                height = 0
            panels.append(p)
            pid, x, height = pid + 1, x + w, max(height, h)
        y += height
    return {
        "title": "expertmesh",
        "uid": "expertmesh",
        "description": "MoE expert placement across DCs: training, balance, plans, cross-DC traffic",
        "tags": ["expertmesh", "ray", "moe"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "",
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "job",
                    "label": "Controller job",
                    "type": "query",
                    "datasource": DS,
                    "query": {
                        "query": "label_values(expertmesh_plan_version, job)",
                        "refId": "job",
                    },
                    "definition": "label_values(expertmesh_plan_version, job)",
                    "includeAll": True,
                    "allValue": ".*",
                    "current": {},
                    "refresh": 2,
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv == ["--check"]:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
