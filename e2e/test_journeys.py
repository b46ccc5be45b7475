"""A user's whole journey on the local control plane, through the tools a user has:
helm, kubectl and the official openai client.

helm install the chart → the operator pod is Ready → kubectl apply the
example manifest → `kubectl get pdc` shows it Ready → the openai client
talks to the router's pod IP (completions and chat, streaming and not) →
an invalid manifest is refused with the CEL rule's message → kubectl
delete, helm uninstall → nothing of the release is left.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.conftest import KubectlRunner
from e2e.kubetest import is_ready
from e2e.nodeagent.kubeapi import KubeApi
from e2e.processes import wait_until

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pdcluster-operator"
EXAMPLE = ROOT / "examples" / "pd-1p1d.yaml"
CLUSTER = "pd-1p1d"  # metadata.name in the example


def labelled(kube: KubeApi, path: str, selector: str) -> list[str]:
    listed = kube.get(path, params={"labelSelector": selector}) or {}
    return [o["metadata"]["name"] for o in listed.get("items", [])]


def router_ip(kube: KubeApi, ns: str) -> str:
    selector = f"pdcluster.io/cluster={CLUSTER},pdcluster.io/role=router"
    listed = kube.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector}) or {}
    ready = [p for p in listed.get("items", []) if is_ready(p)]
    assert len(ready) == 1
    ip: str = ready[0]["status"]["podIP"]
    return ip


def openai_round_trip(base_url: str) -> None:
    openai = pytest.importorskip("openai", reason="the openai client is a dev extra")
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    assert "tiny" in [m.id for m in client.models.list().data]

    prompt = "The capital of France is"
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 8
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert len(pieces) > 1
    # Greedy decoding: the stream spells out exactly the non-streamed text.
    assert "".join(pieces) == done.choices[0].text

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


def test_helm_install_apply_serve_with_openai_then_uninstall(
    kube: KubeApi, kubectl: KubectlRunner, tmp_path: Path
) -> None:
    release = f"pdc-{secrets.token_hex(3)}"
    system, apps = f"{release}-system", f"{release}-apps"
    kubectl("kubectl", "create", "namespace", apps)
    try:
        kubectl(
            "helm", "install", release, str(CHART), "-n", system, "--create-namespace",
            "--wait", "--timeout", "180s",
        )  # fmt: skip
        deployments = labelled(
            kube,
            f"/apis/apps/v1/namespaces/{system}/deployments",
            f"app.kubernetes.io/instance={release}",
        )
        assert len(deployments) == 1
        dep = kube.get(f"/apis/apps/v1/namespaces/{system}/deployments/{deployments[0]}")
        assert dep is not None and dep["status"].get("readyReplicas") == 1

        kubectl("kubectl", "apply", "-n", apps, "-f", str(EXAMPLE))

        def ready() -> bool:
            phase = kubectl(
                "kubectl", "get", "pdc", CLUSTER, "-n", apps, "-o", "jsonpath={.status.phase}"
            ).stdout
            return phase == "Ready"

        wait_until(ready, 180, "the example PDCluster to be Ready", interval_s=1)
        row = kubectl("kubectl", "get", "pdc", "-n", apps).stdout.splitlines()[1].split()
        assert row[:5] == [CLUSTER, "Ready", "1/1", "1/1", "1/1"]

        openai_round_trip(f"http://{router_ip(kube, apps)}:8000/v1")

        # The operator reported what it did, on the PDCluster.
        events = kubectl(
            "kubectl", "get", "events", "-n", apps,
            "--field-selector", "involvedObject.kind=PDCluster", "-o", "yaml",
        ).stdout  # fmt: skip
        reasons = {e["reason"] for e in yaml.safe_load(events)["items"]}
        assert "InstanceCreated" in reasons

        # An invalid manifest never reaches the operator: the API refuses it.
        bad = yaml.safe_load(EXAMPLE.read_text())
        bad["metadata"]["name"] = "bad"
        bad["spec"]["decode"]["topology"]["cp"] = 2
        bad_path = tmp_path / "bad.yaml"
        bad_path.write_text(yaml.safe_dump(bad))
        refused = kubectl("kubectl", "apply", "-n", apps, "-f", str(bad_path), check=False)
        assert refused.returncode != 0
        assert "decode.topology.cp must be 1: cp is prefill-only" in refused.stderr

        kubectl("kubectl", "delete", "-n", apps, "-f", str(EXAMPLE), "--wait=true")
        wait_until(
            lambda: not labelled(kube, f"/api/v1/namespaces/{apps}/pods", "pdcluster.io/cluster"),
            90,
            "the PDCluster's pods to go",
        )
    finally:
        kubectl("helm", "uninstall", release, "-n", system, "--wait", check=False)
        kubectl("kubectl", "delete", "namespace", apps, "--wait=false", check=False)

    # Nothing of the release is left: no pods, no RBAC, no ServiceAccount.
    by_release = f"app.kubernetes.io/instance={release}"
    wait_until(
        lambda: not labelled(kube, f"/api/v1/namespaces/{system}/pods", ""),
        60,
        "the operator pod to go",
    )
    for path in (
        f"/apis/apps/v1/namespaces/{system}/deployments",
        f"/api/v1/namespaces/{system}/serviceaccounts",
        f"/api/v1/namespaces/{system}/services",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    ):
        assert labelled(kube, path, by_release) == [], path
    releases = kubectl("helm", "list", "-n", system, "-q").stdout.split()
    assert release not in releases
    kubectl("kubectl", "delete", "namespace", system, "--wait=false", check=False)
    # The CRD stays: Helm never deletes CRDs (PDClusters elsewhere would go with it).
    crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pdclusters.pdcluster.io"
    assert kube.get(crd) is not None
