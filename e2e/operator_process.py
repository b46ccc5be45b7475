"""The operator as a host process against the local control plane.

`bench/operator_timings.py` and the operator journeys run `python -m
pdcluster.operator --all-namespaces` with its liveness and metrics
endpoints on free loopback ports, and wait for it to answer before use.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from e2e.processes import ProcessRecord, http_get_ok, spawn, stop, wait_until
from pdcluster.runtime.ports import free_port


@contextmanager
def operator_process(
    kubeconfig: Path,
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
) -> Iterator[tuple[ProcessRecord, str]]:
    """Run the operator until the block ends; yields its process and metrics URL.

    `env` adds to the operator's environment (its settings); it is stopped
    with a 10 s grace. Raises TimeoutError naming the log when its liveness
    endpoint does not answer within 60 s.
    """
    health, metrics = free_port(), free_port()
    full_env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PDCLUSTER_OPERATOR_METRICS_PORT": str(metrics),
        "PDCLUSTER_OPERATOR_METRICS_HOST": "127.0.0.1",
        **(env or {}),
    }
    argv = [sys.executable, "-m", "pdcluster.operator", "--all-namespaces"]
    argv.append(f"--liveness=http://127.0.0.1:{health}/healthz")
    _, record = spawn("operator", argv, log, env=full_env, die_with_parent=die_with_parent)
    try:
        wait_until(
            lambda: http_get_ok(f"http://127.0.0.1:{health}/healthz"),
            60,
            f"the operator's liveness endpoint (log: {log})",
        )
        yield record, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        stop(record, grace_s=10)
