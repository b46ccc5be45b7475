"""How the pods of one instance find each other and prove they belong to it.

An instance of R ranks over P pods (runtime/pod_layout.py) meets like this:

    pod 0 (leader, IP A)                      pod k > 0
    ──────────────────────                    ─────────────────────────────
    ranks [0, G): rank 0 hosts the            waits for the leader's address
    torch store on A:<dist port>              (--leader-address, or
                                              $PDCLUSTER_LEADER_ADDRESS, or
                                              the file $PDCLUSTER_LEADER_ADDRESS_FILE
                                              names, polled until non-empty)
            ◄──── every rank r: store key pdcluster/rank/<r> = proof(r) ────
    rank 0 waits until every rank wrote its proof (the missing ones are
    what /health reports meanwhile), checks each proof, then writes the
    verdict; only on "ok" does any rank join torch.distributed.

A proof is an HMAC of (cluster, role, instance, rank) keyed by the cluster
token, so a pod of another cluster, another instance or without the token
is turned away before it takes part in a collective.

What this does not cover (the NetworkPolicy and the pod-IP binding do): the
torch store and gloo accept anyone who reaches their ports, and the objects
they carry are unpickled; a peer that can reach them can read a proof and
disturb the rendezvous. ZMQ traffic between ranks is authenticated frame
by frame (transfer/identity.py) and bootstrap registration by the token.

Invariants (tests/test_pod_rendezvous.py): the verdict is "ok" only when
every rank of [0, R) wrote a proof and each one matches; the leader address
is one host (IPv4, IPv6 or DNS-1123 name), never a URL or host:port.

Pure module: no sockets, no torch, no clock.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pdcluster.runtime.pod_layout import PodLayout, PodLayoutError

LEADER_ADDRESS_ENV = "PDCLUSTER_LEADER_ADDRESS"
LEADER_ADDRESS_FILE_ENV = "PDCLUSTER_LEADER_ADDRESS_FILE"
PROOF_KEY_PREFIX = "pdcluster/rank/"
VERDICT_KEY = "pdcluster/verdict"
VERDICT_OK = "ok"

_DOMAIN = b"pdcluster rank proof v1\0"
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")


class RendezvousError(ValueError):
    """A pod cannot join its instance; the message says why."""


@dataclass(frozen=True)
class RankIdentity:
    """What a rank proves it belongs to."""

    cluster: str
    role: str
    instance: int


def rank_proof(token: str, who: RankIdentity, rank: int) -> str:
    """The proof rank `rank` of `who` writes to the store (hex HMAC-SHA256)."""
    key = hashlib.sha256(_DOMAIN + token.encode()).digest()
    msg = f"{who.cluster}\0{who.role}\0{who.instance}\0{rank}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def proof_key(rank: int) -> str:
    return f"{PROOF_KEY_PREFIX}{rank}"


def missing_ranks(num_ranks: int, present: Iterable[int]) -> list[int]:
    """Ranks of [0, num_ranks) not in `present`, in order."""
    seen = set(present)
    return [r for r in range(num_ranks) if r not in seen]


def describe_missing(layout: PodLayout, missing: list[int]) -> str:
    """`ranks 2, 3 (pod 1)` — what a leader says it still waits for."""
    if not missing:
        return "no rank"
    pods = sorted({layout.pod_of_rank(r) for r in missing})
    pod_text = f"pod{'s' if len(pods) > 1 else ''} " + ", ".join(str(p) for p in pods)
    return f"{_ranks_text(missing)} ({pod_text})"


def compute_verdict(
    token: str, who: RankIdentity, ranks: Sequence[int], proofs: Mapping[int, str]
) -> str:
    """The leader's verdict on the proofs of global `ranks` (`proofs` by global rank):
    VERDICT_OK, or why the gang is refused."""
    missing = [r for r in ranks if r not in proofs]
    if missing:
        return f"refused: no proof from {_ranks_text(missing)}"
    bad = [
        r
        for r in ranks
        if not hmac.compare_digest(proofs[r].encode(), rank_proof(token, who, r).encode())
    ]
    if bad:
        return (
            f"refused: {_ranks_text(bad)} did not prove "
            f"{who.cluster}/{who.role}-{who.instance} with this cluster's token"
        )
    return VERDICT_OK


def _ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(str(r) for r in ranks)


def parse_leader_address(text: str) -> str:
    """The leader pod's address as published (one host), or RendezvousError."""
    host = text.strip()
    if not host:
        raise RendezvousError("the leader address is empty")
    if any(c.isspace() for c in host) or "/" in host or "@" in host:
        raise RendezvousError(f"the leader address {host!r} must be one host (an IP), not a URL")
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    if ":" in host:
        raise RendezvousError(
            f"the leader address {host!r} must be a host without a port "
            "(the ports are the instance's own: --dist-port, --bootstrap-port)"
        )
    if len(host) > 253 or not _HOSTNAME.match(host.lower()):
        raise RendezvousError(f"the leader address {host!r} is neither an IP nor a host name")
    return host.lower()


@dataclass(frozen=True)
class PodPlan:
    """What one pod of an instance runs: `ranks` (global, in order), whether it leads."""

    pod_index: int
    ranks: range
    is_leader: bool


def plan_pod(layout: PodLayout, dp: int, pod_index: int) -> PodPlan:
    """The ranks pod `pod_index` starts, or RendezvousError for a layout not run yet.

    Every dp group's leader serves an HTTP port the instance's HTTP server
    forwards to on loopback, so with several pods every dp leader must live
    on pod 0 — which only dp = 1 guarantees (the order is dp-major).
    """
    try:
        ranks = layout.rank_range(pod_index)
    except PodLayoutError as err:
        raise RendezvousError(str(err)) from None
    if layout.is_multi_pod and dp > 1:
        raise RendezvousError(
            f"an instance with dp={dp} spread over {layout.num_pods} pods is not supported yet "
            "(every dp group's leader must run on pod 0); set gpusPerPod to the rank count "
            "or use dp=1"
        )
    return PodPlan(pod_index=pod_index, ranks=ranks, is_leader=layout.is_leader(pod_index))
