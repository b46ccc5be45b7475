"""The dashboards' panels drawn from real query results (matplotlib), one PNG per dashboard.

Grafana itself cannot run here (no package for it in the registries this
project uses), so `plot_dashboards` evaluates each panel's queries over a
time range and draws them the way the dashboard lays them out: two panels
a row, one line per series, the panel's legend format for the labels.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from pdcluster.operator.observability.panels import DASHBOARDS, Source

RangeQuery = Callable[[str], list[dict[str, Any]]]


def legend_of(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def plot_dashboards(query: RangeQuery, out_dir: Path, sources: Container[Source]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for uid, (title, panels) in DASHBOARDS.items():
        shown = [p for p in panels if p.source in sources]
        if not shown:
            continue
        rows = (len(shown) + 1) // 2
        fig, axes = plt.subplots(rows, 2, figsize=(14, 3.2 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, shown, strict=False):
            t0 = None
            for q in panel.queries:
                for series in query(q.expr):
                    points = [(float(t), float(v)) for t, v in series["values"]]
                    points = [(t, v) for t, v in points if math.isfinite(v)]
                    if not points:
                        continue
                    t0 = points[0][0] if t0 is None else min(t0, points[0][0])
                    xs = [t for t, _ in points]
                    ax.plot(xs, [v for _, v in points], label=legend_of(q.legend, series["metric"]))
            if t0 is not None:
                for line in ax.get_lines():
                    line.set_xdata([x - t0 for x in line.get_xdata()])
                ax.relim()
                ax.autoscale_view()
            ax.set_title(panel.title, fontsize=10)
            ax.set_xlabel("seconds", fontsize=8)
            ax.set_ylabel(panel.unit.value, fontsize=8)
            ax.tick_params(labelsize=7)
            if ax.get_lines():
                ax.legend(fontsize=6, loc="upper left")
        for ax in list(axes.flat)[len(shown) :]:
            ax.axis("off")
        fig.suptitle(f"{title} (panel queries on a real Prometheus)", fontsize=12)
        fig.tight_layout()
        path = out_dir / f"dashboard-{uid}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written
