"""SGLang's PD router (`sglang_router`) in front of local workers.

The interop test and `bench/router.py` run the same command line: both
roles round robin, no retries and no circuit breaker (a failure shows as
such instead of being hidden), and the cluster token as `--api-key`, which
the router sends on both legs (our workers' data plane wants it) and wants
from its own clients.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdcluster.runtime.local.launcher import stop_pids
from pdcluster.runtime.ports import free_ports

HOST = "127.0.0.1"


def sglang_router_argv(
    prefills: Sequence[tuple[str, int]],
    decodes: Sequence[str],
    *,
    port: int,
    prometheus_port: int,
    api_key: str,
) -> list[str]:
    """The router's command line; `prefills` are (worker URL, bootstrap port) pairs."""
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bootstrap_port in prefills:
        argv += ["--prefill", url, str(bootstrap_port)]
    for url in decodes:
        argv += ["--decode", url]
    argv += [
        "--host", HOST, "--port", str(port), "--prometheus-port", str(prometheus_port),
        "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
        "--disable-retries", "--disable-circuit-breaker",
        "--api-key", api_key,
    ]  # fmt: skip
    return argv


@dataclass
class SGLangRouter:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        stop_pids([self.proc.pid])
        self.proc.wait(5)


def start_sglang_router(
    prefills: Sequence[tuple[str, int]],
    decodes: Sequence[str],
    token: str,
    tmp: Path,
    timeout_s: float = 60.0,
) -> SGLangRouter:
    """Start the router (its log and cwd in `tmp`) and wait until /health answers 200."""
    port, prometheus = free_ports(2)
    argv = sglang_router_argv(
        prefills, decodes, port=port, prometheus_port=prometheus, api_key=token
    )
    log_path = tmp / f"sglang-router-{port}.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(log_path, "wb") as log:
        # cwd outside the repository: from its root, the top-level operator/
        # folder would shadow the standard library's `operator` module.
        proc = subprocess.Popen(
            argv, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    router = SGLangRouter(f"http://{HOST}:{port}", proc, log_path, token)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang router exited: {router.log()}")
        try:
            if httpx.get(router.url + "/health", timeout=2).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    router.stop()
    raise RuntimeError(f"sglang router not ready after {timeout_s:.0f} s: {router.log()}")
