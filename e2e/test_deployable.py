"""Deployable on a real GPU cluster, checked against the real control plane.

One operator (as the chart runs it, with the scrapers' selector) watches
every namespace; the tests run in file order:
- Pod Security: the real admission plugin agrees with the level the
  builders say a pod needs (dry-run pods in restricted and baseline
  namespaces); a cluster whose pods need more than its namespace admits gets
  `PodSecurityRefused` naming the label;
- the worked GPU example (`examples/llama-8b-pvc-4p4d-nixl-rdma.yaml`), with
  a test overlay removing its GPU and RDMA resources, node selector, RDMA
  transports and big requests, reads a random Llama-architecture model from
  a claim bound to a hostPath volume, reaches Ready and serves; its
  PodDisruptionBudgets hold a second eviction; the scrape rule of its
  NetworkPolicy, read back from the apiserver, admits exactly the monitoring
  pods on the metrics port;
- a model source that holds no model fails its pod with an Event naming
  the source;
- an in-place rollout completes on a "full" namespace (a ResourceQuota that
  leaves no room for a surge pod) while requests keep being served.
"""

from __future__ import annotations

import copy
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.cluster import ClusterInfo
from e2e.conftest import KubectlRunner
from e2e.netpol import Endpoint, admits
from e2e.nodeagent.kubeapi import ApiError, KubeApi
from e2e.operator_process import operator_process
from e2e.processes import wait_until
from pdcluster.operator.builders import build_worker_pod
from pdcluster.operator.builders.overlay import pod_security_level
from pdcluster.operator.reconcile.cluster import cluster_from_body
from pdcluster.runtime.spec import Role
from tests.engine.testing import write_random_hf_dir

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llama-8b-pvc-4p4d-nixl-rdma.yaml"
PDC = "/apis/pdcluster.io/v1alpha1/namespaces/{ns}/pdclusters"
READY_TIMEOUT_S = 600.0
MONITORING_NS_LABEL = "kubernetes.io/metadata.name"
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


@pytest.fixture(scope="module")
def monitoring(kube: KubeApi) -> Iterator[str]:
    name = f"monitoring-{secrets.token_hex(3)}"
    yield make_namespace(kube, name)
    kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="module")
def operator_log(
    k8s_cluster: ClusterInfo, monitoring: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    settings = {
        "PDCLUSTER_OPERATOR_RESYNC_SECONDS": "10",
        "PDCLUSTER_OPERATOR_EVENT_INTERVAL_SECONDS": "2",
        # What the chart passes by default (monitoring.scrapeFrom), here with a pod selector.
        "PDCLUSTER_OPERATOR_SCRAPE_NAMESPACE_SELECTOR": f"{MONITORING_NS_LABEL}={monitoring}",
        "PDCLUSTER_OPERATOR_SCRAPE_POD_SELECTOR": "app.kubernetes.io/name=prometheus",
    }
    with operator_process(k8s_cluster.kubeconfig, log, env=settings, die_with_parent=True):
        yield log


def make_namespace(kube: KubeApi, name: str, labels: dict[str, str] | None = None) -> str:
    kube.create(
        "/api/v1/namespaces",
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": labels or {}},
        },
    )
    wait_until(
        lambda: kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default") is not None,
        30,
        f"the default service account of {name}",
    )
    return name


@pytest.fixture
def fresh_ns(kube: KubeApi) -> Iterator[str]:
    name = make_namespace(kube, f"pdc-dep-{secrets.token_hex(3)}")
    yield name
    kube.delete(f"/api/v1/namespaces/{name}")
    # The volumes host_model_claim made for it (cluster-wide objects).
    for pv in (kube.get("/api/v1/persistentvolumes") or {}).get("items", []):
        if pv["metadata"]["name"].startswith(f"{name}-"):
            kube.delete(f"/api/v1/persistentvolumes/{pv['metadata']['name']}")


