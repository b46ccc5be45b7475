"""Helpers for tests against the local cluster: pod manifests and waiting on objects."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from e2e.nodeagent.kubeapi import ApiError, KubeApi
from e2e.processes import wait_until

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
# Our own minimal scheduler-plugins PodGroup CRD (scheduling.x-k8s.io/v1alpha1).
POD_GROUP_CRD = Path(__file__).resolve().parent / "crds" / "podgroup.yaml"

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


def install_crd(kube: KubeApi, manifest_file: Path, timeout_s: float = 30) -> None:
    """Create the CRD in `manifest_file` unless one of its name exists; return once
    the apiserver lists its resource (Established alone may come before that)."""
    crd = yaml.safe_load(manifest_file.read_text())
    name = crd["metadata"]["name"]
    if kube.get(f"{CRD_PATH}/{name}") is None:
        kube.create(CRD_PATH, crd)
    spec = crd["spec"]
    version = next(v["name"] for v in spec["versions"] if v.get("served"))
    resource = f"/apis/{spec['group']}/{version}/{spec['names']['plural']}"

    def served() -> bool:
        try:
            return kube.get(resource) is not None
        except ApiError as err:
            if err.status == 429:  # "storage is (re)initializing": the new resource starts
                return False
            raise

    wait_until(served, timeout_s, f"the {name} CRD to be served")
