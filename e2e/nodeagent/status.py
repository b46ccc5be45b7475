"""Pod status from the agent's view of its containers, as the kubelet computes it.

Pure. The phase follows the kubelet's rules: a container waiting to restart
after a crash counts as stopped, not as waiting; under restartPolicy Always a
pod whose containers all stopped is still Running (they come back). Condition
transition times change only when a condition's status changes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Waiting:
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Running:
    started_at: float


@dataclass(frozen=True)
class Terminated:
    exit_code: int
    reason: str  # Completed (exit 0) or Error, as the kubelet says
    started_at: float
    finished_at: float
    signal: int | None = None
    message: str = ""


ContainerState = Waiting | Running | Terminated


@dataclass(frozen=True)
class ContainerView:
    name: str
    image: str
    state: ContainerState
    last_state: Terminated | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    container_id: str = ""


@dataclass(frozen=True)
class PodView:
    restart_policy: str
    host_ip: str
    pod_ip: str | None
    start_time: float | None
    init_containers: tuple[ContainerView, ...]
    containers: tuple[ContainerView, ...]


# Condition type -> (status, lastTransitionTime as epoch seconds).
ConditionMemory = Mapping[str, tuple[str, float]]

CONDITION_TYPES = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def terminated_reason(exit_code: int) -> str:
    return "Completed" if exit_code == 0 else "Error"


def rfc3339(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_init_done(view: PodView) -> bool:
    return all(
        isinstance(c.state, Terminated) and c.state.exit_code == 0 for c in view.init_containers
    )


def compute_phase(view: PodView) -> str:
    if not is_init_done(view):
        failed_for_good = view.restart_policy == "Never" and any(
            isinstance(c.state, Terminated) and c.state.exit_code != 0 for c in view.init_containers
        )
        return "Failed" if failed_for_good else "Pending"
    num_waiting = num_running = num_stopped = num_succeeded = 0
    for container in view.containers:
        state = container.state
        if isinstance(state, Running):
            num_running += 1
        elif isinstance(state, Terminated):
            num_stopped += 1
            num_succeeded += state.exit_code == 0
        elif container.last_state is not None:
            num_stopped += 1  # waiting to restart after an exit
        else:
            num_waiting += 1
    if num_waiting > 0:
        return "Pending"
    if num_running > 0:
        return "Running"
    if num_stopped == 0:
        return "Pending"
    all_succeeded = num_succeeded == num_stopped
    if view.restart_policy == "Always":
        return "Running"
    if view.restart_policy == "OnFailure":
        return "Succeeded" if all_succeeded else "Running"
    return "Succeeded" if all_succeeded else "Failed"


def _condition_values(view: PodView, phase: str) -> dict[str, tuple[str, str, str]]:
    """type -> (status, reason, message); reason/message empty when status is True."""
    init_done = is_init_done(view)
    unready = [c.name for c in view.containers if not c.ready]
    terminal = phase in ("Succeeded", "Failed")
    values = {
        "PodReadyToStartContainers": ("True", "", "") if view.pod_ip else ("False", "", ""),
        "Initialized": ("True", "", "")
        if init_done
        else (
            "False",
            "ContainersNotInitialized",
            "containers with incomplete status: "
            + str([c.name for c in view.init_containers if not isinstance(c.state, Terminated)]),
        ),
    }
    if terminal:
        ready = ("False", "PodCompleted", "")
    elif unready:
        ready = ("False", "ContainersNotReady", f"containers with unready status: {unready}")
    else:
        ready = ("True", "", "")
    values["ContainersReady"] = ready
    values["Ready"] = ready
    return values


def compute_conditions(
    view: PodView, phase: str, memory: ConditionMemory, now: float
) -> tuple[list[dict[str, Any]], dict[str, tuple[str, float]]]:
    """Conditions for the status, and the memory to pass next time."""
    conditions: list[dict[str, Any]] = []
    new_memory: dict[str, tuple[str, float]] = {}
    for kind, (status, reason, message) in _condition_values(view, phase).items():
        previous = memory.get(kind)
        since = previous[1] if previous is not None and previous[0] == status else now
        new_memory[kind] = (status, since)
        condition: dict[str, Any] = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": rfc3339(since),
        }
        if reason:
            condition["reason"] = reason
        if message:
            condition["message"] = message
        conditions.append(condition)
    return conditions, new_memory


def _state_dict(state: ContainerState) -> dict[str, Any]:
    if isinstance(state, Waiting):
        waiting: dict[str, Any] = {"reason": state.reason}
        if state.message:
            waiting["message"] = state.message
        return {"waiting": waiting}
    if isinstance(state, Running):
        return {"running": {"startedAt": rfc3339(state.started_at)}}
    terminated: dict[str, Any] = {
        "exitCode": state.exit_code,
        "reason": state.reason,
        "startedAt": rfc3339(state.started_at),
        "finishedAt": rfc3339(state.finished_at),
    }
    if state.signal is not None:
        terminated["signal"] = state.signal
    if state.message:
        terminated["message"] = state.message
    return {"terminated": terminated}


def container_status(container: ContainerView) -> dict[str, Any]:
    status: dict[str, Any] = {
        "name": container.name,
        "image": container.image,
        "imageID": "",
        "ready": container.ready,
        "restartCount": container.restart_count,
        "started": container.started,
        "state": _state_dict(container.state),
        "lastState": _state_dict(container.last_state) if container.last_state else {},
    }
    if container.container_id:
        status["containerID"] = container.container_id
    return status


def build_pod_status(
    view: PodView, memory: ConditionMemory, now: float
) -> tuple[dict[str, Any], dict[str, tuple[str, float]]]:
    """The `status` to write for the pod (PodScheduled is the scheduler's and is left out)."""
    phase = compute_phase(view)
    conditions, new_memory = compute_conditions(view, phase, memory, now)
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": view.host_ip,
        "hostIPs": [{"ip": view.host_ip}],
        "initContainerStatuses": [container_status(c) for c in view.init_containers],
        "containerStatuses": [container_status(c) for c in view.containers],
    }
    if view.pod_ip:
        status["podIP"] = view.pod_ip
        status["podIPs"] = [{"ip": view.pod_ip}]
    if view.start_time is not None:
        status["startTime"] = rfc3339(view.start_time)
    return status, new_memory
