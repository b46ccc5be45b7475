"""How the pods of one instance find each other and prove they belong to it.

An instance of R ranks over P pods (runtime/pod_layout.py) meets like this:

    pod 0 (leader, IP A)                      pod k > 0
    ──────────────────────                    ─────────────────────────────
    ranks [0, G): rank 0 hosts the            waits for the leader's address
    torch store on A:<dist port>              (--leader-address, or
                                              $PDCLUSTER_LEADER_ADDRESS, or
                                              the file $PDCLUSTER_LEADER_ADDRESS_FILE
                                              names, polled until non-empty)
    rank 0: pdcluster/nonce = a fresh nonce N (this rendezvous only) ──►
            ◄── every rank r: pdcluster/rank/<r> = "<C_r> <proof(r, N, C_r)>" ──
    rank 0 waits until every rank wrote its proof (the missing ones are
    what /health reports meanwhile), checks each one against N, then writes
    the verdict, "ok <mac>" signed over N and every C_r, or why not; a rank
    joins torch.distributed only on an "ok" whose mac it checked itself.

It is a challenge and response in both directions, over a store anyone on
the pod network may read and write:
- a proof is an HMAC keyed by the cluster token of (cluster, role, instance,
  rank, N, C_r): a pod of another cluster or instance, or without the
  token, is turned away before it takes part in a collective, and a proof
  read from one rendezvous is worth nothing in the next (another N);
- the verdict is signed over N and every rank's own fresh challenge C_r, so
  a rank never joins on an "ok" someone without the token wrote, nor on one
  copied from an earlier rendezvous (its C_r is new).

With dp > 1 each dp group is its own torch world whose store (and its
leader's internal HTTP port) lives on the pod of the group's rank 0. Pods
learn each other's addresses through the leader pod's directory, kept in
dp group 0's store before any rank starts:

    pod k hosting a dp leader:  pdcluster/pod/<k> = "<host> <proof(k, host)>"
    pod 0: waits for every such pod (its HTTP front forwards there)
    pod j > 0 running ranks of a group led by pod k > 0: reads pod k's entry

An entry's proof is an HMAC of (cluster, role, instance, pod, host) and the
directory's own nonce (pdcluster/directory-nonce, written by pod 0 when it
opens the directory) keyed by the cluster token, checked by every reader:
an address written without the token, copied from another pod or from an
earlier rendezvous is refused.

What this does not cover (the NetworkPolicy and the pod-IP binding do): the
torch store and gloo accept anyone who reaches their ports; a peer that can
reach them can read what is in the store and disturb a rendezvous (make it
fail), not join it. Nothing a peer sends a rank there is unpickled: the
ranks' endpoints are exchanged as fixed-size msgspec frames
(pd_worker/startup.py) and the step plans as msgpack decoded into their
types (engine/parallel.py). ZMQ traffic between ranks is authenticated
frame by frame (transfer/identity.py) and bootstrap registration by the
token.

Invariants (tests/test_pod_rendezvous.py): the verdict is "ok" only when
every rank of [0, R) wrote a proof for this rendezvous's nonce and each one
matches; a rank accepts only an "ok" signed over the nonce and its own
challenge; the leader address is one host (IPv4, IPv6 or DNS-1123 name),
never a URL or host:port; every address a pod needs is published by exactly
the pod hosting that dp leader.

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
NONCE_KEY = "pdcluster/nonce"
VERDICT_KEY = "pdcluster/verdict"
VERDICT_OK = "ok"
ADDRESS_KEY_PREFIX = "pdcluster/pod/"
DIRECTORY_NONCE_KEY = "pdcluster/directory-nonce"
# A nonce or a challenge: 32 lowercase hex digits (128 random bits).
_FRESH = re.compile(r"^[0-9a-f]{32}$")

_DOMAIN = b"pdcluster rank proof v2\0"
_VERDICT_DOMAIN = b"pdcluster verdict v1\0"
_ADDRESS_DOMAIN = b"pdcluster pod address v2\0"
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


def _mac(domain: bytes, token: str, *fields: object) -> str:
    key = hashlib.sha256(domain + token.encode()).digest()
    return hmac.new(key, "\0".join(map(str, fields)).encode(), hashlib.sha256).hexdigest()


def check_fresh(name: str, value: str) -> str:
    """`value` as a nonce or challenge (32 hex digits), or RendezvousError naming it."""
    if not isinstance(value, str) or not _FRESH.match(value):
        raise RendezvousError(f"the {name} in the store is not 32 hex digits: {value!r:.80}")
    return value


def rank_proof(token: str, who: RankIdentity, rank: int, nonce: str, challenge: str) -> str:
    """Rank `rank` of `who` answering this rendezvous's `nonce` (hex HMAC-SHA256),
    with its own fresh `challenge` (which the verdict must sign)."""
    return _mac(_DOMAIN, token, who.cluster, who.role, who.instance, rank, nonce, challenge)


def proof_entry(token: str, who: RankIdentity, rank: int, nonce: str, challenge: str) -> str:
    """What rank `rank` writes at `proof_key`: its challenge and its proof."""
    return f"{challenge} {rank_proof(token, who, rank, nonce, challenge)}"


def _challenge_of(entry: str) -> str | None:
    parts = entry.split()
    return parts[0] if len(parts) == 2 and _FRESH.match(parts[0]) else None


def _verdict_mac(token: str, who: RankIdentity, nonce: str, challenges: Mapping[int, str]) -> str:
    signed = ",".join(f"{r}:{c}" for r, c in sorted(challenges.items()))
    return _mac(_VERDICT_DOMAIN, token, who.cluster, who.role, who.instance, nonce, signed)


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


def _is_proved(token: str, who: RankIdentity, rank: int, nonce: str, entry: str) -> bool:
    challenge = _challenge_of(entry)
    if challenge is None:
        return False
    want = proof_entry(token, who, rank, nonce, challenge)
    return hmac.compare_digest(entry.encode(), want.encode())


def compute_verdict(
    token: str, who: RankIdentity, ranks: Sequence[int], entries: Mapping[int, str], nonce: str
) -> str:
    """The leader's verdict on the proof entries of global `ranks` (by global rank)
    for this rendezvous's `nonce`: "ok <mac>", or why the gang is refused."""
    missing = [r for r in ranks if r not in entries]
    if missing:
        return f"refused: no proof from {_ranks_text(missing)}"
    bad = [r for r in ranks if not _is_proved(token, who, r, nonce, entries[r])]
    if bad:
        return (
            f"refused: {_ranks_text(bad)} did not prove "
            f"{who.cluster}/{who.role}-{who.instance} with this cluster's token "
            "in this rendezvous"
        )
    challenges = {r: str(_challenge_of(entries[r])) for r in ranks}
    return f"{VERDICT_OK} {_verdict_mac(token, who, nonce, challenges)}"


