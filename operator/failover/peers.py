"""The worker pods of every PDCluster, as the pod watch last reported them, and
which of them must hear about a lost peer.

The fast path answers "whom do I tell?" from this index, without an API
call, so telling the peers costs only their admin round trips.

- a lost prefill instance is reported to every decode worker of its
  cluster (decode rooms name their prefill by `podIP:bootstrapPort`);
- a lost decode instance is reported to every prefill worker (prefill rooms
  write to decode endpoints, matched by the decode pod's address);
- a peer is told only if it has an address and its container still runs;
- vLLM pods with vLLM's connector (`PodFacts.has_admin_api` false) are told
  nothing and polled for nothing: their requests are the router's to end or
  move (the router sees a lost pod through its own pod watch); vLLM pods with
  our connector are told and polled on their side port (`admin_url`).

It also knows each pod's gang (`gang_id`, `gang`): the start of its instance
it belongs to, named by that start's leader pod uid (gangs.py).

Pure module.
"""

from __future__ import annotations

from collections import defaultdict

from pdcluster.operator.failover.pod_facts import PodFacts
from pdcluster.runtime.spec import Role

PEER_ROLE = {Role.prefill: Role.decode, Role.decode: Role.prefill}


class PodIndex:
    def __init__(self) -> None:
        self._by_cluster: dict[tuple[str, str], dict[str, PodFacts]] = defaultdict(dict)
        # Pod k > 0 uid -> the uid of the leader it was started for (first sight).
        self._leader_of: dict[str, str] = {}

    def update(self, pod: PodFacts, *, gone: bool = False) -> None:
        pods = self._by_cluster[pod.key]
        if gone:
            pods.pop(pod.uid, None)
            self._leader_of.pop(pod.uid, None)
            if not pods:
                del self._by_cluster[pod.key]
        else:
            pods[pod.uid] = pod
            self.gang_id(pod)  # remember its leader while that one is indexed

    def gang_id(self, pod: PodFacts) -> str | None:
        """The gang `pod` belongs to: its leader pod's uid (None: that leader was
        never seen, e.g. the operator started after it was gone)."""
        if pod.is_leader:
            return pod.uid
        known = self._leader_of.get(pod.uid)
        if known is not None:
            return known
        candidates = [
            p
            for p in self._by_cluster.get(pod.key, {}).values()
            if p.is_leader
            and _same_instance(p, pod)
            and p.pod_ip is not None
            and p.pod_ip == pod.leader_address
        ]
        if not candidates:
            return None
        # An IP taken again by the next start's leader while the old one terminates:
        # a pod is started for the live leader, the newest of them.
        chosen = max(
            candidates, key=lambda p: (not (p.deleting or p.has_ended), p.created_at or 0.0)
        )
        self._leader_of[pod.uid] = chosen.uid
        return chosen.uid

    def members(self, key: tuple[str, str], gang_id: str) -> list[PodFacts]:
        """The indexed pods of gang `gang_id` (a pod whose object is gone has left)."""
        return [p for p in self._by_cluster.get(key, {}).values() if self.gang_id(p) == gang_id]

    def gang(self, pod: PodFacts) -> list[PodFacts]:
        """The indexed pods of `pod`'s gang (its instance's start), `pod` among them.

        A gang whose leader was never seen is told by the leader IP its other
        pods were started for."""
        gang = self.gang_id(pod)
        members = [
            p
            for p in self._by_cluster.get(pod.key, {}).values()
            if _same_instance(p, pod)
            and (
                self.gang_id(p) == gang
                if gang is not None
                else not p.is_leader and p.leader_address == pod.leader_address
            )
        ]
        return members if any(p.uid == pod.uid for p in members) else [*members, pod]

    def get(self, key: tuple[str, str], uid: str) -> PodFacts | None:
        pods = self._by_cluster.get(key)
        return pods.get(uid) if pods else None

    def clusters(self) -> list[tuple[str, str]]:
        return sorted(self._by_cluster)

    def pods(self, key: tuple[str, str]) -> list[PodFacts]:
        return sorted(self._by_cluster.get(key, {}).values(), key=lambda p: p.name)

    def forget_cluster(self, key: tuple[str, str]) -> None:
        for uid in self._by_cluster.pop(key, {}):
            self._leader_of.pop(uid, None)

    def peers_of(self, lost: PodFacts) -> list[PodFacts]:
        """The workers that may hold rooms tied to `lost`, in name order: the peer
        role's leader pods (only a leader serves the admin API)."""
        role = PEER_ROLE.get(lost.role)
        if role is None:
            return []
        return [
            p
            for p in self.pods(lost.key)
            if p.role == role
            and p.is_leader
            and p.has_admin_api
            and p.cluster_uid == lost.cluster_uid
            and p.pod_ip
            and not p.has_ended
        ]

    def reachable(self, key: tuple[str, str]) -> list[PodFacts]:
        """PD workers of a cluster whose admin API can answer (failure counts): leaders."""
        return [
            p
            for p in self.pods(key)
            if p.role in PEER_ROLE
            and p.is_leader
            and p.has_admin_api
            and p.pod_ip
            and p.phase == "Running"
            and not p.has_ended
        ]


def _same_instance(a: PodFacts, b: PodFacts) -> bool:
    return (a.cluster_uid, a.role, a.instance) == (b.cluster_uid, b.role, b.instance)
