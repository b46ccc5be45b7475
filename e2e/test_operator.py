"""The operator against the real control plane, with worker pods that really run.

One operator process (as `python -m pdcluster.operator` runs it) watches
every namespace. The tests share one PDCluster and run in file order, each
leaving it Ready for the next: apply → Ready and serving; deleted children
come back; load above the TTFT target scales prefill 1 → 2 and back; a
killed prefill makes decode fail its rooms in well under a second
(heartbeats are set to 30 s, so only the operator's fast path can be that
quick), then the instance restarts; `kubectl scale` (of the PDCluster and
of the decode role's scaler); a real HPA reads the decode scaler's /scale
(the harness has no metrics API, so it cannot act); deleting the PDCluster
removes everything. A prefill instance of two pods serves over nixl, and
killing its non-leader pod fails decode's rooms at once, with ABORTs,
while their pages stay held until the surviving leader answers, and
replaces both; one that no node can take stays Pending and is never
restarted. An invalid
manifest (or one above the rank cap, or autoscaling beyond its GPU budget)
is refused by the API; the operator refuses a foreign Secret reference,
reports a quota that refuses its pods as ApplyFailed, and never applies
over an object that replaced one of its own.
"""

from __future__ import annotations

import base64
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.cluster import ClusterInfo
from e2e.conftest import KubectlRunner
from e2e.decode_request import DecodeRequest, generate_body
from e2e.kubetest import POD_GROUP_CRD, install_crd, is_ready
from e2e.nodeagent.client import NodeAgentClient
from e2e.nodeagent.kubeapi import ApiError, KubeApi
from e2e.operator_process import operator_process
from e2e.processes import ProcessRecord, wait_until
from e2e.prometheus_server import PrometheusApi, finite_points, prometheus_server
from pdcluster.operator.observability.panels import Panel, Source, all_panels
from tests.autoscaling_spec import PREFILL_AUTOSCALING, TTFT_TARGET_S
from tests.request_load import CompletionLoad

pytestmark = pytest.mark.k8s

NAME = "demo"
PDC_PATH = "/apis/pdcluster.io/v1alpha1/namespaces/{ns}/pdclusters"
START_TIMEOUT_S = 120.0
# Long enough that the decode heartbeat (2 x 30 s) cannot be what fails a room here.
HEARTBEAT_S = 30.0


def manifest(name: str = NAME, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"name": "tiny"},
        "kvCache": {"numPages": 64},
        "transfer": {
            "heartbeat": {"intervalSeconds": HEARTBEAT_S},
            "bootstrapTimeoutSeconds": 120,
            "waitingTimeoutSeconds": 120,
        },
        "prefill": {"replicas": 1, "restart": {"backoffSeconds": 1}},
        "decode": {"replicas": 1},
    }
    base.update(spec)
    return {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": name},
        "spec": base,
    }


@dataclass
class Operator:
    record: ProcessRecord
    log: Path
    metrics_url: str
    # A real Prometheus scraping the operator's /metrics from its start (the
    # operator dashboard's queries run on it at the module's end).
    prometheus: PrometheusApi
    started: float

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.metrics_url, timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        total = 0.0
        for line in text.splitlines():
            head, _, value = line.rpartition(" ")
            if head == name or head == f"{name}{{{want}}}":
                total += float(value)
        return total


@pytest.fixture(scope="module")
def operator(
    k8s_cluster: ClusterInfo, kube: KubeApi, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    # scheduler-plugins' PodGroup kind, for `gang: podGroup` (our own minimal CRD).
    install_crd(kube, POD_GROUP_CRD)
    settings = {
        "PDCLUSTER_OPERATOR_RESYNC_SECONDS": "20",
        "PDCLUSTER_OPERATOR_FAILURE_POLL_SECONDS": "2",
        "PDCLUSTER_OPERATOR_EVENT_INTERVAL_SECONDS": "5",
    }
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with operator_process(k8s_cluster.kubeconfig, log, env=settings, die_with_parent=True) as (
        record,
        metrics_url,
    ):
        target = metrics_url.split("://", 1)[1].split("/", 1)[0]
        with prometheus_server({"operator": [target]}, log.parent / "prometheus") as prom:
            yield Operator(record, log, metrics_url, prom, time.time())


@pytest.fixture(scope="module")
def ns(kube: KubeApi) -> Iterator[str]:
    name = f"pdc-op-{secrets.token_hex(3)}"
    # The cluster's pods must fit a namespace enforcing Pod Security `restricted`.
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    kube.create(
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}},
    )
    wait_until(
        lambda: kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default") is not None,
        30,
        "the default service account",
    )
    yield name
    kube.delete(f"/api/v1/namespaces/{name}")


def apply(kubectl: KubectlRunner, tmp: Path, ns: str, doc: dict[str, Any], check: bool = True):
    path = tmp / f"{doc['metadata']['name']}-{secrets.token_hex(2)}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return kubectl("kubectl", "apply", "-n", ns, "-f", str(path), check=check)


def pdc(kube: KubeApi, ns: str, name: str = NAME) -> dict[str, Any] | None:
    return kube.get(f"{PDC_PATH.format(ns=ns)}/{name}")


def condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return str(cond.get("status"))
    return None


def wait_ready(op: Operator, kube: KubeApi, ns: str, what: str, extra=lambda o: True) -> dict:
    found: dict[str, Any] = {}

    def ready() -> bool:
        obj = pdc(kube, ns)
        if obj is not None and (obj.get("status") or {}).get("phase") == "Ready" and extra(obj):
            found.update(obj)
            return True
        return False

    try:
        wait_until(ready, START_TIMEOUT_S, what, interval_s=0.5)
    except TimeoutError as err:
        raise AssertionError(f"{err}\nstatus: {pdc(kube, ns)}\noperator:\n{op.log_tail()}") from err
    return found


