"""Every kopf handler of the operator, registered in one place.

    kopf run --standalone --all-namespaces -m pdcluster.operator.handlers \
        --liveness=http://0.0.0.0:8080/healthz

Handlers only translate kopf's triggers into work-queue keys; the
reconcile itself lives in `controller.py`. Triggers:
- PDCluster created, changed or found at start-up → reconcile it;
- a labelled child (pod, service, deployment, configmap, networkpolicy, pdb) changed or was
  deleted → reconcile its cluster (deleted children come back);
- the queue re-runs every cluster at the resync interval and at the
  deadlines the planner names (back-off ends, budget windows);
- one asyncio task per PDCluster runs its autoscaling loop
  (`reconcile/autoscaling.py`: the role scalers' sync, the built-in planner)
  at each role's `intervalSeconds`; a change of the PDCluster or of one of
  its PDClusterRoleScalers wakes it.

The failover fast path (`failover.py`: pod lost → tell the peers' admin
endpoints at once) runs in `on_child_pod`, before the reconcile that
restarts the instance is queued.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from prometheus_client import start_http_server

from pdcluster.operator.api import GROUP, PLURAL, SCALER_PLURAL, VERSION
from pdcluster.operator.crd import crdgen
from pdcluster.operator.failover.fast_path import Failover
from pdcluster.operator.kube.client import ApiError, KubeClient, load_credentials
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.names import LABEL_CLUSTER
from pdcluster.operator.reconcile.autoscaling import Autoscaler
from pdcluster.operator.reconcile.controller import Controller
from pdcluster.operator.reconcile.workqueue import WorkQueue
from pdcluster.operator.settings import OperatorSettings

log = logging.getLogger(__name__)
ANNOTATION_PREFIX = "pdcluster.io"
CHILD_LABELS: dict[str, Any] = {LABEL_CLUSTER: kopf.PRESENT}
BATCH_WINDOW_S = 0.02


@dataclass
class Runtime:
    """What the handlers share; created at start-up, kept in kopf's memo."""

    settings: OperatorSettings
    client: KubeClient
    controller: Controller
    queue: WorkQueue[tuple[str, str]]
    failover: Failover
    autoscaler: Autoscaler
    tasks: tuple[asyncio.Task[None], ...]


def _runtime(memo: kopf.Memo) -> Runtime:
    runtime = memo.get("pdcluster")
    if not isinstance(runtime, Runtime):
        raise kopf.TemporaryError("operator is still starting", delay=1)
    return runtime


async def apply_crd(client: KubeClient, timeout_s: float = 60.0) -> None:
    """Server-side apply of the CRDs this operator was built with (PDCluster and
    PDClusterRoleScaler; Helm does not upgrade CRDs, so the operator does),
    then wait until the API serves both.

    kopf scans the API's resources right after start-up and only rescans when
    a CRD changes later: a CRD still being established at that scan would
    never be watched, so start-up returns only once discovery lists it.
    """
    await client.apply(crdgen.build_crd())
    await client.apply(crdgen.build_scaler_crd())
    deadline = time.monotonic() + timeout_s
    wanted = {PLURAL, SCALER_PLURAL}
    while missing := wanted - set(await client.served_resources(f"/apis/{GROUP}/{VERSION}")):
        if time.monotonic() > deadline:
            what = ", ".join(f"{p}.{GROUP}" for p in sorted(missing))
            raise ApiError(0, "Timeout", f"the API does not serve {what} after apply")
        await asyncio.sleep(0.2)


