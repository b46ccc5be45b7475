"""The local control plane behaves like a cluster: scheduling, controllers,
garbage collection, validation, helm and kubectl, with pods as local processes."""

from __future__ import annotations

import json
import ssl
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import ClusterInfo
from e2e.conftest import KubectlRunner
from e2e.controlplane.build import HELM_VERSION, KUBERNETES_VERSION
from e2e.nodeagent.client import NodeAgentClient, NodeAgentError
from e2e.nodeagent.kubeapi import ApiError, KubeApi
from e2e.processes import process_start_ticks, wait_until

pytestmark = pytest.mark.k8s

PYTHON_HTTP_SERVER = ["python", "-m", "http.server", "8080", "--bind", "$(POD_IP)"]
POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def wait_for_object(
    kube: KubeApi,
    path: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout_s: float,
    what: str,
) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def check() -> bool:
        obj = kube.get(path)
        if obj is not None and predicate(obj):
            found.update(obj)
            return True
        return False

    wait_until(check, timeout_s, what)
    return found


def make_pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "unused", "command": command}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 5, **spec},
    }


def container_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return statuses[0]


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_apiserver_kubectl_and_helm_report_the_pinned_versions(
    k8s_cluster: ClusterInfo, kubectl: KubectlRunner
) -> None:
    context = ssl.create_default_context(cafile=str(k8s_cluster.ca_cert))
    request = urllib.request.Request(
        k8s_cluster.server + "/version",
        headers={"Authorization": f"Bearer {k8s_cluster.admin_token}"},
    )
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        assert json.load(response)["gitVersion"] == KUBERNETES_VERSION

    versions = json.loads(kubectl("kubectl", "version", "-o", "json").stdout)
    assert versions["serverVersion"]["gitVersion"] == KUBERNETES_VERSION
    assert versions["clientVersion"]["minor"] == versions["serverVersion"]["minor"]

    assert kubectl("helm", "version", "--short").stdout.startswith(HELM_VERSION)
    # helm reaches the apiserver too: listing releases needs the API.
    assert kubectl("helm", "list", "--all-namespaces").returncode == 0


def test_nodes_are_ready_with_gpus(kube: KubeApi, k8s_cluster: ClusterInfo) -> None:
    for name in k8s_cluster.nodes:
        node = kube.get(f"/api/v1/nodes/{name}")
        assert node is not None
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready[0]["status"] == "True"
        address = node["status"]["addresses"][0]["address"]
        assert address.startswith("127.")


def test_deployment_runs_ready_processes_and_deleting_it_collects_everything(
    kube: KubeApi, namespace: str, node_agent: NodeAgentClient
) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "web",
                            "image": "unused",
                            "command": PYTHON_HTTP_SERVER,
                            "env": [POD_IP_ENV],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "readinessProbe": {
                                "httpGet": {"path": "/", "port": "http"},
                                "periodSeconds": 1,
                            },
                        }
                    ],
                },
            },
        },
    }
    kube.create(f"/apis/apps/v1/namespaces/{namespace}/deployments", deployment)
    wait_for_object(
        kube,
        f"/apis/apps/v1/namespaces/{namespace}/deployments/web",
        lambda d: (d.get("status") or {}).get("readyReplicas") == 2,
        60,
        "2 ready replicas",
    )
    pods = kube.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
    addresses = {p["status"]["podIP"] for p in pods}
    assert len(addresses) == 2 and all(a.startswith("127.") for a in addresses)
    for address in addresses:  # each pod serves on its own loopback address
        with urllib.request.urlopen(f"http://{address}:8080/", timeout=5) as response:
            assert response.status == 200

    running = [p for p in node_agent.pods() if p["pod"].startswith(namespace + "/")]
    pids = [c["pid"] for p in running for c in p["containers"]]
    assert len(pids) == 2 and all(process_start_ticks(pid) is not None for pid in pids)

    kube.delete(f"/apis/apps/v1/namespaces/{namespace}/deployments/web")
    wait_until(
        lambda: (
            not kube.request("GET", f"/apis/apps/v1/namespaces/{namespace}/replicasets")["items"]
            and not kube.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
        ),
        60,
        "the garbage collector to remove the ReplicaSet and its pods",
    )
    wait_until(
        lambda: all(process_start_ticks(pid) is None for pid in pids), 10, "processes to end"
    )


