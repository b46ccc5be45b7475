"""One reconcile pass of one PDCluster: read, build, plan, act, report.

    body      <- GET the PDCluster (gone or being deleted: nothing to do;
                 owner references let the garbage collector remove children)
    desired   <- build_desired(validated spec)      (pure)
    refusal   <- check_cluster(spec, named Secrets)  (pure, `policy.py`): a
                 refused image or Secret changes nothing and is reported
    observed  <- LIST children by label, GET the names we need but did not see
    plan      <- plan_reconcile(desired, observed)   (pure)
    execute the plan; kvTransport <- compute_kv_transport(the workers' last
                 reports, kept by the failover poller) (pure), a Warning on a
                 new fallback to TCP; status <- compute_status(...)  (pure);
                 write it if changed

The pass returns when it wants to run again: at the earliest back-off or
budget deadline the plan names, after a failed write (2 s, doubling for
every pass in a row that fails again, capped), and at the resync interval
otherwise. It never sleeps. A write the apiserver refuses (admission, quota,
RBAC) becomes an `ApplyFailed` Event with the apiserver's message and the
`Degraded` condition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.api import KVTransportStatus, PDClusterStatus, parse_status
from pdcluster.operator.builders.desired import DesiredState, build_desired
from pdcluster.operator.builders.meta import BuildError, ObjectKey, object_key
from pdcluster.operator.builders.overlay import explain_pod_security_refusal
from pdcluster.operator.builders.scheduling import POD_GROUP_KIND
from pdcluster.operator.kube.client import ApiError, KubeApi
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.names import InvalidNameError
from pdcluster.operator.reconcile.actions import Action, Create, EventType, Reason
from pdcluster.operator.reconcile.cluster import (
    Cluster,
    cluster_from_body,
    ref_from_body,
    with_operator_defaults,
)
from pdcluster.operator.reconcile.executor import Executor
from pdcluster.operator.reconcile.kv_transport import TransportReport, compute_kv_transport
from pdcluster.operator.reconcile.observed import Observed, PodGroupApi, observe
from pdcluster.operator.reconcile.plan import MANAGED_KINDS, Plan, describe, plan_reconcile
from pdcluster.operator.reconcile.policy import Refusal, check_cluster, secret_references
from pdcluster.operator.reconcile.restarts import ledger_from_status
from pdcluster.operator.reconcile.status import (
    compute_invalid_status,
    compute_status,
    status_changed,
    status_patch,
)
from pdcluster.operator.reconcile.workqueue import retry_delay
from pdcluster.operator.settings import OperatorSettings
from pdcluster.runtime.spec import Role, SpecError

log = logging.getLogger(__name__)

# Listed by label each pass. Secrets are only ever read by name, so the
# operator needs no permission to list the namespace's secrets. PodGroups come
# from scheduler-plugins' CRD, which a cluster may lack: listed on their own.
LISTED_KINDS = tuple(k for k in MANAGED_KINDS if k not in ("Secret", POD_GROUP_KIND))
# After a failed write, try again this soon, doubling per pass that fails again
# up to the settings' max_retry_delay_s (the work queue backs off on exceptions).
RETRY_AFTER_WRITE_ERROR_S = 2.0


TransportReports = Callable[[tuple[str, str]], Mapping[Role, Sequence[TransportReport]]]


def pod_security_refusals(namespace: str, errors: Sequence[tuple[Action, Exception]]) -> list[str]:
    """One explanation per role whose pods the namespace's Pod Security admission
    refused: which level they need and why (builders/overlay.py)."""
    out: dict[str, str] = {}
    for action, err in errors:
        if not isinstance(action, Create) or action.key.kind != "Pod":
            continue
        if "violates PodSecurity" not in str(err):
            continue
        role = action.manifest["metadata"]["labels"].get(names.LABEL_ROLE, "worker")
        out.setdefault(role, explain_pod_security_refusal(role, action.manifest["spec"], namespace))
    return list(out.values())


def describe_write(action: Action) -> str:
    summary = describe(action)
    return f"{summary['op']} {summary.get('object', '')}".strip()


class Controller:
    def __init__(
        self,
        api: KubeApi,
        settings: OperatorSettings,
        metrics: OperatorMetrics,
        recorder: EventRecorder,
        clock: Callable[[], float] = time.time,
        on_pod_delete: Callable[[str], None] | None = None,
        transport_reports: TransportReports | None = None,
    ) -> None:
        self.api = api
        self.settings = settings
        self.metrics = metrics
        self.recorder = recorder
        self.executor = Executor(api, recorder, metrics, on_pod_delete)
        self._clock = clock
        # (namespace, name) -> role -> the workers' last kv_transport reports.
        self.transport_reports: TransportReports = transport_reports or (lambda _: {})
        # Last plan per cluster, for logs, probes and tests.
        self.last_plans: dict[tuple[str, str], Plan] = {}
        # Passes in a row whose writes the apiserver refused, per cluster.
        self.write_failures: dict[tuple[str, str], int] = {}

    def forget(self, key: tuple[str, str]) -> None:
        """Drop what is remembered of a deleted cluster."""
        self.last_plans.pop(key, None)
        self.write_failures.pop(key, None)
        self.metrics.forget_cluster(*key)

    async def reconcile(self, key: tuple[str, str]) -> float | None:
        """One pass for (namespace, name); returns seconds until the next wanted pass."""
        namespace, name = key
        started = time.monotonic()
        try:
            return await self._reconcile(namespace, name)
        except Exception:
            self.metrics.reconciles.labels(result="error").inc()
            raise
        finally:
            self.metrics.reconcile_seconds.observe(time.monotonic() - started)

    async def _reconcile(self, namespace: str, name: str) -> float | None:
        body = await self.api.get("PDCluster", namespace, name)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            self.last_plans.pop((namespace, name), None)
            return None
        now = self._clock()
        prev = parse_status(body.get("status"))
        try:
            cluster = with_operator_defaults(cluster_from_body(body), self.settings.otlp_endpoint)
            desired = build_desired(
                cluster,
                operator_namespace=self.settings.operator_namespace,
                scrape=self.settings.scrape_source,
            )
        except (SpecError, BuildError, InvalidNameError) as err:
            await self._report_invalid(body, prev, str(err), now)
            self.metrics.reconciles.labels(result="invalid").inc()
            return None

        refusal = await self._refusal(cluster)
        if refusal is not None:
            await self._report_invalid(body, prev, refusal.message, now, refusal.reason)
            self.metrics.reconciles.labels(result="refused").inc()
            # A label added to a Secret sends no event the operator watches.
            return self.settings.resync_interval_s

        observed = await self.observe(desired)
        ledgers = {
            role.role: ledger_from_status(prev.role(role.role.value)) for role in desired.roles
        }
        plan = plan_reconcile(desired, observed, ledgers, now)
        self.last_plans[(namespace, name)] = plan
        result = await self.executor.run(cluster, plan.actions)
        failed = [f"{describe_write(action)}: {err}" for action, err in result.errors]
        for message in failed:
            await self.recorder.record(
                cluster.ref, EventType.Warning.value, Reason.ApplyFailed.value, message
            )
        for explanation in pod_security_refusals(cluster.namespace, result.errors):
            await self.recorder.record(
                cluster.ref, EventType.Warning.value, Reason.PodSecurityRefused.value, explanation
            )
        await self._write_status(cluster, desired, plan, body.get("status"), prev, now, failed)
        self.metrics.reconciles.labels(result="ok" if not result.errors else "error").inc()
        if result.errors:
            failures = self.write_failures.get((namespace, name), 0) + 1
            self.write_failures[(namespace, name)] = failures
            return retry_delay(failures, RETRY_AFTER_WRITE_ERROR_S, self.settings.max_retry_delay_s)
        self.write_failures.pop((namespace, name), None)
        delay: float = self.settings.resync_interval_s
        if plan.wake_at is not None:
            delay = min(delay, max(0.0, plan.wake_at - self._clock()))
        return delay

    async def _refusal(self, cluster: Cluster) -> Refusal | None:
        """Why the operator's policy refuses the cluster, reading the Secrets it names."""
        secrets = {
            ref.name: await self.api.get("Secret", cluster.namespace, ref.name)
            for ref in secret_references(cluster)
        }
        return check_cluster(cluster, self.settings.image_allowlist, secrets)

    async def observe(self, desired: DesiredState) -> Observed:
        cluster = desired.cluster
        selector = names.format_selector(names.cluster_selector(cluster.name))
        raw: list[dict[str, Any]] = []
        for kind in LISTED_KINDS:
            raw.extend(await self.api.list(kind, cluster.namespace, selector))
        pod_groups, pod_group_api = await self._list_pod_groups(cluster.namespace, selector)
        raw.extend(pod_groups)
        seen = {object_key(o) for o in raw if "metadata" in o}
        # Objects with our names but without our labels are someone else's;
        # look them up so the planner refuses them instead of clobbering them.
        wanted = [object_key(m) for m in desired.objects]
        wanted.append(ObjectKey("Secret", desired.token_secret))
        for key in wanted:
            if key not in seen:
                found = await self.api.get(key.kind, cluster.namespace, key.name)
                if found is not None:
                    raw.append(found)
        return observe(raw, cluster.ref.uid, names.router_name(cluster.name), pod_group_api)

    async def _list_pod_groups(
        self, namespace: str, selector: str
    ) -> tuple[list[dict[str, Any]], PodGroupApi]:
        """The cluster's PodGroups, and whether the apiserver serves them at all: a
        missing CRD (404) or RBAC grant (403) only matters to roles asking for
        them (the planner decides), so it never fails the pass."""
        try:
            return await self.api.list(POD_GROUP_KIND, namespace, selector), PodGroupApi.served
        except ApiError as err:
            if err.is_not_found:
                return [], PodGroupApi.not_installed
            if err.is_forbidden:
                return [], PodGroupApi.forbidden
            raise

    async def _write_status(
        self,
        cluster: Cluster,
        desired: DesiredState,
        plan: Plan,
        stored: Any,
        prev: PDClusterStatus,
        now: float,
        failed_writes: list[str],
    ) -> None:
        hashes: dict[Role, str] = {r.role: r.template_hash for r in desired.roles}
        transports = await self._kv_transports(cluster, desired, prev)
        status = compute_status(
            cluster, plan, hashes, desired.revision, prev, now, tuple(failed_writes), transports
        )
        self.metrics.observe_status(cluster, status, now)
        if status_changed(stored, status):
            try:
                await self.api.patch_status(cluster.namespace, cluster.name, status_patch(status))
            except ApiError as err:
                if err.is_not_found:
                    return  # deleted during the pass; the garbage collector takes it from here
                raise
            self.metrics.status_writes.inc()

    async def _kv_transports(
        self, cluster: Cluster, desired: DesiredState, prev: PDClusterStatus
    ) -> dict[Role, KVTransportStatus]:
        """Each PD role's negotiated transport; a Warning when RDMA was asked for and missed."""
        reports = self.transport_reports((cluster.namespace, cluster.name))
        out: dict[Role, KVTransportStatus] = {}
        for role in (r.role for r in desired.roles):
            if role not in (Role.prefill, Role.decode):
                continue
            before = prev.role(role.value)
            verdict = compute_kv_transport(
                role,
                cluster.spec.transfer,
                reports.get(role, ()),
                before.kv_transport if before is not None else None,
            )
            if verdict.status is not None:
                out[role] = verdict.status
            if verdict.warning is not None:
                log.warning("PDCluster %s/%s: %s", cluster.namespace, cluster.name, verdict.warning)
                await self.recorder.record(
                    cluster.ref,
                    EventType.Warning.value,
                    Reason.KVTransportFallback.value,
                    verdict.warning,
                )
        return out

    async def _report_invalid(
        self,
        body: dict[str, Any],
        prev: PDClusterStatus,
        message: str,
        now: float,
        reason: Reason = Reason.InvalidSpec,
    ) -> None:
        try:
            ref = ref_from_body(body)
        except SpecError:
            log.warning("ignoring a PDCluster without identity: %s", message)
            return
        log.warning("PDCluster %s/%s: %s: %s", ref.namespace, ref.name, reason.value, message)
        await self.recorder.record(ref, EventType.Warning.value, reason.value, message)
        status = compute_invalid_status(ref, message, prev, now, reason)
        if status_changed(body.get("status"), status):
            await self.api.patch_status(ref.namespace, ref.name, status_patch(status))
            self.metrics.status_writes.inc()
