"""Test helpers: clusters from dicts, and an in-memory namespace that plays
the API server's part for the planner (synchronously) and the controller
(through the async `KubeApi` methods).

The store keeps the behaviours the operator relies on: names are unique per
kind, create fails with 409 on an existing name, deletes honour the uid
precondition, list filters by label selector, and list items carry their
kind only because `KubeClient.list` adds it (the store returns it directly).
"""

from __future__ import annotations

import copy
import importlib
import itertools
import os
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from pdcluster.operator.api import RoleAutoscalingStatus, format_time
from pdcluster.operator.builders.config import build_token_secret
from pdcluster.operator.builders.desired import DesiredState, build_desired
from pdcluster.operator.kube.client import ApiError
from pdcluster.operator.names import router_name
from pdcluster.operator.reconcile.actions import (
    Action,
    Apply,
    Create,
    CreateTokenSecret,
    Delete,
    Emit,
)
from pdcluster.operator.reconcile.cluster import Cluster, cluster_from_body
from pdcluster.operator.reconcile.observed import Observed, PodGroupApi, observe
from pdcluster.operator.reconcile.plan import Plan, plan_reconcile
from pdcluster.operator.reconcile.restarts import RestartLedger

# Test-only packages the dev extras must list (cel-python, kubernetes-validate,
# which brings jsonschema). Until they are installed, the tests that need them
# are skipped with this reason instead of breaking collection.
MISSING_DEV_DEP = "needs {}: add cel-python and kubernetes-validate to the dev extras"

# A role's last autoscaling decision as the operator keeps it in status: any one will do
# for the tests that check who keeps, carries over or clears it.
AUTOSCALING_DECISION = RoleAutoscalingStatus(
    metric="ttftP90Seconds",
    target=0.5,
    current=1,
    desired=2,
    reason="ScaleUp",
    last_decision_time="2026-01-01T00:00:00Z",
)


def unavailable(reason: str) -> NoReturn:
    """Skip a test whose tool is missing — except under CI, where it fails.

    CI installs the dev extras and builds the control-plane binaries before
    pytest starts, so a missing tool there is a broken set-up, not a reason
    to report fewer tests.
    """
    import pytest

    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI=true: a test that can run is never skipped)", pytrace=False)
    pytest.skip(reason)


