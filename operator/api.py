"""The PDCluster API as the operator serves it: resource identity and status models.

The spec models live in `pdcluster.runtime.spec` (local mode and pods read
them too); the status is the operator's alone and lives here. Both feed the
CRD generator, so the schema the apiserver enforces is the schema the code
reads.

Status times are RFC 3339 strings with whole seconds (what Kubernetes
writes), so a status computed twice in the same second is byte-identical
and is not written again.

Pure module.
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pdcluster.runtime.spec import API_GROUP, API_VERSION, KIND, Role

GROUP = API_GROUP
VERSION = API_VERSION
PLURAL = "pdclusters"
SINGULAR = "pdcluster"
SHORT_NAMES = ("pdc",)
CRD_NAME = f"{PLURAL}.{GROUP}"
API_VERSION_FULL = f"{GROUP}/{VERSION}"
__all__ = [
    "GROUP",
    "VERSION",
    "KIND",
    "PLURAL",
    "Condition",
    "ConditionType",
    "Phase",
    "PDClusterStatus",
    "RoleStatus",
    "RouterStatus",
    "InstanceBackoff",
    "KVTransportStatus",
    "RoleAutoscalingStatus",
    "RoleScalerSpec",
    "RoleScalerStatus",
    "SCALER_KIND",
    "SCALER_PLURAL",
]

# The per-role scale target: one PDClusterRoleScaler per role of a PDCluster,
# with a /scale subresource, so kubectl scale, an HPA or KEDA drive one role.
SCALER_KIND = "PDClusterRoleScaler"
SCALER_PLURAL = "pdclusterrolescalers"
SCALER_SINGULAR = "pdclusterrolescaler"
SCALER_SHORT_NAMES = ("pdcrs",)
SCALER_CRD_NAME = f"{SCALER_PLURAL}.{GROUP}"


class _StatusModel(BaseModel):
    # Unknown status fields (another writer's) are ignored when read back.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )


class ConditionType(StrEnum):
    Ready = "Ready"
    Progressing = "Progressing"
    Degraded = "Degraded"


class Phase(StrEnum):
    """One-word summary shown by `kubectl get pdc`."""

    Pending = "Pending"
    Progressing = "Progressing"
    Ready = "Ready"
    Degraded = "Degraded"
    Failed = "Failed"


class Condition(_StatusModel):
    type: ConditionType
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str = Field(min_length=1, max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str = Field(description="RFC 3339, when status last changed")
    observed_generation: int = Field(default=0, ge=0)


class InstanceBackoff(_StatusModel):
    """Restart bookkeeping of one instance that failed since it was last Ready."""

    index: int = Field(ge=0)
    consecutive_restarts: int = Field(ge=1, description="restarts since the instance was Ready")
    last_restart_time: str = Field(description="RFC 3339")


class KVTransportStatus(_StatusModel):
    """The KV transport the role's workers negotiated (their `/get_server_info`)."""

    backend: str = Field(description="KV backend the workers run (tcp, shm, nixl)")
    ucx_transports: list[str] = Field(
        default_factory=list, description="nixl: UCX transports on the lanes to peers, e.g. tcp"
    )
    ucx_devices: list[str] = Field(
        default_factory=list, description="nixl: transport/device of those lanes, e.g. tcp/lo"
    )
    tcp_fallback: bool = Field(
        default=False, description="peers reached over lanes none of which is RDMA or GPU-direct"
    )
    rdma_requested: bool = Field(
        default=False, description="the manifest asks for RDMA or GPU-direct (spec.transfer.ucx)"
    )
    reported: int = Field(default=0, ge=0, description="worker pods whose report this is")

    @property
    def is_rdma_missing(self) -> bool:
        return self.rdma_requested and self.tcp_fallback


# status.<role>.autoscaling.recommendations holds at most this many points (a few KiB).
MAX_AUTOSCALING_RECOMMENDATIONS = 128


class AutoscalingRecommendation(_StatusModel):
    """One point of the planner's recommendation step function (`autoscale/planner.py`)."""

    time: str = Field(description="RFC 3339 with milliseconds, when it was recommended")
    replicas: int = Field(ge=0, description="the replicas recommended from then on")


class RoleAutoscalingStatus(_StatusModel):
    """The built-in autoscaler's last decision for one role (`autoscale/step.py`)."""

    metric: str = Field(description="the target's metric, e.g. ttftP90Seconds")
    target: float = Field(description="the metric's target value")
    last_value: float | None = Field(
        default=None, description="the last value measured (kept while samples are missing)"
    )
    last_value_time: str | None = Field(default=None, description="RFC 3339, when it was measured")
    current: int = Field(ge=0, description="replicas when the decision was made")
    desired: int = Field(ge=0, description="replicas decided")
    reason: str = Field(min_length=1, description="ScaleUp, ScaleDown, MetricMissing, ...")
    message: str = Field(default="", max_length=1024)
    last_decision_time: str = Field(description="RFC 3339")
    last_scale_time: str | None = Field(
        default=None, description="RFC 3339, when the autoscaler last changed replicas"
    )
    source: str | None = Field(
        default=None,
        description=(
            "where the metric is read: router (the router's /metrics: prefill ttftP90Seconds) "
            "or workers (the Ready instances' /metrics)"
        ),
    )
    recommendations: list[AutoscalingRecommendation] | None = Field(
        default=None,
        max_length=MAX_AUTOSCALING_RECOMMENDATIONS,
        description=(
            "the planner's stabilization windows (autoscale/persisted.py), restored when the "
            "operator restarts; absent: the windows start afresh"
        ),
    )


