"""What the operator found in the cluster, as typed read-only views.

The I/O layer lists objects and hands the raw dicts here; the planner only
ever sees these views. Parsing is lenient about what other controllers
write (a missing status, an unknown phase) and strict about ownership: an
object is ours only when its *controller* owner reference carries our
PDCluster's uid — a matching name or label is never enough.

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.api import read_api_time
from pdcluster.operator.builders.meta import ObjectKey
from pdcluster.runtime.spec import Role


@dataclass(frozen=True)
class ObservedObject:
    key: ObjectKey
    uid: str
    controller_uid: str | None
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    terminating: bool

    def is_owned_by(self, owner_uid: str) -> bool:
        return self.controller_uid == owner_uid


@dataclass(frozen=True)
class ObservedPod:
    obj: ObservedObject
    role: Role
    instance: int
    pod_index: int
    template_hash: str
    instance_size: int | None
    phase: str
    ready: bool
    pod_ip: str | None = None
    # Passed its startup probe (every container `started`): for a leader, the gang formed.
    started: bool = False
    # A pod k > 0: the leader IP it was started with (None: not recorded, or the leader).
    leader_address: str | None = None
    # Running and not Ready: when its Ready condition last changed (lastTransitionTime,
    # epoch seconds); None otherwise, or when the status does not say.
    not_ready_since: float | None = None
    # The global ranks it runs, from its container's env (None: not stated).
    ranks: range | None = None
    # Ended: the last line its failed container left (termination message or,
    # with FallbackToLogsOnError, its log), e.g. which model source it missed.
    exit_message: str | None = None

    @property
    def name(self) -> str:
        name: str = self.obj.key.name
        return name

    @property
    def has_ended(self) -> bool:
        """The container exited for good (restartPolicy Never): the rank is gone."""
        return self.phase in ("Failed", "Succeeded")


class PodGroupApi(StrEnum):
    """Whether the apiserver let the operator list scheduler-plugins PodGroups."""

    served = "served"
    # The list answered 404: no PodGroup CRD (scheduling.x-k8s.io) is installed.
    not_installed = "not_installed"
    # The list answered 403: the operator's RBAC does not grant podgroups.
    forbidden = "forbidden"


@dataclass(frozen=True)
class Observed:
    objects: Mapping[ObjectKey, ObservedObject]
    # Worker pods owned by this cluster whose identity labels parse.
    pods: tuple[ObservedPod, ...]
    router_ready_replicas: int = 0
    # Not `served`: no PodGroup is in `objects`, and none can be created.
    pod_group_api: PodGroupApi = PodGroupApi.served

    def get(self, key: ObjectKey) -> ObservedObject | None:
        return self.objects.get(key)


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): str(v) for k, v in value.items()}


def _controller_uid(meta: Mapping[str, Any]) -> str | None:
    refs = meta.get("ownerReferences")
    if not isinstance(refs, list):
        return None
    for ref in refs:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            uid = ref.get("uid")
            return uid if isinstance(uid, str) else None
    return None


def parse_object(raw: Mapping[str, Any]) -> ObservedObject | None:
    """A view of any object; None when it lacks kind or name."""
    meta = raw.get("metadata")
    kind = raw.get("kind")
    if not isinstance(meta, Mapping) or not isinstance(kind, str):
        return None
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    uid = meta.get("uid")
    return ObservedObject(
        key=ObjectKey(kind, name),
        uid=uid if isinstance(uid, str) else "",
        controller_uid=_controller_uid(meta),
        labels=_str_map(meta.get("labels")),
        annotations=_str_map(meta.get("annotations")),
        terminating=meta.get("deletionTimestamp") is not None,
    )


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    value = labels.get(key, "")
    return int(value) if value.isdigit() else None


def _is_ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )


def _time(text: Any) -> float | None:
    # A time without a zone could be any moment: no grace counts from it.
    return read_api_time(text, naive_is_utc=False)


def _ready_changed_at(status: Mapping[str, Any]) -> float | None:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return None
    for condition in conditions:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return _time(condition.get("lastTransitionTime"))
    return None


def _pod_ranks(raw: Mapping[str, Any]) -> range | None:
    """The ranks the builder put in the worker container's env, when both values parse."""
    spec = raw.get("spec")
    containers = spec.get("containers") if isinstance(spec, Mapping) else None
    if not isinstance(containers, list):
        return None
    for container in containers:
        if not isinstance(container, Mapping) or not isinstance(container.get("env"), list):
            continue
        env = {e.get("name"): e.get("value") for e in container["env"] if isinstance(e, Mapping)}
        first, count = env.get(names.ENV_FIRST_RANK), env.get(names.ENV_RANKS_PER_POD)
        if isinstance(first, str) and isinstance(count, str) and first.isdigit():
            if count.isdigit() and int(count) > 0:
                return range(int(first), int(first) + int(count))
    return None


