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

With dp > 1 each dp group is its own torch world whose store (and its
leader's internal HTTP port) lives on the pod of the group's rank 0. Pods
learn each other's addresses through the leader pod's directory, kept in
dp group 0's store before any rank starts:

    pod k hosting a dp leader:  pdcluster/pod/<k> = "<host> <proof(k, host)>"
    pod 0: waits for every such pod (its HTTP front forwards there)
    pod j > 0 running ranks of a group led by pod k > 0: reads pod k's entry

An entry's proof is an HMAC of (cluster, role, instance, pod, host) keyed
by the cluster token, checked by every reader: an address written without
the token, or copied from another pod, is refused.

What this does not cover (the NetworkPolicy and the pod-IP binding do): the
torch store and gloo accept anyone who reaches their ports, and the objects
they carry are unpickled; a peer that can reach them can read a proof and
disturb the rendezvous. ZMQ traffic between ranks is authenticated frame
by frame (transfer/identity.py) and bootstrap registration by the token.

Invariants (tests/test_pod_rendezvous.py): the verdict is "ok" only when
every rank of [0, R) wrote a proof and each one matches; the leader address
is one host (IPv4, IPv6 or DNS-1123 name), never a URL or host:port; every
address a pod needs is published by exactly the pod hosting that dp leader.

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
ADDRESS_KEY_PREFIX = "pdcluster/pod/"

_DOMAIN = b"pdcluster rank proof v1\0"
_ADDRESS_DOMAIN = b"pdcluster pod address v1\0"
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
    """What one pod of an instance runs: `ranks` (global, in order), whether it leads,
    whether it publishes its address (it hosts the leader of a dp group > 0), and
    which other pods' addresses it needs (`needs`, pods k > 0 only)."""

    pod_index: int
    ranks: range
    is_leader: bool
    publishes: bool = False
    needs: tuple[int, ...] = ()


def dp_leader_pods(layout: PodLayout, dp: int) -> tuple[int, ...]:
    """The pod of each dp group's rank 0 (dp-major order: group d starts at d*R/dp)."""
    if dp < 1 or layout.num_ranks % dp:
        raise RendezvousError(f"dp={dp} does not divide the instance's {layout.num_ranks} ranks")
    group = layout.num_ranks // dp
    return tuple(layout.pod_of_rank(d * group) for d in range(dp))


def groups_on_pod(layout: PodLayout, dp: int, pod_index: int) -> tuple[int, ...]:
    """The dp groups with at least one rank on pod `pod_index`, in order."""
    group = layout.num_ranks // dp
    return tuple(sorted({r // group for r in layout.rank_range(pod_index)}))


def plan_pod(layout: PodLayout, dp: int, pod_index: int) -> PodPlan:
    """The ranks pod `pod_index` starts and the addresses it exchanges, or RendezvousError.

    dp group d's torch store and its leader's internal HTTP server live on
    the pod of the group's rank 0. Pod 0 (the leader, everyone knows its
    address) hosts the address directory; a pod k > 0 that hosts a dp
    leader publishes its address there, and a pod learns from it the
    address of every dp leader pod it needs: pod 0 all of them (its HTTP
    front forwards to them), a pod k > 0 those of the groups it runs ranks
    of whose rank 0 lives on another pod k' > 0.
    """
    try:
        ranks = layout.rank_range(pod_index)
    except PodLayoutError as err:
        raise RendezvousError(str(err)) from None
    leaders = dp_leader_pods(layout, dp)
    remote = sorted({p for p in leaders if p != 0})
    if pod_index == 0:
        needs = tuple(remote)
    else:
        needs = tuple(
            sorted({leaders[d] for d in groups_on_pod(layout, dp, pod_index)} - {0, pod_index})
        )
    return PodPlan(
        pod_index=pod_index,
        ranks=ranks,
        is_leader=layout.is_leader(pod_index),
        publishes=pod_index != 0 and pod_index in leaders,
        needs=needs,
    )


def address_key(pod_index: int) -> str:
    return f"{ADDRESS_KEY_PREFIX}{pod_index}"


def address_entry(token: str, who: RankIdentity, pod_index: int, host: str) -> str:
    """What pod `pod_index` writes to the directory: its host and a proof binding
    the host to the pod (a host written without the token is refused)."""
    host = parse_leader_address(host)
    return f"{host} {_address_proof(token, who, pod_index, host)}"


def read_address_entry(token: str, who: RankIdentity, pod_index: int, text: str) -> str:
    """The host in pod `pod_index`'s directory entry, or RendezvousError when the
    entry is malformed or was not written with this cluster's token for that pod."""
    parts = text.split()
    if len(parts) != 2:
        raise RendezvousError(f"pod {pod_index}'s address entry is malformed")
    host, proof = parts
    host = parse_leader_address(host)
    want = _address_proof(token, who, pod_index, host)
    if not hmac.compare_digest(proof.encode(), want.encode()):
        raise RendezvousError(
            f"pod {pod_index}'s address {host} was not published for "
            f"{who.cluster}/{who.role}-{who.instance} with this cluster's token"
        )
    return host


def group_hosts(
    layout: PodLayout, dp: int, pod_index: int, own: str, leader: str, known: Mapping[int, str]
) -> tuple[str | None, ...]:
    """Where each dp group's leader (store, internal HTTP) is reached from pod
    `pod_index`: its own address `own` for groups led here, `leader` for those led
    by pod 0, `known[k]` for pod k; None for a group this pod neither runs nor
    fronts. RendezvousError when an address it needs is missing."""
    leaders = dp_leader_pods(layout, dp)
    mine = set(groups_on_pod(layout, dp, pod_index))
    out: list[str | None] = []
    for d, k in enumerate(leaders):
        if pod_index != 0 and d not in mine:
            out.append(None)
        elif k == pod_index:
            out.append(own)
        elif k == 0:
            out.append(leader)
        elif k in known:
            out.append(known[k])
        else:
            raise RendezvousError(f"the address of pod {k} (leader of dp group {d}) is unknown")
    return tuple(out)


def _address_proof(token: str, who: RankIdentity, pod_index: int, host: str) -> str:
    key = hashlib.sha256(_ADDRESS_DOMAIN + token.encode()).digest()
    msg = f"{who.cluster}\0{who.role}\0{who.instance}\0{pod_index}\0{host}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()