def apply(kubectl: KubectlRunner, tmp: Path, ns: str, doc: dict[str, Any]) -> None:
    path = tmp / f"{doc['metadata']['name']}-{secrets.token_hex(2)}.yaml"
    path.write_text(yaml.safe_dump(doc))
    kubectl("kubectl", "apply", "-n", ns, "-f", str(path))


def pdc(kube: KubeApi, ns: str, name: str) -> dict[str, Any]:
    return kube.get(f"{PDC.format(ns=ns)}/{name}") or {}


def wait_phase_ready(kube: KubeApi, ns: str, name: str, log: Path) -> dict[str, Any]:
    try:
        wait_until(
            lambda: (pdc(kube, ns, name).get("status") or {}).get("phase") == "Ready",
            READY_TIMEOUT_S,
            f"PDCluster {name} Ready",
            interval_s=1.0,
        )
    except TimeoutError as err:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise AssertionError(f"{err}\nstatus: {pdc(kube, ns, name).get('status')}\n{tail}") from err
    return pdc(kube, ns, name)


def events(kube: KubeApi, ns: str) -> list[dict[str, Any]]:
    listed = kube.get(f"/api/v1/namespaces/{ns}/events") or {}
    return [e for e in listed.get("items", []) if e["involvedObject"].get("kind") == "PDCluster"]


def wait_event(kube: KubeApi, ns: str, reason: str, words: str, timeout_s: float = 120) -> str:
    found: list[str] = []

    def seen() -> bool:
        found[:] = [e["message"] for e in events(kube, ns) if e["reason"] == reason]
        return any(words in m for m in found)

    wait_until(seen, timeout_s, f"a {reason} Event saying {words!r}", interval_s=1.0)
    return next(m for m in found if words in m)


def pods(kube: KubeApi, ns: str, selector: str) -> list[dict[str, Any]]:
    listed = kube.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector}) or {}
    return list(listed.get("items", []))


def router_ip(kube: KubeApi, ns: str, name: str) -> str:
    ready = [
        p
        for p in pods(kube, ns, f"pdcluster.io/cluster={name},pdcluster.io/role=router")
        if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    ]
    return str(ready[0]["status"]["podIP"])


def complete(ip: str, model: str, prompt: str = "Hello there", tokens: int = 8) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    return httpx.post(f"http://{ip}:8000/v1/completions", json=body, timeout=60)


# ------------------------------------------------------------- Pod Security
PSA_VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "ipc-lock": {"prefill": {"pod": {"capabilities": ["IPC_LOCK"]}}},
    "chown": {"prefill": {"pod": {"capabilities": ["CHOWN"]}}},
    "host-network": {"prefill": {"pod": {"hostNetwork": True}}},
    "host-path-model": {"model": {"name": "m", "source": {"uri": "host:///srv/models/m"}}},
    "pvc-model": {"model": {"name": "m", "source": {"uri": "pvc://models/m"}}},
    "image-model": {"model": {"name": "m", "source": {"uri": "oci://registry.example/m:1"}}},
}


def test_the_real_pod_security_admission_agrees_with_the_level_we_compute(
    kube: KubeApi,
) -> None:
    levels = ("restricted", "baseline")
    namespaces = {
        level: make_namespace(
            kube,
            f"psa-{level}-{secrets.token_hex(3)}",
            {"pod-security.kubernetes.io/enforce": level},
        )
        for level in levels
    }
    try:
        for variant, extra in PSA_VARIANTS.items():
            spec = {"prefill": {}, "decode": {}, **copy.deepcopy(extra)}
            body = {"metadata": {"name": "psa", "namespace": "x", "uid": "u", "generation": 1}}
            cluster = cluster_from_body({**body, "spec": spec})
            pod = build_worker_pod(cluster, Role.prefill, 0, 0)
            need, _ = pod_security_level(pod["spec"])
            for level, ns in namespaces.items():
                pod["metadata"]["namespace"] = ns
                pod["metadata"].pop("ownerReferences", None)
                pod["spec"]["serviceAccountName"] = "default"
                try:
                    kube.request(
                        "POST", f"/api/v1/namespaces/{ns}/pods", body=pod, params={"dryRun": "All"}
                    )
                    admitted = True
                except ApiError as err:
                    assert "violates PodSecurity" in err.message, err.message
                    admitted = False
                expected = levels.index(need) <= levels.index(level) if need in levels else False
                assert admitted is expected, (variant, level, need)
    finally:
        for ns in namespaces.values():
            kube.delete(f"/api/v1/namespaces/{ns}")