def pods(kube: KubeApi, ns: str, role: str) -> list[dict[str, Any]]:
    selector = f"pdcluster.io/cluster={NAME},pdcluster.io/role={role}"
    listed = kube.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector})
    return [
        p for p in (listed or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")
    ]


def one_ready_pod_a_role(kube: KubeApi, ns: str) -> bool:
    for role in ("prefill", "decode", "router"):
        found = pods(kube, ns, role)
        if len(found) != 1 or not is_ready(found[0]):
            return False
    return True


def one_pod(kube: KubeApi, ns: str, role: str) -> dict[str, Any]:
    found = pods(kube, ns, role)
    assert len(found) == 1, [p["metadata"]["name"] for p in found]
    return found[0]


def token(kube: KubeApi, ns: str, name: str = NAME) -> str:
    secret = kube.get(f"/api/v1/namespaces/{ns}/secrets/{name}-token")
    assert secret is not None
    return base64.b64decode(secret["data"]["token"]).decode()


def events(kube: KubeApi, ns: str) -> dict[str, dict[str, Any]]:
    listed = kube.get(f"/api/v1/namespaces/{ns}/events") or {}
    out: dict[str, dict[str, Any]] = {}
    for e in listed.get("items", []):
        if e.get("involvedObject", {}).get("kind") == "PDCluster":
            out[e["reason"]] = e
    return out


def complete(router_ip: str, prompt: str = "The capital of France is") -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    resp = httpx.post(f"http://{router_ip}:8000/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


@pytest.fixture(scope="module")
def demo(
    operator: Operator,
    kube: KubeApi,
    kubectl: KubectlRunner,
    ns: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    apply(kubectl, tmp_path_factory.mktemp("manifests"), ns, manifest())
    return wait_ready(operator, kube, ns, "PDCluster demo Ready")


# ---------------------------------------------------------------- tests, in order
def test_apply_brings_up_a_ready_cluster_that_serves(
    demo: dict[str, Any], kube: KubeApi, kubectl: KubectlRunner, ns: str
) -> None:
    status = demo["status"]
    assert condition(demo, "Ready") == "True" and condition(demo, "Degraded") == "False"
    assert status["observedGeneration"] == demo["metadata"]["generation"]
    uid = demo["metadata"]["uid"]
    for path in (
        f"/api/v1/namespaces/{ns}/configmaps/{NAME}-config",
        f"/api/v1/namespaces/{ns}/secrets/{NAME}-token",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{NAME}-runtime",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{NAME}-runtime",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/{NAME}-runtime",
        f"/apis/apps/v1/namespaces/{ns}/deployments/{NAME}-router",
        f"/api/v1/namespaces/{ns}/services/{NAME}-router",
    ):
        obj = kube.get(path)
        assert obj is not None, path
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid, path
    for role in ("prefill", "decode", "router"):
        assert is_ready(one_pod(kube, ns, role))
    # The printer columns show phase and per-role ready/desired.
    table = kubectl("kubectl", "get", "pdc", NAME, "-n", ns).stdout.split("\n")
    header, row = table[0].split(), table[1].split()
    assert header[:5] == ["NAME", "PHASE", "PREFILL", "DECODE", "ROUTER"]
    assert row[:5] == [NAME, "Ready", "1/1", "1/1", "1/1"]
    # The router answers through its pod IP, with prefill and decode behind it.
    router_ip = one_pod(kube, ns, "router")["status"]["podIP"]
    first = complete(router_ip)
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 8
    assert complete(router_ip)["choices"][0]["text"] == first["choices"][0]["text"]


def test_deleted_children_come_back(demo: dict[str, Any], kube: KubeApi, ns: str) -> None:
    paths = [
        f"/api/v1/namespaces/{ns}/configmaps/{NAME}-config",
        f"/api/v1/namespaces/{ns}/services/{NAME}-router",
    ]
    before = {p: kube.get(p)["metadata"]["uid"] for p in paths}  # type: ignore[index]
    for path in paths:
        assert kube.delete(path)

    def recreated() -> bool:
        now = {p: (kube.get(p) or {}).get("metadata", {}).get("uid") for p in paths}
        return all(now[p] and now[p] != before[p] for p in paths)

    wait_until(recreated, 30, "the deleted ConfigMap and Service to be recreated")


def router_settings(kube: KubeApi, ns: str) -> dict[str, Any]:
    router_ip = one_pod(kube, ns, "router")["status"]["podIP"]
    headers = {"Authorization": f"Bearer {token(kube, ns)}"}
    resp = httpx.get(f"http://{router_ip}:8000/admin/settings", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


def test_a_router_policy_change_is_applied_live_and_restarts_no_pod(
    demo: dict[str, Any], operator: Operator, kube: KubeApi, ns: str
) -> None:
    def uids() -> dict[str, str]:
        return {
            p["metadata"]["name"]: p["metadata"]["uid"]
            for role in ("prefill", "decode", "router")
            for p in pods(kube, ns, role)
        }

    before = uids()
    assert len(before) == 3
    deployment = f"/apis/apps/v1/namespaces/{ns}/deployments/{NAME}-router"
    generation = kube.get(deployment)["metadata"]["generation"]  # type: ignore[index]
    assert router_settings(kube, ns)["policy"]["decode"] == "round_robin"
    path = f"{PDC_PATH.format(ns=ns)}/{NAME}"
    live = {"policy": {"decode": "least_outstanding"}, "healthCheckIntervalSeconds": 1}
    kube.patch(path, {"spec": {"router": live}}, patch_type="merge")
    try:
        wait_until(
            lambda: router_settings(kube, ns)["policy"]["decode"] == "least_outstanding",
            30,
            "the router to report the new decode policy",
        )
        assert router_settings(kube, ns)["healthCheckIntervalSeconds"] == 1.0
        wait_until(lambda: "SettingsApplied" in events(kube, ns), 30, "a SettingsApplied Event")
        message = events(kube, ns)["SettingsApplied"]["message"]
        assert "router.policy.decode: round_robin -> least_outstanding" in message, message
        # A router started later reads the new values from the manifest it mounts.
        config = kube.get(f"/api/v1/namespaces/{ns}/configmaps/{NAME}-config") or {}
        assert "least_outstanding" in str(config.get("data")), config
        assert uids() == before
        assert kube.get(deployment)["metadata"]["generation"] == generation  # type: ignore[index]
        router_ip = one_pod(kube, ns, "router")["status"]["podIP"]
        assert complete(router_ip)["usage"]["completion_tokens"] == 8
    finally:
        kube.patch(path, {"spec": {"router": None}}, patch_type="merge")
    wait_until(
        lambda: router_settings(kube, ns)["policy"]["decode"] == "round_robin",
        30,
        "the router to report its first decode policy again",
    )
    assert uids() == before


SCALERS_PATH = "/apis/pdcluster.io/v1alpha1/namespaces/{ns}/pdclusterrolescalers"


LOAD_BODY: dict[str, Any] = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4}


def prefill_autoscaling(kube: KubeApi, ns: str) -> dict[str, Any]:
    return ((pdc(kube, ns) or {}).get("status") or {}).get("prefill", {}).get("autoscaling") or {}


def test_load_above_target_scales_prefill_up_and_back_down_when_it_stops(
    demo: dict[str, Any], operator: Operator, kube: KubeApi, ns: str
) -> None:
    """The built-in planner, end to end: the router's own TTFT histogram over
    target makes the operator raise prefill 1 -> 2 (ScaledUp, the role's scaler
    following, status.prefill.autoscaling filled); with the load gone it goes
    back to 1 after the scale-down window, through the drain, with no failed
    request."""
    wait_ready(operator, kube, ns, "Ready before autoscaling")
    scaler_path = f"{SCALERS_PATH.format(ns=ns)}/{NAME}-prefill"
    scaler = kube.get(scaler_path)
    assert scaler is not None, "the operator creates one scaler per role"
    assert scaler["metadata"]["ownerReferences"][0]["uid"] == demo["metadata"]["uid"]
    assert scaler["spec"] == {"cluster": NAME, "role": "prefill", "replicas": 1}
    path = f"{PDC_PATH.format(ns=ns)}/{NAME}"
    kube.patch(
        path, {"spec": {"prefill": {"autoscaling": PREFILL_AUTOSCALING}}}, patch_type="merge"
    )
    router_ip = one_pod(kube, ns, "router")["status"]["podIP"]
    try:
        url = f"http://{router_ip}:8000/v1/completions"
        with CompletionLoad(url, LOAD_BODY, num_threads=1, timeout_s=60) as load:
            wait_until(
                lambda: (pdc(kube, ns) or {})["spec"]["prefill"]["replicas"] == 2,
                90,
                f"prefill scaled up (status: {prefill_autoscaling(kube, ns)})",
                interval_s=0.5,
            )
        assert load.done > 0 and not load.failures, load.failures
        wait_until(
            lambda: bool(prefill_autoscaling(kube, ns).get("lastScaleTime")),
            30,
            "status.prefill.autoscaling naming the scale",
        )
        decided = prefill_autoscaling(kube, ns)
        assert decided["metric"] == "ttftP90Seconds" and decided["target"] == TTFT_TARGET_S
        # Prefill's TTFT comes from the router's own /metrics (its end-to-end view).
        assert decided["source"] == "router", decided
        assert isinstance(decided["lastValue"], float) and decided["lastDecisionTime"]
        # The planner's windows, kept for an operator restart.
        kept = [p["replicas"] for p in decided.get("recommendations") or []]
        assert kept and set(kept) <= {1, 2}, decided
        wait_until(lambda: "ScaledUp" in events(kube, ns), 30, "the ScaledUp Event")
        message = events(kube, ns)["ScaledUp"]["message"]
        assert "ttftP90Seconds" in message and "1 -> 2" in message, message
        wait_until(
            lambda: (kube.get(scaler_path) or {})["spec"]["replicas"] == 2,
            30,
            "the prefill scaler following the PDCluster",
        )
        # Idle: p90 0 -> the minimum, once the new instance is Ready and the window passed.
        wait_ready(
            operator,
            kube,
            ns,
            "prefill back at one instance",
            extra=lambda o: (
                o["spec"]["prefill"]["replicas"] == 1
                and (o["status"].get("prefill") or {}).get("summary") == "1/1"
            ),
        )
        wait_until(lambda: "ScaledDown" in events(kube, ns), 30, "the ScaledDown Event")
        assert "2 -> 1" in events(kube, ns)["ScaledDown"]["message"]
        wait_until(lambda: len(pods(kube, ns, "prefill")) == 1, 60, "the drained pod gone")
    finally:
        kube.patch(path, {"spec": {"prefill": {"autoscaling": None}}}, patch_type="merge")
    wait_until(lambda: not prefill_autoscaling(kube, ns), 60, "the autoscaling status cleared")
    # Still serving after the drain. Sent only now: with autoscaling still on,
    # this one request's TTFT (over the 1 ms target) would raise prefill again
    # and leave the next tests two prefills.
    assert complete(router_ip)["usage"]["completion_tokens"] == 8
    assert (pdc(kube, ns) or {})["spec"]["prefill"]["replicas"] == 1


@dataclass
class StatusLog:
    """Every status the PDCluster goes through, from a watch in a thread."""

    seen: list[tuple[str, str | None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def phases(self) -> list[str]:
        return [p for p, _ in self.seen]


def watch_status(k8s_cluster: ClusterInfo, ns: str, log: StatusLog) -> threading.Thread:
    api = KubeApi(k8s_cluster.server, k8s_cluster.admin_token, k8s_cluster.ca_cert)
    path = PDC_PATH.format(ns=ns)
    version = api.get(path)["metadata"]["resourceVersion"]  # type: ignore[index]

    def run() -> None:
        try:
            for kind, obj in api.watch(path, version, timeout_s=120):
                if kind in ("ADDED", "MODIFIED"):
                    log.seen.append(
                        ((obj.get("status") or {}).get("phase", ""), condition(obj, "Degraded"))
                    )
                if log.stop.is_set():
                    return
        finally:
            api.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def fail_fast_when_a_pod_dies(
    node_agent: NodeAgentClient,
    ns: str,
    decode_url: str,
    admin: dict[str, str],
    *,
    frozen: dict[str, Any],
    killed: dict[str, Any],
    freeze: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[float, DecodeRequest]:
    """Freeze the prefill pod `frozen`, open a decode room waiting for its KV, then
    kill the pod `killed` (of the same instance): decode fails the room by the
    operator's fast path, pod event → operator → /admin/fail_peer, well before its
    heartbeat (2 x HEARTBEAT_S) could. How long after the kill decode answered,
    and the request."""
    if freeze is None:
        node_agent.freeze_pod(ns, frozen["metadata"]["name"])
    else:
        freeze(frozen)
    request = DecodeRequest(decode_url, frozen["status"]["podIP"], admin, timeout_s=90)
    try:
        wait_until(request.room_open, 30, "decode to open the room")
    except TimeoutError as err:
        raise AssertionError(f"{err}: rooms {request.rooms}, answer {request.answer}") from err
    killed_at = time.monotonic()
    node_agent.kill_pod(ns, killed["metadata"]["name"])
    answer = request.join(60)
    assert answer, "decode never answered"
    took: float = answer["at"] - killed_at
    assert answer["status"] == 502 and "prefill_pod_lost" in answer["text"], answer
    assert FAST_PATH_BOUND_S < HEARTBEAT_S
    assert took < FAST_PATH_BOUND_S, f"decode failed the room {took:.2f}s after the kill"
    failures = httpx.get(f"{decode_url}/admin/failures", headers=admin, timeout=5).json()
    assert failures["failures"].get("room_failed:prefill_pod_lost", 0) >= 1
    return took, request


def freeze_as_a_kubelet_would_find_it(node_agent: NodeAgentClient, pod: dict[str, Any]) -> None:
    """SIGSTOP the pod's processes directly. The node agent's own freeze makes its
    termination send SIGCONT with SIGTERM; unknown to it, the pod stays frozen
    through its termination (a kubelet sends SIGTERM alone) until it is killed."""
    (entry,) = [p for p in node_agent.pods() if p["uid"] == pod["metadata"]["uid"]]
    pids = [c["pid"] for c in entry["containers"] if c["pid"]]
    assert pids, entry
    for pid in pids:
        os.killpg(pid, signal.SIGSTOP)


# How long the test watches the frozen writer's room before it kills that writer.
HOLD_S = 8.0


def held_until_the_frozen_writer_is_gone(
    node_agent: NodeAgentClient,
    kube: KubeApi,
    ns: str,
    decode_url: str,
    admin: dict[str, str],
    room: int,
    frozen: dict[str, Any],
) -> None:
    """One-sided writes (nixl): decode failed the room and sent ABORT, and freed
    nothing of it: the killed pod's ranks are settled (gone), but the frozen
    pod's may still write into the room's pages. They stay the room's while that
    pod runs (frozen, then terminating: the gang restart deletes it) and come
    back only once it is gone (it cannot acknowledge while frozen)."""

    def view() -> dict[str, Any] | None:
        rooms = httpx.get(f"{decode_url}/admin/rooms", headers=admin, timeout=5).json()["rooms"]
        return next((r for r in rooms if r["room"] == room), None)

    info = httpx.get(f"{decode_url}/get_server_info", headers=admin, timeout=5).json()
    assert info["pd_stats"].get("abort_sent", 0) >= 1, info["pd_stats"]
    path = f"/api/v1/namespaces/{ns}/pods/{frozen['metadata']['name']}"

    def writer() -> str:
        """frozen (not asked to stop), terminating (still frozen), or ended."""
        pod = kube.get(path)
        if pod is None or pod["metadata"]["uid"] != frozen["metadata"]["uid"]:
            return "ended"
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        if any("terminated" in (cs.get("state") or {}) for cs in statuses):
            return "ended"
        return "terminating" if pod["metadata"].get("deletionTimestamp") else "frozen"

    seen: list[tuple[str, bool]] = []  # (the writer's state, the room still held), in order
    started = time.monotonic()
    killed = False
    while True:
        state = writer()
        held = view()
        if held is None:
            seen.append((writer(), False))  # the writer's state once released
            break
        seen.append((state, True))
        # Failed at once; held, with only the frozen writer's source unsettled.
        assert held["state"] == "Failed", held
        elapsed = time.monotonic() - started
        if not killed and elapsed > HOLD_S:
            node_agent.kill_pod(ns, frozen["metadata"]["name"])  # held long enough: it goes
            killed = True
        assert elapsed < HOLD_S + 60, f"room {room} never came back: {held}, {seen[-5:]}"
        time.sleep(0.25)
    held_states = {state for state, held in seen if held}
    assert seen[0][1], f"room {room} was released at once: {seen}"
    assert seen[-1][0] == "ended", f"room {room} was released while its writer ran: {seen}"
    print(f"room {room} held while its writer was {sorted(held_states)}; released once it ended")


def test_killed_prefill_fails_decode_rooms_at_once_then_restarts(
    demo: dict[str, Any],
    operator: Operator,
    kube: KubeApi,
    node_agent: NodeAgentClient,
    k8s_cluster: ClusterInfo,
    ns: str,
) -> None:
    prefill, decode = one_pod(kube, ns, "prefill"), one_pod(kube, ns, "decode")
    admin = {"Authorization": f"Bearer {token(kube, ns)}"}
    decode_url = f"http://{decode['status']['podIP']}:8000"
    log = StatusLog()
    watch_status(k8s_cluster, ns, log)

    # A request whose KV must come from a prefill that hangs, then the prefill dies.
    fail_fast_when_a_pod_dies(node_agent, ns, decode_url, admin, frozen=prefill, killed=prefill)
    failovers = {
        cause: operator.metric("pdcluster_operator_failovers_total", role="prefill", cause=cause)
        for cause in ("failed", "not_ready")
    }
    assert failovers["failed"] >= 1, f"prefill failovers by cause: {failovers}"

    # The instance comes back as a new pod; the cluster goes Degraded, then Ready.
    old_uid = prefill["metadata"]["uid"]
    wait_ready(
        operator,
        kube,
        ns,
        "the restarted prefill to be Ready",
        extra=lambda o: any(p["metadata"]["uid"] != old_uid for p in pods(kube, ns, "prefill")),
    )
    log.stop.set()
    assert ("Degraded", "True") in log.seen, log.seen
    assert log.phases()[-1] == "Ready" or pdc(kube, ns)["status"]["phase"] == "Ready"  # type: ignore[index]

    def reported() -> bool:
        return {"PrefillInstanceLost", "InstanceRestarted", "RoomsFailed"} <= set(events(kube, ns))

    wait_until(reported, 20, f"the failover Events (have {sorted(events(kube, ns))})")
    found = events(kube, ns)
    assert found["PrefillInstanceLost"]["type"] == "Warning"
    assert "its rooms failed at 1/1 decode workers" in found["PrefillInstanceLost"]["message"]
    assert found["RoomsFailed"]["count"] >= 1
    # And it serves again.
    assert (
        complete(one_pod(kube, ns, "router")["status"]["podIP"])["usage"]["completion_tokens"] == 8
    )


def test_hung_prefill_fails_decode_rooms_after_the_not_ready_grace(
    demo: dict[str, Any],
    operator: Operator,
    kube: KubeApi,
    node_agent: NodeAgentClient,
    ns: str,
) -> None:
    # A hung process (SIGSTOP) is not dead: the kubelet only sees its readiness
    # probe fail. NotReady past the grace is a loss too.
    # One Ready pod a role, none terminating: a failover before this one may have
    # left a pod replaced after the cluster's phase last said Ready.
    wait_ready(
        operator,
        kube,
        ns,
        "Ready before the freeze",
        extra=lambda o: one_ready_pod_a_role(kube, ns),
    )
    prefill, decode = one_pod(kube, ns, "prefill"), one_pod(kube, ns, "decode")
    name, prefill_ip = prefill["metadata"]["name"], prefill["status"]["podIP"]
    decode_url = f"http://{decode['status']['podIP']}:8000"
    router_ip = one_pod(kube, ns, "router")["status"]["podIP"]
    answers: list[tuple[int, str]] = []

    def served() -> bool:
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4}
        resp = httpx.post(f"http://{router_ip}:8000/v1/completions", json=body, timeout=60)
        answers.append((resp.status_code, resp.text[:200]))
        return resp.status_code == 200

    # Decode learns a prefill's topology on its first room there: frozen before
    # that, the /route fetch times out (`bootstrap_unreachable`) before any
    # NotReady verdict. Let one request through first, as a pod that hangs in
    # production has served before (the router may still be admitting workers).
    wait_until(served, START_TIMEOUT_S, "a request served before the freeze", interval_s=0.5)
    answers.clear()
    frozen_at = time.monotonic()
    node_agent.freeze_pod(ns, name)
    try:
        body = generate_body(prefill_ip)
        auth = {"Authorization": f"Bearer {token(kube, ns)}"}  # the worker API is guarded
        resp = httpx.post(f"{decode_url}/generate", json=body, headers=auth, timeout=90)
        took = time.monotonic() - frozen_at
    finally:
        node_agent.thaw_pod(ns, name)
    assert resp.status_code == 502 and "prefill_pod_lost" in resp.text, resp.text
    # Readiness fails after 3 x 2 s, then the 5 s grace; the heartbeat needs 2 x 30 s.
    # The margin is for a loaded box; the bound stays well below the heartbeat's.
    bound = 3 * 2 + 5 + 19
    assert bound < 2 * HEARTBEAT_S
    assert took < bound, f"decode failed the room {took:.1f}s after the freeze"
    listed = kube.get(f"/api/v1/namespaces/{ns}/events") or {}
    lost = [e["message"] for e in listed["items"] if e["reason"] == "PrefillInstanceLost"]
    assert any("has not been Ready for 5s" in m for m in lost), lost
    assert operator.metric("pdcluster_operator_failovers_total", role="prefill", cause="not_ready")
    # Thawed before the liveness probe gave up on it: the same pod serves again.
    wait_ready(
        operator,
        kube,
        ns,
        "the thawed prefill Ready again",
        extra=lambda o: (
            one_pod(kube, ns, "prefill")["metadata"]["uid"] == prefill["metadata"]["uid"]
        ),
    )
    # Ready again, but decode holds it dead until its heartbeat sees it answer (up to
    # 30 s here): the router keeps it out meanwhile, so no request fails at decode.
    wait_until(served, 3 * HEARTBEAT_S, "a request through the router served", interval_s=0.5)
    refused = [(code, text) for code, text in answers if code != 200]
    assert all(code == 503 and "prefill" in text for code, text in refused), refused


def test_kubectl_scale_sets_the_decode_replicas(
    demo: dict[str, Any], operator: Operator, kube: KubeApi, kubectl: KubectlRunner, ns: str
) -> None:
    def scale_to(target: str, replicas: int, what: str) -> dict[str, Any]:
        """`kubectl scale` `target`, then the cluster Ready with that many decode instances."""
        kubectl("kubectl", "scale", target, "-n", ns, f"--replicas={replicas}")
        summary = f"{replicas}/{replicas}"
        return wait_ready(
            operator,
            kube,
            ns,
            what,
            extra=lambda o: (o["status"].get("decode") or {}).get("summary") == summary,
        )

    ready = scale_to(f"pdc/{NAME}", 3, "3 decode instances Ready")
    assert ready["spec"]["decode"]["replicas"] == 3
    assert ready["status"]["replicas"] == 3
    assert len(pods(kube, ns, "decode")) == 3
    scale = kube.get(f"{PDC_PATH.format(ns=ns)}/{NAME}/scale")
    assert scale is not None and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == f"pdcluster.io/cluster={NAME},pdcluster.io/role=decode"
    # The decode scaler followed, and scaling it scales the role.
    scaler_path = f"{SCALERS_PATH.format(ns=ns)}/{NAME}-decode"
    wait_until(
        lambda: ((kube.get(scaler_path) or {}).get("status") or {}).get("syncedReplicas") == 3,
        30,
        "the decode scaler synced at 3",
    )
    assert (kube.get(scaler_path) or {})["spec"]["replicas"] == 3
    scaled = scale_to(
        f"pdcrs/{NAME}-decode", 2, "2 decode instances Ready after scaling the decode scaler"
    )
    assert scaled["spec"]["decode"]["replicas"] == 2
    wait_until(
        lambda: (kube.get(f"{scaler_path}/scale") or {}).get("status", {}).get("replicas") == 2,
        60,
        "the decode scaler's /scale reporting 2 instances",
    )


HPA_PATH = "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers"


def hpa_condition(hpa: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((hpa or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def test_a_real_hpa_reads_the_decode_scalers_scale_and_waits_for_metrics(
    demo: dict[str, Any], kube: KubeApi, ns: str
) -> None:
    """An `autoscaling/v2` HorizontalPodAutoscaler on the decode role's scaler,
    run by the harness's real kube-controller-manager: it reads the scaler's
    /scale (replicas and selector: AbleToScale True, SucceededGetScale) and,
    with no metrics API in the harness, reports ScalingActive False
    (FailedGetResourceMetric) and changes nothing."""
    scaler_path = f"{SCALERS_PATH.format(ns=ns)}/{NAME}-decode"
    wait_until(
        lambda: bool(
            ((kube.get(f"{scaler_path}/scale") or {}).get("status") or {}).get("selector")
        ),
        30,
        "the decode scaler's /scale selector",
    )
    before = kube.get(scaler_path)
    assert before is not None
    replicas = before["spec"]["replicas"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"{NAME}-decode"},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "pdcluster.io/v1alpha1",
                "kind": "PDClusterRoleScaler",
                "name": f"{NAME}-decode",
            },
            # The current replicas lie inside the bounds: only a metric could move them.
            "minReplicas": 1,
            "maxReplicas": max(3, replicas),
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {"type": "Utilization", "averageUtilization": 50},
                    },
                }
            ],
        },
    }
    path = HPA_PATH.format(ns=ns)
    kube.create(path, hpa)
    try:
        # The controller syncs an HPA every 15 s.
        wait_until(
            lambda: bool(hpa_condition(kube.get(f"{path}/{NAME}-decode"), "ScalingActive")),
            90,
            "the HPA controller's conditions",
            interval_s=1.0,
        )
        seen = kube.get(f"{path}/{NAME}-decode")
        able = hpa_condition(seen, "AbleToScale")
        assert able.get("status") == "True" and able.get("reason") == "SucceededGetScale", seen
        active = hpa_condition(seen, "ScalingActive")
        assert active.get("status") == "False", seen
        assert active.get("reason") == "FailedGetResourceMetric", seen
        assert "metrics" in active.get("message", ""), seen
        assert (seen or {})["status"]["currentReplicas"] == replicas
        # Without a metric it decided nothing: the scaler and the role are untouched.
        assert (kube.get(scaler_path) or {})["spec"]["replicas"] == replicas
        assert (pdc(kube, ns) or {})["spec"]["decode"]["replicas"] == replicas
    finally:
        kube.delete(f"{path}/{NAME}-decode")


OPERATOR_PANELS = [(uid, p) for uid, p in all_panels() if p.source is Source.operator]


@pytest.mark.parametrize(
    ("uid", "panel"), OPERATOR_PANELS, ids=[f"{u}:{p.title}" for u, p in OPERATOR_PANELS]
)
def test_every_operator_panel_shows_what_this_module_did(
    demo: dict[str, Any], operator: Operator, uid: str, panel: Panel
) -> None:
    """The operator dashboard's (and the capacity dashboard's operator) queries on a
    real Prometheus that scraped this module's operator: the reconciles, the
    autoscaler's decisions, the killed prefill's failover, restart, Events and
    failed rooms of the tests above all show."""
    end = time.time() + 2
    span = f"{int(end - operator.started) + 1}s"
    for query in panel.queries:
        expr = query.expr.replace("$__rate_interval", "30s").replace("$__range", span)
        expr = expr.replace("$pdcluster", ".*")
        result = operator.prometheus.query_range(expr, operator.started, end, 5)
        assert finite_points(result) > 0, f"{uid} / {panel.title}: {query.expr}"


def test_deleting_the_cluster_removes_everything(
    demo: dict[str, Any], kube: KubeApi, ns: str
) -> None:
    selector = {"labelSelector": f"pdcluster.io/cluster={NAME}"}
    kinds = [
        "/api/v1/namespaces/{ns}/pods",
        "/api/v1/namespaces/{ns}/services",
        "/api/v1/namespaces/{ns}/configmaps",
        "/api/v1/namespaces/{ns}/secrets",
        "/api/v1/namespaces/{ns}/serviceaccounts",
        "/apis/apps/v1/namespaces/{ns}/deployments",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
        "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    ]

    def left() -> list[str]:
        names = []
        for path in kinds:
            listed = kube.get(path.format(ns=ns), params=selector) or {}
            names += [f"{path.rsplit('/', 1)[1]}/{o['metadata']['name']}" for o in listed["items"]]
        return names

    assert len(left()) >= 10
    assert kube.delete(f"{PDC_PATH.format(ns=ns)}/{NAME}")
    wait_until(lambda: pdc(kube, ns) is None and not left(), 90, "garbage collection")


# ------------------------------------------------------ a multi-pod instance (own namespace)
MULTI = "multipod"


def cluster_pods(kube: KubeApi, ns: str, role: str, name: str = MULTI) -> list[dict[str, Any]]:
    selector = f"pdcluster.io/cluster={name},pdcluster.io/role={role}"
    listed = kube.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector})
    items = [
        p for p in (listed or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")
    ]
    return sorted(
        items, key=lambda p: int(p["metadata"]["labels"].get("pdcluster.io/pod-index", 0))
    )


def wait_cluster_ready(op: Operator, kube: KubeApi, ns: str, name: str, check) -> dict[str, Any]:
    """Wait until the PDCluster is Ready and `check(obj)` holds; the operator log on timeout."""
    found: dict[str, Any] = {}

    def ready() -> bool:
        obj = pdc(kube, ns, name)
        if obj is not None and (obj.get("status") or {}).get("phase") == "Ready" and check(obj):
            found.update(obj)
            return True
        return False

    try:
        wait_until(ready, 2 * START_TIMEOUT_S, f"PDCluster {name} Ready", interval_s=0.5)
    except TimeoutError as err:
        raise AssertionError(f"{err}\nstatus: {pdc(kube, ns, name)}\n{op.log_tail()}") from err
    return found


def assert_pod_group(
    kube: KubeApi, namespace: str, leader: dict[str, Any], follower: dict[str, Any]
) -> None:
    """The instance's PodGroup (`gang: podGroup`): both pods name it, it asks for both,
    and the PDCluster owns it. The harness runs the default scheduler, which ignores
    PodGroups: the object and the labels are checked, not all-or-nothing binding."""
    label = "scheduling.x-k8s.io/pod-group"
    name = leader["metadata"]["labels"][label]
    assert follower["metadata"]["labels"][label] == name
    group = kube.get(f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{namespace}/podgroups/{name}")
    assert group is not None, f"PodGroup {name} does not exist"
    assert group["spec"]["minMember"] == 2
    cluster = pdc(kube, namespace, MULTI)
    assert cluster is not None
    (owner,) = group["metadata"]["ownerReferences"]
    assert owner["kind"] == "PDCluster" and owner["name"] == MULTI
    assert owner["uid"] == cluster["metadata"]["uid"] and owner["controller"] is True


def test_a_two_pod_prefill_instance_serves_and_is_replaced_whole_when_a_pod_goes(
    operator: Operator,
    kube: KubeApi,
    kubectl: KubectlRunner,
    node_agent: NodeAgentClient,
    namespace: str,
    tmp_path: Path,
) -> None:
    """prefill tp2 with gpusPerPod 1: one instance of two pods (leader + one) that
    meet over pod IPs, placed on one node, moving KV with nixl (one-sided WRITEs);
    killing the non-leader pod fails decode's rooms at once, with ABORTs, and
    frees no page while the leader (frozen) may still write; both pods are
    replaced and serve the same answer. A gang that cannot be scheduled is never
    restarted."""
    prefill = {
        "replicas": 1,
        "topology": {"tp": 2},
        "gpusPerPod": 1,
        "restart": {"backoffSeconds": 1},
        "scheduling": {"gang": "podGroup"},
    }
    transfer = {**manifest()["spec"]["transfer"], "backend": "nixl"}
    apply(
        kubectl,
        tmp_path,
        namespace,
        manifest(MULTI, prefill={**prefill, "placement": PLACEMENT}, transfer=transfer),
    )
    apply(kubectl, tmp_path, namespace, unschedulable_manifest())

    def two_ready_pods(obj: dict[str, Any]) -> bool:
        instances = obj["status"].get("prefill", {}).get("instances", [])
        return (
            len(instances) == 1
            and instances[0]["ready"]
            and [p["index"] for p in instances[0]["pods"]] == [0, 1]
            and all(p["phase"] == "Running" for p in instances[0]["pods"])
        )

    status = wait_cluster_ready(operator, kube, namespace, MULTI, two_ready_pods)["status"]
    leader, follower = cluster_pods(kube, namespace, "prefill")
    assert_pod_group(kube, namespace, leader, follower)
    assert [p["name"] for p in status["prefill"]["instances"][0]["pods"]] == [
        leader["metadata"]["name"],
        follower["metadata"]["name"],
    ]
    assert is_ready(leader) and leader["metadata"]["labels"]["pdcluster.io/leader"] == "true"
    assert follower["metadata"]["labels"]["pdcluster.io/leader"] == "false"
    # The non-leader pod was given its leader's pod IP (there is no cluster DNS).
    annotations = follower["metadata"]["annotations"]
    assert annotations["pdcluster.io/leader-address"] == leader["status"]["podIP"]
    (router,) = cluster_pods(kube, namespace, "router")
    first = complete(router["status"]["podIP"])
    assert first["usage"]["completion_tokens"] == 8

    assert_placement(kube, namespace, leader, follower)
    pending_uid, pending_since = pending_leader(kube, namespace), time.monotonic()

    # A request whose KV must come from the instance, frozen at its leader: decode
    # waits for it. Then the non-leader pod dies (SIGKILL, exit 137).
    (decode,) = cluster_pods(kube, namespace, "decode")
    admin = {"Authorization": f"Bearer {token(kube, namespace, MULTI)}"}
    decode_url = f"http://{decode['status']['podIP']}:8000"
    old_uids = {leader["metadata"]["uid"], follower["metadata"]["uid"]}
    # The follower's pod event makes the operator name the instance by its
    # leader's bootstrap address (failing, not gone: its leader runs) and the
    # follower by its own address (gone).
    took, request = fail_fast_when_a_pod_dies(
        node_agent,
        namespace,
        decode_url,
        admin,
        frozen=leader,
        killed=follower,
        freeze=lambda pod: freeze_as_a_kubelet_would_find_it(node_agent, pod),
    )
    print(f"decode failed the room {took * 1000:.0f} ms after the non-leader pod was killed")
    held_until_the_frozen_writer_is_gone(
        node_agent, kube, namespace, decode_url, admin, request.room, leader
    )

    def replaced(obj: dict[str, Any]) -> bool:
        now = cluster_pods(kube, namespace, "prefill")
        uids = {p["metadata"]["uid"] for p in now}
        return len(now) == 2 and not uids & old_uids and two_ready_pods(obj)

    wait_cluster_ready(operator, kube, namespace, MULTI, replaced)
    new_leader, new_follower = cluster_pods(kube, namespace, "prefill")
    # Same stable names, new pods; the new follower knows the new leader.
    assert new_leader["metadata"]["name"] == leader["metadata"]["name"]
    assert new_follower["metadata"]["name"] == follower["metadata"]["name"]
    assert (
        new_follower["metadata"]["annotations"]["pdcluster.io/leader-address"]
        == new_leader["status"]["podIP"]
    )

    def reported() -> bool:
        return {"PrefillInstanceLost", "InstanceRestarted"} <= set(events_of(kube, namespace))

    wait_until(reported, 20, f"the failover Events (have {sorted(events_of(kube, namespace))})")
    # The Warning names the pod that died, not only its instance.
    lost = events_of(kube, namespace)["PrefillInstanceLost"]
    assert lost["type"] == "Warning"
    assert f"pod {follower['metadata']['name']} exited" in lost["message"], lost["message"]
    assert "its rooms failed at 1/1 decode workers" in lost["message"], lost["message"]
    assert complete(router["status"]["podIP"])["choices"][0]["text"] == first["choices"][0]["text"]

    # The gang that cannot be scheduled: its leader stays Pending (its followers
    # wait for the leader's IP), and over several reconcile passes nothing is restarted.
    assert_pending_gang_never_restarts(operator, kube, namespace, pending_uid, pending_since)


# Under the decode heartbeat's 2 x 30 s by far: only the operator's fast path can
# be this quick. The issue's target is 1 s; the margin is for a loaded CI box.
FAST_PATH_BOUND_S = 3.0
HOSTNAME_KEY = "kubernetes.io/hostname"
PLACEMENT = {"topologyKey": HOSTNAME_KEY}
# A two-pod prefill instance no node can take: no node carries this label.
UNSCHEDULABLE = "multipod-pending"
NO_SUCH_NODE = {"pdcluster.io/e2e-no-such-node": "true"}
INSTANCE_KEYS = (
    "pdcluster.io/cluster",
    "pdcluster.io/role",
    "pdcluster.io/instance",
    "pdcluster.io/template-hash",
)
# The operator fixture's resync period (PDCLUSTER_OPERATOR_RESYNC_SECONDS).
RESYNC_S = 20.0


def events_of(kube: KubeApi, ns: str, name: str = MULTI) -> dict[str, dict[str, Any]]:
    """The Events of PDCluster `name`, by reason."""
    listed = kube.get(f"/api/v1/namespaces/{ns}/events") or {}
    return {
        e["reason"]: e
        for e in listed.get("items", [])
        if e.get("involvedObject", {}).get("kind") == "PDCluster"
        and e["involvedObject"].get("name") == name
    }


def unschedulable_manifest() -> dict[str, Any]:
    role = {"nodeSelector": NO_SUCH_NODE}
    prefill = {"topology": {"tp": 2}, "gpusPerPod": 1, "restart": {"backoffSeconds": 1}, **role}
    return manifest(UNSCHEDULABLE, prefill=prefill, decode=role, router={"replicas": 0})


def assert_placement(
    kube: KubeApi, ns: str, leader: dict[str, Any], follower: dict[str, Any]
) -> None:
    """`placement.topologyKey` on the pods the apiserver holds: each prefill pod requires
    its own instance's pods in its hostname domain; decode prefers prefill's."""
    selector = {k: leader["metadata"]["labels"][k] for k in INSTANCE_KEYS}
    for pod in (leader, follower):
        assert {k: pod["metadata"]["labels"][k] for k in INSTANCE_KEYS} == selector
        affinity = pod["spec"]["affinity"]["podAffinity"]
        assert affinity["requiredDuringSchedulingIgnoredDuringExecution"] == [
            {"labelSelector": {"matchLabels": selector}, "topologyKey": HOSTNAME_KEY}
        ], affinity
    assert leader["spec"]["nodeName"] == follower["spec"]["nodeName"]
    (decode,) = cluster_pods(kube, ns, "decode")
    affinity = decode["spec"]["affinity"]["podAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity, affinity
    prefill_pods = {"pdcluster.io/cluster": MULTI, "pdcluster.io/role": "prefill"}
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {
            "weight": 100,
            "podAffinityTerm": {
                "labelSelector": {"matchLabels": prefill_pods},
                "topologyKey": HOSTNAME_KEY,
            },
        }
    ], affinity


def pending_leader(kube: KubeApi, ns: str) -> str:
    """The UID of the unschedulable cluster's one pod: its leader, Pending for want of a node."""
    (pending,) = cluster_pods(kube, ns, "prefill", UNSCHEDULABLE)
    assert pending["metadata"]["labels"]["pdcluster.io/pod-index"] == "0"
    assert pending["status"]["phase"] == "Pending"
    # The real scheduler said why.
    scheduled = next(
        c for c in pending["status"].get("conditions", []) if c["type"] == "PodScheduled"
    )
    assert scheduled["status"] == "False" and scheduled["reason"] == "Unschedulable", scheduled
    uid: str = pending["metadata"]["uid"]
    return uid


def assert_pending_gang_never_restarts(
    op: Operator, kube: KubeApi, ns: str, uid: str, since: float
) -> None:
    """The unschedulable cluster's leader kept its UID over at least two resyncs."""
    left = since + 2 * RESYNC_S + 5 - time.monotonic()
    if left > 0:
        time.sleep(left)
    (still,) = cluster_pods(kube, ns, "prefill", UNSCHEDULABLE)
    assert still["metadata"]["uid"] == uid and still["status"]["phase"] == "Pending"
    status = (pdc(kube, ns, UNSCHEDULABLE) or {}).get("status") or {}
    prefill = status.get("prefill") or {}
    assert prefill.get("restarts", 0) == 0, prefill
    (instance,) = prefill["instances"]
    assert instance["health"] == "incomplete", instance  # pod 1 waits for the leader's IP
    assert [(p["index"], p["phase"]) for p in instance["pods"]] == [(0, "Pending")], instance
    reasons = set(events_of(kube, ns, UNSCHEDULABLE))
    assert "InstanceRestarted" not in reasons, (reasons, op.log_tail())


def test_invalid_manifest_is_refused_with_the_cel_message(
    operator: Operator,
    kube: KubeApi,
    kubectl: KubectlRunner,
    namespace: str,
    tmp_path: Path,
) -> None:
    bad = manifest("bad", prefill={"topology": {"pp": 2}}, decode={"topology": {"cp": 2}})
    result = apply(kubectl, tmp_path, namespace, bad, check=False)
    assert result.returncode != 0
    assert "decode.topology.cp must be 1: cp is prefill-only" in result.stderr
    assert pdc(kube, namespace, "bad") is None
    # Within bounds per field, but the cross-field rule catches it too.
    worse = manifest("worse", decode={"topology": {"pp": 3}}, prefill={"topology": {"pp": 2}})
    result = apply(kubectl, tmp_path, namespace, worse, check=False)
    assert "decode.topology.pp must be 1 or equal prefill.topology.pp" in result.stderr
    with pytest.raises(ApiError) as err:
        kube.create(PDC_PATH.format(ns=namespace), {**bad, "metadata": {"name": "direct"}})
    assert err.value.status == 422
    assert "decode.topology.cp must be 1" in err.value.message


# ------------------------------------------------- refusals (each in its own namespace)
def wait_refused(
    op: Operator, kube: KubeApi, ns: str, name: str, reason: str, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Wait for an Event `reason` on the PDCluster and Degraded=True with that reason."""
    found: dict[str, Any] = {}

    def refused() -> bool:
        obj = pdc(kube, ns, name)
        conds = ((obj or {}).get("status") or {}).get("conditions") or []
        degraded = next((c for c in conds if c.get("type") == "Degraded"), None)
        event = events(kube, ns).get(reason)
        if event and degraded and degraded["status"] == "True" and degraded["reason"] == reason:
            found.update(event=event, degraded=degraded)
            return True
        return False

    try:
        wait_until(refused, timeout_s, f"{reason} on {name}", interval_s=0.5)
    except TimeoutError as err:
        raise AssertionError(f"{err}\nstatus: {pdc(kube, ns, name)}\n{op.log_tail()}") from err
    return found


def listed(kube: KubeApi, path: str, name: str) -> list[str]:
    got = kube.get(path, params={"labelSelector": f"pdcluster.io/cluster={name}"}) or {}
    return [o["metadata"]["name"] for o in got.get("items", [])]


def test_rank_product_above_the_cap_is_refused_by_the_apiserver(
    operator: Operator, kube: KubeApi, kubectl: KubectlRunner, namespace: str, tmp_path: Path
) -> None:
    # Every axis is within its own bound (<= 64); the product is 128 ranks.
    big = manifest("big", prefill={"topology": {"dp": 8, "tp": 8, "pp": 2}})
    result = apply(kubectl, tmp_path, namespace, big, check=False)
    assert result.returncode != 0
    assert "ranks per instance (dp*tp*cp*pp) must be at most 64" in result.stderr
    assert pdc(kube, namespace, "big") is None


def test_autoscaling_is_checked_by_the_apiserver(
    operator: Operator, kube: KubeApi, namespace: str
) -> None:
    """The autoscaling CEL rules compile and pass the apiserver's cost limits, accept a
    manifest that fits its GPU budget (server-side dry run: nothing is created) and
    refuse one that does not, with the models' words."""
    target = {"metric": "ttftP90Seconds", "value": 0.5}
    fits = manifest(
        "scaled",
        prefill={"replicas": 1, "autoscaling": {"maxReplicas": 2, "target": target}},
        autoscaling={"maxTotalGPUs": 3},
    )
    path = PDC_PATH.format(ns=namespace)
    created = kube.request("POST", path, body=fits, params={"dryRun": "All"})
    assert created["spec"]["prefill"]["autoscaling"]["scaleDown"] == {"stabilizationSeconds": 300.0}
    over = manifest(
        "over",
        prefill={"replicas": 1, "autoscaling": {"maxReplicas": 3, "target": target}},
        autoscaling={"maxTotalGPUs": 3},
    )
    with pytest.raises(ApiError) as err:
        kube.create(path, over)
    assert err.value.status == 422
    assert "prefill.autoscaling.maxReplicas with the other role at its minimum" in (
        err.value.message
    )
    assert pdc(kube, namespace, "over") is None


def test_a_foreign_secret_reference_is_refused_and_nothing_mounts_it(
    operator: Operator, kube: KubeApi, kubectl: KubectlRunner, namespace: str, tmp_path: Path
) -> None:
    kube.create(
        f"/api/v1/namespaces/{namespace}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "someone-elses"},
            "type": "Opaque",
            "data": {"token": base64.b64encode(b"not-yours").decode()},
        },
    )
    doc = manifest("thief", auth={"tokenSecretName": "someone-elses"})
    apply(kubectl, tmp_path, namespace, doc)
    found = wait_refused(operator, kube, namespace, "thief", "SecretNotAllowed")
    assert "someone-elses" in found["event"]["message"]
    assert "pdcluster.io/allow-reference" in found["degraded"]["message"]
    time.sleep(2)  # a further pass changes nothing either
    assert listed(kube, f"/api/v1/namespaces/{namespace}/pods", "thief") == []
    assert listed(kube, f"/apis/apps/v1/namespaces/{namespace}/deployments", "thief") == []


def test_a_quota_refusing_the_pods_is_reported_as_apply_failed(
    operator: Operator, kube: KubeApi, kubectl: KubectlRunner, namespace: str, tmp_path: Path
) -> None:
    kube.create(
        f"/api/v1/namespaces/{namespace}/resourcequotas",
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "no-pods"},
            "spec": {"hard": {"pods": "0"}},
        },
    )
    wait_until(
        lambda: (
            (kube.get(f"/api/v1/namespaces/{namespace}/resourcequotas/no-pods") or {})
            .get("status", {})
            .get("hard")
        ),
        30,
        "the quota's status",
    )
    apply(kubectl, tmp_path, namespace, manifest("quota"))
    found = wait_refused(operator, kube, namespace, "quota", "ApplyFailed")
    assert "exceeded quota" in found["event"]["message"]
    assert found["event"]["message"].startswith("create Pod/")
    assert "exceeded quota" in found["degraded"]["message"]
    assert listed(kube, f"/api/v1/namespaces/{namespace}/pods", "quota") == []
    # The children the quota allows were created; the NetworkPolicies passed the
    # apiserver's validation (no CNI here enforces them).
    policies = {
        p["metadata"]["name"]: p
        for p in (
            kube.get(f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies") or {}
        ).get("items", [])
    }
    assert set(policies) == {"quota-workers-ingress", "quota-router-ingress"}
    workers = policies["quota-workers-ingress"]["spec"]
    assert workers["podSelector"]["matchLabels"]["pdcluster.io/cluster"] == "quota"
    assert workers["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {
        "pdcluster.io/cluster": "quota"
    }


CM = {"apiVersion": "v1", "kind": "ConfigMap"}


async def test_apply_carries_the_uid_so_a_replaced_object_is_not_taken_over(
    k8s_cluster: ClusterInfo, kube: KubeApi, namespace: str
) -> None:
    from pdcluster.operator.kube.client import ApiError as OperatorApiError
    from pdcluster.operator.kube.client import KubeClient, load_credentials

    path = f"/api/v1/namespaces/{namespace}/configmaps"
    first = kube.create(path, {**CM, "metadata": {"name": "cm"}, "data": {"who": "ours"}})
    uid = first["metadata"]["uid"]
    client = KubeClient(load_credentials(str(k8s_cluster.kubeconfig)))
    doc = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"who": "applied"}}
    try:
        await client.apply({**doc, "metadata": {"name": "cm", "namespace": namespace, "uid": uid}})
        assert (kube.get(f"{path}/cm") or {})["data"] == {"who": "applied"}
        # Someone else's object now has the name: the same apply is refused.
        kube.delete(f"{path}/cm")
        wait_until(lambda: kube.get(f"{path}/cm") is None, 30, "the ConfigMap gone")
        kube.create(path, {**CM, "metadata": {"name": "cm"}, "data": {"who": "theirs"}})
        with pytest.raises(OperatorApiError) as err:
            await client.apply(
                {**doc, "metadata": {"name": "cm", "namespace": namespace, "uid": uid}}
            )
        # The apiserver answers 422 "metadata.uid: field is immutable".
        assert err.value.status == 422 and "uid" in err.value.message
        assert (kube.get(f"{path}/cm") or {})["data"] == {"who": "theirs"}
    finally:
        await client.aclose()