def test_crashing_container_restarts_with_growing_back_off(
    kube: KubeApi, namespace: str, tmp_path: Path
) -> None:
    starts = tmp_path / "starts"
    script = (
        f"import sys, time; open({str(starts)!r}, 'a').write(f'{{time.time()}}\\n'); sys.exit(3)"
    )
    kube.create(f"/api/v1/namespaces/{namespace}/pods", make_pod("crash", ["python", "-c", script]))
    pod = wait_for_object(
        kube,
        f"/api/v1/namespaces/{namespace}/pods/crash",
        lambda p: container_status(p).get("restartCount", 0) >= 3,
        60,
        "3 restarts",
    )
    status = container_status(pod)
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert pod["status"]["phase"] == "Running"  # restartPolicy Always: it keeps coming back
    # restartCount counts a run as soon as it is spawned; wait for its own timestamp.
    wait_until(lambda: len(starts.read_text().split()) >= 4, 10, "the fourth start")
    times = [float(line) for line in starts.read_text().split()]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Back-off is a floor that doubles: 1 s, 2 s, 4 s (plus start-up time).
    assert gaps[0] >= 0.9 and gaps[1] >= 1.8 and gaps[2] >= 3.6, gaps
    assert gaps[2] > 2 * gaps[0], gaps
    waiting = wait_for_object(
        kube,
        f"/api/v1/namespaces/{namespace}/pods/crash",
        lambda p: "waiting" in container_status(p).get("state", {}),
        30,
        "the container waiting in back-off",
    )
    assert container_status(waiting)["state"]["waiting"]["reason"] == "CrashLoopBackOff"


def test_restart_policy_never_fails_the_pod_with_the_exit_code(
    kube: KubeApi, namespace: str
) -> None:
    pod = make_pod("once", ["python", "-c", "raise SystemExit(7)"], restartPolicy="Never")
    kube.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    done = wait_for_object(
        kube,
        f"/api/v1/namespaces/{namespace}/pods/once",
        lambda p: p.get("status", {}).get("phase") == "Failed",
        30,
        "phase Failed",
    )
    terminated = container_status(done)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (7, "Error")
    assert container_status(done)["restartCount"] == 0


def test_downward_api_and_secret_reach_the_process_environment(
    kube: KubeApi, namespace: str, node_agent: NodeAgentClient
) -> None:
    kube.create(
        f"/api/v1/namespaces/{namespace}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "token"},
            "stringData": {"value": "s3cret"},
        },
    )
    env = [
        POD_IP_ENV,
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "token", "key": "value"}}},
        {"name": "GREETING", "value": "hello from $(POD_NAME)"},
    ]
    script = "import json, os; print(json.dumps(dict(os.environ)))"
    pod = make_pod("env", ["python", "-c", script], restartPolicy="Never", container={"env": env})
    kube.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    done = wait_for_object(
        kube,
        f"/api/v1/namespaces/{namespace}/pods/env",
        lambda p: p.get("status", {}).get("phase") == "Succeeded",
        30,
        "phase Succeeded",
    )
    seen = json.loads(node_agent.pod_log(namespace, "env"))
    assert seen["POD_IP"] == done["status"]["podIP"]
    assert (seen["POD_NAME"], seen["POD_NS"], seen["APP"]) == ("env", namespace, "env")
    assert seen["TOKEN"] == "s3cret"
    assert seen["GREETING"] == "hello from env"
    assert Path(seen["KUBECONFIG"]).is_file()  # the pod's service account, bound to this pod


