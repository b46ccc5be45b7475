"""What the peers are told about a lost pod: which address, which incarnation, and
whether nothing of it can write any more.

A multi-pod instance is a gang: one loss restarts every pod of it, but the
pods do not end together. Until the last one has, the survivors' ranks may
still be writing into a decode's pages (one-sided writes: nixl, shm), so a
partial loss is "failing, not gone":

    lost pod                     reports (fail_peer: peer, incarnation, gone)
    prefill, any pod k           the instance: leaderIP:bootstrapPort, the leader
                                 pod's uid; gone only once EVERY pod of the gang
                                 has ended or is gone
    prefill, pod k > 0, gone     also its own ranks: its pod IP, its uid, gone
    decode, any pod k            its own ranks: its pod IP, its uid, gone when
                                 it cannot run

So a decode fails the instance's rooms at once, ABORTs them, frees the
pages of the ranks that are gone (the pod-k report settles exactly the
sources on that pod) and quarantines the others until their writers
acknowledge or the last pod of the gang is gone; a prefill forgets a lost
decode pod's own rank endpoints, which the decode leader's address never
named. The incarnation lets a worker tell a report about a pod from one
about its successor at the same IP (runtime/pd/incarnations.py).

The gang of a pod is its instance's start it belongs to: the leader pod
(pod 0) names it by its uid, and a pod k > 0 belongs to the leader it was
started for (the leader with the IP it was given, remembered at first
sight: the leader's object may be gone before the pod's last event). Pods
of a later start of the instance are another gang, whatever their IPs.

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdcluster.operator.failover.pod_facts import PodFacts
from pdcluster.runtime.pd.peer_address import PeerRef
from pdcluster.runtime.spec import Role


@dataclass(frozen=True)
class Report:
    """One `fail_peer` call to every peer of the lost pod."""

    peer: PeerRef
    incarnation: str | None
    gone: bool

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.peer, self.incarnation)


def is_gang_gone(gang: Iterable[PodFacts], lost: PodFacts, *, lost_gone: bool) -> bool:
    """Nothing of the gang can run: the lost pod as it is reported (`lost_gone`), and
    every other pod of it ended (a pod whose object is gone has left `gang`)."""
    return lost_gone and all(p.has_ended for p in gang if p.uid != lost.uid)


def compute_reports(
    pod: PodFacts, *, pod_gone: bool, gang_id: str | None, gang_gone: bool
) -> list[Report]:
    """The reports of a lost `pod` (see the table above); none for a colocated pod
    or one without an address."""
    if pod.role is Role.decode:
        return [Report(pod.pod_ip, pod.uid, pod_gone)] if pod.pod_ip else []
    if pod.role is not Role.prefill:
        return []
    reports: list[Report] = []
    instance = pod.bootstrap_address
    if instance is not None:
        reports.append(Report(instance, gang_id, pod_gone and gang_gone))
    if not pod.is_leader and pod.pod_ip and pod_gone:
        reports.append(Report(pod.pod_ip, pod.uid, True))
    return reports
