"""The per-cluster autoscaling loop: read, decide (pure modules), write.

One pass of one PDCluster (`Autoscaler.run_pass`), run by one asyncio task
per PDCluster (`Autoscaler.ensure`, called by the cluster's kopf handlers)
that sleeps between passes until the next role is due (`intervalSeconds`),
or until the cluster or one of its scalers changed (`wake`); it ends when the
cluster is gone. (A kopf timer or daemon would put a finalizer on every
PDCluster, which then could not be deleted while the operator is down; the
operator keeps PDClusters free of finalizers.)

    body, pods     <- GET the PDCluster, LIST its pods
    scalers        <- GET each role's PDClusterRoleScaler; plan_scaler (pure):
                      create a missing one (owned by the PDCluster), copy the
                      winning side's replicas to the other (scaler_sync.py),
                      write the scaler's status (replicas, selector, synced);
                      delete the scalers of roles the cluster no longer has
    scrapes        <- GET /metrics of each autoscaled role's Ready leader pods
                      (prefill ttftP90Seconds: of the Ready router pods,
                      autoscale/router_metrics.py)
    step           <- compute_autoscale_step(...)  (pure: planner + samples)
    write          <- merge-patch spec.<role>.replicas (the path `kubectl
                      scale` takes, so the reconcile drains a removed
                      instance), the Events, status.<role>.autoscaling

The planner's history is kept in memory per cluster and replaced only once
every replicas patch succeeded (a failed write: the next pass starts from
the old history). Its windows are also written to status.<role>.autoscaling
(`autoscale/persisted.py`) and restored from there when the loop has no
history for the cluster (an operator restart). A pass that copied a
scaler's replicas into the PDCluster decides nothing: the next one (at
once) sees the new replicas. Nothing here raises into kopf: a failed API or
HTTP call is logged and the pass retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import httpx

from pdcluster.operator import names
from pdcluster.operator.api import SCALER_KIND, parse_status
from pdcluster.operator.autoscale.persisted import restore_history
from pdcluster.operator.autoscale.router_metrics import (
    as_prefill_scrape,
    is_read_from_router,
    router_scrape_targets,
    with_router_hold_notes,
)
from pdcluster.operator.autoscale.step import (
    AutoscaleHistory,
    AutoscaleStep,
    PodScrape,
    compute_autoscale_step,
    roles_due,
)
from pdcluster.operator.autoscale.wiring import (
    MIN_WAIT_S,
    ScalerObjectError,
    existing_instances,
    plan_scaler,
    scrape_targets,
    stale_scalers,
    status_patch,
    token_secret,
    wait_seconds,
)
from pdcluster.operator.builders.desired import roles_of
from pdcluster.operator.failover.admin_client import ResponseTooLarge, read_capped
from pdcluster.operator.kube.client import ApiError, KubeClient
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.reconcile.cluster import Cluster, cluster_from_body
from pdcluster.runtime.spec import Role, SpecError

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0
# A /metrics body larger than this is cut (and then probably unreadable).
MAX_METRICS_BYTES = 4 << 20
# After a failed pass (an API or HTTP error), try again this soon.
RETRY_S = 2.0

TokenLookup = Callable[[str, str | None], Awaitable[str | None]]
Key = tuple[str, str]


class Autoscaler:
    def __init__(
        self,
        client: KubeClient,
        recorder: EventRecorder,
        token_for: TokenLookup,
        clock: Callable[[], float] = time.time,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.recorder = recorder
        self.token_for = token_for
        self._clock = clock
        self._http = httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, trust_env=False)
        self.histories: dict[Key, AutoscaleHistory] = {}
        self.last_steps: dict[Key, AutoscaleStep] = {}  # for logs and tests
        self._wakes: dict[Key, asyncio.Event] = {}
        self._loops: dict[Key, asyncio.Task[None]] = {}

    async def aclose(self) -> None:
        loops = list(self._loops.values())
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await self._http.aclose()

    def ensure(self, key: Key) -> None:
        """Start the cluster's loop if it does not run, else wake it (the cluster changed)."""
        task = self._loops.get(key)
        if task is None or task.done():
            self._wakes[key] = asyncio.Event()
            self._loops[key] = asyncio.create_task(self._loop(key), name=f"autoscale {key}")
        else:
            self.wake(key)

    def forget(self, key: Key) -> None:
        """The cluster was deleted: stop its loop and drop what was kept of it."""
        self.histories.pop(key, None)
        self.last_steps.pop(key, None)
        self._wakes.pop(key, None)
        task = self._loops.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def wake(self, key: Key) -> None:
        """Run the cluster's next pass now (no loop runs for it: nothing to do)."""
        event = self._wakes.get(key)
        if event is not None:
            event.set()

    async def _sleep(self, key: Key, seconds: float) -> None:
        event = self._wakes.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=seconds)
        except TimeoutError:
            pass
        event.clear()

    async def _loop(self, key: Key) -> None:
        while True:
            try:
                delay = await self.run_pass(key)
            except Exception:  # the loop must outlive a bug in one pass
                log.exception("autoscaling pass of %s/%s failed", *key)
                delay = RETRY_S
            if delay is None:
                return
            await self._sleep(key, delay)

    async def run_pass(self, key: Key) -> float | None:
        """One pass; the seconds to sleep before the next one (None: the cluster is gone)."""
        try:
            return await self._run_pass(key)
        except (ApiError, httpx.HTTPError) as err:
            log.warning("autoscaling pass of %s/%s failed: %s", *key, err)
            return RETRY_S

    async def _run_pass(self, key: Key) -> float | None:
        namespace, name = key
        body = await self.client.get("PDCluster", namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            self.forget(key)
            return None
        try:
            cluster = cluster_from_body(body)
        except SpecError:
            return wait_seconds(None, 0.0)  # the controller reports it
        selector = names.format_selector(names.cluster_selector(name))
        pods = await self.client.list("Pod", namespace, selector)
        if await self._sync_scalers(cluster, pods):
            return MIN_WAIT_S  # the replicas moved: decide on the new ones
        stored = parse_status(body.get("status"))
        if not _autoscales(cluster) and not any(
            (s := stored.role(r.value)) is not None and s.autoscaling is not None
            for r in (Role.prefill, Role.decode)
        ):
            self.histories.pop(key, None)
            return wait_seconds(None, 0.0)
        history = self.histories.get(key)
        if history is None:  # a start: the windows the last operator wrote
            history = restore_history(stored)
        # One `now` for "which roles are due" and the step, so a role that
        # turns due while the others are scraped is not decided without scrapes.
        now = self._clock()
        due = roles_due(cluster, history, now)
        scrapes = await self._scrape(cluster, pods, list(due)) if due else {}
        step = compute_autoscale_step(cluster, stored, scrapes, history, now)
        answered = {role: len(by_pod) for role, by_pod in scrapes.items()}
        step = with_router_hold_notes(cluster, step, answered)
        self.last_steps[key] = step
        for patch in step.patches:
            try:
                await self.client.patch("PDCluster", namespace, name, patch.body())
            except ApiError as err:
                log.warning("%s/%s: could not set %s replicas: %s", *key, patch.role.value, err)
                return RETRY_S  # the history stays: the next pass decides again
        self.histories[key] = step.history
        for event in step.events:
            await self.recorder.record(cluster.ref, event.type, event.reason, event.message)
        if step.statuses:
            try:
                await self.client.patch_status(namespace, name, status_patch(cluster, step))
            except ApiError as err:
                if not err.is_not_found:
                    log.warning("%s/%s: could not write the autoscaling status: %s", *key, err)
        for patch in step.patches:
            log.info("%s/%s: %s replicas -> %d", *key, patch.role.value, patch.replicas)
            if self.metrics is not None:
                before = cluster.spec.role_spec(patch.role)
                up = before is None or patch.replicas > before.replicas
                direction = "up" if up else "down"
                self.metrics.autoscaler_decisions.labels(patch.role.value, direction).inc()
        return wait_seconds(step, self._clock())

    async def _sync_scalers(self, cluster: Cluster, pods: list[dict[str, Any]]) -> bool:
        """Create and sync each role's scaler; True when the PDCluster's replicas were changed."""
        existing = existing_instances(pods, cluster.ref)
        selector = names.format_selector(names.cluster_selector(cluster.name))
        listed = await self.client.list(SCALER_KIND, cluster.namespace, selector)
        for name, uid in stale_scalers(listed, cluster.ref.uid, roles_of(cluster)):
            await self.client.delete(SCALER_KIND, cluster.namespace, name, uid)
        changed = False
        for role in roles_of(cluster):
            scaler_name = names.role_scaler_name(cluster.name, role)
            scaler = await self.client.get(SCALER_KIND, cluster.namespace, scaler_name)
            try:
                plan = plan_scaler(cluster, role, scaler, existing.get(role, 0))
            except ScalerObjectError as err:
                log.warning("%s/%s: %s", cluster.namespace, cluster.name, err)
                continue
            if plan.create is not None:
                try:
                    await self.client.create(plan.create)
                except ApiError as err:
                    if not err.is_conflict:
                        raise
                    continue  # created meanwhile: the next pass reads it
            sync = plan.sync
            if sync.cluster_replicas is not None:
                body = {"spec": {role.value: {"replicas": sync.cluster_replicas}}}
                await self.client.patch("PDCluster", cluster.namespace, cluster.name, body)
                changed = True
            if sync.scaler_replicas is not None:
                await self.client.patch(
                    SCALER_KIND,
                    cluster.namespace,
                    scaler_name,
                    {"spec": {"replicas": sync.scaler_replicas}},
                )
            for event in sync.events:
                await self.recorder.record(cluster.ref, event.type, event.reason, event.message)
            stored = (scaler or {}).get("status") if plan.create is None else None
            if stored != plan.status_patch()["status"]:
                await self.client.patch_status(
                    cluster.namespace, scaler_name, plan.status_patch(), kind=SCALER_KIND
                )
        return changed

    async def _scrape(
        self, cluster: Cluster, pods: list[dict[str, Any]], roles: list[Role]
    ) -> dict[Role, dict[str, PodScrape]]:
        """Per role, the /metrics of its Ready leader pods, or of the router's Ready pods
        for a target read from the router (`router_metrics.py`)."""
        from_router = [r for r in roles if is_read_from_router(cluster, r)]
        targets = scrape_targets(pods, cluster.ref, [r for r in roles if r not in from_router])
        routers = router_scrape_targets(pods, cluster.name)
        targets.update({role: dict(routers) for role in from_router})
        token = await self.token_for(cluster.namespace, token_secret(pods, cluster.ref))
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        async def fetch(url: str, worker: bool) -> PodScrape | None:
            # The router's /metrics is open, and its pods are matched by label only
            # (their owner is a ReplicaSet): the token goes to worker pods alone.
            try:
                async with self._http.stream("GET", url, headers=headers if worker else {}) as resp:
                    if resp.status_code != 200:
                        return None
                    text = (await read_capped(resp, MAX_METRICS_BYTES)).decode(errors="replace")
            except (httpx.HTTPError, ResponseTooLarge) as err:
                log.debug("scrape of %s failed: %s", url, err)
                return None
            return PodScrape(text, self._clock())

        out: dict[Role, dict[str, PodScrape]] = {}
        for role, by_pod in targets.items():
            pairs = list(by_pod.items())
            worker = role not in from_router
            results = await asyncio.gather(*(fetch(url, worker) for _, url in pairs))
            found = _found(dict(zip((p for p, _ in pairs), results, strict=True)))
            if role in from_router:
                found = {p: replace(s, text=as_prefill_scrape(s.text)) for p, s in found.items()}
            out[role] = found
        return out


def _autoscales(cluster: Cluster) -> bool:
    return any(
        (spec := cluster.spec.role_spec(role)) is not None and spec.autoscaling is not None
        for role in (Role.prefill, Role.decode)
    )


def _found(results: Mapping[str, PodScrape | None]) -> dict[str, PodScrape]:
    return {pod: scrape for pod, scrape in results.items() if scrape is not None}
