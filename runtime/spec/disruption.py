"""How instances go away on purpose: rollouts, node drains and the drain budget.

- `rollout` (per role): `maxSurge: 1, maxUnavailable: 0` (the default) starts
  a replacement beside the old instance and retires the old one once the new
  one is Ready: capacity holds, at the price of one spare instance's GPUs.
  `maxSurge: 0, maxUnavailable: 1` replaces in place: the old instance
  drains and goes first, then the new one starts in its GPUs — for a full
  cluster. Both may not be 0.
- `disruptionBudget` (per role and the router): a PodDisruptionBudget over
  the role's pods, so an eviction (a node drain) never takes more than
  `maxUnavailable` instances, nor the last one of the role (a role of one
  instance blocks the drain of its node until it is moved).
- `drain` (per role and the router): how long a pod that was asked to stop
  may finish its requests. Left out, the router's request timeout: a
  request admitted just before the stop may run that long. The pod's
  `terminationGracePeriodSeconds` is this plus `DRAIN_MARGIN_SECONDS`
  (stopping the ranks, flushing), so the kubelet never cuts a drain short.
  A worker's drain starts with an announcement (`drain.announceSeconds`, per
  role): on Kubernetes a worker pod asked to stop first keeps taking
  requests for that long while its /health says Not Ready, so every router
  (ours watches the pod; others follow readiness or Endpoints) has stopped
  sending it new ones before it stops accepting. Without it a request routed
  in the moment between the pod's deletion and the router seeing it meets a
  closed port.

Pure module.
"""

from __future__ import annotations

import math

from pydantic import Field, model_validator

from pdcluster.runtime.spec.base import SpecModel

# Seconds a pod needs after its drain to stop its ranks and exit.
DRAIN_MARGIN_SECONDS = 30


class RolloutSpec(SpecModel):
    max_surge: int = Field(
        default=1, ge=0, le=1024, description="replacement instances started beside old ones"
    )
    max_unavailable: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="old instances drained and removed before their replacement starts",
    )

    @model_validator(mode="after")
    def _some_progress(self) -> RolloutSpec:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError("rollout: maxSurge and maxUnavailable cannot both be 0")
        return self

    @property
    def is_in_place(self) -> bool:
        """No spare capacity: an instance is replaced in the GPUs it held."""
        return self.max_surge == 0


class DisruptionBudgetSpec(SpecModel):
    enabled: bool = True
    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="instances an eviction may take at once (never the role's last one)",
    )

    def min_available_pods(self, replicas: int, pods_per_instance: int) -> int:
        """The budget's minAvailable, in pods: all but `maxUnavailable` pods (an
        evicted pod breaks its whole instance, so a pod stands for an instance),
        and at least every pod of one instance while the role has any."""
        total = replicas * pods_per_instance
        return max(total - self.max_unavailable, min(replicas, 1) * pods_per_instance)


class DrainSpec(SpecModel):
    timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        le=86400,
        description="how long a stopping pod finishes its requests; default: the router's "
        "requestTimeoutSeconds",
    )

    def budget_seconds(self, request_timeout_s: float) -> float:
        return self.timeout_seconds if self.timeout_seconds is not None else request_timeout_s

    def grace_period_seconds(self, request_timeout_s: float) -> int:
        """The pod's terminationGracePeriodSeconds: the drain plus the margin."""
        return math.ceil(self.stop_seconds(request_timeout_s)) + DRAIN_MARGIN_SECONDS

    def stop_seconds(self, request_timeout_s: float) -> float:
        """From the stop signal to the end of the drain."""
        return self.budget_seconds(request_timeout_s)


class WorkerDrainSpec(DrainSpec):
    announce_seconds: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="on Kubernetes: how long a worker pod asked to stop keeps taking requests "
        "before its drain starts, the time routers need to see it go (our workers answer Not "
        "Ready meanwhile; a vLLM pod sleeps in preStop, rounded up to whole seconds)",
    )

    def stop_seconds(self, request_timeout_s: float) -> float:
        return self.announce_seconds + self.budget_seconds(request_timeout_s)
