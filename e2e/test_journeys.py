"""A user's whole path on the local control plane, through the tools a user has:
helm, kubectl and the official openai client. The journeys run in file order
against one operator installed by `helm install` (as a pod) and share state:

1. helm install → operator Ready → kubectl apply the 1P1D example → `kubectl
   get pdc` Ready → the openai client gets completions and chat (streaming
   and not) through the router pod's address, equal to colocated output.
   Both namespaces enforce Pod Security `restricted` (a root pod is refused;
   the operator's and the cluster's pods run); with router API keys set, the
   router reads them from the mounted Secret and refuses a request without one.
1b. The nixl example (with `requireRdma`) → the openai client's completions
   equal colocated → `status.<role>.kvTransport` shows what UCX negotiated
   (tcp over lo here) and a `KVTransportFallback` Warning says it is no
   RDMA → a killed prefill pod fails its waiting rooms fast, comes back,
   serves.
2. A prefill pod's process is killed during a burst of long requests → its
   in-flight requests end fast with a clear error, the others complete →
   Events show the loss and the failed rooms → it comes back → serves.
   After journey 3, again under `failurePolicy: recompute`: every request
   of the burst completes with exactly the colocated answer.
3. A prefill pod is frozen (SIGSTOP): Kubernetes still says Running; decode's
   heartbeats fail its rooms within interval × threshold + slack; Events say
   so; new requests go to the other prefill.
4. `kubectl scale` decode to 3 and a patch of prefill replicas → the router
   sends work to every new instance; scaling down during a burst drains the
   removed instances: no request fails.
5. A runtime setting changes, then the image tag → pods (and, for the
   image, the router) are replaced one by one while clients keep sending;
   no request fails that was not in flight on a replaced pod.
6. Invalid manifests are refused with the CEL rule's message; bad requests
   to the router get clear OpenAI-shaped errors and leave it serving.
7. `helm upgrade` brings a changed CRD; `kubectl delete` + `helm uninstall`
   leave nothing of the release behind (only the CRD, by design).
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.cluster import ClusterInfo
from e2e.conftest import KubectlRunner
from e2e.journey_load import Burst, Outcome, PodTimeline, SteadyLoad, complete, long_prompt
from e2e.kubetest import is_ready, make_pod
from e2e.nodeagent.client import NodeAgentClient
from e2e.nodeagent.kubeapi import ApiError, KubeApi
from e2e.processes import wait_until

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pdcluster-operator"
EXAMPLE = ROOT / "examples" / "pd-1p1d.yaml"
TOUR = "pd-1p1d"  # metadata.name in the example
NIXL_EXAMPLE = ROOT / "examples" / "pd-1p1d-nixl.yaml"
NIXL = "nixl-journey"  # the nixl cluster of journey 1b
NAME = "journey"  # the cluster journeys 2-5 use
CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pdclusters.pdcluster.io"
HEARTBEAT_S, HEARTBEAT_MISSES = 1.0, 2
MAX_PROMPT_TOKENS = 2048
RESTRICTED = [
    "pod-security.kubernetes.io/enforce=restricted",
    "pod-security.kubernetes.io/enforce-version=latest",
]
# Helm values: Events and failure counts fast enough to assert on within seconds.
OPERATOR_VALUES = [
    "--set", "failover.failurePollSeconds=2",
    "--set", "operator.eventIntervalSeconds=2",
    "--set", "operator.resyncSeconds=20",
]  # fmt: skip


@dataclass
class Release:
    name: str
    system: str  # the operator's namespace
    apps: str  # where the user's PDClusters live
    uninstalled: bool = False


@pytest.fixture(scope="module")
def release(kube: KubeApi, kubectl: KubectlRunner) -> Iterator[Release]:
    name = f"pdc-{secrets.token_hex(3)}"
    rel = Release(name, f"{name}-system", f"{name}-apps")
    # Both namespaces enforce Pod Security `restricted` (the apiserver's admission).
    for namespace in (rel.apps, rel.system):
        kubectl("kubectl", "create", "namespace", namespace)
        kubectl("kubectl", "label", "namespace", namespace, *RESTRICTED)
    try:
        kubectl(
            "helm", "install", name, str(CHART), "-n", rel.system, "--create-namespace",
            "--wait", "--timeout", "180s", *OPERATOR_VALUES,
        )  # fmt: skip
        yield rel
    finally:
        if not rel.uninstalled:
            kubectl("kubectl", "delete", "pdc", "--all", "-n", rel.apps, check=False)
            kubectl("helm", "uninstall", name, "-n", rel.system, "--wait", check=False)
        kubectl("kubectl", "delete", "namespace", rel.apps, "--wait=false", check=False)
        kubectl("kubectl", "delete", "namespace", rel.system, "--wait=false", check=False)


# ---------------------------------------------------------------- helpers
def labelled(kube: KubeApi, path: str, selector: str) -> list[str]:
    listed = kube.get(path, params={"labelSelector": selector}) or {}
    return [o["metadata"]["name"] for o in listed.get("items", [])]


def pods(kube: KubeApi, ns: str, cluster: str, role: str) -> list[dict[str, Any]]:
    selector = f"pdcluster.io/cluster={cluster},pdcluster.io/role={role}"
    listed = kube.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector}) or {}
    return [p for p in listed.get("items", []) if not p["metadata"].get("deletionTimestamp")]


def router_url(kube: KubeApi, ns: str, cluster: str) -> str:
    ready = [p for p in pods(kube, ns, cluster, "router") if is_ready(p)]
    assert ready, f"no Ready router pod for {cluster}"
    return f"http://{ready[0]['status']['podIP']}:8000"


def get_pdc(kubectl: KubectlRunner, ns: str, name: str) -> dict[str, Any]:
    out = kubectl("kubectl", "get", "pdc", name, "-n", ns, "-o", "yaml").stdout
    doc: dict[str, Any] = yaml.safe_load(out)
    return doc


def wait_pdc(
    kubectl: KubectlRunner, ns: str, name: str, prefill: str, decode: str, timeout_s: float = 180
) -> dict[str, Any]:
    """Wait until `kubectl get pdc` says Ready with these ready/desired counts, all
    instances on the current template and nothing else left."""
    seen: dict[str, Any] = {}

    def ready() -> bool:
        doc = get_pdc(kubectl, ns, name)
        status = doc.get("status") or {}
        seen.clear()
        seen.update(status)
        return (
            # A status about the spec as it is now, not the one before an edit.
            status.get("observedGeneration") == doc["metadata"]["generation"]
            and status.get("phase") == "Ready"
            and (status.get("prefill") or {}).get("summary") == prefill
            and (status.get("decode") or {}).get("summary") == decode
            and all(
                (status.get(role) or {}).get("updated") == (status.get(role) or {}).get("desired")
                for role in ("prefill", "decode")
            )
            # Progressing=False (Stable): no outdated or surplus instance is left.
            and any(
                c.get("type") == "Progressing" and c.get("status") == "False"
                for c in status.get("conditions") or []
            )
        )

    try:
        wait_until(
            ready, timeout_s, f"{name} Ready with prefill {prefill}, decode {decode}", interval_s=1
        )
    except TimeoutError as err:
        raise AssertionError(f"{err}; last status: {seen}") from err
    return get_pdc(kubectl, ns, name)


def kubectl_events(kubectl: KubectlRunner, ns: str, name: str = NAME) -> list[dict[str, Any]]:
    """The Events of one PDCluster, as `kubectl get events` shows them."""
    out = kubectl(
        "kubectl", "get", "events", "-n", ns, "-o", "yaml",
        "--field-selector", f"involvedObject.kind=PDCluster,involvedObject.name={name}",
    ).stdout  # fmt: skip
    items: list[dict[str, Any]] = yaml.safe_load(out)["items"]
    return items


def wait_event(
    kubectl: KubectlRunner,
    ns: str,
    reason: str,
    words: str | tuple[str, ...],
    timeout_s: float,
    name: str = NAME,
) -> dict[str, Any]:
    """Until an Event with `reason` whose message holds `words` (or one of them)."""
    found: dict[str, Any] = {}
    alternatives = (words,) if isinstance(words, str) else words

    def seen() -> bool:
        for e in kubectl_events(kubectl, ns, name):
            if e["reason"] == reason and any(w in e.get("message", "") for w in alternatives):
                found.update(e)
                return True
        return False

    try:
        wait_until(seen, timeout_s, f"a {reason} Event mentioning {words!r}", interval_s=0.5)
    except TimeoutError as err:
        have = [(e["reason"], e.get("message")) for e in kubectl_events(kubectl, ns, name)]
        raise AssertionError(f"{err}; events: {have}") from err
    return found


def journey_manifest(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny"},
        "kvCache": {"numPages": 2048, "dtype": "float32"},
        "transfer": {
            "heartbeat": {
                "intervalSeconds": HEARTBEAT_S,
                "failureThreshold": HEARTBEAT_MISSES,
            },
        },
        "prefill": {
            "replicas": 2,
            "restart": {"backoffSeconds": 1},
            "engine": {"maxPromptTokens": MAX_PROMPT_TOKENS},
        },
        "decode": {"replicas": 1, "engine": {"maxPromptTokens": MAX_PROMPT_TOKENS}},
        "router": {"policy": {"prefill": "round_robin", "decode": "least_outstanding"}},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value}
    return {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": NAME},
        "spec": spec,
    }


def apply(kubectl: KubectlRunner, tmp: Path, ns: str, doc: dict[str, Any], check: bool = True):
    path = tmp / f"{doc['metadata']['name']}-{secrets.token_hex(2)}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return kubectl("kubectl", "apply", "-n", ns, "-f", str(path), check=check)


def colocated_text(
    prompts: list[str], max_tokens: int, manifest: dict[str, Any] | None = None
) -> list[str]:
    """What a colocated engine with the manifest's settings (default: the example's)
    answers, computed in-process."""
    from pdcluster.runtime.engine.tokenizer import ByteTokenizer
    from pdcluster.runtime.spec import PDCluster
    from tests.pd_integration.reference import colocated_outputs

    cluster = PDCluster.model_validate(manifest or yaml.safe_load(EXAMPLE.read_text()))
    tokenizer = ByteTokenizer()
    ids = [tokenizer.encode(p) for p in prompts]
    return [tokenizer.decode(out) for out in colocated_outputs(cluster, ids, max_tokens)]


def wait_room_on(decode_url: str, token: str, prefill_ip: str, timeout_s: float = 30.0) -> None:
    """Until decode has a room whose KV comes from the prefill at `prefill_ip`."""
    headers = {"Authorization": f"Bearer {token}"}

    def open_room() -> bool:
        rooms = httpx.get(f"{decode_url}/admin/rooms", headers=headers, timeout=5).json()["rooms"]
        return any(any(p.startswith(f"{prefill_ip}:") for p in r["peers"]) for r in rooms)

    wait_until(open_room, timeout_s, f"a room on prefill {prefill_ip}", interval_s=0.05)


def cluster_token(kube: KubeApi, ns: str, name: str = NAME) -> str:
    secret = kube.get(f"/api/v1/namespaces/{ns}/secrets/{name}-token")
    assert secret is not None
    return base64.b64decode(secret["data"]["token"]).decode()


def assert_clear_prefill_failure(o: Outcome, words: tuple[str, ...]) -> None:
    assert o.status in (502, 503, 504), o
    error = httpx.Response(o.status, content=o.body.encode()).json()["error"]
    assert any(w in error["message"] for w in words), error


def kill_prefill_mid_burst(
    kube: KubeApi, node_agent: NodeAgentClient, ns: str, cluster: str, burst: Burst
) -> tuple[dict[str, Any], float, list[Outcome]]:
    """Kill -9 `cluster`'s first prefill pod once decode has a room on it.

    Returns the victim, when it was killed and the burst's outcomes."""
    victim = pods(kube, ns, cluster, "prefill")[0]
    decode_url = f"http://{pods(kube, ns, cluster, 'decode')[0]['status']['podIP']}:8000"
    wait_room_on(decode_url, cluster_token(kube, ns, cluster), victim["status"]["podIP"])
    killed_at = time.monotonic()
    node_agent.kill_pod(ns, victim["metadata"]["name"])
    return victim, killed_at, burst.result()


