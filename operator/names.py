"""Deterministic names, labels and selectors of every object a PDCluster owns.

Every child name comes from this module, so the planner can find an object
by name without listing, and two reconciles of the same spec agree.

Invariants:
- every name is a valid DNS-1035 label (lowercase alphanumerics and '-',
  starts with a letter, ends with an alphanumeric, at most 63 characters),
  which is the strictest rule among the kinds we create (Services);
- a name that would be too long keeps its distinguishing suffix and replaces
  the tail of the cluster part with a short hash of the whole cluster name,
  so two different clusters never collide by truncation;
- label values are the cluster name, role, decimal indexes and hex hashes,
  all of which are valid label values (<= 63 characters).

Pure module.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pdcluster.runtime.spec import Role

MAX_NAME = 63
_HASH_CHARS = 5
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# Label keys. The router's Kubernetes discovery reads ROLE, POD_INDEX and the
# HTTP port annotation; keep them in step with runtime/router/discovery.py.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_CLUSTER = "pdcluster.io/cluster"
LABEL_ROLE = "pdcluster.io/role"
LABEL_INSTANCE_INDEX = "pdcluster.io/instance"
LABEL_POD_INDEX = "pdcluster.io/pod-index"
# "true" on pod 0 of an instance (bootstrap server, HTTP API), "false" on the others.
LABEL_LEADER = "pdcluster.io/leader"
# Compatibility revision: prefill and decode pods pair only when equal.
LABEL_REVISION = "pdcluster.io/revision"
# Hash of one role's pod template: a change rolls that role's instances.
LABEL_TEMPLATE = "pdcluster.io/template-hash"
# "vllm" on the worker pods of `spec.engine.kind: vllm` (absent: our engine):
# they serve no admin API, so the fast path and the pollers leave them out.
LABEL_ENGINE = "pdcluster.io/engine"
# scheduler-plugins' coscheduling: pods with one value form one PodGroup.
LABEL_POD_GROUP = "scheduling.x-k8s.io/pod-group"

ANNOTATION_HTTP_PORT = "pdcluster.io/http-port"
ANNOTATION_BOOTSTRAP_PORT = "pdcluster.io/bootstrap-port"
ANNOTATION_DIST_PORT = "pdcluster.io/dist-port"
# A vLLM pod whose cache the router follows (cache_aware): the ports of its
# prefix-cache events (PUB) and of their replays (runtime/router/discovery.py).
ANNOTATION_KV_EVENTS_PORT = "pdcluster.io/kv-events-port"
ANNOTATION_KV_REPLAY_PORT = "pdcluster.io/kv-replay-port"
# Where a worker serves our admin API (fail_peer, failures, prefill peers) when
# not on its HTTP port: a vLLM pod with our connector (its side port).
ANNOTATION_ADMIN_PORT = "pdcluster.io/admin-port"
# On a pod k > 0: the leader pod's IP it was started with ($PDCLUSTER_LEADER_ADDRESS).
ANNOTATION_LEADER_ADDRESS = "pdcluster.io/leader-address"
# Pods in the instance the pod belongs to, so a gang is judged complete or
# not even after the spec (and with it the instance size) changed.
ANNOTATION_INSTANCE_SIZE = "pdcluster.io/pods-per-instance"
# Hash of the manifest the operator last applied; equal hashes skip the write.
ANNOTATION_APPLIED_HASH = "pdcluster.io/applied-hash"
# A worker pod's global ranks [first, first + per pod), in its container's env:
# the operator reads them back from the pod for `status.<role>.instances[].pods[].ranks`.
ENV_FIRST_RANK = "PDCLUSTER_FIRST_RANK"
ENV_RANKS_PER_POD = "PDCLUSTER_RANKS_PER_POD"

APP_NAME = "pdcluster"
MANAGED_BY = "pdcluster-operator"


class InvalidNameError(ValueError):
    """A cluster name cannot produce valid child names."""


def short_hash(text: str, chars: int = 8) -> str:
    """Stable lowercase hex digest prefix of `text`."""
    return hashlib.sha256(text.encode()).hexdigest()[:chars]


def _cluster_part(cluster: str) -> str:
    # Services need a leading letter; a cluster named "1a" gets "c1a".
    return cluster if cluster[:1].isalpha() else f"c{cluster}"


def fit_name(cluster: str, suffix: str) -> str:
    """`<cluster>-<suffix>`, shortened to a valid DNS-1035 label when needed."""
    if not cluster:
        raise InvalidNameError("cluster name must not be empty")
    head = _cluster_part(cluster)
    name = f"{head}-{suffix}" if suffix else head
    if len(name) > MAX_NAME:
        tag = short_hash(cluster, _HASH_CHARS)
        room = MAX_NAME - len(suffix) - len(tag) - 2
        if room < 1:
            raise InvalidNameError(f"name suffix {suffix!r} leaves no room for the cluster name")
        name = f"{head[:room].rstrip('-')}-{tag}-{suffix}"
    if not _DNS_LABEL.match(name):
        raise InvalidNameError(
            f"cluster name {cluster!r} does not give a valid object name ({name!r})"
        )
    return name


def pod_name(cluster: str, role: Role, instance: int, template_hash: str, pod_index: int) -> str:
    """`<cluster>-<role>-<instance>-<template>-<pod index>`: pod k of one instance.

    The template hash sits between instance and pod index so that, during a
    rollout, the new instance i runs beside the old one without a name clash;
    the name is otherwise stable across restarts of the gang.
    """
    return fit_name(cluster, f"{role.value}-{instance}-{template_hash}-{pod_index}")


def instance_name(cluster: str, role: Role, instance: int, template_hash: str) -> str:
    """`<cluster>-<role>-<instance>-<template>`: one instance generation (its PodGroup)."""
    return fit_name(cluster, f"{role.value}-{instance}-{template_hash}")


@dataclass(frozen=True, order=True)
class PodIdentity:
    """Which pod of which instance a worker pod is."""

    role: Role
    instance: int
    template_hash: str
    pod_index: int

    def name(self, cluster: str) -> str:
        return pod_name(cluster, self.role, self.instance, self.template_hash, self.pod_index)


def pod_identity_labels(identity: PodIdentity) -> dict[str, str]:
    """The labels that say which pod a worker pod is (`pod_identity_from_labels` reads them)."""
    return {
        LABEL_ROLE: identity.role.value,
        LABEL_INSTANCE_INDEX: str(identity.instance),
        LABEL_TEMPLATE: identity.template_hash,
        LABEL_POD_INDEX: str(identity.pod_index),
    }


def instance_selector(
    cluster: str, role: Role, instance: int, template_hash: str
) -> dict[str, str]:
    """Labels every pod of one instance generation carries, and only they."""
    return {
        LABEL_CLUSTER: cluster,
        LABEL_ROLE: role.value,
        LABEL_INSTANCE_INDEX: str(instance),
        LABEL_TEMPLATE: template_hash,
    }


_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")
_TEMPLATE = re.compile(r"^[0-9a-f]+$")
_POD_SUFFIX = re.compile(
    r"-(?P<role>[a-z]+)-(?P<instance>0|[1-9][0-9]*)-(?P<template>[0-9a-f]+)"
    r"-(?P<pod>0|[1-9][0-9]*)$"
)


def _identity(role: str, instance: str, template: str, pod: str) -> PodIdentity | None:
    try:
        parsed_role = Role(role)
    except ValueError:
        return None
    if not (_INDEX.match(instance) and _INDEX.match(pod) and _TEMPLATE.match(template)):
        return None
    return PodIdentity(parsed_role, int(instance), template, int(pod))


def pod_identity_from_labels(labels: Mapping[str, str]) -> PodIdentity | None:
    """The pod's identity from its labels; None when one is missing or malformed."""
    return _identity(
        labels.get(LABEL_ROLE, ""),
        labels.get(LABEL_INSTANCE_INDEX, ""),
        labels.get(LABEL_TEMPLATE, ""),
        labels.get(LABEL_POD_INDEX, ""),
    )


