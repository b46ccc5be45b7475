"""The ports of an instance's dp groups: each group's torch store and, for
groups 1..dp-1, the internal HTTP port of the group's leader.

Group d's store listens on `dist_ports[d]`, its leader's internal HTTP
server (the front, group 0, relays requests and admin calls to it) on
`http_ports[d - 1]`. Who picks them:

- local mode (every process on 127.0.0.1): the plan (runtime/local/plan.py)
  draws all of them together with every other port it hands out and passes
  them (`--dp-ports`, `--dp-dist-ports`), so no two processes of a cluster
  are ever given the same port. A worker that drew its own ports at start
  raced with ports handed to other processes but not bound yet.
- Kubernetes (a pod is its own network namespace, holding only fixed
  ports): the flags are left out and the ports follow from `--dist-port`
  P: stores on P, P+1, ..., P+dp-1, then the internal HTTP ports on
  P+dp, ..., P+2*dp-2. Fixed ports make a remote dp leader's port known to
  every pod of the instance without an exchange.

Invariants (tests/test_dp_ports.py): one store port per group, one HTTP
port per group > 0, all distinct; given lists are used as given, derived
ones are the contiguous block above.

Pure module: no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass


class DpPortsError(ValueError):
    """The dp ports given do not fit the instance; the message says how."""


@dataclass(frozen=True)
class DpPorts:
    """`dist_ports[d]`: group d's store; `http_ports[d - 1]`: group d's leader (d >= 1)."""

    dist_ports: tuple[int, ...]
    http_ports: tuple[int, ...]

    @property
    def dp(self) -> int:
        return len(self.dist_ports)

    def dist_port(self, dp_rank: int) -> int:
        return self.dist_ports[dp_rank]

    def http_port(self, dp_rank: int) -> int:
        """The internal HTTP port of group `dp_rank`'s leader (group 0 has the instance's)."""
        if dp_rank < 1:
            raise DpPortsError("dp group 0 serves the instance's own HTTP port")
        return self.http_ports[dp_rank - 1]

    @property
    def all_ports(self) -> tuple[int, ...]:
        return (*self.dist_ports, *self.http_ports)


def derived_dp_ports(dp: int, dist_port: int) -> DpPorts:
    """The fixed block above `dist_port` (the rule when no ports are given)."""
    _check_dp(dp)
    _check_port(dist_port + 2 * dp - 2, "--dist-port + 2*dp - 2")
    dist = tuple(dist_port + d for d in range(dp))
    http = tuple(dist_port + dp + d for d in range(dp - 1))
    return DpPorts(dist, http)


def resolve_dp_ports(
    dp: int,
    dist_port: int,
    http_ports: tuple[int, ...] | None,
    dist_ports: tuple[int, ...] | None,
) -> DpPorts:
    """The instance's dp ports: `http_ports` / `dist_ports` (groups 1..dp-1) as given,
    or both derived from `dist_port`; DpPortsError for lists that do not fit."""
    _check_dp(dp)
    _check_port(dist_port, "--dist-port")
    if http_ports is None and dist_ports is None:
        return derived_dp_ports(dp, dist_port)
    if http_ports is None or dist_ports is None:
        raise DpPortsError("--dp-ports and --dp-dist-ports go together (give both or neither)")
    for name, got in (("--dp-ports", http_ports), ("--dp-dist-ports", dist_ports)):
        if len(got) != dp - 1:
            raise DpPortsError(
                f"{name} needs one port per dp group after the first ({dp - 1} for dp={dp}), "
                f"got {len(got)}"
            )
        for port in got:
            _check_port(port, name)
    ports = DpPorts((dist_port, *dist_ports), tuple(http_ports))
    if len(set(ports.all_ports)) != len(ports.all_ports):
        raise DpPortsError(
            f"the dp ports must be distinct: stores {list(ports.dist_ports)}, "
            f"HTTP {list(ports.http_ports)}"
        )
    return ports


def parse_port_list(text: str, name: str) -> tuple[int, ...]:
    """`"20001,20002"` → (20001, 20002); an empty text is no port."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            port = int(item)
        except ValueError:
            raise DpPortsError(f"{name}: {item!r} is not a port number") from None
        _check_port(port, name)
        out.append(port)
    return tuple(out)


def _check_dp(dp: int) -> None:
    if dp < 1:
        raise DpPortsError(f"dp must be at least 1, got {dp}")


def _check_port(port: int, name: str) -> None:
    if not 1 <= port <= 65535:
        raise DpPortsError(f"{name}: port {port} is outside 1-65535")