def test_the_role_scaler_crd_serves_scale_and_the_layout_rule_is_enforced(
    operator: Operator, kube: KubeApi, namespace: str
) -> None:
    """The generated PDClusterRoleScaler CRD is accepted by the apiserver and its
    /scale subresource reads and writes spec.replicas (what kubectl scale, HPA and
    KEDA use); its cluster and role cannot move; and a gpusPerPod that does not
    divide an instance's ranks is refused with the models' words."""
    from pdcluster.operator.api import GROUP, SCALER_CRD_NAME, SCALER_KIND, SCALER_PLURAL, VERSION
    from pdcluster.operator.crd.crdgen import build_scaler_crd

    crd_path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    if kube.get(f"{crd_path}/{SCALER_CRD_NAME}") is None:
        kube.create(crd_path, build_scaler_crd())
    wait_until(
        lambda: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in ((kube.get(f"{crd_path}/{SCALER_CRD_NAME}") or {}).get("status") or {}).get(
                "conditions"
            )
            or []
        ),
        30,
        "the scaler CRD to be established",
    )
    objects = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{SCALER_PLURAL}"
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": SCALER_KIND,
        "metadata": {"name": "demo-decode"},
        "spec": {"cluster": "demo", "role": "decode", "replicas": 1},
    }

    def created() -> bool:
        try:
            kube.create(objects, body)
        except ApiError as err:
            if err.status == 404:  # the new API is not served yet
                return False
            raise
        return True

    wait_until(created, 30, "the scaler API to be served")
    scale = kube.get(f"{objects}/demo-decode/scale")
    assert scale is not None and scale["kind"] == "Scale"
    assert scale["spec"]["replicas"] == 1
    kube.patch(f"{objects}/demo-decode/scale", {"spec": {"replicas": 3}}, patch_type="merge")
    stored = kube.get(f"{objects}/demo-decode")
    assert stored is not None and stored["spec"]["replicas"] == 3
    with pytest.raises(ApiError) as moved:
        kube.patch(f"{objects}/demo-decode", {"spec": {"cluster": "other"}}, patch_type="merge")
    assert moved.value.status == 422
    assert "is immutable" in moved.value.message
    with pytest.raises(ApiError) as refused:
        kube.create(
            PDC_PATH.format(ns=namespace),
            manifest("uneven", prefill={"topology": {"tp": 4}, "gpusPerPod": 3}),
        )
    assert refused.value.status == 422
    assert "gpusPerPod" in refused.value.message
    assert pdc(kube, namespace, "uneven") is None