def gpu_example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def test_pods_beyond_the_namespace_level_are_explained(
    operator_log: Path, kube: KubeApi, kubectl: KubectlRunner, tmp_path: Path
) -> None:
    ns = make_namespace(
        kube, f"pdc-psa-{secrets.token_hex(3)}", {"pod-security.kubernetes.io/enforce": "baseline"}
    )
    try:
        doc = gpu_example()
        apply(kubectl, tmp_path, ns, doc)
        said = wait_event(kube, ns, "PodSecurityRefused", "IPC_LOCK")
        assert "pod-security.kubernetes.io/enforce=privileged" in said
        assert wait_event(kube, ns, "ApplyFailed", "violates PodSecurity")
    finally:
        kube.delete(f"/api/v1/namespaces/{ns}")


# ---------------------------------------------------------- the worked example
def host_model_claim(kube: KubeApi, ns: str, folder: Path, claim: str = "models") -> None:
    """A PersistentVolume on a host folder and the claim `claim` bound to it (the
    controller-manager's binder binds them; the node agent mounts the folder)."""
    pv = f"{ns}-{claim}"
    kube.create(
        "/api/v1/persistentvolumes",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(folder), "type": "Directory"},
                "claimRef": {"namespace": ns, "name": claim},
            },
        },
    )
    kube.create(
        f"/api/v1/namespaces/{ns}/persistentvolumeclaims",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    wait_until(
        lambda: (
            (kube.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{claim}") or {})
            .get("status", {})
            .get("phase")
            == "Bound"
        ),
        60,
        f"claim {claim} bound",
    )


def without_gpus(doc: dict[str, Any]) -> dict[str, Any]:
    """The test overlay: what a CPU-only cluster cannot give the example — GPUs,
    RDMA devices and transports, the GPU node label, GPU-sized requests and KV."""
    out = copy.deepcopy(doc)
    spec = out["spec"]
    spec["model"]["computeDtype"] = "float32"
    spec["kvCache"] = {**spec["kvCache"], "dtype": "float32", "numPages": 256}
    spec["transfer"]["ucx"] = {}
    for role in ("prefill", "decode"):
        spec[role]["device"] = "cpu"
        spec[role]["resources"] = {"requests": {"cpu": "250m", "memory": "512Mi"}}
        spec[role].pop("nodeSelector")
    return out


@pytest.mark.timeout(900)
def test_the_worked_gpu_example_reaches_ready_and_serves_from_its_claim(
    operator_log: Path,
    kube: KubeApi,
    kubectl: KubectlRunner,
    fresh_ns: str,
    monitoring: str,
    tmp_path: Path,
) -> None:
    doc = without_gpus(gpu_example())
    name, model = doc["metadata"]["name"], doc["spec"]["model"]["name"]
    write_random_hf_dir(tmp_path / "models" / "llama-3.1-8b-instruct", seed=3)
    host_model_claim(kube, fresh_ns, tmp_path / "models")
    kube.create(
        f"/api/v1/namespaces/{fresh_ns}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "regcred"},
            "type": "kubernetes.io/dockerconfigjson",
            "data": {".dockerconfigjson": "eyJhdXRocyI6e319"},  # {"auths":{}}
        },
    )
    started = time.monotonic()
    apply(kubectl, tmp_path, fresh_ns, doc)
    status = wait_phase_ready(kube, fresh_ns, name, operator_log)
    took = time.monotonic() - started
    assert status["status"]["prefill"]["summary"] == "4/4"
    assert status["status"]["decode"]["summary"] == "4/4"
    ip = router_ip(kube, fresh_ns, name)
    wait_until(lambda: complete(ip, model).status_code == 200, 60, "a completion", interval_s=1)
    answers = [complete(ip, model, f"prompt {i}") for i in range(8)]
    assert all(a.status_code == 200 and a.json()["choices"][0]["text"] for a in answers), [
        a.text for a in answers
    ]
    workers = pods(
        kube, fresh_ns, f"pdcluster.io/cluster={name},app.kubernetes.io/component=worker"
    )
    for pod in workers:
        container = pod["spec"]["containers"][0]
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        # The announcement (1 s), the drain budget (300 s) and the margin (30 s).
        assert pod["spec"]["terminationGracePeriodSeconds"] == 331
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "models"
    print(f"worked example Ready in {took:.0f}s")  # noqa: T201 (shown with -s)
    check_disruption_budgets(kube, fresh_ns, name)
    check_scrape_policy(kube, fresh_ns, name, monitoring)


def check_disruption_budgets(kube: KubeApi, ns: str, name: str) -> None:
    """Evicting one decode pod is allowed (4 instances, minAvailable 3); a second
    eviction at once is refused by the apiserver for the budget."""
    path = f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}-decode-budget"
    wait_until(
        lambda: (kube.get(path) or {}).get("status", {}).get("disruptionsAllowed") == 1,
        60,
        "the decode budget to allow one disruption",
    )
    budget = kube.get(path) or {}
    assert budget["spec"]["minAvailable"] == 3
    decodes = sorted(
        p["metadata"]["name"]
        for p in pods(kube, ns, f"pdcluster.io/cluster={name},pdcluster.io/role=decode")
    )

    def evict(pod: str) -> None:
        kube.create(
            f"/api/v1/namespaces/{ns}/pods/{pod}/eviction",
            {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod}},
        )

    evict(decodes[0])
    with pytest.raises(ApiError) as refused:
        evict(decodes[1])
    assert refused.value.status == 429 and "disruption budget" in refused.value.message


