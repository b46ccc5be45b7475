"""The router: a Deployment (stateless, the kubelet may restart it freely) and
its Service. The router finds workers by pod labels through the API, so it
needs no per-instance configuration and does not change when roles scale.

Pure module.
"""

from __future__ import annotations

from typing import Any

from pdcluster.operator import names
from pdcluster.operator.builders import meta, podsecurity
from pdcluster.operator.builders.disruption import router_grace_period_s
from pdcluster.operator.builders.meta import BuildError, Manifest
from pdcluster.operator.builders.overlay import apply_pod_overlay
from pdcluster.operator.builders.workers import token_secret_for
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.operator.reconcile.revision import compute_cluster_revision, compute_router_hash

ROUTER_ROLE = "router"
ANNOTATION_ROUTER_HASH = "pdcluster.io/router-hash"


def router_selector(cluster: Cluster) -> dict[str, str]:
    selector: dict[str, str] = names.role_selector(cluster.name, ROUTER_ROLE)
    return selector


def router_resources(cluster: Cluster) -> dict[str, Any]:
    """`router.resources` with the default requests; raises BuildError on a malformed one."""
    given = cluster.spec.router.resources
    unknown = set(given) - {"limits", "requests", "claims"}
    if unknown:
        raise BuildError(
            f"router.resources: unknown keys {sorted(unknown)} (expected limits, requests, claims)"
        )
    for key in ("limits", "requests"):
        if key in given and not isinstance(given[key], dict):
            raise BuildError(f"router.resources.{key} must be a mapping")
    return podsecurity.with_default_requests(given, "router")


def build_router_deployment(cluster: Cluster) -> Manifest:
    spec = cluster.spec
    # The router sends the cluster token on every call to a worker (their data
    # plane needs it); it reads it from a mounted Secret file, never from env.
    env: list[dict[str, Any]] = [
        *meta.manifest_env(names.config_map_name(cluster.name)),
        meta.env_value("HOME", podsecurity.HOME_DIR),
        meta.env_field("POD_NAMESPACE", "metadata.namespace"),
        meta.env_value("PDCLUSTER_CLUSTER", cluster.name),
        meta.env_value(podsecurity.TOKEN_FILE_ENV, f"{podsecurity.TOKEN_DIR}/{meta.TOKEN_KEY}"),
        meta.log_format_env(spec),
    ]
    volumes, mounts = podsecurity.writable_volumes()
    token_volume, token_mount = podsecurity.token_volume(token_secret_for(cluster), meta.TOKEN_KEY)
    volumes.append(token_volume)
    mounts.append(token_mount)
    key_args: list[str] = []
    if spec.auth.router_api_key_secret_name:
        volumes.append(
            podsecurity.secret_volume(
                podsecurity.API_KEYS_VOLUME,
                spec.auth.router_api_key_secret_name,
                meta.ROUTER_API_KEYS_KEY,
            )
        )
        mounts.append(
            {
                "name": podsecurity.API_KEYS_VOLUME,
                "mountPath": podsecurity.API_KEYS_DIR,
                "readOnly": True,
            }
        )
        key_args = ["--api-key-file", f"{podsecurity.API_KEYS_DIR}/{meta.ROUTER_API_KEYS_KEY}"]
    labels = {
        **names.cluster_labels(cluster.name),
        names.LABEL_COMPONENT: ROUTER_ROLE,
        names.LABEL_ROLE: ROUTER_ROLE,
        names.LABEL_REVISION: compute_cluster_revision(spec),
    }
    container = {
        "name": "router",
        "image": spec.image,
        "command": ["pdcluster"],
        "args": [
            "router",
            "-f",
            meta.MANIFEST_ARG,
            "--host",
            meta.BIND_HOST,
            "--port",
            str(meta.HTTP_PORT),
            "--kubernetes",
            "--namespace",
            cluster.namespace,
            "--cluster",
            cluster.name,
            *key_args,
        ],
        "env": env,
        "ports": [{"name": "http", "containerPort": meta.HTTP_PORT, "protocol": "TCP"}],
        # Ready once it has a prefill and a decode (or a colocated) worker to use.
        "readinessProbe": meta.http_probe(2, 3),
        # Alive while it answers at all: /health is 503 without workers, and
        # restarting the router would not bring any worker back.
        "livenessProbe": meta.http_probe(10, 3, timeout_s=5, path="/metrics"),
        "resources": router_resources(cluster),
        "securityContext": podsecurity.container_security_context(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        # The router watches the cluster's pods (discovery): it keeps
        # the token of the runtime account, which may only read pods.
        "serviceAccountName": names.runtime_account_name(cluster.name),
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": podsecurity.pod_security_context(),
        # Streams in flight finish before the router stops (builders/disruption.py).
        "terminationGracePeriodSeconds": router_grace_period_s(cluster),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.router.node_selector:
        pod_spec["nodeSelector"] = dict(spec.router.node_selector)
    if spec.router.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.router.tolerations]
    if spec.router.affinity:
        pod_spec["affinity"] = dict(spec.router.affinity)
    template_meta: dict[str, Any] = {
        "labels": labels,
        # The router reads the manifest once at start; a change of
        # what it reads must roll it.
        "annotations": {ANNOTATION_ROUTER_HASH: compute_router_hash(spec)},
    }
    apply_pod_overlay(template_meta, pod_spec, spec.router.pod, ROUTER_ROLE)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _router_meta(cluster),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": router_selector(cluster)},
            "template": {
                "metadata": template_meta,
                "spec": pod_spec,
            },
        },
    }


def _router_meta(cluster: Cluster) -> dict[str, Any]:
    """Metadata of the router's Deployment and Service (one name, one role label)."""
    return meta.object_meta(
        cluster.ref,
        names.router_name(cluster.name),
        component=ROUTER_ROLE,
        labels={names.LABEL_ROLE: ROUTER_ROLE},
    )


def build_router_service(cluster: Cluster) -> Manifest:
    service = cluster.spec.router.service
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _router_meta(cluster),
        "spec": {
            "type": service.type,
            "selector": router_selector(cluster),
            "ports": [
                {"name": "http", "port": service.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
