"""Helpers for tests against the local cluster: pod manifests and waiting on objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from e2e.nodeagent.kubeapi import KubeApi
from e2e.processes import wait_until

# A web server bound to the pod's own loopback address, as every pod process must be:
# pods share the host's network, so binding 0.0.0.0 would collide between pods.
PYTHON_HTTP_SERVER = ["python", "-m", "http.server", "8080", "--bind", "$(POD_IP)"]
POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def wait_for_object(
    kube: KubeApi,
    path: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout_s: float,
    what: str,
) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def check() -> bool:
        obj = kube.get(path)
        if obj is not None and predicate(obj):
            found.update(obj)
            return True
        return False

    wait_until(check, timeout_s, what)
    return found


def wait_for_phase(kube: KubeApi, path: str, *phases: str, timeout_s: float = 30) -> dict[str, Any]:
    """The pod once its status.phase is one of `phases`."""
    return wait_for_object(
        kube,
        path,
        lambda p: (p.get("status") or {}).get("phase") in phases,
        timeout_s,
        f"phase {' or '.join(phases)}",
    )


def make_pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "unused", "command": command}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 5, **spec},
    }


def container_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses: list[dict[str, Any]] = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return statuses[0]


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
