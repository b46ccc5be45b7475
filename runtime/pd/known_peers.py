"""The prefill bootstrap servers a decode worker may contact.

A `/generate` body names its prefill by `bootstrap_host` and
`bootstrap_port`; decode then calls `GET /route` there with the cluster
token. Taken as given, that address lets anyone who reaches a decode pod
collect the token. So decode contacts only the bootstrap servers of prefill
instances it was told about by someone holding the token: the launcher at
start (local mode) or the operator (`PUT /admin/prefill_peers`, on every
change of the prefill pods and on each reconcile).

Invariants:
- until a set was published, decode knows no peer and is not ready;
- a publication replaces the whole set (a removed prefill is unknown at once);
- an address is a `BootstrapAddress` (`peer_address.py`): `host:port` with
  a non-empty host and a port in 1..65535;
  comparison is exact on the normalized form (hosts lower-cased, IPv6 in
  brackets), so `bootstrap_host` must be the address that was published.

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.pd.peer_address import BootstrapAddress

# Bounds a publication (a cluster has far fewer prefill instances).
MAX_PEERS = 1024
MAX_HOST_CHARS = 253


class PeerSetError(ValueError):
    """A peer list or address that cannot be used; the message says why."""


def normalize_address(host: str, port: int | str) -> BootstrapAddress:
    """`host`, `port` → canonical `host:port`; raises PeerSetError on a bad one."""
    if not isinstance(host, str) or not host or len(host) > MAX_HOST_CHARS:
        raise PeerSetError(f"bad bootstrap host {host!r}")
    h = host.strip().lower()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if not h or any(c.isspace() or c in "/?#@[]" for c in h):
        raise PeerSetError(f"bad bootstrap host {host!r}")
    if isinstance(port, bool):
        raise PeerSetError(f"bad bootstrap port {port!r}")
    try:
        p = int(port)
    except (TypeError, ValueError):
        raise PeerSetError(f"bad bootstrap port {port!r}") from None
    if not 1 <= p <= 65535:
        raise PeerSetError(f"bad bootstrap port {port!r}")
    return BootstrapAddress(f"[{h}]:{p}" if ":" in h else f"{h}:{p}")


def parse_address(address: str) -> BootstrapAddress:
    """`host:port` (or `[v6]:port`) → canonical form; raises PeerSetError."""
    if not isinstance(address, str) or ":" not in address:
        raise PeerSetError(f"peer {address!r} is not host:port")
    host, _, port = address.rpartition(":")
    return normalize_address(host, port)


def parse_peer_list(peers: Iterable[Any]) -> frozenset[BootstrapAddress]:
    out = set()
    for item in peers:
        out.add(parse_address(item))
        if len(out) > MAX_PEERS:
            raise PeerSetError(f"more than {MAX_PEERS} prefill peers")
    return frozenset(out)


def parse_peers_body(body: Any) -> frozenset[BootstrapAddress]:
    """The body of `PUT /admin/prefill_peers`: `{"peers": ["host:port", ...]}`."""
    if not isinstance(body, dict) or set(body) != {"peers"} or not isinstance(body["peers"], list):
        raise PeerSetError('body must be {"peers": ["host:port", ...]}')
    return parse_peer_list(body["peers"])


def parse_peers_env(value: str) -> frozenset[BootstrapAddress]:
    """A comma-separated list (the launcher's `--prefill-peers`)."""
    return parse_peer_list(p.strip() for p in value.split(",") if p.strip())


@dataclass(frozen=True)
class KnownPeers:
    """The published set; `None` until the first publication."""

    peers: frozenset[BootstrapAddress] | None = None

    @property
    def is_published(self) -> bool:
        return self.peers is not None

    def replaced(self, peers: frozenset[BootstrapAddress]) -> KnownPeers:
        return KnownPeers(peers)

    def check(self, host: Any, port: Any) -> BootstrapAddress:
        """The canonical address when decode may contact it; PeerSetError otherwise."""
        address = normalize_address(host, port)
        if self.peers is None:
            raise PeerSetError(
                "this decode worker has not been told its prefill peers yet "
                "(PUT /admin/prefill_peers)"
            )
        if address not in self.peers:
            raise PeerSetError(
                f"bootstrap server {address} is not a known prefill instance of this cluster"
            )
        return address