def assert_failed_fast_and_clearly(outcomes: list[Outcome], killed_at: float) -> list[Outcome]:
    """Some request was hit; each one hit failed within 10 s (the operator's fast
    path, not a timeout) with an error that names the prefill."""
    failed = [o for o in outcomes if not o.ok]
    assert failed, "no request was in flight on the killed prefill"
    for o in failed:
        assert o.ended - killed_at < 10, f"ended {o.ended - killed_at:.1f}s after the kill"
        assert_clear_prefill_failure(o, ("prefill_pod_lost", "prefill", "connect"))
    return failed


def check_restricted_pods(kube: KubeApi, ns: str) -> None:
    """The namespace really enforces `restricted`, and the tour's pods got in."""
    root = {"securityContext": {"runAsUser": 0, "privileged": True}}
    with pytest.raises(ApiError, match="violates PodSecurity") as refused:
        kube.create(f"/api/v1/namespaces/{ns}/pods", make_pod("root", ["true"], container=root))
    assert refused.value.status == 403
    workers = pods(kube, ns, TOUR, "prefill") + pods(kube, ns, TOUR, "decode")
    assert workers and all(p["spec"]["automountServiceAccountToken"] is False for p in workers)
    for pod in workers:
        env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
        assert "PDCLUSTER_TOKEN_FILE" in env and "PDCLUSTER_TOKEN" not in env