def check_scrape_policy(kube: KubeApi, ns: str, name: str, monitoring: str) -> None:
    """The NetworkPolicies as the apiserver stored them admit the monitoring
    namespace's Prometheus pods to the workers' metrics port, and nothing more."""
    stored = (kube.get(f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies") or {})[
        "items"
    ]
    own = [p for p in stored if p["metadata"]["name"].startswith(f"{name}-")]
    assert len(own) == 2
    worker = pods(kube, ns, f"pdcluster.io/cluster={name},pdcluster.io/role=decode")[0]
    labels = worker["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in worker["spec"]["containers"][0]["ports"]}
    target = Endpoint(ns, {MONITORING_NS_LABEL: ns}, labels, ports)
    prometheus = Endpoint(monitoring, {MONITORING_NS_LABEL: monitoring}, PROMETHEUS)
    other_in_monitoring = Endpoint(monitoring, {MONITORING_NS_LABEL: monitoring}, {"app": "x"})
    prometheus_elsewhere = Endpoint("team-b", {MONITORING_NS_LABEL: "team-b"}, PROMETHEUS)
    peer = Endpoint(ns, {MONITORING_NS_LABEL: ns}, {"pdcluster.io/cluster": name})
    stranger = Endpoint(ns, {MONITORING_NS_LABEL: ns}, {"app": "other"})
    metrics, dist = ports["http"], ports["dist"]
    assert admits(own, prometheus, target, metrics)
    assert not admits(own, prometheus, target, dist)
    assert not admits(own, other_in_monitoring, target, metrics)
    assert not admits(own, prometheus_elsewhere, target, metrics)
    assert not admits(own, stranger, target, metrics)
    assert admits(own, peer, target, dist)  # the cluster's own pods: every port
    router = pods(kube, ns, f"pdcluster.io/cluster={name},pdcluster.io/role=router")[0]
    router_target = Endpoint(ns, {MONITORING_NS_LABEL: ns}, router["metadata"]["labels"])
    assert admits(own, stranger, router_target, 8000)  # the API port, and /metrics on it


# ------------------------------------------------------------ a missing model
def test_a_source_without_a_model_fails_the_pod_with_an_event_naming_it(
    operator_log: Path, kube: KubeApi, kubectl: KubectlRunner, fresh_ns: str, tmp_path: Path
) -> None:
    (tmp_path / "models").mkdir()
    host_model_claim(kube, fresh_ns, tmp_path / "models")
    doc = {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": "nomodel"},
        "spec": {
            "model": {"name": "llama", "source": {"uri": "pvc://models/llama-missing"}},
            "colocated": {"restart": {"backoffSeconds": 30}},
        },
    }
    apply(kubectl, tmp_path, fresh_ns, doc)
    said = wait_event(kube, fresh_ns, "InstanceRestarted", "pvc://models/llama-missing")
    assert "config.json does not exist" in said


# ------------------------------------------------------------ in place, full
def full_cluster(name: str) -> dict[str, Any]:
    role = {
        "replicas": 2,
        "rollout": {"maxSurge": 0, "maxUnavailable": 1},
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
    }
    return {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "tiny"},
            "kvCache": {"numPages": 64},
            "transfer": {"bootstrapTimeoutSeconds": 60, "waitingTimeoutSeconds": 60},
            "prefill": copy.deepcopy(role),
            "decode": copy.deepcopy(role),
            "router": {"healthCheckIntervalSeconds": 0.5},
        },
    }


