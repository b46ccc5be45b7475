"""The local control plane behaves like a cluster: scheduling, controllers,
garbage collection, validation, helm and kubectl."""

from __future__ import annotations

import json
import ssl
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import ClusterInfo
from e2e.conftest import KubectlRunner
from e2e.controlplane.build import HELM_VERSION, KUBERNETES_VERSION
from e2e.kubetest import (
    POD_IP_ENV,
    PYTHON_HTTP_SERVER,
    is_ready,
    make_pod,
    wait_for_object,
)
from e2e.nodeagent.client import NodeAgentClient
from e2e.nodeagent.kubeapi import ApiError, KubeApi
from e2e.processes import process_start_ticks, wait_until

pytestmark = pytest.mark.k8s


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


def test_the_kubernetes_client_works_with_the_written_kubeconfig(k8s_cluster: ClusterInfo) -> None:
    from kubernetes import client, config

    kubeconfig = str(k8s_cluster.kubeconfig)
    api_client = config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    with api_client:
        nodes = client.CoreV1Api(api_client).list_node()
    names = sorted(str(n.metadata.name) for n in nodes.items if n.metadata is not None)
    assert names == sorted(k8s_cluster.nodes)
