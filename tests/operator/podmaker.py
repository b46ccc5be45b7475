"""Worker pod objects as the API would return them, for the failover tests."""

from __future__ import annotations

import copy
import time
from typing import Any

from pdcluster.operator.api import format_time
from pdcluster.operator.builders import build_worker_pod
from pdcluster.operator.failover.pod_facts import PodFacts, parse_pod_facts
from pdcluster.runtime.spec import Role

from .helpers import PD, make_cluster

T0 = "2026-01-01T00:00:00Z"


def worker_pod(
    role: Role,
    index: int = 0,
    *,
    uid: str | None = None,
    ip: str | None = "127.0.0.10",
    phase: str = "Running",
    ready: bool = True,
    ready_changed: str = T0,
    http_port: int | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A pod the operator built, with the status a kubelet would write."""
    pod = copy.deepcopy(build_worker_pod(make_cluster(spec or PD), role, index, 0))
    meta = pod["metadata"]
    meta["uid"] = uid or f"uid-{role.value}-{index}"
    # Created now: after any operator a test starts, so its failures are news.
    meta["creationTimestamp"] = format_time(time.time() + 1)
    if http_port is not None:
        meta["annotations"]["pdcluster.io/http-port"] = str(http_port)
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "lastTransitionTime": ready_changed,
            }
        ],
    }
    if ip:
        status["podIP"] = ip
    pod["status"] = status
    return pod


def facts(raw: dict[str, Any]) -> PodFacts:
    """What the failover loop reads from a worker pod (one the operator built)."""
    pod = parse_pod_facts(raw)
    assert pod is not None
    return pod


def terminated(pod: dict[str, Any], finished: str = "2026-01-01T00:01:00Z") -> dict[str, Any]:
    """The same pod after its container exited (restartPolicy Never)."""
    out = copy.deepcopy(pod)
    out["status"]["phase"] = "Failed"
    out["status"]["conditions"][0]["status"] = "False"
    out["status"]["containerStatuses"] = [
        {"name": "worker", "state": {"terminated": {"exitCode": 137, "finishedAt": finished}}}
    ]
    return out


def deleting(
    pod: dict[str, Any], at: str = "2026-01-01T00:02:30Z", grace: int = 30
) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["metadata"]["deletionTimestamp"] = at
    out["metadata"]["deletionGracePeriodSeconds"] = grace
    return out


def not_ready(pod: dict[str, Any], changed: str = "2026-01-01T00:03:00Z") -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["status"]["conditions"][0].update(status="False", lastTransitionTime=changed)
    return out
