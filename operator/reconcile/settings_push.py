"""Putting the router's live settings in force on its running pods.

Each reconcile pass (`Controller`) calls `RouterSettingsPusher.push`: the
desired settings (`live_settings.py`) go to every Ready router pod of the
current router hash that has not accepted them yet (`router_targets.py`),
concurrently, each call with the admin client's timeout. What each pod
accepted is remembered by pod uid; a pod never told (started later, or
the operator restarted) is told once, which changes nothing when it
already read the same values from the manifest.

- all accepted, and the settings differ from those this operator last
  pushed for the cluster → one Normal Event `SettingsApplied` naming the
  changed fields and the pods;
- a pod answers 4xx → a Warning `SettingsRefused` naming the pod and its
  answer; it is asked again on later passes;
- no answer or 5xx → asked again soon (`push` returns a retry delay).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from pdcluster.operator.failover.admin_client import AdminClient, AdminResult
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.reconcile.actions import EventType, Reason
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.operator.reconcile.live_settings import (
    compute_live_changes,
    compute_router_live_settings,
)
from pdcluster.operator.reconcile.revision import compute_router_hash
from pdcluster.operator.reconcile.router_targets import (
    RouterPod,
    plan_router_pushes,
    router_pods,
)
from pdcluster.runtime.router.live_settings import RouterLiveSettings

log = logging.getLogger("pdcluster.operator.reconcile.settings_push")

# A router that did not answer (or answered 5xx) is asked again this soon.
RETRY_S = 5.0


class RouterSettingsPusher:
    def __init__(self, admin: AdminClient, recorder: EventRecorder) -> None:
        self.admin = admin
        self.recorder = recorder
        # router pod uid -> the settings it accepted.
        self._accepted: dict[str, RouterLiveSettings] = {}
        # (namespace, name) -> the settings last accepted by all the cluster's router pods.
        self._in_force: dict[tuple[str, str], RouterLiveSettings] = {}

    def forget(self, key: tuple[str, str]) -> None:
        self._in_force.pop(key, None)

    async def push(
        self,
        cluster: Cluster,
        pods: Sequence[Mapping[str, Any]],
        token: Callable[[], Awaitable[str | None]],
    ) -> float | None:
        """Put the cluster's live router settings to its router pods; a retry delay or None."""
        desired = compute_router_live_settings(cluster.spec)
        targets = router_pods(pods, cluster.name, compute_router_hash(cluster.spec))
        live_uids = {p.uid for p in targets}
        for uid in [u for u in self._accepted if u not in live_uids]:
            del self._accepted[uid]  # deleted, or not Ready (told again once Ready)
        due = plan_router_pushes(targets, self._accepted, desired)
        if not due:
            return None
        secret = await token()
        body = desired.model_dump(mode="json", by_alias=True)
        results = await asyncio.gather(
            *(self.admin.router_settings(p.url, secret, body) for p in due)
        )
        retry = False
        for pod, result in zip(due, results, strict=True):
            if result.ok:
                self._accepted[pod.uid] = desired
            elif 0 < result.status < 500:
                await self._refused(cluster, pod, result)
            else:
                retry = True
                log.warning(
                    "router settings at %s: %s %s", pod.name, result.status or "", result.error
                )
        if any(self._accepted.get(p.uid) != desired for p in targets):
            return RETRY_S if retry else None
        key = (cluster.namespace, cluster.name)
        before = self._in_force.get(key)
        self._in_force[key] = desired
        if before is not None and before != desired:
            changes = "; ".join(compute_live_changes(before, desired))
            pods_named = ", ".join(p.name for p in targets)
            await self.recorder.record(
                cluster.ref,
                EventType.Normal.value,
                Reason.SettingsApplied.value,
                f"{changes} (in force on {pods_named}, no restart)",
            )
        return None

    async def _refused(self, cluster: Cluster, pod: RouterPod, result: AdminResult) -> None:
        await self.recorder.record(
            cluster.ref,
            EventType.Warning.value,
            Reason.SettingsRefused.value,
            f"router pod {pod.name} refused the live settings: HTTP {result.status} {result.error}",
        )