def test_missing_secret_is_reported_then_picked_up_once_created(
    kube: KubeApi, namespace: str
) -> None:
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "later", "key": "value"}}}]
    pod = make_pod("waits", ["python", "-c", "import time; time.sleep(60)"], container={"env": env})
    kube.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    path = f"/api/v1/namespaces/{namespace}/pods/waits"
    stuck = wait_for_object(
        kube,
        path,
        lambda p: "waiting" in container_status(p).get("state", {}),
        30,
        "a waiting container",
    )
    waiting = container_status(stuck)["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError"
    assert "later" in waiting["message"]
    kube.create(
        f"/api/v1/namespaces/{namespace}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "later"},
            "stringData": {"value": "x"},
        },
    )
    wait_for_object(kube, path, is_ready, 30, "the pod to start once the Secret exists")


def test_kill_freeze_and_thaw_hooks(
    kube: KubeApi, namespace: str, node_agent: NodeAgentClient
) -> None:
    pod = make_pod(
        "victim",
        PYTHON_HTTP_SERVER,
        container={
            "env": [POD_IP_ENV],
            "readinessProbe": {
                "httpGet": {"path": "/", "port": 8080},
                "periodSeconds": 1,
                "failureThreshold": 1,
            },
        },
    )
    kube.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    path = f"/api/v1/namespaces/{namespace}/pods/victim"
    wait_for_object(kube, path, is_ready, 30, "Ready")

    assert node_agent.freeze_pod(namespace, "victim") == ["main"]
    wait_for_object(kube, path, lambda p: not is_ready(p), 15, "a frozen pod to turn unready")
    node_agent.thaw_pod(namespace, "victim")
    wait_for_object(kube, path, is_ready, 15, "a thawed pod to turn ready again")

    node_agent.kill_pod(namespace, "victim")
    killed = wait_for_object(
        kube,
        path,
        lambda p: container_status(p).get("restartCount") == 1,
        30,
        "a restart after the kill",
    )
    assert container_status(killed)["lastState"]["terminated"]["exitCode"] == 137
    wait_for_object(kube, path, is_ready, 30, "Ready after the restart")

    with pytest.raises(NodeAgentError, match="no container"):
        node_agent.kill_pod(namespace, "victim", container="nope")
    with pytest.raises(NodeAgentError, match="not running"):
        node_agent.kill_pod(namespace, "no-such-pod")


def test_liveness_failure_restarts_the_container(kube: KubeApi, namespace: str) -> None:
    pod = make_pod(
        "hangs",
        ["python", "-c", "import time; time.sleep(600)"],
        container={
            "livenessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2}
        },
        terminationGracePeriodSeconds=1,
    )
    kube.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    restarted = wait_for_object(
        kube,
        f"/api/v1/namespaces/{namespace}/pods/hangs",
        lambda p: container_status(p).get("restartCount", 0) >= 1,
        30,
        "a restart after failed liveness probes",
    )
    # The process was asked to stop with SIGTERM, which Python's default handler obeys.
    assert container_status(restarted)["lastState"]["terminated"]["exitCode"] == 128 + 15


