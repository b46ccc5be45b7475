"""The Helm chart: values schema, `helm lint`, and rendered manifests that pass
the Kubernetes schemas of the pinned version.

`helm` is the binary the e2e control-plane build produces (or one on PATH);
the lint/template tests are skipped, with the reason, when neither exists
(and fail under CI, which builds it before pytest starts).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .helpers import need

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdcluster-operator"
K8S_VERSION = "1.37.0"


def find_helm() -> str | None:
    try:
        from e2e.controlplane.build import binaries_dir

        built = binaries_dir() / "helm"
        if built.is_file():
            return str(built)
    except Exception:  # the e2e build may be absent or unable to ask Go; fall back to PATH
        pass
    return shutil.which("helm")


HELM = find_helm()
# The `helm_binary` fixture (tests/conftest.py) skips without helm, and fails under CI.
needs_helm = pytest.mark.usefixtures("helm_binary")


def values_schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def test_default_values_satisfy_the_values_schema() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    need("jsonschema").Draft7Validator(values_schema()).validate(values)


@pytest.mark.parametrize(
    "patch",
    [
        {"metrics": {"port": 0}},
        {"watchNamespaces": ["Not_A_Namespace"]},
        {"typo": 1},
        {"operator": {"workers": 0}},
        {"image": {"pullPolicy": "Sometimes"}},
        {"imageAllowlist": ["a,b"]},
    ],
    ids=[
        "port-0",
        "bad-namespace",
        "unknown-key",
        "no-workers",
        "bad-pull-policy",
        "bad-allowlist",
    ],
)
def test_values_schema_rejects_mistakes(patch: dict[str, Any]) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, value in patch.items():
        values[key] = (
            {**values[key], **value} if isinstance(value, dict) and key in values else value
        )
    assert list(need("jsonschema").Draft7Validator(values_schema()).iter_errors(values))


def helm(*args: str) -> str:
    assert HELM is not None
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def render(*sets: str) -> list[dict[str, Any]]:
    args = ["template", "rel", str(CHART), "--namespace", "ops", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


VARIANTS = {
    "defaults": (),
    "namespaced": ("watchNamespaces={team-a,team-b}",),
    "monitored": ("metrics.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true"),
    "minimal": (
        "metrics.enabled=false",
        "crds.applyOnStartup=false",
        "serviceAccount.create=false",
        "serviceAccount.name=existing",
    ),
}


@needs_helm
@pytest.mark.parametrize("sets", VARIANTS.values(), ids=VARIANTS.keys())
def test_chart_lints_clean(sets: tuple[str, ...]) -> None:
    args = ["lint", str(CHART), "--strict"]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert "0 chart(s) failed" in out


@needs_helm
@pytest.mark.parametrize("sets", VARIANTS.values(), ids=VARIANTS.keys())
def test_rendered_manifests_pass_the_kubernetes_schemas(sets: tuple[str, ...]) -> None:
    validator = need("kubernetes_validate")
    docs = render(*sets)
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor", "PodMonitor"):
            continue  # Prometheus Operator CRDs, not part of the Kubernetes schemas
        validator.validate(doc, K8S_VERSION, strict=True)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@needs_helm
def test_cluster_wide_by_default_and_per_namespace_when_asked() -> None:
    wide = render()
    assert len(by_kind(wide, "Role")) == 0
    assert {r["metadata"]["name"] for r in by_kind(wide, "ClusterRole")} == {
        "rel-pdcluster-operator",
        "rel-pdcluster-operator-crd",
    }
    (dep,) = by_kind(wide, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--namespace") for a in args)

    scoped = render(*VARIANTS["namespaced"])
    assert {r["metadata"]["namespace"] for r in by_kind(scoped, "Role")} == {"team-a", "team-b"}
    assert {r["metadata"]["name"] for r in by_kind(scoped, "ClusterRole")} == {
        "rel-pdcluster-operator-crd"
    }
    (dep,) = by_kind(scoped, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    # Scoped: pods, secrets, role bindings are granted only in the watched namespaces.
    cluster_wide = {
        res for r in by_kind(scoped, "ClusterRole") for g in r["rules"] for res in g["resources"]
    }
    assert cluster_wide == {"customresourcedefinitions"}
    (wide_role,) = [
        r for r in by_kind(wide, "ClusterRole") if r["metadata"]["name"] == "rel-pdcluster-operator"
    ]
    for role in by_kind(scoped, "Role"):
        assert role["rules"] == wide_role["rules"]
    bindings = by_kind(scoped, "RoleBinding")
    assert {(b["metadata"]["namespace"], b["roleRef"]["kind"]) for b in bindings} == {
        ("team-a", "Role"),
        ("team-b", "Role"),
    }
    assert all(b["subjects"][0]["namespace"] == "ops" for b in bindings)


@needs_helm
def test_rbac_is_least_privilege() -> None:
    docs = render()
    rules = [r for role in by_kind(docs, "ClusterRole") for r in role["rules"]]
    grants = {(res, verb) for r in rules for res in r["resources"] for verb in r["verbs"]}
    assert ("secrets", "list") not in grants and ("secrets", "watch") not in grants
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in rules)
    crd_rules = [r for r in rules if r["apiGroups"] == ["apiextensions.k8s.io"]]
    assert all(
        r.get("resourceNames") == ["pdclusters.pdcluster.io", "pdclusterrolescalers.pdcluster.io"]
        or r["verbs"] == ["create"]
        for r in crd_rules
    )
    # The Role the operator hands to a cluster's pods must be a subset of its own grants.
    from pdcluster.operator.builders import build_runtime_rbac

    from .helpers import PD, make_cluster

    _, pod_role, _ = build_runtime_rbac(make_cluster(PD))
    for rule in pod_role["rules"]:
        for res in rule["resources"]:
            for verb in rule["verbs"]:
                assert (res, verb) in grants, (res, verb)
    # ... and so must every write the controller makes.
    for res, verb in [
        ("pods", "create"),
        ("pods", "delete"),
        ("services", "patch"),
        ("deployments", "patch"),
        ("secrets", "create"),
        ("secrets", "get"),
        ("pdclusters/status", "patch"),
        # The per-role scalers: created with the cluster, their /scale value synced both ways.
        ("pdclusterrolescalers", "create"),
        ("pdclusterrolescalers", "patch"),
        ("pdclusterrolescalers", "watch"),
        ("pdclusterrolescalers/status", "patch"),
        ("events", "create"),
        ("roles", "patch"),
        ("rolebindings", "patch"),
        ("serviceaccounts", "patch"),
        ("networkpolicies", "create"),
        ("networkpolicies", "patch"),
        ("networkpolicies", "list"),
        ("networkpolicies", "watch"),
        # One PodDisruptionBudget per role and the router.
        ("poddisruptionbudgets", "create"),
        ("poddisruptionbudgets", "patch"),
        ("poddisruptionbudgets", "delete"),
        ("poddisruptionbudgets", "list"),
        ("poddisruptionbudgets", "watch"),
        # gang: podGroup: one PodGroup per instance, deleted with its generation.
        ("podgroups", "list"),
        ("podgroups", "create"),
        ("podgroups", "delete"),
    ]:
        assert (res, verb) in grants, (res, verb)
    (pod_groups,) = [r for r in rules if "podgroups" in r["resources"]]
    assert pod_groups["apiGroups"] == ["scheduling.x-k8s.io"]


@needs_helm
def test_probes_use_kopf_liveness_and_crd_comes_with_the_chart() -> None:
    docs = render()
    (dep,) = by_kind(docs, "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    # Health and metrics bind the pod's own address, which the kubelet expands.
    assert "--liveness=http://$(POD_IP):8080/healthz" in container["args"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("PDCLUSTER_OPERATOR_METRICS_HOST")
    assert env["PDCLUSTER_OPERATOR_METRICS_HOST"] == "$(POD_IP)"
    assert env["PDCLUSTER_OPERATOR_APPLY_CRDS"] == "true"
    assert env["PDCLUSTER_OPERATOR_NOT_READY_GRACE_SECONDS"] == "5"
    crds = {c["metadata"]["name"] for c in by_kind(docs, "CustomResourceDefinition")}
    assert crds == {"pdclusters.pdcluster.io", "pdclusterrolescalers.pdcluster.io"}
    minimal = render(*VARIANTS["minimal"])
    (dep,) = by_kind(minimal, "Deployment")
    env = {
        e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PDCLUSTER_OPERATOR_METRICS_PORT"] == "0"
    assert env["PDCLUSTER_OPERATOR_APPLY_CRDS"] == "false"
    assert by_kind(minimal, "ServiceAccount") == [] and by_kind(minimal, "Service") == []
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


@needs_helm
def test_image_allowlist_and_own_namespace_reach_the_operator() -> None:
    def env_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
        (dep,) = by_kind(docs, "Deployment")
        container = dep["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}

    env = env_of(render("imageAllowlist={registry.example/team,pdcluster}"))
    assert env["PDCLUSTER_OPERATOR_IMAGE_ALLOWLIST"] == "registry.example/team,pdcluster"
    assert env["PDCLUSTER_OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    from pdcluster.operator.settings import OperatorSettings

    parsed = OperatorSettings.from_env({k: v for k, v in env.items() if isinstance(v, str)})
    assert parsed.image_allowlist == ("registry.example/team", "pdcluster")
    assert env_of(render())["PDCLUSTER_OPERATOR_IMAGE_ALLOWLIST"] == ""


@needs_helm
def test_the_scrapers_reach_the_operator_and_pod_monitors_select_serving_pods() -> None:
    from pdcluster.operator.builders.networkpolicy import ScrapeSource
    from pdcluster.operator.settings import OperatorSettings

    def settings_of(docs: list[dict[str, Any]]) -> OperatorSettings:
        (dep,) = by_kind(docs, "Deployment")
        container = dep["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        return OperatorSettings.from_env(env)

    # By default: every pod of the monitoring namespace.
    assert settings_of(render()).scrape_source == ScrapeSource.namespace("monitoring")
    chosen = settings_of(
        render(
            "monitoring.scrapeFrom.namespaceSelector.team=obs",
            "monitoring.scrapeFrom.podSelector.app\\.kubernetes\\.io/name=prometheus",
        )
    )
    assert chosen.scrape_source == ScrapeSource(
        {"team": "obs"}, {"app.kubernetes.io/name": "prometheus"}
    )
    assert settings_of(render("monitoring.scrapeFrom.enabled=false")).scrape_source is None
    assert by_kind(render(), "PodMonitor") == []
    monitors = {
        m["metadata"]["name"]: m
        for m in by_kind(render("monitoring.podMonitor.enabled=true"), "PodMonitor")
    }
    workers, routers = (
        monitors["rel-pdcluster-operator-workers"],
        monitors["rel-pdcluster-operator-routers"],
    )
    assert workers["metadata"]["namespace"] == "monitoring"
    # Only a leader serves HTTP; the port is the worker's `http` (/metrics).
    assert workers["spec"]["selector"]["matchLabels"]["pdcluster.io/leader"] == "true"
    assert workers["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert routers["spec"]["selector"]["matchLabels"]["pdcluster.io/role"] == "router"
    # The selectors match the pods the operator builds: leaders, not pods k > 0.
    from pdcluster.operator.builders import build_router_deployment, build_worker_pod
    from pdcluster.runtime.spec import Role

    from .helpers import make_cluster

    cluster = make_cluster({"prefill": {"topology": {"tp": 2}, "gpusPerPod": 1}, "decode": {}})
    leader = build_worker_pod(cluster, Role.prefill, 0, 0)["metadata"]["labels"]
    follower = build_worker_pod(cluster, Role.prefill, 0, 1, "10.0.0.1")["metadata"]["labels"]
    router = build_router_deployment(cluster)["spec"]["template"]["metadata"]["labels"]
    wanted = workers["spec"]["selector"]["matchLabels"].items()
    assert leader.items() >= wanted and not follower.items() >= wanted
    assert router.items() >= routers["spec"]["selector"]["matchLabels"].items()
    assert workers["spec"]["namespaceSelector"] == {"any": True}
    namespaced = by_kind(
        render("monitoring.podMonitor.enabled=true", "watchNamespaces={team-a}"), "PodMonitor"
    )
    assert all(m["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]} for m in namespaced)