async def _flush_events(recorder: EventRecorder, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await recorder.flush()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    op = OperatorSettings.from_env(os.environ)
    # Handler progress lives in annotations: the status belongs to the operator's
    # own schema, which has no room for kopf's bookkeeping.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # Our own Events and logs say what happened; kopf's per-handler ones and a
    # line per HTTP request would drown them.
    settings.posting.level = logging.WARNING
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # kopf waits this long for more events on one object before handling the
    # latest; it is part of the failover path's latency.
    settings.batching.batch_window = BATCH_WINDOW_S
    client = KubeClient(load_credentials(op.kubeconfig))
    if op.apply_crds:
        try:
            await apply_crd(client)
        except ApiError as err:
            raise kopf.PermanentError(f"could not apply the CRDs: {err}") from err
    metrics = OperatorMetrics()
    if op.metrics_port:
        start_http_server(op.metrics_port, op.metrics_host, registry=metrics.registry)
    recorder = EventRecorder(
        client, clock=time.time, min_interval_s=op.event_min_interval_s, metrics=metrics
    )
    failover = Failover(client, recorder, metrics, op)
    controller = Controller(
        client,
        op,
        metrics,
        recorder,
        on_pod_delete=failover.expect_deletion,
        transport_reports=failover.transports.reports,
    )
    queue: WorkQueue[tuple[str, str]] = WorkQueue(
        controller.reconcile,
        num_workers=op.num_workers,
        retry_delay_s=op.retry_delay_s,
        max_retry_delay_s=op.max_retry_delay_s,
    )
    failover.on_transport_change = queue.add
    autoscaler = Autoscaler(client, recorder, failover.token_for, metrics=metrics)
    queue.start()
    tasks = (
        asyncio.create_task(_flush_events(recorder, op.event_min_interval_s)),
        asyncio.create_task(failover.run_poller()),
    )
    memo["pdcluster"] = Runtime(op, client, controller, queue, failover, autoscaler, tasks)
    log.info("pdcluster operator started (metrics port %s)", op.metrics_port or "off")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    runtime = memo.get("pdcluster")
    if isinstance(runtime, Runtime):
        for task in runtime.tasks:
            task.cancel()
        await runtime.queue.stop()
        await runtime.failover.aclose()
        await runtime.autoscaler.aclose()
        await runtime.client.aclose()


@kopf.on.probe(id="queue_depth")
def queue_depth(memo: kopf.Memo, **_: Any) -> int:
    return len(_runtime(memo).queue)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def on_cluster(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    if namespace:
        runtime = _runtime(memo)
        runtime.queue.add((namespace, name))
        runtime.autoscaler.ensure((namespace, name))  # autoscaling or replicas may have changed


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def on_cluster_deleted(
    namespace: str | None, name: str, uid: str, memo: kopf.Memo, **_: Any
) -> None:
    # Owner references hand the children to the garbage collector; only the
    # operator's own memory of the cluster needs forgetting.
    if not namespace:
        return
    runtime = _runtime(memo)
    runtime.failover.forget_cluster(namespace, name, uid)
    runtime.queue.forget((namespace, name))
    runtime.controller.recorder.forget(uid)
    runtime.controller.forget((namespace, name))
    runtime.autoscaler.forget((namespace, name))


@kopf.on.event(GROUP, VERSION, SCALER_PLURAL)
async def on_role_scaler(
    namespace: str | None, spec: Mapping[str, Any], memo: kopf.Memo, **_: Any
) -> None:
    cluster = spec.get("cluster")
    if namespace and isinstance(cluster, str) and cluster:
        _runtime(memo).autoscaler.wake((namespace, cluster))


def _enqueue_parent(memo: kopf.Memo, namespace: str | None, labels: Mapping[str, str]) -> None:
    cluster = labels.get(LABEL_CLUSTER)
    if namespace and cluster:
        _runtime(memo).queue.add((namespace, cluster))


@kopf.on.event("v1", "pods", labels=CHILD_LABELS)
async def on_child_pod(
    event: kopf.RawEvent,
    namespace: str | None,
    labels: Mapping[str, str],
    memo: kopf.Memo,
    **_: Any,
) -> None:
    runtime = _runtime(memo)
    try:
        await runtime.failover.on_pod_event(event.get("type"), event["object"])
    except Exception:  # the reconcile below must be queued whatever happened here
        log.exception("failover handling of a pod event failed")
    _enqueue_parent(memo, namespace, labels)


@kopf.on.event("v1", "services", labels=CHILD_LABELS)
@kopf.on.event("v1", "configmaps", labels=CHILD_LABELS)
@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=CHILD_LABELS)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
async def on_child(
    namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **_: Any
) -> None:
    _enqueue_parent(memo, namespace, labels)