def pod_identity_from_name(cluster: str, name: str) -> PodIdentity | None:
    """The identity `pod_name(cluster, ...)` encoded in `name`; None when `name` is not
    a worker pod name of `cluster` (including names shortened by `fit_name`)."""
    match = _POD_SUFFIX.search(name)
    if match is None:
        return None
    identity = _identity(match["role"], match["instance"], match["template"], match["pod"])
    if identity is None:
        return None
    try:
        return identity if identity.name(cluster) == name else None
    except InvalidNameError:
        return None


def bootstrap_service_name(cluster: str, instance: int, template_hash: str) -> str:
    return fit_name(cluster, f"prefill-{instance}-{template_hash}-bs")


def role_scaler_name(cluster: str, role: Role) -> str:
    """The role's PDClusterRoleScaler: `kubectl scale pdcrs <cluster>-decode --replicas=N`."""
    return fit_name(cluster, role.value)


def router_name(cluster: str) -> str:
    return fit_name(cluster, "router")


def config_map_name(cluster: str) -> str:
    return fit_name(cluster, "config")


def token_secret_name(cluster: str) -> str:
    return fit_name(cluster, "token")


def network_policy_name(cluster: str, target: str) -> str:
    """NetworkPolicy guarding the cluster's `target` pods ("workers", "router")."""
    return fit_name(cluster, f"{target}-ingress")


def disruption_budget_name(cluster: str, target: str) -> str:
    """PodDisruptionBudget of the cluster's `target` pods (a role, or "router")."""
    return fit_name(cluster, f"{target}-budget")


def runtime_account_name(cluster: str) -> str:
    """ServiceAccount, Role and RoleBinding of the cluster's pods share it."""
    return fit_name(cluster, "runtime")


def cluster_labels(cluster: str) -> dict[str, str]:
    """Labels every child carries; `LABEL_CLUSTER` is what the operator lists by."""
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: cluster,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_CLUSTER: cluster,
    }


def cluster_selector(cluster: str) -> dict[str, str]:
    return {LABEL_CLUSTER: cluster}


def role_selector(cluster: str, role: Role | str) -> dict[str, str]:
    return {LABEL_CLUSTER: cluster, LABEL_ROLE: str(role)}


def format_selector(labels: Mapping[str, str]) -> str:
    """A label selector string, keys sorted so it is stable."""
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels))
