"""A real Prometheus scraping local processes, and its HTTP query API.

`prometheus_server(targets, rule_files, workdir)` runs Debian's Prometheus
(`prometheus_tools.py`) on a free loopback port with a 1 s scrape interval
over static targets (host:port of the router, the workers, the operator)
and stops it when the block ends; the yielded `PrometheusApi` runs instant
and range queries and reads the rules' health.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from e2e.processes import http_get_ok, spawn, stop, tail, wait_until
from e2e.prometheus_tools import ensure_tools
from pdcluster.runtime.ports import free_port

SCRAPE_INTERVAL_S = 1


class QueryError(RuntimeError):
    """Prometheus refused a query; the message has its error text and the expression."""


@dataclass(frozen=True)
class PrometheusApi:
    url: str

    def _get(self, path: str, params: Mapping[str, Any]) -> Any:
        resp = httpx.get(self.url + path, params=dict(params), timeout=30, trust_env=False)
        body = resp.json()
        if body.get("status") != "success":
            raise QueryError(f"{body.get('errorType')}: {body.get('error')} in {params}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        result: list[dict[str, Any]] = self._get("/api/v1/query", params)["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": start, "end": end, "step": step}
        result: list[dict[str, Any]] = self._get("/api/v1/query_range", params)["result"]
        return result

    def rules(self) -> list[dict[str, Any]]:
        groups = self._get("/api/v1/rules", {})["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def targets_up(self) -> dict[str, bool]:
        active = self._get("/api/v1/targets", {})["activeTargets"]
        return {t["scrapeUrl"]: t["health"] == "up" for t in active}


def finite_points(series: Sequence[dict[str, Any]]) -> int:
    """How many finite values a range query's series hold (NaN and ±Inf do not count)."""
    count = 0
    for s in series:
        for _, value in s.get("values", [s["value"]] if "value" in s else []):
            if math.isfinite(float(value)):
                count += 1
    return count


def build_config(
    targets: Mapping[str, Sequence[str]], rule_files: Sequence[Path]
) -> dict[str, Any]:
    """One scrape job per name, 1 s apart, static host:port targets."""
    return {
        "global": {
            "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
            "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        },
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(hosts)}]}
            for job, hosts in targets.items()
        ],
    }


@contextmanager
def prometheus_server(
    targets: Mapping[str, Sequence[str]], workdir: Path, rule_files: Sequence[Path] = ()
) -> Iterator[PrometheusApi]:
    tools = ensure_tools()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(build_config(targets, rule_files)))
    port = free_port()
    log = workdir / "prometheus.log"
    _, record = spawn(
        "prometheus",
        [
            str(tools.prometheus),
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_get_ok(url + "/-/ready"), 60, f"prometheus ({tail(log)})")
        yield PrometheusApi(url)
    finally:
        stop(record, grace_s=10)
