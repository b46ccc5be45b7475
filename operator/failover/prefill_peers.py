"""Publishing each cluster's prefill bootstrap servers to its decode workers.

A decode worker contacts (and sends the cluster token to) only the
bootstrap servers it was told about, and reports not ready until it was
told. The operator tells it: `PUT /admin/prefill_peers {"peers": [...]}`
with every prefill pod of the cluster (`podIP:bootstrapPort`, the address a
PD router names in `bootstrap_host`/`bootstrap_port`).

- `compute_prefill_peers` / `decode_targets` decide (pure);
- `PeerPublisher.publish` sends to each decode pod whose last answered set
  differs (on pod events), or to all of them (`force`, each poll), so a
  restarted decode, which starts with no set, hears it again. A decode that
  does not answer yet (still loading) is asked again (Failover retries).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdcluster.operator.failover.admin_client import AdminClient, AdminResult
from pdcluster.operator.failover.pod_facts import PodFacts
from pdcluster.runtime.pd.peer_address import BootstrapAddress
from pdcluster.runtime.spec import Role

log = logging.getLogger("pdcluster.operator.failover.prefill_peers")


def compute_prefill_peers(pods: list[PodFacts], cluster_uid: str) -> frozenset[BootstrapAddress]:
    """Bootstrap addresses of the cluster's prefill leader pods that have an IP and run."""
    return frozenset(
        address
        for p in pods
        if p.role == Role.prefill
        and p.is_leader
        and p.cluster_uid == cluster_uid
        and (address := p.bootstrap_address) is not None
        and not p.has_ended
    )


def decode_targets(pods: list[PodFacts], cluster_uid: str) -> list[PodFacts]:
    """Decode pods that can answer an admin call (leaders: the others serve no HTTP)."""
    return [
        p
        for p in pods
        if p.role == Role.decode
        and p.is_leader
        and p.has_admin_api
        and p.cluster_uid == cluster_uid
        and p.pod_ip
        and p.phase == "Running"
        and not p.has_ended
    ]


class PeerPublisher:
    def __init__(self, admin: AdminClient) -> None:
        self.admin = admin
        # decode pod uid -> the set it last accepted.
        self._told: dict[str, frozenset[BootstrapAddress]] = {}

    def forget(self, uid: str) -> None:
        self._told.pop(uid, None)

    async def publish(
        self,
        pods: list[PodFacts],
        token: Callable[[], Awaitable[str | None]],
        *,
        force: bool = False,
    ) -> int:
        """Tell the decode pods of `pods` (one cluster) their prefill peers.

        Returns how many calls failed for a reason worth retrying (no answer
        yet, 5xx); every failed pod is due again next time."""
        decodes = [p for p in pods if p.role == Role.decode]
        if not decodes:
            return 0
        cluster_uid = decodes[0].cluster_uid
        peers = compute_prefill_peers(pods, cluster_uid)
        due = [
            p for p in decode_targets(pods, cluster_uid) if force or self._told.get(p.uid) != peers
        ]
        if not due:
            return 0
        secret = await token()

        async def tell(pod: PodFacts) -> AdminResult:
            assert pod.admin_url is not None
            result = await self.admin.prefill_peers(pod.admin_url, secret, sorted(peers))
            if result.ok:
                self._told[pod.uid] = peers
            else:
                self._told.pop(pod.uid, None)
                log.warning(
                    "prefill_peers at %s failed: %s %s", result.url, result.status, result.error
                )
            return result

        results = await asyncio.gather(*(tell(p) for p in due))
        return sum(not r.ok and (r.status == 0 or r.status >= 500) for r in results)
