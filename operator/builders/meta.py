"""Object metadata shared by every child: labels, owner reference, identity key.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from pdcluster.operator import names
from pdcluster.operator.reconcile.cluster import ClusterRef
from pdcluster.runtime.spec import LogFormat, PDClusterSpec
from pdcluster.runtime.spec.observability import LOG_FORMAT_ENV

Manifest = dict[str, Any]

# The pod contract: ports every worker and router container listens on.
HTTP_PORT = 8000
DIST_PORT = 29500
BOOTSTRAP_PORT = 8998
MANIFEST_KEY = "manifest.yaml"
# Pods read the manifest from this variable (`-f env:PDCLUSTER_MANIFEST`),
# filled from the cluster's ConfigMap: no volume, so any node runs them.
MANIFEST_ENV = "PDCLUSTER_MANIFEST"
MANIFEST_ARG = f"env:{MANIFEST_ENV}"
# Every pod binds its own address: on a node whose pods share one network
# (the e2e node agent, hostNetwork) 0.0.0.0 would collide between pods.
POD_IP_ENV = "POD_IP"
BIND_HOST = f"$({POD_IP_ENV})"
TOKEN_KEY = "token"
ROUTER_API_KEYS_KEY = "keys"


class BuildError(ValueError):
    """The spec cannot be turned into valid Kubernetes objects; the message says why."""


class ObjectKey(NamedTuple):
    """Identity of a namespaced child: kind plus name (the namespace is the cluster's)."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


def object_key(manifest: Mapping[str, Any]) -> ObjectKey:
    return ObjectKey(str(manifest["kind"]), str(manifest["metadata"]["name"]))


def object_meta(
    ref: ClusterRef,
    name: str,
    component: str,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Metadata of a child: deterministic name, cluster labels, controller owner reference."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ref.namespace,
        "labels": {
            **names.cluster_labels(ref.name),
            names.LABEL_COMPONENT: component,
            **(labels or {}),
        },
        "ownerReferences": [ref.owner_reference()],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def env_value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def env_field(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def env_secret(name: str, secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def http_probe(
    period_s: int, failure_threshold: int, timeout_s: int = 2, path: str = "/health"
) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failure_threshold,
    }


def env_config_map(name: str, config_map: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"configMapKeyRef": {"name": config_map, "key": key}}}


def manifest_env(config_map: str) -> list[dict[str, Any]]:
    """The variables every pod needs first: its own address and the manifest."""
    return [
        env_field(POD_IP_ENV, "status.podIP"),
        env_config_map(MANIFEST_ENV, config_map, MANIFEST_KEY),
    ]


def log_format_env(spec: PDClusterSpec) -> dict[str, Any]:
    """`PDCLUSTER_LOG_FORMAT` of a pod: the manifest's `logFormat`, JSON when it names none."""
    stated = spec.observability.log_format
    return env_value(LOG_FORMAT_ENV, (stated or LogFormat.json).value)
