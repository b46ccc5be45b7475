"""One PDCluster as the operator sees it: identity plus the validated spec.

Every pure step (builders, planner, status) takes this object, so none of
them re-parses the raw body or reads a field the validation did not check.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcluster.operator.api import API_VERSION_FULL, KIND
from pdcluster.runtime.spec import PDClusterSpec, SpecError, parse_spec


@dataclass(frozen=True)
class ClusterRef:
    """Identity of the PDCluster object; owner of every child."""

    name: str
    namespace: str
    uid: str
    generation: int = 0

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION_FULL,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class Cluster:
    ref: ClusterRef
    spec: PDClusterSpec

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def namespace(self) -> str:
        return self.ref.namespace


def ref_from_body(body: Mapping[str, Any]) -> ClusterRef:
    """Identity from a raw object; raises SpecError when a field is missing."""
    meta = body.get("metadata")
    if not isinstance(meta, Mapping):
        raise SpecError("PDCluster object has no metadata")
    name, namespace, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
    if not (isinstance(name, str) and name):
        raise SpecError("PDCluster object has no metadata.name")
    if not (isinstance(namespace, str) and namespace):
        raise SpecError(f"PDCluster {name} has no metadata.namespace")
    if not (isinstance(uid, str) and uid):
        raise SpecError(f"PDCluster {namespace}/{name} has no metadata.uid")
    generation = meta.get("generation", 0)
    return ClusterRef(
        name=name,
        namespace=namespace,
        uid=uid,
        generation=generation if isinstance(generation, int) else 0,
    )


def cluster_from_body(body: Mapping[str, Any]) -> Cluster:
    """Validate a PDCluster object as read from the API; raises SpecError."""
    ref = ref_from_body(body)
    if len(ref.name) > 63 or "." in ref.name:
        raise SpecError(f"metadata.name {ref.name!r} must be a DNS label (<= 63, no dots)")
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError(f"PDCluster {ref.namespace}/{ref.name} has no spec")
    return Cluster(ref=ref, spec=parse_spec(dict(spec)))


def with_operator_defaults(cluster: Cluster, otlp_endpoint: str) -> Cluster:
    """The cluster with what the operator's settings fill in: the chart's OTLP
    collector for a cluster that turns tracing on and names no endpoint."""
    tracing = cluster.spec.observability.tracing
    if not otlp_endpoint or not tracing.enabled or tracing.endpoint is not None:
        return cluster
    observability = cluster.spec.observability.model_copy(
        update={"tracing": tracing.model_copy(update={"endpoint": otlp_endpoint})}
    )
    spec = cluster.spec.model_copy(update={"observability": observability})
    return Cluster(cluster.ref, spec)
