"""vLLM on the real control plane: a user's `kind: vllm` PDCluster, end to end.

The operator (a host process, applying its CRD) renders vLLM worker pods; the
node agent runs them as `vllm serve` from the cached vLLM CPU environment
(e2e/vllmenv: the pods' PATH names its bin folder through `engine.vllm.env`,
as an image would have it on PATH), with our router pod in front:

apply → `kubectl get pdc` Ready → the official openai client, through the
router pod, gets completions and chat (streamed and not) equal to the decode
vLLM's own colocated answer (the 1P1D row of the interop table) → the prefill
pod is deleted → a PrefillInstanceLost Warning Event says the router ends or
moves its requests → a new prefill pod is Ready → served again, the same
tokens → the decode pod is deleted in the middle of a long stream, which
still ends complete (the pod's preStop sleep and vLLM's drain).
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from e2e.cluster import ClusterInfo
from e2e.conftest import KubectlRunner
from e2e.kubetest import is_ready
from e2e.nodeagent.kubeapi import KubeApi
from e2e.operator_process import operator_process
from e2e.processes import wait_until
from tests.vllm.harness import CPU_ENV, MODEL_NAME, write_vllm_model

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(1800)]

NAME = "vllm-journey"
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 6
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox and a dog. " * 6}]
READY_S = 900  # two vLLM pods starting at once on a busy 2-core box
# A stream long enough to outlast its pod's preStop sleep (1 s) by seconds here
# (the prompt and it fit the 1,024-token context).
LONG_TOKENS = 300


@pytest.fixture(scope="module")
def vllm_bin() -> Path:
    from e2e.vllmenv.build import VllmEnvError, ensure_vllm_env
    from tests.operator.helpers import unavailable

    try:
        return ensure_vllm_env().root / "bin"
    except VllmEnvError as err:
        unavailable(f"no vLLM environment: {err}")


@pytest.fixture(scope="module")
def operator(k8s_cluster: ClusterInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    settings = {
        "PDCLUSTER_OPERATOR_RESYNC_SECONDS": "20",
        "PDCLUSTER_OPERATOR_EVENT_INTERVAL_SECONDS": "2",
    }
    log = tmp_path_factory.mktemp("vllm-operator") / "operator.log"
    with operator_process(k8s_cluster.kubeconfig, log, env=settings, die_with_parent=True):
        yield


@pytest.fixture(scope="module")
def ns(kube: KubeApi, kubectl: KubectlRunner) -> Iterator[str]:
    name = f"pdc-vllm-{secrets.token_hex(3)}"
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
    kubectl("kubectl", "delete", "pdc", "--all", "-n", name, check=False)
    kube.delete(f"/api/v1/namespaces/{name}")


def manifest(model: Path, vllm_bin: Path) -> dict[str, Any]:
    env = {**CPU_ENV, "PATH": f"{vllm_bin}:/usr/local/bin:/usr/bin:/bin"}
    return {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": NAME},
        "spec": {
            "engine": {
                "kind": "vllm",
                "vllm": {
                    "image": "vllm/vllm-openai:v0.32.0",
                    "extraArgs": ["--max-model-len", "1024", "--enforce-eager"],
                    "env": env,
                },
            },
            "model": {"name": MODEL_NAME, "path": str(model)},
            "kvCache": {"pageSize": 128},
            "transfer": {"backend": "nixl"},
            "prefill": {"replicas": 1, "restart": {"backoffSeconds": 1}},
            "decode": {"replicas": 1},
        },
    }


def pods(kube: KubeApi, ns: str, role: str) -> list[dict[str, Any]]:
    selector = f"pdcluster.io/cluster={NAME},pdcluster.io/role={role}"
    listed = kube.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector}) or {}
    return [p for p in listed.get("items", []) if not p["metadata"].get("deletionTimestamp")]


def wait_ready(kubectl: KubectlRunner, ns: str) -> None:
    def ready() -> bool:
        out = kubectl("kubectl", "get", "pdc", NAME, "-n", ns, "-o", "yaml").stdout
        status = yaml.safe_load(out).get("status") or {}
        return (
            status.get("phase") == "Ready"
            and (status.get("prefill") or {}).get("summary") == "1/1"
            and (status.get("decode") or {}).get("summary") == "1/1"
        )

    wait_until(ready, READY_S, f"{NAME} Ready with one prefill and one decode", interval_s=2)


def router_url(kube: KubeApi, ns: str) -> str:
    ready = [p for p in pods(kube, ns, "router") if is_ready(p)]
    assert ready, "no Ready router pod"
    return f"http://{ready[0]['status']['podIP']}:8000"


CASES = ("completions", "completions-stream", "chat", "chat-stream")


def served(kube: KubeApi, ns: str, cases: tuple[str, ...] = CASES) -> dict[str, list[int]]:
    """Token ids of each endpoint x stream case, through the router pod."""
    oai = openai.OpenAI(base_url=router_url(kube, ns) + "/v1", api_key="unused", timeout=300)
    common: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }
    out: dict[str, list[int]] = {}
    for case in cases:
        stream = case.endswith("-stream")
        if case.startswith("completions"):
            answer = oai.completions.create(prompt=PROMPT, stream=stream, **common)
        else:
            answer = oai.chat.completions.create(messages=MESSAGES, stream=stream, **common)
        chunks = answer if stream else [answer]
        out[case] = [
            t
            for chunk in chunks
            for choice in chunk.choices[:1]
            for t in (choice.model_extra.get("token_ids") or [])
        ]
    return out


def colocated(kube: KubeApi, ns: str) -> dict[str, list[int]]:
    """The decode vLLM's own answers (no kv_transfer_params), with the cluster token."""
    secret = kube.get(f"/api/v1/namespaces/{ns}/secrets/{NAME}-token")
    assert secret is not None
    token = base64.b64decode(secret["data"]["token"]).decode()
    decode = f"http://{pods(kube, ns, 'decode')[0]['status']['podIP']}:8000"
    headers = {"Authorization": f"Bearer {token}"}
    base = {"model": MODEL_NAME, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    out = {}
    for key, path, extra in (
        ("completions", "/v1/completions", {"prompt": PROMPT}),
        ("chat", "/v1/chat/completions", {"messages": MESSAGES}),
    ):
        resp = httpx.post(decode + path, json={**base, **extra}, headers=headers, timeout=300)
        resp.raise_for_status()
        out[key] = out[f"{key}-stream"] = list(resp.json()["choices"][0]["token_ids"])
    return out


def test_vllm_pods_serve_through_the_router_and_come_back_after_a_loss(
    kube: KubeApi,
    kubectl: KubectlRunner,
    operator: None,
    ns: str,
    vllm_bin: Path,
    tmp_path: Path,
) -> None:
    model = write_vllm_model(tmp_path / "model")
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(manifest(model, vllm_bin)))
    kubectl("kubectl", "apply", "-n", ns, "-f", str(path))
    wait_ready(kubectl, ns)
    (prefill,) = pods(kube, ns, "prefill")
    (decode,) = pods(kube, ns, "decode")
    for pod in (prefill, decode):
        assert pod["metadata"]["labels"]["pdcluster.io/engine"] == "vllm"
        container = pod["spec"]["containers"][0]
        assert "vllm serve" in container["command"][2], container["command"]
    reference = colocated(kube, ns)
    assert served(kube, ns) == reference

    # The prefill pod is lost: an Event says so, a new one takes its place.
    kubectl("kubectl", "delete", "pod", prefill["metadata"]["name"], "-n", ns, "--wait=false")

    def lost_event() -> bool:
        out = kubectl(
            "kubectl", "get", "events", "-n", ns, "-o", "yaml",
            "--field-selector", f"involvedObject.kind=PDCluster,involvedObject.name={NAME}",
        ).stdout  # fmt: skip
        return any(
            e["reason"] == "PrefillInstanceLost" and "the router ends its requests" in e["message"]
            for e in yaml.safe_load(out)["items"]
        )

    wait_until(lost_event, 60, "a PrefillInstanceLost Event", interval_s=1)

    def new_prefill_ready() -> bool:
        now = pods(kube, ns, "prefill")
        return (
            len(now) == 1
            and now[0]["metadata"]["uid"] != prefill["metadata"]["uid"]
            and (is_ready(now[0]))
        )

    wait_until(new_prefill_ready, READY_S, "a new prefill pod Ready", interval_s=2)
    wait_ready(kubectl, ns)

    def router_has_both() -> bool:
        workers = httpx.get(router_url(kube, ns) + "/health", timeout=10).json()["workers"]
        return len(workers) == 2 and all(w["healthy"] for w in workers)

    wait_until(router_has_both, 60, "the router serving the new prefill", interval_s=1)
    assert served(kube, ns, cases=("completions-stream",)) == {
        "completions-stream": reference["completions-stream"]
    }

    # The decode pod is deleted while it streams: the stream still ends complete
    # (its preStop sleep, then vLLM's drain; vLLM's default aborts on SIGTERM).
    tokens, finish = stream_while_deleting(kube, kubectl, ns, pods(kube, ns, "decode")[0])
    assert finish == "length"
    assert len(tokens) == LONG_TOKENS
    reference_tokens = reference["completions-stream"]
    assert tokens[: len(reference_tokens)] == reference_tokens


def stream_while_deleting(
    kube: KubeApi, kubectl: KubectlRunner, ns: str, pod: dict[str, Any]
) -> tuple[list[int], str | None]:
    """A long greedy stream through the router; `pod` is deleted at its first token."""
    oai = openai.OpenAI(base_url=router_url(kube, ns) + "/v1", api_key="unused", timeout=300)
    answer = oai.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=LONG_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    tokens: list[int] = []
    finish: str | None = None
    deleted = False
    for chunk in answer:
        for choice in chunk.choices[:1]:
            tokens += choice.model_extra.get("token_ids") or []
            finish = choice.finish_reason or finish
        if tokens and not deleted:
            name = pod["metadata"]["name"]
            kubectl("kubectl", "delete", "pod", name, "-n", ns, "--wait=false")
            deleted = True
    assert deleted, "the stream ended before its pod could be deleted"
    return tokens, finish