def _has_started(status: Mapping[str, Any]) -> bool:
    containers = status.get("containerStatuses")
    if not isinstance(containers, list) or not containers:
        return False
    return all(isinstance(c, Mapping) and c.get("started") is True for c in containers)


def parse_pod(obj: ObservedObject, raw: Mapping[str, Any]) -> ObservedPod | None:
    """A worker pod view; None when its identity labels are missing or malformed."""
    labels = obj.labels
    try:
        role = Role(labels.get(names.LABEL_ROLE, ""))
    except ValueError:
        return None
    instance = _int_label(labels, names.LABEL_INSTANCE_INDEX)
    pod_index = _int_label(labels, names.LABEL_POD_INDEX)
    template_hash = labels.get(names.LABEL_TEMPLATE, "")
    if instance is None or pod_index is None or not template_hash:
        return None
    size_text = obj.annotations.get(names.ANNOTATION_INSTANCE_SIZE, "")
    status = raw.get("status")
    status = status if isinstance(status, Mapping) else {}
    phase = status.get("phase")
    ready = phase == "Running" and _is_ready(status)
    return ObservedPod(
        obj=obj,
        role=role,
        instance=instance,
        pod_index=pod_index,
        template_hash=template_hash,
        instance_size=int(size_text) if size_text.isdigit() and int(size_text) > 0 else None,
        phase=phase if isinstance(phase, str) else "Pending",
        ready=ready,
        pod_ip=pod_ip if isinstance(pod_ip := status.get("podIP"), str) and pod_ip else None,
        started=phase == "Running" and _has_started(status),
        leader_address=obj.annotations.get(names.ANNOTATION_LEADER_ADDRESS) or None,
        not_ready_since=_ready_changed_at(status) if phase == "Running" and not ready else None,
        ranks=_pod_ranks(raw),
        exit_message=_exit_message(status),
    )


# An Event message quotes at most this much of a container's last words.
MAX_EXIT_MESSAGE = 300


def _exit_message(status: Mapping[str, Any]) -> str | None:
    """The last non-empty line of the first terminated container's message."""
    for key in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(key) or []:
            if not isinstance(container, Mapping):
                continue
            terminated = (container.get("state") or {}).get("terminated") or {}
            message = terminated.get("message") if isinstance(terminated, Mapping) else None
            if isinstance(message, str) and terminated.get("exitCode") not in (0, None):
                lines = [line.strip() for line in message.splitlines() if line.strip()]
                if lines:
                    return lines[-1][-MAX_EXIT_MESSAGE:]
    return None


def observe(
    raw_objects: Iterable[Mapping[str, Any]],
    owner_uid: str,
    router_name: str,
    pod_group_api: PodGroupApi = PodGroupApi.served,
) -> Observed:
    """Build the planner's view from raw API objects (any kinds, any owners);
    `pod_group_api`: how the PodGroup list went."""
    objects: dict[ObjectKey, ObservedObject] = {}
    pods: list[ObservedPod] = []
    router_ready = 0
    for raw in raw_objects:
        obj = parse_object(raw)
        if obj is None:
            continue
        objects[obj.key] = obj
        if not obj.is_owned_by(owner_uid):
            continue
        if obj.key.kind == "Pod":
            pod = parse_pod(obj, raw)
            if pod is not None:
                pods.append(pod)
        elif obj.key == ObjectKey("Deployment", router_name):
            status = raw.get("status")
            ready = status.get("readyReplicas") if isinstance(status, Mapping) else None
            router_ready = ready if isinstance(ready, int) else 0
    pods.sort(key=lambda p: (p.role.value, p.instance, p.template_hash, p.pod_index))
    return Observed(
        objects=objects,
        pods=tuple(pods),
        router_ready_replicas=router_ready,
        pod_group_api=pod_group_api,
    )