def need(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        unavailable(MISSING_DEV_DEP.format(module))


NS = "team-a"
UID = "uid-cluster-1"


def body(spec: Mapping[str, Any], name: str = "demo", generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": name, "namespace": NS, "uid": UID, "generation": generation},
        "spec": copy.deepcopy(dict(spec)),
    }


def make_cluster(spec: Mapping[str, Any], name: str = "demo", generation: int = 1) -> Cluster:
    return cluster_from_body(body(spec, name, generation))


PD = {"prefill": {}, "decode": {}}


def _matches(labels: Mapping[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class Store:
    """One namespace of objects, keyed by (kind, name)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._uids = itertools.count(1)
        self._ips = itertools.count(0)
        self._gang_waiting: set[str] = set()
        # The kubelet's clock, for the Ready condition's lastTransitionTime (Sim moves it).
        self.now = 1_000_000.0
        self.writes: list[tuple[str, str, str]] = []  # (op, kind, name)
        self.status_writes: list[dict[str, Any]] = []
        # True: a deleted pod stays, terminating, until `end_terminating` (its drain).
        self.graceful_pod_deletes = False

    # --- what the controller's API calls do ---------------------------------
    def get_obj(self, kind: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list_objs(self, kind: str, selector: str) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(o)
            for (k, _), o in sorted(self.objects.items())
            if k == kind and _matches(o["metadata"].get("labels", {}), selector)
        ]

    def put(self, manifest: Mapping[str, Any], *, create_only: bool) -> dict[str, Any]:
        kind, name = str(manifest["kind"]), str(manifest["metadata"]["name"])
        existing = self.objects.get((kind, name))
        if existing is not None and create_only:
            raise ApiError(409, "AlreadyExists", f"{kind} {name} already exists")
        uid = manifest["metadata"].get("uid")
        if uid and (existing is None or existing["metadata"]["uid"] != uid):
            # What the apiserver answers an apply whose uid is not the object's.
            raise ApiError(422, "Invalid", f"{kind} {name}: metadata.uid: field is immutable")
        obj = copy.deepcopy(dict(manifest))
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", NS)
        if existing is None:
            meta["uid"] = f"uid-{next(self._uids)}"
            if kind == "Pod":
                obj["status"] = {"phase": "Pending"}
        else:
            meta["uid"] = existing["metadata"]["uid"]
            if "status" in existing:
                obj["status"] = existing["status"]
        self.objects[(kind, name)] = obj
        self.writes.append(("create" if create_only else "apply", kind, name))
        return copy.deepcopy(obj)

    def remove(self, kind: str, name: str, uid: str = "") -> bool:
        obj = self.objects.get((kind, name))
        if obj is None:
            return False
        if uid and obj["metadata"]["uid"] != uid:
            raise ApiError(409, "Conflict", "uid precondition failed")
        self.writes.append(("delete", kind, name))
        if kind == "Pod" and self.graceful_pod_deletes:
            obj["metadata"]["deletionTimestamp"] = format_time(self.now)
            return True
        del self.objects[(kind, name)]
        return True

    def terminating_pods(self) -> list[str]:
        return sorted(
            n
            for (k, n), o in self.objects.items()
            if k == "Pod" and o["metadata"].get("deletionTimestamp")
        )

    def end_terminating(self, names: Iterable[str] | None = None) -> None:
        """Terminating pods (all, or `names`) finished their drain and are gone."""
        for name in list(self.terminating_pods() if names is None else names):
            self.objects.pop(("Pod", name), None)

    # --- what happens in a real cluster between passes -----------------------
    def pods(self, **labels: str) -> list[dict[str, Any]]:
        sel = ",".join(f"pdcluster.io/{k.replace('_', '-')}={v}" for k, v in labels.items())
        return self.list_objs("Pod", sel)

    def set_pod(self, name: str, phase: str, ready: bool) -> None:
        """The status a kubelet writes: a pod that ran got an IP (kept across updates);
        a Ready one passed its startup probe; the Ready condition's lastTransitionTime
        moves (to `now`) only when its status flips."""
        pod = self.objects[("Pod", name)]
        before = pod.get("status", {})
        ready_text = "True" if ready else "False"
        was = next((c for c in before.get("conditions", []) if c.get("type") == "Ready"), None)
        since = (
            was["lastTransitionTime"]
            if was is not None and was.get("status") == ready_text
            else format_time(self.now)
        )
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": ready_text, "lastTransitionTime": since}],
        }
        ip = before.get("podIP")
        if phase != "Pending" or ip:
            n = next(self._ips)
            status["podIP"] = ip or f"10.0.{n // 250}.{n % 250 + 1}"
        if phase == "Running":
            was_started = any(c.get("started") for c in before.get("containerStatuses", []))
            status["containerStatuses"] = [{"name": "worker", "started": ready or was_started}]
        pod["status"] = status

    def make_all_ready(self) -> None:
        """Pending pods start; a pod turns Ready once every pod of its instance
        exists (a leader answers 503 until all its ranks joined, and pods k > 0
        are created only after the leader got its IP)."""
        for (kind, name), obj in self.objects.items():
            if kind == "Pod" and obj.get("status", {}).get("phase") == "Pending":
                self.set_pod(name, "Running", False)
                self._gang_waiting.add(name)
            if kind == "Deployment":
                obj["status"] = {"readyReplicas": obj["spec"]["replicas"]}
        for name in sorted(self._gang_waiting):
            pod = self.objects.get(("Pod", name))
            if pod is None:
                self._gang_waiting.discard(name)
            elif self._gang_complete(pod):
                self.set_pod(name, "Running", True)
                self._gang_waiting.discard(name)

    def _gang_complete(self, pod: Mapping[str, Any]) -> bool:
        labels = pod["metadata"].get("labels", {})
        size = int(pod["metadata"].get("annotations", {}).get("pdcluster.io/pods-per-instance", 1))
        keys = ("pdcluster.io/role", "pdcluster.io/instance", "pdcluster.io/template-hash")
        members = [
            o
            for (k, _), o in self.objects.items()
            if k == "Pod"
            and all(o["metadata"].get("labels", {}).get(key) == labels.get(key) for key in keys)
        ]
        return len(members) >= size

    def foreign(self, kind: str, name: str, labels: Mapping[str, str] | None = None) -> None:
        self.objects[(kind, name)] = {
            "apiVersion": "v1",
            "kind": kind,
            "metadata": {
                "name": name,
                "namespace": NS,
                "uid": f"foreign-{name}",
                "labels": dict(labels or {}),
            },
        }

    def names(self, kind: str) -> list[str]:
        return sorted(n for k, n in self.objects if k == kind)


def observe_store(
    store: Store, cluster: Cluster, pod_group_api: PodGroupApi = PodGroupApi.served
) -> Observed:
    # Like the controller: everything labelled, plus the names we look up.
    return observe(
        [copy.deepcopy(o) for o in store.objects.values()],
        cluster.ref.uid,
        router_name(cluster.name),
        pod_group_api,
    )


def execute(store: Store, cluster: Cluster, actions: Iterable[Action]) -> list[Emit]:
    """Carry out a plan on the store (synchronously); returns the events."""
    events: list[Emit] = []
    for action in actions:
        try:
            if isinstance(action, Apply):
                store.put(action.manifest, create_only=False)
            elif isinstance(action, Create):
                store.put(action.manifest, create_only=True)
            elif isinstance(action, CreateTokenSecret):
                store.put(build_token_secret(cluster, "test-token"), create_only=True)
            elif isinstance(action, Delete):
                store.remove(action.key.kind, action.key.name, action.uid)
            else:
                events.append(action)
        except ApiError:
            continue
    return events


class Sim:
    """Plan and execute passes against a store, carrying the ledgers the way the
    controller carries them through the status."""

    def __init__(
        self,
        spec: Mapping[str, Any],
        store: Store | None = None,
    ) -> None:
        self.store = store or Store()
        self.ledgers: dict[Any, RestartLedger] = {}
        # How the controller's PodGroup list went (not served: the CRD is missing).
        self.pod_group_api = PodGroupApi.served
        self.set_spec(spec)

    @property
    def now(self) -> float:
        """The planner's clock, which is also the store's kubelet's."""
        return self.store.now

    @now.setter
    def now(self, value: float) -> None:
        self.store.now = value

    def set_spec(self, spec: Mapping[str, Any]) -> None:
        self.cluster = make_cluster(spec)
        self.desired: DesiredState = build_desired(self.cluster)

    def plan(self) -> Plan:
        observed = observe_store(self.store, self.cluster, self.pod_group_api)
        return plan_reconcile(self.desired, observed, self.ledgers, self.now)

    def step(self) -> tuple[Plan, list[Emit]]:
        plan = self.plan()
        events = execute(self.store, self.cluster, plan.actions)
        self.ledgers = {r.role: r.ledger for r in plan.roles}
        return plan, events


class FakeApi:
    """`KubeApi` over a Store, plus the PDCluster objects and Events."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store or Store()
        # op ("create") or op:kind ("create:Pod") -> error raised once
        self.fail_next: dict[str, ApiError] = {}
        # op:kind -> error raised on every call
        self.fail_always: dict[str, ApiError] = {}

    def _maybe_fail(self, op: str, kind: str = "") -> None:
        always = self.fail_always.get(f"{op}:{kind}")
        if always is not None:
            raise always
        err = self.fail_next.pop(f"{op}:{kind}", None) or self.fail_next.pop(op, None)
        if err is not None:
            raise err

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._maybe_fail("get")
        return self.store.get_obj(kind, name)

    async def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        self._maybe_fail("list", kind)
        return self.store.list_objs(kind, selector)

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        self._maybe_fail("apply", str(manifest["kind"]))
        return self.store.put(manifest, create_only=False)

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        self._maybe_fail("create", str(manifest["kind"]))
        return self.store.put(manifest, create_only=True)

    async def delete(
        self, kind: str, namespace: str, name: str, uid: str, grace_period_s: int | None = None
    ) -> bool:
        self._maybe_fail("delete")
        try:
            return self.store.remove(kind, name, uid)
        except ApiError:
            return False

    async def patch_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        self._maybe_fail("patch_status")
        obj = self.store.objects[("PDCluster", name)]
        status = dict(obj.get("status") or {})
        for key, value in patch["status"].items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = copy.deepcopy(value)
        obj["status"] = status
        self.store.status_writes.append(copy.deepcopy(status))
        return copy.deepcopy(obj)

    async def patch(
        self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        obj = self.store.objects[(kind, name)]
        obj.update(copy.deepcopy(dict(patch)))
        self.store.writes.append(("patch", kind, name))
        return copy.deepcopy(obj)

    def events(self) -> list[dict[str, Any]]:
        return [o for (k, _), o in sorted(self.store.objects.items()) if k == "Event"]