# status.<role>.instances lists at most this many instances (the lowest slots first).
MAX_STATUS_INSTANCES = 256


class PodRanks(_StatusModel):
    """The global ranks one pod runs: first to last, both included (contiguous)."""

    first: int = Field(ge=0, description="the pod's lowest global rank")
    last: int = Field(ge=0, description="the pod's highest global rank")


class InstancePodStatus(_StatusModel):
    """One pod of an instance, as the operator last observed it."""

    name: str
    index: int = Field(ge=0, description="pod index in the instance (0: the leader)")
    phase: str = Field(description="the pod's phase (Pending, Running, Failed, ...)")
    ready: bool = Field(default=False, description="the pod's Ready condition")
    ranks: PodRanks | None = Field(
        default=None,
        description=(
            "the global ranks the pod runs (pod k of G ranks each: k*G to k*G+G-1), read "
            "from the pod itself; absent when its spec does not state them"
        ),
    )


class InstanceStatus(_StatusModel):
    """One instance of a role: its pods and whether it serves."""

    index: int = Field(ge=0, description="the instance slot")
    template_hash: str = Field(description="the role template the instance was built from")
    ready: bool = Field(
        default=False, description="every pod is Ready (the leader only once every rank joined)"
    )
    health: str = Field(description="ready, starting, incomplete, broken or terminating")
    message: str = Field(default="", max_length=1024)
    pods: list[InstancePodStatus] = Field(default_factory=list)


class RoleStatus(_StatusModel):
    desired: int = Field(default=0, ge=0, description="instances asked for")
    ready: int = Field(default=0, ge=0, description="instance slots served by a Ready instance")
    updated: int = Field(default=0, ge=0, description="Ready instances at the current template")
    summary: str = Field(default="0/0", description="ready/desired, for printer columns")
    template_hash: str = ""
    restarts: int = Field(default=0, ge=0, description="gang restarts since creation")
    restarts_in_window: int = Field(default=0, ge=0, description="restarts in the budget window")
    budget_window_start: str | None = Field(default=None, description="RFC 3339")
    backoff: list[InstanceBackoff] = Field(default_factory=list)
    kv_transport: KVTransportStatus | None = None
    autoscaling: RoleAutoscalingStatus | None = None
    instances: list[InstanceStatus] = Field(
        default_factory=list,
        max_length=MAX_STATUS_INSTANCES,
        description="the role's instances (every template) and their pods, by slot",
    )


class RouterStatus(_StatusModel):
    desired: int = Field(default=0, ge=0)
    ready: int = Field(default=0, ge=0)
    summary: str = "0/0"


class PDClusterStatus(_StatusModel):
    observed_generation: int = Field(default=0, ge=0)
    phase: Phase = Phase.Pending
    revision: str = Field(default="", description="compatibility revision of the current spec")
    conditions: list[Condition] = Field(default_factory=list)
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    colocated: RoleStatus | None = None
    router: RouterStatus | None = None
    # The scale subresource reads these (kubectl scale acts on decode).
    replicas: int = Field(default=0, ge=0, description="decode instances that exist")
    selector: str = Field(default="", description="label selector of the decode pods")

    def condition(self, kind: ConditionType) -> Condition | None:
        return next((c for c in self.conditions if c.type == kind), None)

    def role(self, name: str) -> RoleStatus | None:
        value: RoleStatus | None = getattr(self, name)
        return value

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class _SpecModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class RoleScalerSpec(_SpecModel):
    """Desired replicas of one role of a PDCluster; the /scale subresource's `spec.replicas`."""

    cluster: str = Field(
        min_length=1, max_length=63, description="the PDCluster (same namespace) it scales"
    )
    role: Role = Field(description="the role it scales")
    replicas: int = Field(ge=0, le=1024, description="instances of the role")


class RoleScalerStatus(_StatusModel):
    """Observed state of a scaler, written by the operator."""

    replicas: int = Field(default=0, ge=0, description="instances of the role that exist")
    selector: str = Field(default="", description="label selector of the role's pods")
    synced_replicas: int | None = Field(
        default=None,
        ge=0,
        description="replicas the PDCluster and the scaler agreed on at the last sync",
    )

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def parse_status(raw: Any) -> PDClusterStatus:
    """Read a stored status; anything unreadable counts as no status at all."""
    if not isinstance(raw, dict):
        return PDClusterStatus()
    try:
        return PDClusterStatus.model_validate(raw)
    except ValueError:
        return PDClusterStatus()


def format_time(epoch_seconds: float) -> str:
    moment = dt.datetime.fromtimestamp(int(epoch_seconds), tz=dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    """Inverse of `format_time`; raises ValueError on anything else."""
    moment = dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    return moment.timestamp()


def read_api_time(value: Any, *, naive_is_utc: bool) -> float | None:
    """Epoch seconds of an RFC 3339 time as the API server writes it (with or
    without fractions); None when absent or unreadable. A time without a zone
    is read as UTC when `naive_is_utc`, else it is unreadable."""
    if not isinstance(value, str):
        return None
    try:
        moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        if not naive_is_utc:
            return None
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()
