"""What a reconcile decided to do: plain values the executor carries out in order.

Every new object is *created*: a plain create fails on an existing name
rather than taking over an object someone else made. Cluster-wide children
we already own are *applied* (server-side apply: idempotent, updates in
place), carrying the uid the planner saw, so an apply never lands on a
different object that took the name. Instance members — pods and bootstrap
Services — are only ever created: pods are immutable, a template change
rolls the instance instead. Deletes carry the uid the planner saw, so a delete never
hits a newer object that reused the name.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pdcluster.operator.builders.meta import Manifest, ObjectKey, object_key


class EventType(StrEnum):
    Normal = "Normal"
    Warning = "Warning"


class Reason(StrEnum):
    """Event reasons on the PDCluster (also condition reasons where they fit)."""

    InstanceCreated = "InstanceCreated"
    InstanceReplaced = "InstanceReplaced"
    InstanceRemoved = "InstanceRemoved"
    InstanceRestarted = "InstanceRestarted"
    RestartBudgetExhausted = "RestartBudgetExhausted"
    ForeignObject = "ForeignObject"
    InvalidSpec = "InvalidSpec"
    TokenSecretMissing = "TokenSecretMissing"
    # `gang: podGroup`, but the apiserver serves no PodGroups (no CRD, no RBAC grant).
    PodGroupUnavailable = "PodGroupUnavailable"
    ApplyFailed = "ApplyFailed"
    # The namespace's Pod Security admission refused pods: the level they need.
    PodSecurityRefused = "PodSecurityRefused"
    # Refused by the operator's policy (`policy.py`): nothing is changed.
    ImageNotAllowed = "ImageNotAllowed"
    SecretNotAllowed = "SecretNotAllowed"
    # Failover fast path (pod watch); emitted by the failover module.
    PrefillInstanceLost = "PrefillInstanceLost"
    DecodeInstanceLost = "DecodeInstanceLost"
    RoomsFailed = "RoomsFailed"
    # A prefill instance whose ranks stay unregistered with its bootstrap server.
    InstanceUnregistered = "InstanceUnregistered"
    # The manifest asks for RDMA / GPU-direct, but nixl's UCX moves KV over TCP.
    KVTransportFallback = "KVTransportFallback"


@dataclass(frozen=True)
class _ManifestWrite:
    """A write that carries the whole object; its key is the manifest's."""

    manifest: Manifest

    @property
    def key(self) -> ObjectKey:
        return object_key(self.manifest)


@dataclass(frozen=True)
class Apply(_ManifestWrite):
    """Server-side apply (with force) of an object we own, whose uid is `uid`."""

    uid: str = ""


@dataclass(frozen=True)
class Create(_ManifestWrite):
    pass


@dataclass(frozen=True)
class CreateTokenSecret:
    """Create the cluster token Secret with a fresh random token (the executor draws it)."""

    name: str


@dataclass(frozen=True)
class Delete:
    key: ObjectKey
    uid: str
    # Seconds the object's processes get to stop (a pod's drain); None: its own setting.
    grace_period_s: int | None = None


@dataclass(frozen=True)
class Emit:
    type: EventType
    reason: Reason
    message: str
    # The role concerned, for metrics labels; None for cluster-wide events.
    role: str | None = None


Action = Apply | Create | CreateTokenSecret | Delete | Emit
