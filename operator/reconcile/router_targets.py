"""Which router pods get the live settings (`live_settings.py`) on this pass.

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.builders.meta import HTTP_PORT
from pdcluster.operator.builders.router import ANNOTATION_ROUTER_HASH, ROUTER_ROLE
from pdcluster.runtime.router.live_settings import RouterLiveSettings


@dataclass(frozen=True)
class RouterPod:
    name: str
    uid: str
    url: str  # http://podIP:port


def router_pods(
    pods: Iterable[Mapping[str, Any]], cluster: str, router_hash: str
) -> list[RouterPod]:
    """The cluster's Ready router pods of `router_hash`, not being deleted, sorted by name.

    A pod of another hash is being rolled away: it may refuse settings that
    need a restart (which roles cache_aware follows), and its successor
    reads the new ones from the manifest anyway."""
    out: list[RouterPod] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        if annotations.get(ANNOTATION_ROUTER_HASH) != router_hash:
            continue
        status = pod.get("status") or {}
        if labels.get(names.LABEL_ROLE) != ROUTER_ROLE:
            continue
        if labels.get(names.LABEL_CLUSTER) != cluster or meta.get("deletionTimestamp"):
            continue
        name, uid, ip = meta.get("name"), meta.get("uid"), status.get("podIP")
        conditions = status.get("conditions")
        ready = any(
            isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
            for c in (conditions if isinstance(conditions, list) else [])
        )
        if all(isinstance(v, str) and v for v in (name, uid, ip)) and ready:
            out.append(RouterPod(str(name), str(uid), f"http://{ip}:{HTTP_PORT}"))
    return sorted(out, key=lambda p: p.name)


def plan_router_pushes(
    pods: Iterable[RouterPod],
    accepted: Mapping[str, RouterLiveSettings],
    desired: RouterLiveSettings,
) -> list[RouterPod]:
    """The pods to put `desired` to: those whose last accepted settings (by uid) differ."""
    return [p for p in pods if accepted.get(p.uid) != desired]
