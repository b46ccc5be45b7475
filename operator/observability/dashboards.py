"""Grafana dashboard JSON from the panel tables (`panels.py`).

Each dashboard has a Prometheus data-source variable and a `pdcluster`
variable (the clusters the router or the operator reports), time series
panels two to a row, and the tag `pdcluster`. The chart ships them as
ConfigMaps with Grafana's sidecar label; `docs/dashboards/` holds the same
files for an import by hand.

Pure module.
"""

from __future__ import annotations

import json
from typing import Any

from pdcluster.operator.observability.panels import DASHBOARDS, Panel, Source

SCHEMA_VERSION = 39
PANEL_WIDTH, PANEL_HEIGHT = 12, 8
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_REF_IDS = "ABCDEFGH"


def _cluster_variable(panels: tuple[Panel, ...]) -> dict[str, Any]:
    operator_only = all(p.source is Source.operator for p in panels)
    metric = "pdcluster_operator_role_replicas" if operator_only else "pdcluster_router_info"
    query = f"label_values({metric}, pdcluster)"
    return {
        "name": "pdcluster",
        "label": "PDCluster",
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": "PDClusters"},
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
        "sort": 1,
    }


def build_panel(panel: Panel, panel_id: int) -> dict[str, Any]:
    column = (panel_id - 1) % 2
    row = (panel_id - 1) // 2
    custom: dict[str, Any] = {"fillOpacity": 10, "showPoints": "never"}
    if panel.stacked:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {
            "x": column * PANEL_WIDTH,
            "y": row * PANEL_HEIGHT,
            "w": PANEL_WIDTH,
            "h": PANEL_HEIGHT,
        },
        "fieldConfig": {"defaults": {"unit": panel.unit.value, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": _REF_IDS[i],
                "datasource": DATASOURCE,
                "expr": q.expr,
                "legendFormat": q.legend,
            }
            for i, q in enumerate(panel.queries)
        ],
    }


def build_dashboard(uid: str) -> dict[str, Any]:
    title, panels = DASHBOARDS[uid]
    return {
        "uid": uid,
        "title": title,
        "tags": ["pdcluster"],
        "timezone": "",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                _cluster_variable(panels),
            ]
        },
        "panels": [build_panel(p, i) for i, p in enumerate(panels, start=1)],
    }


def render_dashboard(uid: str) -> str:
    """The dashboard as the JSON file the chart and the docs hold."""
    return json.dumps(build_dashboard(uid), indent=2, sort_keys=True) + "\n"
