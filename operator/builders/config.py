"""Cluster-wide children: the manifest ConfigMap, the token Secret and the
RBAC the pods need (the router lists pods).

The token Secret is built from a token the caller passes in: builders draw
no randomness, and the planner creates the Secret once and never rewrites
it, so reconcile never rotates a token under running pods.

Pure module.
"""

from __future__ import annotations

import base64
from typing import Any

import yaml

from pdcluster.operator import names
from pdcluster.operator.api import API_VERSION_FULL, KIND
from pdcluster.operator.builders import meta
from pdcluster.operator.builders.meta import Manifest
from pdcluster.operator.builders.workers import placed_spec
from pdcluster.operator.reconcile.cluster import Cluster


def render_manifest_yaml(cluster: Cluster) -> str:
    """The PDCluster as the pods read it (`-f env:PDCLUSTER_MANIFEST`).

    Defaults are filled in (`placed_spec`), so every pod
    reads exactly what the operator validated and runs; status is left out so
    status writes never touch the ConfigMap.
    """
    doc = {
        "apiVersion": API_VERSION_FULL,
        "kind": KIND,
        "metadata": {"name": cluster.name, "namespace": cluster.namespace},
        "spec": placed_spec(cluster.spec).model_dump(mode="json", by_alias=True, exclude_none=True),
    }
    return yaml.safe_dump(doc, sort_keys=True)


def build_config_map(cluster: Cluster) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta.object_meta(
            cluster.ref, names.config_map_name(cluster.name), component="config"
        ),
        "data": {meta.MANIFEST_KEY: render_manifest_yaml(cluster)},
    }


def build_token_secret(cluster: Cluster, token: str) -> Manifest:
    """The cluster token Secret; raises ValueError on an empty or non-ASCII token."""
    if not token or not token.isascii() or not token.isprintable():
        raise ValueError("cluster token must be non-empty printable ASCII")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta.object_meta(
            cluster.ref, names.token_secret_name(cluster.name), component="token"
        ),
        "type": "Opaque",
        "data": {meta.TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_runtime_rbac(cluster: Cluster) -> list[Manifest]:
    """ServiceAccount, Role and RoleBinding of the cluster's pods, in apply order.

    Only the router mounts the account's token (worker pods opt out): it
    reads pods in its own namespace for discovery, nothing else.
    """
    name = names.runtime_account_name(cluster.name)
    rules: list[dict[str, Any]] = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta.object_meta(cluster.ref, name, component="runtime"),
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta.object_meta(cluster.ref, name, component="runtime"),
        "rules": rules,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta.object_meta(cluster.ref, name, component="runtime"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": cluster.namespace}],
    }
    return [account, role, binding]