def check_router_api_keys(kube: KubeApi, kubectl: KubectlRunner, ns: str) -> None:
    """With `auth.routerApiKeySecretName` the router reads its keys from the mounted
    Secret: a request without a key is refused, one with it served."""
    key = secrets.token_hex(8)
    # A Secret of the user's own must opt in to being mounted (docs/security.md).
    labels = {"pdcluster.io/allow-reference": "true"}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "tour-keys", "labels": labels},
    }
    kube.create(f"/api/v1/namespaces/{ns}/secrets", {**secret, "stringData": {"keys": key}})
    patch = {"spec": {"auth": {"routerApiKeySecretName": "tour-keys"}}}
    kubectl("kubectl", "patch", "pdc", TOUR, "-n", ns, "--type", "merge", "-p", json.dumps(patch))

    def rolled() -> bool:
        routers = pods(kube, ns, TOUR, "router")
        return (
            len(routers) == 1
            and is_ready(routers[0])
            and ("--api-key-file" in routers[0]["spec"]["containers"][0]["args"])
        )

    wait_until(rolled, 120, "the router rolled with an API key file", interval_s=1)
    url = f"{router_url(kube, ns, TOUR)}/v1/completions"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    authorized = {"Authorization": f"Bearer {key}"}
    assert httpx.post(url, json=body, headers=authorized, timeout=60).status_code == 200
    kube.delete(f"/api/v1/namespaces/{ns}/secrets/tour-keys")