def is_admitted(verdict: str) -> bool:
    """Whether a verdict says "ok" (signed or not: `check_verdict` says if it counts)."""
    return verdict.split(" ", 1)[0] == VERDICT_OK


def check_verdict(
    token: str,
    who: RankIdentity,
    ranks: Sequence[int],
    entries: Mapping[int, str],
    nonce: str,
    verdict: str,
) -> None:
    """A rank's check of the verdict it read: returns only for an "ok" the leader
    signed (with the token) over `nonce` and every rank's challenge in `entries`,
    this rank's own among them; RendezvousError otherwise, with the reason."""
    if not is_admitted(verdict):
        raise RendezvousError(f"the instance's leader refused this rank: {verdict[:300]}")
    challenges = {r: _challenge_of(entries.get(r, "")) for r in ranks}
    parts = verdict.split()
    if len(parts) == 2 and all(challenges.values()):
        want = _verdict_mac(token, who, nonce, {r: str(c) for r, c in challenges.items()})
        if hmac.compare_digest(parts[1].encode(), want.encode()):
            return
    raise RendezvousError(
        "the verdict in the store is not signed with this cluster's token for this "
        "rendezvous; not joining"
    )


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


def address_entry(token: str, who: RankIdentity, pod_index: int, host: str, nonce: str) -> str:
    """What pod `pod_index` writes to the directory: its host and a proof binding
    the host to the pod and to this directory's `nonce` (a host written without
    the token, or in an earlier rendezvous, is refused)."""
    host = parse_leader_address(host)
    return f"{host} {_address_proof(token, who, pod_index, host, nonce)}"


def read_address_entry(token: str, who: RankIdentity, pod_index: int, text: str, nonce: str) -> str:
    """The host in pod `pod_index`'s directory entry, or RendezvousError when the
    entry is malformed or was not written with this cluster's token for that pod
    in this rendezvous (`nonce`)."""
    parts = text.split()
    if len(parts) != 2:
        raise RendezvousError(f"pod {pod_index}'s address entry is malformed")
    host, proof = parts
    host = parse_leader_address(host)
    want = _address_proof(token, who, pod_index, host, nonce)
    if not hmac.compare_digest(proof.encode(), want.encode()):
        raise RendezvousError(
            f"pod {pod_index}'s address {host} was not published for "
            f"{who.cluster}/{who.role}-{who.instance} with this cluster's token "
            "in this rendezvous"
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


def _address_proof(token: str, who: RankIdentity, pod_index: int, host: str, nonce: str) -> str:
    return _mac(_ADDRESS_DOMAIN, token, who.cluster, who.role, who.instance, pod_index, host, nonce)
