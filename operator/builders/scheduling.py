"""Gang scheduling and placement of one instance's pods: a PodGroup and pod affinity.

Both are opt-in per role and rendered from the spec alone:

- `scheduling.gang: podGroup` → one scheduler-plugins `PodGroup`
  (`scheduling.x-k8s.io/v1alpha1`) per instance generation, named like the
  instance (`<cluster>-<role>-<i>-<template>`), `minMember` = the instance's
  pods; its pods carry `scheduling.x-k8s.io/pod-group: <that name>`, so a
  coscheduling scheduler binds all of them or none. `scheduling.schedulerName`
  is set on the pods whatever `gang` says (a PodGroup is only honoured by a
  scheduler that runs the coscheduling plugin; the default scheduler ignores
  it and binds the pods one by one).
- `placement.topologyKey: K` → every pod of an instance requires pod
  affinity to the pods of its own instance (`names.instance_selector`) over
  K: all land in one K domain. The first pod may land anywhere: Kubernetes
  lets a pod that matches its own required affinity term be scheduled when
  no other pod matches yet. Decode pods also *prefer* (weight 100) the K
  domain of prefill pods; K is decode's key, or prefill's when decode sets
  none.

The user's own `affinity` is kept; these terms are appended to it.

Every worker pod gets `build_pod_scheduling` (builders/workers.py); the
PodGroup is part of the instance's manifests (`InstanceManifests.pod_group`).
The planner creates it with the instance, before its pods, keeps it across
gang restarts (same name) and deletes it once no pod of its generation is
left and the generation is not the slot's current one
(reconcile/pod_groups.py). It is owned by the PDCluster like every child,
so deleting the cluster removes it.

Pure module.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.builders import meta
from pdcluster.operator.builders.meta import BuildError, Manifest
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.operator.reconcile.revision import compute_template_hash
from pdcluster.runtime.spec import GangScheduling, Role, RoleSpec

POD_GROUP_GROUP = "scheduling.x-k8s.io"
POD_GROUP_VERSION = "v1alpha1"
POD_GROUP_API_VERSION = f"{POD_GROUP_GROUP}/{POD_GROUP_VERSION}"
POD_GROUP_KIND = "PodGroup"
POD_GROUP_PLURAL = "podgroups"
PREFER_PREFILL_WEIGHT = 100


@dataclass(frozen=True)
class PodScheduling:
    """What one worker pod gets for gang scheduling and placement."""

    labels: dict[str, str] = field(default_factory=dict)
    scheduler_name: str | None = None
    affinity: dict[str, Any] = field(default_factory=dict)  # the pod's whole affinity

    def apply_to(self, pod: Manifest) -> Manifest:
        """A copy of the worker pod `pod` with these fields set."""
        out = copy.deepcopy(pod)
        out["metadata"].setdefault("labels", {}).update(self.labels)
        if self.scheduler_name is not None:
            out["spec"]["schedulerName"] = self.scheduler_name
        if self.affinity:
            out["spec"]["affinity"] = copy.deepcopy(self.affinity)
        return out


def _role(cluster: Cluster, role: Role) -> RoleSpec:
    spec = cluster.spec.role_spec(role)
    if spec is None:
        raise BuildError(f"cluster {cluster.name} has no {role.value} role")
    return spec


def _instance_name(cluster: Cluster, role: Role, index: int) -> str:
    if index < 0:
        raise BuildError(f"instance index must be >= 0, got {index}")
    return names.instance_name(cluster.name, role, index, compute_template_hash(cluster.spec, role))


def build_pod_group(cluster: Cluster, role: Role, index: int) -> Manifest | None:
    """The PodGroup of instance `index` of `role`; None unless `scheduling.gang: podGroup`."""
    spec = _role(cluster, role)
    if spec.scheduling.gang is not GangScheduling.pod_group:
        return None
    template = compute_template_hash(cluster.spec, role)
    return {
        "apiVersion": POD_GROUP_API_VERSION,
        "kind": POD_GROUP_KIND,
        "metadata": meta.object_meta(
            cluster.ref,
            _instance_name(cluster, role, index),
            component="pod-group",
            labels={
                names.LABEL_ROLE: role.value,
                names.LABEL_INSTANCE_INDEX: str(index),
                names.LABEL_TEMPLATE: template,
            },
        ),
        "spec": {"minMember": spec.pod_layout.num_pods},
    }


def _topology_key(cluster: Cluster, role: Role) -> str | None:
    key: str | None = _role(cluster, role).placement.topology_key
    return key


def _placement_affinity(cluster: Cluster, role: Role, index: int) -> dict[str, Any]:
    """The pod affinity terms `placement.topologyKey` asks for (none when unset)."""
    affinity: dict[str, Any] = {}
    own_key = _topology_key(cluster, role)
    if own_key is not None:
        template = compute_template_hash(cluster.spec, role)
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = [
            {
                "labelSelector": {
                    "matchLabels": names.instance_selector(cluster.name, role, index, template)
                },
                "topologyKey": own_key,
            }
        ]
    if role is Role.decode and cluster.spec.prefill is not None:
        prefer_key = own_key or _topology_key(cluster, Role.prefill)
        if prefer_key is not None:
            affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
                {
                    "weight": PREFER_PREFILL_WEIGHT,
                    "podAffinityTerm": {
                        "labelSelector": {
                            "matchLabels": names.role_selector(cluster.name, Role.prefill)
                        },
                        "topologyKey": prefer_key,
                    },
                }
            ]
    return affinity


def _merged_affinity(user: dict[str, Any], pod_affinity: dict[str, Any]) -> dict[str, Any]:
    """The user's affinity with our podAffinity terms appended to theirs."""
    merged = copy.deepcopy(user)
    if not pod_affinity:
        return merged
    section = merged.get("podAffinity")
    if section is not None and not isinstance(section, dict):
        raise BuildError("affinity.podAffinity must be a mapping")
    section = merged.setdefault("podAffinity", {})
    for kind, terms in pod_affinity.items():
        given = section.get(kind, [])
        if not isinstance(given, list):
            raise BuildError(f"affinity.podAffinity.{kind} must be a list")
        section[kind] = [*given, *terms]
    return merged


def build_pod_scheduling(cluster: Cluster, role: Role, index: int) -> PodScheduling:
    """The gang-scheduling and placement fields of every pod of instance `index`."""
    spec = _role(cluster, role)
    labels: dict[str, str] = {}
    if spec.scheduling.gang is GangScheduling.pod_group:
        labels[names.LABEL_POD_GROUP] = _instance_name(cluster, role, index)
    return PodScheduling(
        labels=labels,
        scheduler_name=spec.scheduling.scheduler_name,
        affinity=_merged_affinity(spec.affinity, _placement_affinity(cluster, role, index)),
    )
