"""The failover fast path: a lost worker pod → its peers fail the affected rooms now.

Driven by the pod watch (`handlers.on_child_pod`), before the reconcile that
restarts the instance is even queued:

    pod event → PodIndex (who exists) → LossTracker (is this a loss, once?)
      prefill lost → POST /admin/fail_peer {peer: leaderIP:bootstrapPort,
                     incarnation: leader uid} to every decode (and, for a pod
                     k > 0 that is gone, {peer: its IP, incarnation: its uid})
      decode lost  → POST /admin/fail_peer {peer: podIP, incarnation: pod uid}
                     to every prefill                       (gangs.py decides)
      → metrics (failovers by role/cause, detection latency, fan-out time)
      → Warning Event PrefillInstanceLost / DecodeInstanceLost (not for the
        operator's own deletions: those already have their Normal Event)
      → a poll of the workers' /admin/failures shortly after

The same poller reads the prefill workers' /health: an instance whose ranks
stay unregistered with its bootstrap server past `registration_warn_s` gets
one Warning Event `InstanceUnregistered` per episode (registration.py).
It also reads every PD worker's `/get_server_info` → `kv_transport` into
`transports` (reconcile/kv_transport.py); when a cluster's reports change,
`on_transport_change` queues its reconcile, which writes them to the status.

Failure counts: every `failure_poll_interval_s` (and right after a loss)
each PD worker's `/admin/failures` is read; the increase per (role, reason)
becomes one aggregated `RoomsFailed` Event whose count is the number of
rooms, plus a metric — never one Event per request.

Gone or maybe hung (`gone` in the call, `is_peer_gone`): a pod that has
exited, or whose object is gone, cannot write any more — `gone: true`, and
a decode may reuse the failed rooms' pages at once. A pod NotReady past the
grace, or still terminating (deletion started, processes may run until the
kubelet kills them), may still write into a decode's shared-memory pages —
`gone: false`: the rooms fail now, the pages wait for the peer's ack. A
multi-pod prefill instance is `gone` only once every pod of its gang is: a
pod k that ended while pod 0 runs leaves the instance "failing, not gone"
(its own ranks are reported gone by its address). What was reported with
`gone: false` is remembered (per gang, and per pod for a pod's own
address), and once it is seen ended or gone the peers are told again with
`gone: true` (no new Event: the loss was reported), so pages never wait on
a pod that cannot ack any more. A NotReady pod that turns Ready again is
forgotten: it is alive and acks for itself. Every report names the
incarnation it is about (a pod uid), so a worker ignores a late one about a
pod whose IP a successor has taken.

Peers are told concurrently, each with its own timeout, so a dead peer
never delays the others. Nothing here raises into the watch: a failed call
is logged and counted.

Which cluster a pod belongs to: the watch selects pods by label, and labels
can be written by anyone who may create a pod. A pod counts only if its
controller owner is the PDCluster its label names, by that object's uid
(read from the API once, and again when a pod names another uid: the
cluster may have been created anew). Another's pod — of a PDCluster
deleted and created again under the same name, or a pod made to look like
one of ours — is ignored (`foreign_pods_total`): it never takes the place
of the cluster's decodes when the prefill set is published, is never sent
a Secret its own spec names, and its losses are reported to nobody.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from pdcluster.operator.builders.meta import TOKEN_KEY
from pdcluster.operator.failover.admin_client import AdminClient, AdminResult
from pdcluster.operator.failover.failure_counts import FailureCounts
from pdcluster.operator.failover.gangs import Report, compute_reports
from pdcluster.operator.failover.losses import Loss, LossCause, LossTracker
from pdcluster.operator.failover.peers import PEER_ROLE, PodIndex
from pdcluster.operator.failover.pod_facts import PodFacts, parse_pod_facts
from pdcluster.operator.failover.prefill_peers import PeerPublisher
from pdcluster.operator.failover.registration import RegistrationWatch, Unregistered
from pdcluster.operator.kube.client import ApiError, KubeApi
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.reconcile.actions import EventType, Reason
from pdcluster.operator.reconcile.cluster import ClusterRef
from pdcluster.operator.reconcile.kv_transport import (
    TransportReport,
    TransportTable,
    parse_transport_report,
)
from pdcluster.operator.settings import OperatorSettings
from pdcluster.runtime.pd.failure_labels import reason_label
from pdcluster.runtime.spec import Role

log = logging.getLogger(__name__)

# The reasons the peers' rooms fail with (their /admin/failures keys, metric labels).
PEER_LOST_REASON = {Role.prefill: "prefill_pod_lost", Role.decode: "decode_pod_lost"}
PEER_REMOVED_REASON = {Role.prefill: "prefill_pod_removed", Role.decode: "decode_pod_removed"}
LOST_EVENT = {Role.prefill: Reason.PrefillInstanceLost, Role.decode: Reason.DecodeInstanceLost}
# After telling the peers, read their failure counts this much later (their
# ranks fail the rooms asynchronously).
POLL_AFTER_LOSS_S = 0.5


def loss_message(loss: Loss, results: list[AdminResult], grace_s: float) -> str:
    """The Event message of a loss; stable across repeats so they aggregate."""
    pod = loss.pod
    peer_role = PEER_ROLE[pod.role].value
    told = sum(r.ok for r in results)
    text = f"{pod.role.value} instance {pod.instance} lost ({loss.describe(grace_s)})"
    if not pod.has_admin_api:
        # vLLM: the router's pod watch sees the loss and ends or moves its requests.
        text += "; the router ends its requests, or moves those still waiting for its KV"
    elif not results:
        text += f"; no {peer_role} worker held rooms with it"
    else:
        text += f"; its rooms failed at {told}/{len(results)} {peer_role} workers"
        failed = [r for r in results if not r.ok]
        if failed:
            text += f" (no answer from {', '.join(r.url for r in failed[:3])})"
    return text + "; the instance is restarted"


def is_peer_gone(loss: Loss, *, object_gone: bool) -> bool:
    """Whether the lost pod's processes can no longer run (fail_peer's `gone`).

    `object_gone`: the loss came with the pod's DELETED event. A pod only
    being deleted may still run for its grace period, and a NotReady one may
    be merely hung: neither is gone yet.
    """
    if loss.cause is LossCause.failed:
        return True
    return loss.cause is LossCause.deleted and object_gone


def is_settled_by(pod: PodFacts, *, object_gone: bool) -> bool:
    """Whether this sighting of a pod reported `gone: false` makes it gone for sure."""
    return object_gone or pod.has_ended


def rooms_failed_message(role: Role, reason: str) -> str:
    return f"rooms failed at {role.value} workers: {reason}"


# The longest a cluster's uid is trusted when a pod names another (it may be new).
CLUSTER_UID_REFRESH_S = 5.0

# A decode pod still loading does not answer its admin API yet: ask again.
PUBLISH_ATTEMPTS = 60
PUBLISH_RETRY_S = 1.0


class Failover:
    def __init__(
        self,
        api: KubeApi,
        recorder: EventRecorder,
        metrics: OperatorMetrics,
        settings: OperatorSettings,
        admin: AdminClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.recorder = recorder
        self.metrics = metrics
        self.settings = settings
        self.admin = admin or AdminClient(settings.admin_timeout_s)
        self.index = PodIndex()
        self.tracker = LossTracker(settings.not_ready_grace_s)
        self._clock = clock
        self._started_at = clock()
        self._tokens: dict[tuple[str, str], str] = {}
        self._rechecks: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._deleted_clusters: set[str] = set()
        # Reported with `gone: false`, until told `gone: true`: a gang (its leader
        # uid) -> the loss that reported its instance; a pod (its uid) -> the loss
        # that reported its own address (a decode pod, a prefill pod k > 0).
        self._maybe_alive: dict[str, Loss] = {}
        self._maybe_alive_pods: dict[str, Loss] = {}
        self.counts = FailureCounts()
        self.registration = RegistrationWatch(settings.registration_warn_s)
        self.peers = PeerPublisher(self.admin)
        self.transports = TransportTable()
        # Called with a cluster's key when its workers' transport reports changed.
        self.on_transport_change: Callable[[tuple[str, str]], None] | None = None
        self._publish_locks: dict[tuple[str, str], asyncio.Lock] = {}
        # (namespace, name) -> (the PDCluster's uid or None: no such object, when read).
        self._cluster_uids: dict[tuple[str, str], tuple[str | None, float]] = {}

    # ------------------------------------------------------------ pod events
    async def on_pod_event(self, event_type: str | None, raw: Mapping[str, Any]) -> Loss | None:
        """Feed one watch event; returns the loss it revealed (already acted on)."""
        received = time.monotonic()
        pod = parse_pod_facts(raw)
        if pod is None:
            return None
        if not await self._is_owned_by_its_cluster(pod):
            self.metrics.foreign_pods.inc()
            log.warning(
                "%s/%s: pod %s carries the cluster's labels but is controlled by another "
                "PDCluster (uid %s); ignored",
                pod.namespace,
                pod.cluster,
                pod.name,
                pod.cluster_uid,
            )
            return None
        gone = event_type == "DELETED"
        gang_id = self.index.gang_id(pod)  # before a DELETED pod leaves the index
        self.index.update(pod, gone=gone)
        # Decode workers learn which bootstrap servers they may contact (off the fast path).
        self._spawn(self.publish_peers(pod.key))
        if gone:
            self.peers.forget(pod.uid)
            self.counts.forget(pod.uid)
            self._cancel_recheck(pod.uid)
        if pod.cluster_uid in self._deleted_clusters:
            self._maybe_alive.pop(pod.uid, None)
            self._maybe_alive_pods.pop(pod.uid, None)
            return None
        verdict = self.tracker.observe(pod, self._clock(), gone=gone)
        if verdict.recheck_at is not None:
            self._schedule_recheck(pod, verdict.recheck_at)
        if verdict.loss is None:
            await self._settle(pod, gang_id, object_gone=gone)
            return None
        self._cancel_recheck(pod.uid)
        await self.handle_loss(verdict.loss, received, object_gone=gone, gang_id=gang_id)
        return verdict.loss

    async def _is_owned_by_its_cluster(self, pod: PodFacts) -> bool:
        """Whether the pod's controller owner is the PDCluster its label names (uid)."""
        uid, read_at = self._cluster_uids.get(pod.key, (None, -math.inf))
        if uid == pod.cluster_uid:
            return True
        if time.monotonic() - read_at < CLUSTER_UID_REFRESH_S:
            return False
        try:
            body = await self.api.get("PDCluster", pod.namespace, pod.cluster)
        except ApiError as err:
            # Unverified is not accepted; the pod's next event asks again.
            log.warning("cannot read PDCluster %s/%s: %s", pod.namespace, pod.cluster, err)
            return False
        found = ((body or {}).get("metadata") or {}).get("uid")
        uid = found if isinstance(found, str) and found else None
        self._cluster_uids[pod.key] = (uid, time.monotonic())
        return uid == pod.cluster_uid

    async def _settle(self, pod: PodFacts, gang_id: str | None, *, object_gone: bool) -> None:
        """A pod reported with `gone: false` (itself, or its gang) is seen again:
        gone now, or back?"""
        resumed = pod.ready and not (object_gone or pod.deleting or pod.has_ended)
        own = self._maybe_alive_pods.get(pod.uid)
        if own is not None and (resumed or is_settled_by(pod, object_gone=object_gone)):
            # Ready again: the same processes resumed and ack their rooms themselves.
            del self._maybe_alive_pods[pod.uid]
            if not resumed and pod.pod_ip:
                await self._tell_gone(own, Report(pod.pod_ip, pod.uid, True))
        loss = self._maybe_alive.get(gang_id) if gang_id is not None else None
        if loss is None or gang_id is None:
            return
        if resumed and pod.uid == loss.pod.uid:
            del self._maybe_alive[gang_id]
            return
        if not all(p.has_ended for p in self.index.members(pod.key, gang_id)):
            return  # a pod of the gang may still run (and write)
        del self._maybe_alive[gang_id]
        peer = loss.pod.peer
        if peer is not None:
            await self._tell_gone(loss, Report(peer, gang_id, True))

    async def _tell_gone(self, loss: Loss, report: Report) -> None:
        pod = loss.pod
        results = await self.tell_peers(loss, report)
        log.info(
            "%s/%s: %s instance %d (%s, incarnation %s) is gone; told %d/%d peers to free "
            "its pages",
            pod.namespace,
            pod.cluster,
            pod.role.value,
            pod.instance,
            report.peer,
            report.incarnation,
            sum(r.ok for r in results),
            len(results),
        )

    def expect_deletion(self, uid: str) -> None:
        """The operator deletes this pod itself (passed to the executor)."""
        self.tracker.expect_deletion(uid)

    def forget_cluster(self, namespace: str, name: str, uid: str) -> None:
        """The PDCluster is being deleted: its pods going away is no loss to report."""
        self._deleted_clusters.add(uid)
        for pod in self.index.pods((namespace, name)):
            self._cancel_recheck(pod.uid)
            self.counts.forget(pod.uid)
            self._maybe_alive.pop(pod.uid, None)
            self._maybe_alive_pods.pop(pod.uid, None)
        self.index.forget_cluster((namespace, name))
        self.transports.forget((namespace, name))
        self._cluster_uids.pop((namespace, name), None)
        self._tokens = {k: v for k, v in self._tokens.items() if k[0] != namespace}

    def _schedule_recheck(self, pod: PodFacts, at: float) -> None:
        self._cancel_recheck(pod.uid)
        loop = asyncio.get_running_loop()
        delay = max(0.0, at - self._clock())
        self._rechecks[pod.uid] = loop.call_later(delay, self._spawn_recheck, pod.key, pod.uid)

    def _cancel_recheck(self, uid: str) -> None:
        handle = self._rechecks.pop(uid, None)
        if handle is not None:
            handle.cancel()

    def _spawn_recheck(self, key: tuple[str, str], uid: str) -> None:
        self._rechecks.pop(uid, None)
        self._spawn(self._recheck(key, uid))

    async def _recheck(self, key: tuple[str, str], uid: str) -> None:
        pod = self.index.get(key, uid)
        if pod is None or pod.cluster_uid in self._deleted_clusters:
            return
        verdict = self.tracker.observe(pod, self._clock())
        if verdict.recheck_at is not None:
            self._schedule_recheck(pod, verdict.recheck_at)
        if verdict.loss is not None:
            await self.handle_loss(verdict.loss, time.monotonic())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ acting on a loss
    async def handle_loss(
        self,
        loss: Loss,
        received_monotonic: float,
        *,
        object_gone: bool = False,
        gang_id: str | None = None,
    ) -> list[AdminResult]:
        """Tell the peers, record metrics and the Event. `object_gone`: from a DELETED
        event; `gang_id`: the pod's gang, as known before that event (else looked up)."""
        pod = loss.pod
        role = pod.role.value
        gone = is_peer_gone(loss, object_gone=object_gone)
        gang_id = gang_id or self.index.gang_id(pod)
        others = (
            self.index.members(pod.key, gang_id) if gang_id is not None else self.index.gang(pod)
        )
        gang_gone = gone and all(p.has_ended for p in others if p.uid != pod.uid)
        reports = compute_reports(pod, pod_gone=gone, gang_id=gang_id, gang_gone=gang_gone)
        self._remember(loss, reports, gang_id)
        # Counted once decided, before any peer hears of it: a peer's answer to its
        # rooms' owners never runs ahead of the count.
        self.metrics.failovers.labels(role=role, cause=loss.cause.value).inc()
        told = [await self.tell_peers(loss, report) for report in reports]
        results = told[0] if told else []
        elapsed = time.monotonic() - received_monotonic
        self.metrics.failover_seconds.labels(role=role).observe(elapsed)
        if loss.happened_at is not None:
            detection = max(0.0, self._clock() - loss.happened_at)
            self.metrics.detection_seconds.labels(role=role).observe(detection)
        log.warning(
            "%s/%s: %s instance %d lost (%s, pod %s %s, %s); told %d/%d peers in %.0f ms",
            pod.namespace,
            pod.cluster,
            role,
            pod.instance,
            loss.cause.value,
            pod.name,
            ", ".join(f"{r.peer} {'gone' if r.gone else 'may still run'}" for r in reports),
            f"incarnation {gang_id if pod.role is Role.prefill else pod.uid}",
            sum(r.ok for r in results),
            len(results),
            elapsed * 1000,
        )
        for r in (r for batch in told for r in batch):
            if not r.ok:
                log.warning("fail_peer at %s failed: %s %s", r.url, r.status, r.error)
        if pod.role in LOST_EVENT and not loss.planned and await self._cluster_alive(pod):
            await self.recorder.record(
                ClusterRef(pod.cluster, pod.namespace, pod.cluster_uid),
                EventType.Warning.value,
                LOST_EVENT[pod.role].value,
                loss_message(loss, results, self.tracker.not_ready_grace_s),
            )
        if results:
            self._spawn(self._poll_soon(pod.key))
        return results

    def _remember(self, loss: Loss, reports: list[Report], gang_id: str | None) -> None:
        """What was reported `gone: false` is told again once it cannot run."""
        pod = loss.pod
        for report in reports:
            if report.incarnation == pod.uid and report.peer == pod.pod_ip:
                store, key = self._maybe_alive_pods, pod.uid  # the pod's own address
            elif gang_id is not None:
                store, key = self._maybe_alive, gang_id  # its instance
            else:
                continue
            if report.gone:
                store.pop(key, None)
            else:
                store.setdefault(key, loss)

    async def tell_peers(self, loss: Loss, report: Report) -> list[AdminResult]:
        pod = loss.pod
        peers = self.index.peers_of(pod)
        if not peers:
            return []
        reasons = PEER_REMOVED_REASON if loss.planned else PEER_LOST_REASON
        reason = reasons[pod.role]
        token = await self._token(pod.namespace, pod.token_secret)

        async def tell(peer: PodFacts) -> AdminResult:
            assert peer.admin_url is not None
            return await self.admin.fail_peer(
                peer.admin_url,
                token,
                report.peer,
                reason,
                gone=report.gone,
                incarnation=report.incarnation,
            )

        results = list(await asyncio.gather(*(tell(p) for p in peers)))
        if any(r.status in (401, 403) for r in results) and pod.token_secret:
            # The cached token is stale (the Secret was replaced): read it again once.
            self._tokens.pop((pod.namespace, pod.token_secret), None)
            token = await self._token(pod.namespace, pod.token_secret)
            retry = [i for i, r in enumerate(results) if r.status in (401, 403)]
            again = await asyncio.gather(*(tell(peers[i]) for i in retry))
            for i, result in zip(retry, again, strict=True):
                results[i] = result
        return results

    async def token_for(self, namespace: str, secret: str | None) -> str | None:
        """The cluster token read from `secret` (cached); None without one."""
        return await self._token(namespace, secret)

    async def _token(self, namespace: str, secret: str | None) -> str | None:
        if not secret:
            return None
        cached = self._tokens.get((namespace, secret))
        if cached is not None:
            return cached
        try:
            obj = await self.api.get("Secret", namespace, secret)
        except ApiError as err:
            log.warning("cannot read token Secret %s/%s: %s", namespace, secret, err)
            return None
        data = (obj or {}).get("data") or {}
        try:
            token = base64.b64decode(str(data.get(TOKEN_KEY, ""))).decode()
        except ValueError:
            token = ""
        if token:
            self._tokens[(namespace, secret)] = token
        return token or None

    async def _cluster_alive(self, pod: PodFacts) -> bool:
        """The PDCluster still exists and is not being deleted: a garbage-collected
        pod is no loss worth a Warning."""
        try:
            body = await self.api.get("PDCluster", pod.namespace, pod.cluster)
        except ApiError:
            return True
        meta = (body or {}).get("metadata") or {}
        if meta.get("uid") != pod.cluster_uid or meta.get("deletionTimestamp"):
            self._deleted_clusters.add(pod.cluster_uid)
            return False
        return True

    # ------------------------------------------------------------ failure counts
    async def _poll_soon(self, key: tuple[str, str]) -> None:
        await asyncio.sleep(POLL_AFTER_LOSS_S)
        await self.poll_failures(key)

    async def poll_failures(self, key: tuple[str, str]) -> dict[tuple[Role, str], int]:
        """Read every PD worker's failure counts of one cluster; report the increases."""
        pods = self.index.reachable(key)
        if not pods:
            return {}
        token = await self._token(key[0], pods[0].token_secret)

        async def read(pod: PodFacts) -> dict[str, int] | None:
            assert pod.admin_url is not None
            return await self.admin.failures(pod.admin_url, token)

        answers = await asyncio.gather(*(read(p) for p in pods))
        totals: dict[tuple[Role, str], int] = defaultdict(int)
        for pod, counts in zip(pods, answers, strict=True):
            if counts is None:
                continue
            if not self.counts.knows(pod.uid) and self._predates_operator(pod):
                self.counts.baseline(pod.uid, counts)
                continue
            for reason, increase in self.counts.update(pod.uid, counts).items():
                totals[(pod.role, reason_label(reason))] += increase
        ref = ClusterRef(key[1], key[0], pods[0].cluster_uid)
        for (role, reason), n in sorted(totals.items()):
            self.metrics.rooms_failed.labels(role=role.value, reason=reason).inc(n)
            await self.recorder.record(
                ref,
                EventType.Warning.value,
                Reason.RoomsFailed.value,
                rooms_failed_message(role, reason),
                times=n,
            )
        return dict(totals)

    async def publish_peers(self, key: tuple[str, str], *, force: bool = False) -> int:
        """Send the cluster's prefill set to its decode pods; retry the ones not answering.

        One publication per cluster at a time, each reading the index afresh,
        so an older set never lands after a newer one. Returns calls that failed.
        """
        lock = self._publish_locks.setdefault(key, asyncio.Lock())
        if force and lock.locked():
            return 0  # a publication is running and reads the index afresh anyway
        failed = 0
        async with lock:
            for attempt in range(PUBLISH_ATTEMPTS):
                pods = self.index.pods(key)
                if not pods:
                    return 0
                secret = pods[0].token_secret
                failed = await self.peers.publish(
                    pods,
                    functools.partial(self._token, key[0], secret),
                    force=force and attempt == 0,
                )
                if not failed:
                    return 0
                await asyncio.sleep(PUBLISH_RETRY_S)
        return failed

    def _predates_operator(self, pod: PodFacts) -> bool:
        # Whole-second creation times: a pod created in the operator's first
        # second counts as new (its failures are news), not as stale.
        return pod.created_at is not None and pod.created_at < int(self._started_at)

    async def poll_registration(self, key: tuple[str, str]) -> list[Unregistered]:
        """Read the prefill workers' /health; warn for an instance unregistered too long."""
        pods = [p for p in self.index.reachable(key) if p.role == Role.prefill]

        async def read(pod: PodFacts) -> tuple[bool, str | None]:
            assert pod.admin_url is not None
            return await self.admin.health(pod.admin_url)

        answers = await asyncio.gather(*(read(p) for p in pods))
        warnings: list[Unregistered] = []
        now = self._clock()
        for pod, (answered, reason) in zip(pods, answers, strict=True):
            verdict = self.registration.observe(pod.uid, pod.name, reason, answered, now)
            if verdict is None:
                continue
            warnings.append(verdict)
            log.warning("%s", verdict.message())
            ref = ClusterRef(key[1], key[0], pod.cluster_uid)
            await self.recorder.record(
                ref,
                EventType.Warning.value,
                Reason.InstanceUnregistered.value,
                verdict.message(),
            )
        return warnings

    async def poll_transports(self, key: tuple[str, str]) -> bool:
        """Read the PD workers' negotiated KV transport; True when the reports changed."""
        pods = self.index.reachable(key)
        if not pods:
            return False
        token = await self._token(key[0], pods[0].token_secret)

        async def read(pod: PodFacts) -> TransportReport | None:
            assert pod.admin_url is not None
            return parse_transport_report(await self.admin.server_info(pod.admin_url, token))

        answers = await asyncio.gather(*(read(p) for p in pods))
        changed = self.transports.update(
            key, {p.uid: (p.role, r) for p, r in zip(pods, answers, strict=True)}
        )
        if changed and self.on_transport_change is not None:
            self.on_transport_change(key)
        return changed

    async def poll_all(self) -> None:
        live = {p.uid for key in self.index.clusters() for p in self.index.pods(key)}
        self.counts.retain(live)
        self.registration.retain(live)
        self.transports.retain(live)
        for key in self.index.clusters():
            try:
                self._spawn(self.publish_peers(key, force=True))
                await self.poll_failures(key)
                await self.poll_registration(key)
                await self.poll_transports(key)
            except Exception:  # one cluster's trouble must not stop the others' reports
                log.exception("polling failure counts of %s/%s failed", *key)

    async def run_poller(self) -> None:
        while True:
            await asyncio.sleep(self.settings.failure_poll_interval_s)
            await self.poll_all()

    async def aclose(self) -> None:
        for handle in self._rechecks.values():
            handle.cancel()
        self._rechecks.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.admin.aclose()