def test_deletion_is_graceful_then_forced(kube: KubeApi, namespace: str, tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    polite = textwrap.dedent(
        f"""
        import signal, sys, time
        def stop(*_):
            open({str(marker)!r}, "w").write("sigterm")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        time.sleep(600)
        """
    )
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    kube.create(
        f"/api/v1/namespaces/{namespace}/pods", make_pod("polite", ["python", "-c", polite])
    )
    stubborn_pod = make_pod("stubborn", ["python", "-c", stubborn], terminationGracePeriodSeconds=2)
    kube.create(f"/api/v1/namespaces/{namespace}/pods", stubborn_pod)
    for name in ("polite", "stubborn"):
        wait_for_object(
            kube, f"/api/v1/namespaces/{namespace}/pods/{name}", is_ready, 30, f"{name} Ready"
        )

    time.sleep(0.5)  # let the polite one install its handler
    started = time.monotonic()
    for name in ("polite", "stubborn"):
        kube.delete(f"/api/v1/namespaces/{namespace}/pods/{name}")
    wait_until(
        lambda: kube.get(f"/api/v1/namespaces/{namespace}/pods/polite") is None,
        15,
        "polite pod gone",
    )
    assert marker.read_text() == "sigterm"
    wait_until(
        lambda: kube.get(f"/api/v1/namespaces/{namespace}/pods/stubborn") is None,
        15,
        "stubborn gone",
    )
    elapsed = time.monotonic() - started
    assert 1.5 <= elapsed < 10, elapsed  # SIGKILL came after the 2 s grace period, not 30 s


def test_pod_without_command_gets_a_clear_error(kube: KubeApi, namespace: str) -> None:
    pod = make_pod("nocmd", [])
    del pod["spec"]["containers"][0]["command"]
    kube.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    stuck = wait_for_object(
        kube,
        f"/api/v1/namespaces/{namespace}/pods/nocmd",
        lambda p: "waiting" in container_status(p).get("state", {}),
        30,
        "a waiting container",
    )
    waiting = container_status(stuck)["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError"
    assert "set `command`" in waiting["message"]


def test_crd_cel_rule_rejects_an_invalid_object(kube: KubeApi, namespace: str) -> None:
    group = f"{namespace}.e2e.pdcluster.io"
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "minReplicas": {"type": "integer"},
                    "maxReplicas": {"type": "integer"},
                },
                "x-kubernetes-validations": [
                    {
                        "rule": "self.minReplicas <= self.maxReplicas",
                        "message": "minReplicas must not exceed maxReplicas",
                    }
                ],
            }
        },
    }
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"ranges.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "ranges", "singular": "range", "kind": "Range"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }
    crd_path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    kube.create(crd_path, crd)
    try:
        wait_for_object(
            kube,
            f"{crd_path}/ranges.{group}",
            lambda c: any(
                x["type"] == "Established" and x["status"] == "True"
                for x in (c.get("status") or {}).get("conditions") or []
            ),
            30,
            "the CRD to be established",
        )
        objects = f"/apis/{group}/v1/namespaces/{namespace}/ranges"

        def create(name: str, low: int, high: int) -> dict[str, Any]:
            body = {
                "apiVersion": f"{group}/v1",
                "kind": "Range",
                "metadata": {"name": name},
                "spec": {"minReplicas": low, "maxReplicas": high},
            }
            return kube.create(objects, body)

        wait_until(lambda: _served(kube, objects), 30, "the CRD's API to be served")
        assert create("good", 1, 3)["spec"]["maxReplicas"] == 3
        with pytest.raises(ApiError) as rejected:
            create("bad", 5, 2)
        assert rejected.value.status == 422
        assert "minReplicas must not exceed maxReplicas" in rejected.value.message
        assert kube.get(f"{objects}/bad") is None
    finally:
        kube.delete(f"{crd_path}/ranges.{group}")


def _served(kube: KubeApi, path: str) -> bool:
    try:
        kube.request("GET", path)
    except ApiError:
        return False
    return True


def test_helm_installs_and_uninstalls_a_chart(
    kubectl: KubectlRunner, kube: KubeApi, namespace: str, tmp_path: Path
) -> None:
    chart = tmp_path / "greeter"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: greeter\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-greeting\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    kubectl(
        "helm", "install", "hi", str(chart), "-n", namespace, "--set", "greeting=bonjour", "--wait"
    )
    config_map = kube.get(f"/api/v1/namespaces/{namespace}/configmaps/hi-greeting")
    assert config_map is not None and config_map["data"] == {"greeting": "bonjour"}
    releases = json.loads(kubectl("helm", "list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("hi", "deployed")]
    kubectl("helm", "uninstall", "hi", "-n", namespace, "--wait")
    assert kube.get(f"/api/v1/namespaces/{namespace}/configmaps/hi-greeting") is None


def test_kubectl_sees_pods_running_on_fake_nodes(
    kubectl: KubectlRunner, kube: KubeApi, namespace: str, k8s_cluster: ClusterInfo
) -> None:
    kube.create(
        f"/api/v1/namespaces/{namespace}/pods",
        make_pod("idle", [sys.executable, "-c", "import time; time.sleep(600)"]),
    )
    wait_for_object(kube, f"/api/v1/namespaces/{namespace}/pods/idle", is_ready, 30, "Ready")
    out = kubectl("kubectl", "get", "pods", "-n", namespace, "-o", "wide").stdout
    assert "idle" in out and "Running" in out
    assert any(node in out for node in k8s_cluster.nodes)