# ---------------------------------------------------------------- 1
def test_1_install_apply_and_serve_with_the_openai_client(
    release: Release, kube: KubeApi, kubectl: KubectlRunner
) -> None:
    openai = pytest.importorskip("openai", reason="the openai client is a dev extra")
    deployments = labelled(
        kube,
        f"/apis/apps/v1/namespaces/{release.system}/deployments",
        f"app.kubernetes.io/instance={release.name}",
    )
    assert len(deployments) == 1
    dep = kube.get(f"/apis/apps/v1/namespaces/{release.system}/deployments/{deployments[0]}")
    assert dep is not None and dep["status"].get("readyReplicas") == 1

    kubectl("kubectl", "apply", "-n", release.apps, "-f", str(EXAMPLE))
    wait_pdc(kubectl, release.apps, TOUR, "1/1", "1/1")
    row = kubectl("kubectl", "get", "pdc", "-n", release.apps).stdout.splitlines()[1].split()
    assert row[:5] == [TOUR, "Ready", "1/1", "1/1", "1/1"]

    client = openai.OpenAI(
        base_url=f"{router_url(kube, release.apps, TOUR)}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
    )
    assert "tiny" in [m.id for m in client.models.list().data]
    prompts = ["The capital of France is", "Hello", "x" * 700]
    for prompt, want in zip(prompts, colocated_text(prompts, 12), strict=True):
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert done.choices[0].text == want
        assert done.usage is not None and done.usage.completion_tokens == 12
        streamed = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        pieces = [c.choices[0].text for c in streamed if c.choices]
        assert len(pieces) > 1 and "".join(pieces) == want

    messages: list[Any] = [{"role": "user", "content": "Say hello"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    chunks = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content

    reasons = {e["reason"] for e in kubectl_events(kubectl, release.apps, TOUR)}
    assert "InstanceCreated" in reasons
    check_restricted_pods(kube, release.apps)
    check_router_api_keys(kube, kubectl, release.apps)
    # The tour is over; the next journeys use a cluster of their own.
    kubectl("kubectl", "delete", "-n", release.apps, "-f", str(EXAMPLE), "--wait=true")


# ---------------------------------------------------------------- 1b
def nixl_manifest() -> dict[str, Any]:
    """The nixl example with `requireRdma`, which this box (tcp over lo) cannot give."""
    doc: dict[str, Any] = yaml.safe_load(NIXL_EXAMPLE.read_text())
    doc["metadata"]["name"] = NIXL
    spec = doc["spec"]
    spec["kvCache"]["numPages"] = 2048
    spec["transfer"]["ucx"] = {"requireRdma": True}
    spec["transfer"]["heartbeat"] = {
        "intervalSeconds": HEARTBEAT_S,
        "failureThreshold": HEARTBEAT_MISSES,
    }
    engine = {"maxPromptTokens": MAX_PROMPT_TOKENS}
    spec["prefill"].update(restart={"backoffSeconds": 1}, engine=engine)
    spec["decode"]["engine"] = engine
    return doc


def test_1b_a_nixl_cluster_serves_reports_its_transport_and_survives_a_killed_prefill(
    release: Release,
    kube: KubeApi,
    kubectl: KubectlRunner,
    node_agent: NodeAgentClient,
    tmp_path: Path,
) -> None:
    openai = pytest.importorskip("openai", reason="the openai client is a dev extra")
    ns, manifest = release.apps, nixl_manifest()
    apply(kubectl, tmp_path, ns, manifest)
    wait_pdc(kubectl, ns, NIXL, "1/1", "1/1")
    url = router_url(kube, ns, NIXL)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = ["The capital of France is", "x" * 700]
    for prompt, want in zip(prompts, colocated_text(prompts, 12, manifest), strict=True):
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert done.choices[0].text == want

    # The status shows what UCX negotiated; tcp over lo is no RDMA: a Warning says so.
    seen: dict[str, Any] = {}

    def negotiated() -> bool:
        status = get_pdc(kubectl, ns, NIXL).get("status") or {}
        seen.update({r: (status.get(r) or {}).get("kvTransport") for r in ("prefill", "decode")})
        return all(seen.values()) and any((t or {}).get("ucxDevices") for t in seen.values())

    wait_until(negotiated, 30, "status.<role>.kvTransport with UCX lanes", interval_s=1)
    for entry in seen.values():
        assert entry["backend"] == "nixl" and entry["rdmaRequested"] is True, seen
    lanes = [t for t in seen.values() if t["ucxDevices"]]
    assert all(t["tcpFallback"] and "tcp" in t["ucxTransports"] for t in lanes), seen
    fallback = wait_event(kubectl, ns, "KVTransportFallback", "asks for RDMA", 30, name=NIXL)
    assert fallback["type"] == "Warning" and "tcp/" in fallback["message"], fallback

    # A killed prefill: the rooms waiting on its writes fail fast, it comes back.
    burst = Burst(url, n=6, prompt_chars=1500, max_tokens=16)
    victim, killed_at, outcomes = kill_prefill_mid_burst(kube, node_agent, ns, NIXL, burst)
    assert_failed_fast_and_clearly(outcomes, killed_at)
    wait_event(kubectl, ns, "PrefillInstanceLost", victim["metadata"]["name"], 15, name=NIXL)
    wait_until(
        lambda: (
            victim["metadata"]["uid"]
            not in {p["metadata"]["uid"] for p in pods(kube, ns, NIXL, "prefill")}
        ),
        60,
        "the killed prefill pod replaced",
    )
    wait_pdc(kubectl, ns, NIXL, "1/1", "1/1")
    after = Burst(router_url(kube, ns, NIXL), n=4, prompt_chars=1500, max_tokens=16).result()
    assert all(o.ok and o.completion_tokens == 16 for o in after), after
    kubectl("kubectl", "delete", "pdc", NIXL, "-n", ns, "--wait=true")


# ---------------------------------------------------------------- 2
def test_2_killed_prefill_during_a_burst_fails_only_its_requests_then_comes_back(
    release: Release,
    kube: KubeApi,
    kubectl: KubectlRunner,
    node_agent: NodeAgentClient,
    tmp_path: Path,
) -> None:
    ns = release.apps
    apply(kubectl, tmp_path, ns, journey_manifest())
    wait_pdc(kubectl, ns, NAME, "2/2", "1/1")
    url = router_url(kube, ns, NAME)
    burst = Burst(url, n=24, prompt_chars=1500, max_tokens=16)
    victim, killed_at, outcomes = kill_prefill_mid_burst(kube, node_agent, ns, NAME, burst)

    failed = assert_failed_fast_and_clearly(outcomes, killed_at)
    assert len(failed) < len(outcomes), "the other prefill's requests failed too"
    assert all(o.completion_tokens == 16 for o in outcomes if o.ok)

    lost = wait_event(kubectl, ns, "PrefillInstanceLost", victim["metadata"]["name"], 15)
    assert lost["type"] == "Warning"
    # Whoever noticed first names the reason: the operator's fast path
    # (prefill_pod_lost) or the router, whose prefill leg broke (aborted).
    rooms = wait_event(kubectl, ns, "RoomsFailed", ("prefill_pod_lost", "aborted"), 15)
    assert rooms["count"] >= 1
    # The instance comes back as a new pod, and the service is whole again.
    wait_pdc(kubectl, ns, NAME, "2/2", "1/1")
    assert victim["metadata"]["uid"] not in {
        p["metadata"]["uid"] for p in pods(kube, ns, NAME, "prefill")
    }
    after = Burst(url, n=8, prompt_chars=1500, max_tokens=16).result()
    assert all(o.ok and o.completion_tokens == 16 for o in after), after


# ---------------------------------------------------------------- 3
def test_3_frozen_prefill_is_caught_by_heartbeats_and_requests_fail_over(
    release: Release,
    kube: KubeApi,
    kubectl: KubectlRunner,
    node_agent: NodeAgentClient,
) -> None:
    ns = release.apps
    wait_pdc(kubectl, ns, NAME, "2/2", "1/1")
    url = router_url(kube, ns, NAME)
    victim = pods(kube, ns, NAME, "prefill")[0]
    name, victim_ip = victim["metadata"]["name"], victim["status"]["podIP"]
    decode_url = f"http://{pods(kube, ns, NAME, 'decode')[0]['status']['podIP']}:8000"

    burst = Burst(url, n=24, prompt_chars=1500, max_tokens=16)
    wait_room_on(decode_url, cluster_token(kube, ns), victim_ip)
    frozen_at = time.monotonic()
    node_agent.freeze_pod(ns, name)
    try:
        outcomes = burst.result()
        # Kubernetes sees nothing wrong with the process itself.
        phase = kubectl(
            "kubectl", "get", "pod", name, "-n", ns, "-o", "jsonpath={.status.phase}"
        ).stdout
        assert phase == "Running"
        failed = [o for o in outcomes if not o.ok]
        assert failed, "no request was in flight on the frozen prefill"
        # interval x threshold + the probe timeout, plus slack for a loaded machine.
        bound = HEARTBEAT_S * HEARTBEAT_MISSES + min(HEARTBEAT_S / 2, 1.0) + 4.0
        for o in failed:
            assert o.ended - frozen_at < bound, f"{o.ended - frozen_at:.1f}s > {bound}s"
            assert_clear_prefill_failure(o, ("prefill_unreachable",))
        wait_event(kubectl, ns, "RoomsFailed", "prefill_unreachable", 15)

        # Requests fail over: once the pod is NotReady the router leaves it out.
        def not_ready() -> bool:
            pod = kube.get(f"/api/v1/namespaces/{ns}/pods/{name}")
            return pod is not None and not is_ready(pod)

        wait_until(not_ready, 30, f"{name} NotReady")
        after = Burst(url, n=8, prompt_chars=1500, max_tokens=16).result()
        assert all(o.ok and o.completion_tokens == 16 for o in after), after
        wait_event(kubectl, ns, "PrefillInstanceLost", name, 20)
    finally:
        node_agent.thaw_pod(ns, name)
    wait_pdc(kubectl, ns, NAME, "2/2", "1/1")


# ---------------------------------------------------------------- 2, under recompute
def worker_metric(pod: dict[str, Any], name: str, label: str = "") -> float:
    """Sum of a counter's samples on one worker pod (those whose labels hold `label`)."""
    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{")[0].split(" ")[0] == name and label in line
    )


def test_2b_under_recompute_a_killed_prefill_changes_no_answer(
    release: Release,
    kube: KubeApi,
    kubectl: KubectlRunner,
    node_agent: NodeAgentClient,
) -> None:
    # Journey 2 again with `failurePolicy: recompute` (the rest of the file keeps it).
    ns = release.apps
    kubectl(
        "kubectl", "patch", "pdc", NAME, "-n", ns, "--type=merge",
        "-p", '{"spec": {"transfer": {"failurePolicy": "recompute"}}}',
    )  # fmt: skip
    wait_pdc(kubectl, ns, NAME, "2/2", "1/1")
    url = router_url(kube, ns, NAME)
    decode = pods(kube, ns, NAME, "decode")[0]
    n, chars, max_tokens = 16, 1500, 16
    expected = colocated_text(
        [long_prompt(i, chars) for i in range(n)], max_tokens, journey_manifest()
    )

    burst = Burst(url, n=n, prompt_chars=chars, max_tokens=max_tokens)
    _, _, outcomes = kill_prefill_mid_burst(kube, node_agent, ns, NAME, burst)

    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
    texts = [
        httpx.Response(200, content=o.body.encode()).json()["choices"][0]["text"] for o in outcomes
    ]
    assert texts == expected
    # The kill did hit requests: decode recomputed their prompts itself.
    assert worker_metric(decode, "pdcluster_failures_total", 'reason="recomputed"') >= 1
    wait_pdc(kubectl, ns, NAME, "2/2", "1/1")


# ---------------------------------------------------------------- 4
def test_4_scaling_up_uses_new_instances_and_scaling_down_drains(
    release: Release,
    kube: KubeApi,
    kubectl: KubectlRunner,
    k8s_cluster: ClusterInfo,
) -> None:
    ns = release.apps
    wait_pdc(kubectl, ns, NAME, "2/2", "1/1")
    kubectl("kubectl", "scale", f"pdc/{NAME}", "-n", ns, "--replicas=3")
    kubectl(
        "kubectl", "patch", "pdc", NAME, "-n", ns, "--type=merge",
        "-p", '{"spec": {"prefill": {"replicas": 3}}}',
    )  # fmt: skip
    wait_pdc(kubectl, ns, NAME, "3/3", "3/3")
    url = router_url(kube, ns, NAME)
    before = {
        p["metadata"]["name"]: worker_metric(p, "pdcluster_requests_total")
        for role in ("prefill", "decode")
        for p in pods(kube, ns, NAME, role)
    }
    outcomes = Burst(url, n=24, prompt_chars=300, max_tokens=8).result()
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
    for role in ("prefill", "decode"):
        for p in pods(kube, ns, NAME, role):
            served = worker_metric(p, "pdcluster_requests_total") - before[p["metadata"]["name"]]
            assert served > 0, f"the router sent nothing to {p['metadata']['name']}"

    # Scale down while a burst is in flight: the removed instances drain.
    timeline = PodTimeline(k8s_cluster, ns, NAME)
    try:
        burst = Burst(url, n=24, prompt_chars=1500, max_tokens=32)
        time.sleep(1.0)  # every request has reached its workers
        scaled_at = time.monotonic()
        kubectl("kubectl", "scale", f"pdc/{NAME}", "-n", ns, "--replicas=1")
        kubectl(
            "kubectl", "patch", "pdc", NAME, "-n", ns, "--type=merge",
            "-p", '{"spec": {"prefill": {"replicas": 1}}}',
        )  # fmt: skip
        outcomes = burst.result()
        wait_pdc(kubectl, ns, NAME, "1/1", "1/1")
        removed = timeline.replaced(scaled_at)
    finally:
        timeline.close()
    assert len(removed) == 4, [p.name for p in removed]
    assert all(o.ok and o.completion_tokens == 32 for o in outcomes), [
        o for o in outcomes if not o.ok
    ]
    # A drain is not a loss: no Warning about these pods.
    removed_names = {p.name for p in removed}
    for e in kubectl_events(kubectl, ns):
        if e["reason"] in ("PrefillInstanceLost", "DecodeInstanceLost"):
            assert not any(n in e["message"] for n in removed_names), e


# ---------------------------------------------------------------- 5
def roll_under_load(
    kube: KubeApi,
    kubectl: KubectlRunner,
    info: ClusterInfo,
    ns: str,
    patch: dict[str, Any],
    roles: tuple[str, ...],
) -> None:
    """Apply `patch`, which must replace every pod of `roles`, while four clients
    keep sending; check that no request failed unless it was in flight while a
    replaced pod was going away."""
    wait_pdc(kubectl, ns, NAME, "1/1", "1/1")
    old = {p["metadata"]["uid"] for r in roles for p in pods(kube, ns, NAME, r)}
    timeline = PodTimeline(info, ns, NAME)
    # Each request goes to the router that is Ready now: the router may be replaced too.
    load = SteadyLoad(lambda: router_url(kube, ns, NAME), clients=4).start()
    try:
        time.sleep(2.0)
        changed_at = time.monotonic()
        kubectl(
            "kubectl", "patch", "pdc", NAME, "-n", ns, "--type=merge", "-p", yaml.safe_dump(patch)
        )  # fmt: skip
        wait_pdc(kubectl, ns, NAME, "1/1", "1/1")
        wait_until(
            lambda: all(len(pods(kube, ns, NAME, r)) == 1 for r in roles),
            60,
            "one pod per role, the replaced ones gone",
        )
        time.sleep(2.0)
    finally:
        outcomes = load.stop()
        timeline.close()
    now = {p["metadata"]["uid"] for r in roles for p in pods(kube, ns, NAME, r)}
    assert not (old & now), "some pods were not replaced"
    replaced = timeline.replaced(changed_at, roles)
    assert {p.uid for p in replaced} >= old
    during = [o for o in outcomes if o.ended >= changed_at]
    failed = [(o.status, o.body[:120]) for o in during if not o.ok]
    print(f"rollout of {roles}: {len(during)} requests, {len(failed)} failed {failed}")
    assert len([o for o in during if o.ok]) >= 8, "the service did not keep serving"
    for o in during:
        if o.ok:
            continue
        # A request the router could not place reached no pod: never acceptable.
        assert "no healthy" not in o.body, o
        # Only a request in flight while a replaced pod was going away may fail.
        assert any(
            p.terminating_at is not None
            and o.started <= (p.gone_at or o.ended)
            and o.ended >= p.terminating_at
            for p in replaced
        ), o


def test_5_rolling_a_setting_change_fails_only_requests_on_replaced_pods(
    release: Release,
    kube: KubeApi,
    kubectl: KubectlRunner,
    k8s_cluster: ClusterInfo,
) -> None:
    engine = {"maxPromptTokens": MAX_PROMPT_TOKENS, "maxRunningRequests": 32}
    patch = {"spec": {"prefill": {"engine": engine}, "decode": {"engine": engine}}}
    roll_under_load(kube, kubectl, k8s_cluster, release.apps, patch, ("prefill", "decode"))


def test_5b_a_new_image_tag_replaces_every_pod_and_the_router_too(
    release: Release,
    kube: KubeApi,
    kubectl: KubectlRunner,
    k8s_cluster: ClusterInfo,
) -> None:
    # The image is part of the cluster revision: workers and the router roll, and
    # the router pairs a prefill only with a decode of its own revision meanwhile.
    patch = {"spec": {"image": "pdcluster:0.1.1"}}
    roll_under_load(
        kube, kubectl, k8s_cluster, release.apps, patch, ("prefill", "decode", "router")
    )
    revisions = {
        p["metadata"]["labels"].get("pdcluster.io/revision")
        for r in ("prefill", "decode", "router")
        for p in pods(kube, release.apps, NAME, r)
    }
    assert len(revisions) == 1, revisions


# ---------------------------------------------------------------- 6
def test_6_bad_manifests_and_bad_requests_get_clear_errors(
    release: Release, kube: KubeApi, kubectl: KubectlRunner, tmp_path: Path
) -> None:
    ns = release.apps
    bad = yaml.safe_load(EXAMPLE.read_text())
    bad["metadata"]["name"] = "bad"
    bad["spec"]["decode"]["topology"]["cp"] = 2
    refused = apply(kubectl, tmp_path, ns, bad, check=False)
    assert refused.returncode != 0
    assert "decode.topology.cp must be 1: cp is prefill-only" in refused.stderr
    worse = journey_manifest(decode={"topology": {"pp": 3}}, prefill={"topology": {"pp": 2}})
    worse["metadata"]["name"] = "worse"
    refused = apply(kubectl, tmp_path, ns, worse, check=False)
    assert "decode.topology.pp must be 1 or equal prefill.topology.pp" in refused.stderr
    assert kubectl("kubectl", "get", "pdc", "bad", "-n", ns, check=False).returncode != 0

    url = router_url(kube, ns, NAME)
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "tiny"}', 400, "prompt"),
        (b'{"model": "gpt-4", "prompt": "a"}', 404, "gpt-4"),
        (
            b'{"model": "tiny", "prompt": "' + b"a" * (MAX_PROMPT_TOKENS + 10) + b'"}',
            400,
            str(MAX_PROMPT_TOKENS),
        ),
    ]
    for content, status, words in cases:
        resp = httpx.post(
            f"{url}/v1/completions",
            content=content,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert resp.status_code == status, (content[:40], resp.text)
        assert words in resp.json()["error"]["message"], resp.text
    # Still serving.
    assert complete(url, "after the bad ones", 4).completion_tokens == 4


# ---------------------------------------------------------------- 7
def test_7_helm_upgrade_updates_the_crd_and_uninstall_leaves_nothing(
    release: Release, kube: KubeApi, kubectl: KubectlRunner
) -> None:
    # The cluster holds an older CRD: without the PHASE printer column a
    # previous release did not have. The chart's CRD has it.
    crd = kube.get(CRD)
    assert crd is not None
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    index = next(i for i, c in enumerate(columns) if c["name"] == "Phase")
    kube.patch(
        CRD,
        [{"op": "remove", "path": f"/spec/versions/0/additionalPrinterColumns/{index}"}],
        patch_type="json",
    )
    header = kubectl("kubectl", "get", "pdc", "-n", release.apps).stdout.split()
    assert "PHASE" not in header

    kubectl(
        "helm", "upgrade", release.name, str(CHART), "-n", release.system,
        "--wait", "--timeout", "180s", *OPERATOR_VALUES, "--set", "operator.workers=2",
    )  # fmt: skip
    history = kubectl("helm", "history", release.name, "-n", release.system, "-o", "yaml").stdout
    assert [r["status"] for r in yaml.safe_load(history)][-1] == "deployed"

    def crd_updated() -> bool:
        now = kube.get(CRD) or {}
        cols = now.get("spec", {}).get("versions", [{}])[0].get("additionalPrinterColumns", [])
        return any(c["name"] == "Phase" for c in cols)

    wait_until(crd_updated, 90, "the upgraded operator to apply the chart's CRD")
    header = kubectl("kubectl", "get", "pdc", "-n", release.apps).stdout.split()
    assert "PHASE" in header
    # The cluster kept serving through the operator's upgrade.
    assert complete(router_url(kube, release.apps, NAME), "still here", 4).ok

    # kubectl delete + helm uninstall: nothing of the release or the cluster is left.
    kubectl("kubectl", "delete", "pdc", NAME, "-n", release.apps, "--wait=true")
    apps_pods = f"/api/v1/namespaces/{release.apps}/pods"
    wait_until(
        lambda: not labelled(kube, apps_pods, "pdcluster.io/cluster"),
        90,
        "the PDCluster's pods to go",
    )
    for path in (
        f"/api/v1/namespaces/{release.apps}/services",
        f"/api/v1/namespaces/{release.apps}/configmaps",
        f"/api/v1/namespaces/{release.apps}/secrets",
        f"/apis/apps/v1/namespaces/{release.apps}/deployments",
    ):
        assert labelled(kube, path, "pdcluster.io/cluster") == [], path
    kubectl("helm", "uninstall", release.name, "-n", release.system, "--wait")
    release.uninstalled = True
    wait_until(
        lambda: not labelled(kube, f"/api/v1/namespaces/{release.system}/pods", ""),
        60,
        "the operator pod to go",
    )
    by_release = f"app.kubernetes.io/instance={release.name}"
    for path in (
        f"/apis/apps/v1/namespaces/{release.system}/deployments",
        f"/api/v1/namespaces/{release.system}/serviceaccounts",
        f"/api/v1/namespaces/{release.system}/services",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    ):
        assert labelled(kube, path, by_release) == [], path
    assert release.name not in kubectl("helm", "list", "-n", release.system, "-q").stdout.split()
    # The CRD stays: Helm never deletes CRDs (PDClusters elsewhere would go with it).
    assert kube.get(CRD) is not None
