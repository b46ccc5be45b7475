"""Probe specs and the pure bookkeeping of their results.

A ProbeTracker turns a sequence of timed probe results into a verdict the
way the kubelet does: nothing before initialDelaySeconds, one probe per
periodSeconds, `successThreshold` consecutive successes to pass and
`failureThreshold` consecutive failures to fail. Running the probe (HTTP,
TCP, exec) is the caller's job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any


class ProbeKind(Enum):
    HTTP_GET = "httpGet"
    TCP_SOCKET = "tcpSocket"
    EXEC = "exec"


class ProbeError(ValueError):
    """A probe spec the agent cannot run; the message names the field."""


@dataclass(frozen=True)
class ProbeSpec:
    kind: ProbeKind
    port: int = 0
    host: str = ""  # empty: the pod IP
    path: str = "/"
    scheme: str = "HTTP"
    headers: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] = ()
    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3


def _resolve_port(value: object, container: Mapping[str, Any], where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        port = value
    elif isinstance(value, str) and value.isdigit():
        port = int(value)
    elif isinstance(value, str):
        named = [p for p in container.get("ports") or [] if p.get("name") == value]
        if not named:
            raise ProbeError(f"{where}.port: no container port named {value!r}")
        port = int(named[0]["containerPort"])
    else:
        raise ProbeError(f"{where}.port: expected a number or a port name, got {value!r}")
    if not 1 <= port <= 65535:
        raise ProbeError(f"{where}.port: {port} is out of range 1-65535")
    return port


def parse_probe(raw: Mapping[str, Any], container: Mapping[str, Any], where: str) -> ProbeSpec:
    """Read a probe from its API form (camelCase dict); `where` names it in errors."""
    # The kind is a placeholder until the handler below is known.
    timing = ProbeSpec(
        ProbeKind.EXEC,
        initial_delay_s=float(raw.get("initialDelaySeconds") or 0),
        period_s=float(raw.get("periodSeconds") or 10),
        timeout_s=float(raw.get("timeoutSeconds") or 1),
        success_threshold=int(raw.get("successThreshold") or 1),
        failure_threshold=int(raw.get("failureThreshold") or 3),
    )
    if timing.period_s <= 0 or timing.timeout_s <= 0:
        raise ProbeError(f"{where}: periodSeconds and timeoutSeconds must be positive")
    if timing.success_threshold < 1 or timing.failure_threshold < 1:
        raise ProbeError(f"{where}: thresholds must be >= 1")
    if "httpGet" in raw and raw["httpGet"] is not None:
        http = raw["httpGet"]
        scheme = str(http.get("scheme") or "HTTP").upper()
        if scheme not in ("HTTP", "HTTPS"):
            raise ProbeError(f"{where}.httpGet.scheme: {scheme!r} is not HTTP or HTTPS")
        headers = tuple((str(h["name"]), str(h["value"])) for h in http.get("httpHeaders") or [])
        return replace(
            timing,
            kind=ProbeKind.HTTP_GET,
            port=_resolve_port(http.get("port"), container, f"{where}.httpGet"),
            host=str(http.get("host") or ""),
            path=str(http.get("path") or "/"),
            scheme=scheme,
            headers=headers,
        )
    if "tcpSocket" in raw and raw["tcpSocket"] is not None:
        tcp = raw["tcpSocket"]
        return replace(
            timing,
            kind=ProbeKind.TCP_SOCKET,
            port=_resolve_port(tcp.get("port"), container, f"{where}.tcpSocket"),
            host=str(tcp.get("host") or ""),
        )
    if "exec" in raw and raw["exec"] is not None:
        command = tuple(str(c) for c in raw["exec"].get("command") or [])
        if not command:
            raise ProbeError(f"{where}.exec.command is empty")
        return replace(timing, command=command)
    raise ProbeError(f"{where}: only httpGet, tcpSocket and exec probes are supported")


class ProbeTracker:
    """Consecutive-result counting for one probe of one container run.

    `verdict` is None until a threshold is first reached, then True (passing)
    or False (failing); it flips only when the opposite threshold is reached.
    """

    def __init__(self, spec: ProbeSpec, started_at: float) -> None:
        self.spec = spec
        self._next_due = started_at + spec.initial_delay_s
        self._successes = 0
        self._failures = 0
        self.verdict: bool | None = None
        self.last_message = ""

    def is_due(self, now: float) -> bool:
        return now >= self._next_due

    def record(self, ok: bool, now: float, message: str = "") -> bool | None:
        """Count one result taken at `now`; returns the verdict after it."""
        self._next_due = now + self.spec.period_s
        self.last_message = message
        if ok:
            self._successes += 1
            self._failures = 0
            if self._successes >= self.spec.success_threshold:
                self.verdict = True
        else:
            self._failures += 1
            self._successes = 0
            if self._failures >= self.spec.failure_threshold:
                self.verdict = False
        return self.verdict