@pytest.mark.timeout(900)
def test_an_in_place_rollout_completes_on_a_full_cluster_while_serving(
    operator_log: Path, kube: KubeApi, kubectl: KubectlRunner, fresh_ns: str, tmp_path: Path
) -> None:
    name = "full"
    # 2 prefill + 2 decode + 1 router: not one pod more fits.
    kube.create(
        f"/api/v1/namespaces/{fresh_ns}/resourcequotas",
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "no-surge"},
            "spec": {"hard": {"pods": "5"}},
        },
    )
    doc = full_cluster(name)
    apply(kubectl, tmp_path, fresh_ns, doc)
    wait_phase_ready(kube, fresh_ns, name, operator_log)
    ip = router_ip(kube, fresh_ns, name)
    wait_until(lambda: complete(ip, "tiny").status_code == 200, 60, "a completion", interval_s=1)
    before = {
        p["metadata"]["name"]
        for p in pods(
            kube, fresh_ns, f"pdcluster.io/cluster={name},app.kubernetes.io/component=worker"
        )
    }
    # A worker setting: both roles roll, the router (same revision) stays.
    for role in ("prefill", "decode"):
        doc["spec"][role]["engine"] = {"chunkSize": 256}
    outcomes: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                outcomes.append(complete(ip, "tiny", tokens=16).status_code)
            except httpx.HTTPError:
                outcomes.append(0)

    clients = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for client in clients:
        client.start()
    apply(kubectl, tmp_path, fresh_ns, doc)

    def rolled() -> bool:
        status = pdc(kube, fresh_ns, name).get("status") or {}
        current = {
            p["metadata"]["name"]
            for p in pods(
                kube, fresh_ns, f"pdcluster.io/cluster={name},app.kubernetes.io/component=worker"
            )
        }
        return (
            status.get("phase") == "Ready"
            and status.get("prefill", {}).get("updated") == 2
            and status.get("decode", {}).get("updated") == 2
            and not current & before
        )

    try:
        wait_until(rolled, READY_TIMEOUT_S, "the in-place rollout", interval_s=1.0)
    finally:
        stop.set()
        for client in clients:
            client.join(70)
    # The quota never let a surge pod in, and nothing was refused for it: the
    # operator never tried to create one.
    refused = [e["message"] for e in events(kube, fresh_ns) if e["reason"] == "ApplyFailed"]
    assert refused == []
    replaced = [e for e in events(kube, fresh_ns) if e["reason"] == "InstanceReplaced"]
    assert any("in place" in e["message"] for e in replaced)
    # The counts per status, not the list: a long list is cut before the codes that matter.
    assert outcomes and all(code == 200 for code in outcomes), Counter(outcomes)
    print(f"{len(outcomes)} requests served during the in-place rollout")  # noqa: T201
