"""Carries out a plan's actions through the API, in order.

Each action is independent: one failure is recorded and the rest still
run, so a single bad object cannot stall the whole cluster. The caller
retries the pass when any write failed.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdcluster.operator.builders.config import build_token_secret
from pdcluster.operator.builders.meta import Manifest
from pdcluster.operator.kube.client import ApiError, KubeApi
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.reconcile import actions as A
from pdcluster.operator.reconcile.actions import Action
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.operator.reconcile.observed import parse_object
from pdcluster.operator.reconcile.plan import describe

log = logging.getLogger(__name__)
TOKEN_BYTES = 32


@dataclass
class ExecutionResult:
    errors: list[tuple[Action, ApiError]] = field(default_factory=list)
    num_writes: int = 0


def _with_uid(manifest: Manifest, uid: str) -> Manifest:
    """The manifest with `metadata.uid`: the apiserver refuses the apply (422,
    "metadata.uid: field is immutable") when the object under that name is no
    longer the one we own."""
    if not uid:
        return manifest
    return {**manifest, "metadata": {**manifest["metadata"], "uid": uid}}


class Executor:
    def __init__(
        self,
        api: KubeApi,
        recorder: EventRecorder,
        metrics: OperatorMetrics,
        on_pod_delete: Callable[[str], None] | None = None,
    ) -> None:
        self._api = api
        self._recorder = recorder
        self._metrics = metrics
        # Told the uid of every pod the operator deletes itself, before the
        # delete: the failover path then knows the loss was planned.
        self._on_pod_delete = on_pod_delete

    async def run(self, cluster: Cluster, actions: Sequence[Action]) -> ExecutionResult:
        result = ExecutionResult()
        for action in actions:
            if isinstance(action, A.Emit):
                await self._recorder.record(
                    cluster.ref, action.type.value, action.reason.value, action.message
                )
                if action.reason == A.Reason.InstanceRestarted and action.role:
                    self._metrics.restarts.labels(role=action.role, cause="instance_broken").inc()
                continue
            summary = describe(action)
            try:
                await self._perform(cluster, action)
            except ApiError as err:
                self._metrics.errors.labels(op=summary["op"], status=str(err.status)).inc()
                log.warning("%s %s failed: %s", summary["op"], summary.get("object"), err)
                result.errors.append((action, err))
                continue
            result.num_writes += 1
            kind = str(summary.get("object", "")).split("/", 1)[0]
            self._metrics.actions.labels(op=summary["op"], kind=kind).inc()
        return result

    async def _perform(self, cluster: Cluster, action: Action) -> None:
        ns = cluster.namespace
        if isinstance(action, A.Apply):
            await self._api.apply(_with_uid(action.manifest, action.uid))
        elif isinstance(action, A.Create):
            await self._create(cluster, action.manifest, action.key.kind, action.key.name)
        elif isinstance(action, A.CreateTokenSecret):
            manifest = build_token_secret(cluster, secrets.token_urlsafe(TOKEN_BYTES))
            await self._create(cluster, manifest, "Secret", action.name)
        elif isinstance(action, A.Delete):
            if action.key.kind == "Pod" and self._on_pod_delete is not None:
                self._on_pod_delete(action.uid)
            await self._api.delete(
                action.key.kind, ns, action.key.name, action.uid, action.grace_period_s
            )

    async def _create(self, cluster: Cluster, manifest: Manifest, kind: str, name: str) -> None:
        try:
            await self._api.create(manifest)
        except ApiError as err:
            if not err.is_conflict:
                raise
            await self._check_owner(cluster, kind, name)

    async def _check_owner(self, cluster: Cluster, kind: str, name: str) -> None:
        """A create hit an existing name: fine if ours (a race), reported if not."""
        raw = await self._api.get(kind, cluster.namespace, name)
        obj = parse_object(raw) if raw is not None else None
        if obj is not None and not obj.is_owned_by(cluster.ref.uid):
            await self._recorder.record(
                cluster.ref,
                A.EventType.Warning.value,
                A.Reason.ForeignObject.value,
                f"{kind}/{name} already exists and is not owned by PDCluster {cluster.name}; "
                "it is left alone (delete or rename it to let the operator create its own)",
            )
