"""What the operator says about deployability: Secrets an overlay or a model
source reaches, a pod that could not find its model, a Pod Security refusal."""

from __future__ import annotations

from typing import Any

from pdcluster.operator.builders.meta import ObjectKey
from pdcluster.operator.kube.client import ApiError
from pdcluster.operator.reconcile.actions import Create, Delete
from pdcluster.operator.reconcile.controller import pod_security_refusals
from pdcluster.operator.reconcile.instances import Health, judge
from pdcluster.operator.reconcile.observed import parse_object, parse_pod
from pdcluster.operator.reconcile.policy import check_cluster, secret_references

from .helpers import PD, UID, make_cluster


def test_secrets_an_overlay_or_a_model_source_reach_need_the_opt_in_label() -> None:
    spec = {
        **PD,
        "model": {
            "name": "llama",
            "source": {"uri": "hf://org/llama", "cacheClaim": "hf", "tokenSecretName": "hf"},
        },
        "prefill": {
            "pod": {
                "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "db", "key": "k"}}}],
                "envFrom": [{"secretRef": {"name": "bulk"}}],
                "volumes": [{"name": "v", "secret": {"secretName": "files"}}],
            }
        },
        "router": {"pod": {"envFrom": [{"secretRef": {"name": "bulk"}}]}},
    }
    cluster = make_cluster(spec)
    refs = {(r.field, r.name) for r in secret_references(cluster)}
    assert refs == {
        ("spec.model.source.tokenSecretName", "hf"),
        ("spec.prefill.pod.env[X]", "db"),
        ("spec.prefill.pod.envFrom", "bulk"),
        ("spec.prefill.pod.volumes[v]", "files"),
        ("spec.router.pod.envFrom", "bulk"),
    }
    foreign = {"kind": "Secret", "metadata": {"name": "db", "uid": "u", "labels": {}}}
    refusal = check_cluster(cluster, (), {"db": foreign})
    assert refusal is not None and "spec.prefill.pod.env[X]" in refusal.message


def ended_pod(message: str) -> dict[str, Any]:
    labels = {
        "pdcluster.io/cluster": "demo",
        "pdcluster.io/role": "prefill",
        "pdcluster.io/instance": "0",
        "pdcluster.io/template-hash": "t",
        "pdcluster.io/pod-index": "0",
    }
    owner = {"controller": True, "uid": UID, "kind": "PDCluster", "name": "demo"}
    return {
        "kind": "Pod",
        "metadata": {"name": "p", "uid": "u", "labels": labels, "ownerReferences": [owner]},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"name": "worker", "state": {"terminated": {"exitCode": 1, "message": message}}}
            ],
        },
    }


def test_a_pod_that_found_no_model_says_so_in_the_restart_reason() -> None:
    said = (
        "loading...\npdcluster worker: model source pvc://models/llama: "
        "/models/llama/config.json does not exist (a model folder needs it)\n"
    )
    raw = ended_pod(said)
    obj = parse_object(raw)
    assert obj is not None
    pod = parse_pod(obj, raw)
    assert pod is not None
    inst = judge(pod_key(pod), 1, {0: pod}, now=0.0, not_ready_grace_s=30.0)
    assert inst.health is Health.broken
    assert inst.reason == (
        "pod p is Failed: pdcluster worker: model source pvc://models/llama: "
        "/models/llama/config.json does not exist (a model folder needs it)"
    )


def pod_key(pod: Any) -> Any:
    from pdcluster.operator.builders.workers import InstanceKey

    return InstanceKey(pod.role, pod.instance, pod.template_hash)


def test_a_pod_security_refusal_names_the_level_and_the_label() -> None:
    manifest = {
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"pdcluster.io/role": "decode"}},
        "spec": {
            "containers": [
                {"name": "worker", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}
            ]
        },
    }
    refused = ApiError(
        403, "Forbidden", 'pods "p" is forbidden: violates PodSecurity "restricted:latest": ...'
    )
    other = ApiError(403, "Forbidden", "exceeded quota")
    errors = [
        (Create(manifest), refused),
        (Create(manifest), refused),  # one Event per role
        (Create({**manifest, "metadata": {"name": "q", "labels": {}}}), other),
        (Delete(ObjectKey("Pod", "x"), "u"), refused),
    ]
    (message,) = pod_security_refusals("team-a", errors)
    assert message == (
        "decode pods need Pod Security level privileged (container worker adds IPC_LOCK), "
        "which the namespace team-a does not admit: label it "
        "pod-security.kubernetes.io/enforce=privileged (kubectl label namespace ... "
        "--overwrite), or remove those settings"
    )
