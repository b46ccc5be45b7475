"""Runs one probe against a pod (I/O): HTTP GET, TCP connect or a command."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
from collections.abc import Mapping
from pathlib import Path

from e2e.nodeagent.probes import ProbeKind, ProbeSpec


def run_probe(spec: ProbeSpec, pod_ip: str, env: Mapping[str, str], cwd: Path) -> tuple[bool, str]:
    """(passed, message). Success is what the kubelet counts: HTTP 200-399, a
    completed TCP connect, or a command exiting 0 within timeoutSeconds."""
    host = spec.host or pod_ip
    try:
        if spec.kind is ProbeKind.HTTP_GET:
            return _http_get(spec, host)
        if spec.kind is ProbeKind.TCP_SOCKET:
            with socket.create_connection((host, spec.port), timeout=spec.timeout_s):
                return True, ""
        proc = subprocess.run(
            list(spec.command),
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            timeout=spec.timeout_s,
            stdin=subprocess.DEVNULL,
        )
        output = (proc.stdout + proc.stderr).decode(errors="replace").strip()
        return proc.returncode == 0, output[-200:]
    except subprocess.TimeoutExpired:
        return False, f"probe timed out after {spec.timeout_s:g}s"
    except (OSError, http.client.HTTPException) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def _http_get(spec: ProbeSpec, host: str) -> tuple[bool, str]:
    connection: http.client.HTTPConnection
    if spec.scheme == "HTTPS":
        # The kubelet does not verify probe certificates either.
        context = ssl._create_unverified_context()
        connection = http.client.HTTPSConnection(
            host, spec.port, timeout=spec.timeout_s, context=context
        )
    else:
        connection = http.client.HTTPConnection(host, spec.port, timeout=spec.timeout_s)
    try:
        headers = {"User-Agent": "kube-probe/pdcluster-nodeagent", **dict(spec.headers)}
        connection.request("GET", spec.path, headers=headers)
        response = connection.getresponse()
        response.read(10_000)
        ok = 200 <= response.status < 400
        return ok, "" if ok else f"HTTP probe failed with statuscode: {response.status}"
    finally:
        connection.close()
