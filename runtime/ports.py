"""Free TCP ports for processes started later (local clusters, dp children, tests).

A port picked now is bound by another process later, so the pick must not be
one the kernel may hand out in between. Asking the kernel for port 0 returns a
port from the ephemeral range, and the same range is where every outgoing
connection takes its source port (httpx clients, ZMQ dealers, the router's
health checks): on a busy machine one of them can take the port in that gap and
the worker fails at start with "address already in use". So ports are drawn at
random *below* the ephemeral range, where the kernel never assigns one by
itself; only another caller of this module (or a fixed-port service) can collide,
and each pick is checked by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Lowest port drawn: clear of the well-known and registered ports services usually take.
LOWEST = 20000
# Used when the ephemeral range cannot be read (not Linux): Linux's default start.
DEFAULT_EPHEMERAL_START = 32768
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_ATTEMPTS = 200


def ephemeral_start(range_file: Path = _RANGE_FILE) -> int:
    """First port of the kernel's ephemeral range."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1", rng: random.Random | None = None) -> list[int]:
    """n distinct ports free on `host` now, outside the kernel's ephemeral range.

    Falls back to kernel-chosen ports when the ephemeral range leaves no room
    below it (a machine configured to hand out almost every port)."""
    rng = rng or random.Random()
    top = ephemeral_start()
    ports: list[int] = []
    if top - LOWEST < 4 * n:
        while len(ports) < n:
            port = _kernel_port(host)
            if port not in ports:
                ports.append(port)
        return ports
    for _ in range(_ATTEMPTS * n):
        if len(ports) == n:
            break
        port = rng.randrange(LOWEST, top)
        if port not in ports and _bindable(host, port):
            ports.append(port)
    if len(ports) < n:
        raise OSError(f"no {n} free ports found in {LOWEST}-{top - 1} on {host}")
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` now (see `free_ports`)."""
    return free_ports(1, host)[0]
