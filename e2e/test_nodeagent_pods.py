"""Pods as local processes: restarts and back-off, probes, environment, fault
hooks and graceful termination, observed through the API as a user would."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.conftest import KubectlRunner
from e2e.kubetest import (
    POD_IP_ENV,
    PYTHON_HTTP_SERVER,
    container_status,
    is_ready,
    make_pod,
    wait_for_object,
    wait_for_phase,
)
from e2e.nodeagent.client import NodeAgentClient, NodeAgentError
from e2e.nodeagent.kubeapi import KubeApi
from e2e.processes import wait_until

pytestmark = pytest.mark.k8s

SLEEPER = "import time; time.sleep(600)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def create_pod(kube: KubeApi, namespace: str, pod: dict[str, Any]) -> str:
    """Create `pod` in `namespace`; its API path."""
    kube.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    return f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}"


def create_secret(kube: KubeApi, namespace: str, name: str, value: str) -> None:
    """A Secret `name` whose one key, `value`, holds `value`."""
    kube.create(
        f"/api/v1/namespaces/{namespace}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            "stringData": {"value": value},
        },
    )


def wait_waiting(
    kube: KubeApi, path: str, what: str, *, with_message: bool = False
) -> dict[str, Any]:
    """The pod once its container waits; `with_message`: waits with a message (past
    the plain ContainerCreating)."""

    def is_waiting(pod: dict[str, Any]) -> bool:
        state = container_status(pod).get("state", {})
        return "waiting" in state and (not with_message or "message" in state["waiting"])

    return wait_for_object(kube, path, is_waiting, 30, what)


def test_crashing_container_restarts_with_growing_back_off(
    kube: KubeApi, namespace: str, tmp_path: Path
) -> None:
    starts = tmp_path / "starts"
    script = (
        f"import sys, time; open({str(starts)!r}, 'a').write(f'{{time.time()}}\\n'); sys.exit(3)"
    )
    path = create_pod(kube, namespace, make_pod("crash", ["python", "-c", script]))
    pod = wait_for_object(
        kube,
        path,
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
    waiting = wait_waiting(kube, path, "the container waiting in back-off")
    assert container_status(waiting)["state"]["waiting"]["reason"] == "CrashLoopBackOff"


def test_restart_policy_never_fails_the_pod_with_the_exit_code(
    kube: KubeApi, namespace: str
) -> None:
    pod = make_pod("once", ["python", "-c", "raise SystemExit(7)"], restartPolicy="Never")
    path = create_pod(kube, namespace, pod)
    done = wait_for_phase(kube, path, "Failed")
    terminated = container_status(done)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (7, "Error")
    assert container_status(done)["restartCount"] == 0


def test_downward_api_and_secret_reach_the_process_environment(
    kube: KubeApi, namespace: str, node_agent: NodeAgentClient
) -> None:
    create_secret(kube, namespace, "token", "s3cret")
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
    path = create_pod(kube, namespace, pod)
    done = wait_for_phase(kube, path, "Succeeded")
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
    path = create_pod(kube, namespace, pod)
    # Past the ContainerCreating every container starts out in: the first start attempt.
    stuck = wait_waiting(kube, path, "a container waiting with a reason", with_message=True)
    waiting = container_status(stuck)["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError"
    assert "later" in waiting["message"]
    create_secret(kube, namespace, "later", "x")
    wait_for_object(kube, path, is_ready, 30, "the pod to start once the Secret exists")


def test_secret_volume_files_reach_the_process_read_only_without_a_token(
    kube: KubeApi, namespace: str, node_agent: NodeAgentClient
) -> None:
    volumes = [{"name": "tok", "secret": {"secretName": "mounted", "items": [
        {"key": "value", "path": "token"}]}}]  # fmt: skip
    script = textwrap.dedent(
        """
        import json, os, stat, sys
        path = os.environ["TOKEN_FILE"]
        mode = stat.S_IMODE(os.stat(path).st_mode)
        print(json.dumps({"arg": sys.argv[1], "path": path,
                          "text": open(path).read(), "mode": mode,
                          "kubeconfig": "KUBECONFIG" in os.environ,
                          "api_host": os.environ.get("KUBERNETES_SERVICE_HOST")}))
        """
    )
    container = {
        "args": ["/etc/pdc/tok/token"],
        "env": [{"name": "TOKEN_FILE", "value": "/etc/pdc/tok/token"}],
        "volumeMounts": [{"name": "tok", "mountPath": "/etc/pdc/tok", "readOnly": True}],
    }
    pod = make_pod(
        "files",
        ["python", "-c", script],
        restartPolicy="Never",
        automountServiceAccountToken=False,
        volumes=volumes,
        container=container,
    )
    path = create_pod(kube, namespace, pod)
    # Like a kubelet: no Secret, no mount, the container waits (the pod stays Pending).
    # Every container starts out waiting in ContainerCreating; wait for the mount's message.
    stuck = wait_waiting(kube, path, "waiting on the mount", with_message=True)
    waiting = container_status(stuck)["state"]["waiting"]
    assert waiting["reason"] == "ContainerCreating" and "mounted" in waiting["message"]
    assert stuck["status"]["phase"] == "Pending"
    create_secret(kube, namespace, "mounted", "from-a-file")
    wait_for_phase(kube, path, "Succeeded")
    seen = json.loads(node_agent.pod_log(namespace, "files"))
    assert seen["text"] == "from-a-file" and seen["mode"] == 0o400
    assert seen["arg"] == seen["path"] != "/etc/pdc/tok/token"  # rewritten to the pod's folder
    # No token without automount, but the API's address, as the kubelet gives every container.
    assert seen["kubeconfig"] is False and seen["api_host"]


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
    path = create_pod(kube, namespace, pod)
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


@pytest.mark.parametrize(
    ("command", "probe", "exit_code"),
    [
        # Asked to stop with SIGTERM, which Python's default handler obeys.
        pytest.param(SLEEPER, {"failureThreshold": 2}, 128 + 15, id="stops_on_sigterm"),
        # Ignores SIGTERM: SIGKILL at the end of the grace period.
        pytest.param(
            STUBBORN,
            # The delay is time for Python to start ignoring SIGTERM.
            {"initialDelaySeconds": 2, "failureThreshold": 1},
            128 + 9,
            id="ignores_sigterm",
        ),
    ],
)
def test_liveness_failure_restarts_the_container(
    kube: KubeApi, namespace: str, command: str, probe: dict[str, int], exit_code: int
) -> None:
    pod = make_pod(
        "probed",
        ["python", "-c", command],
        container={"livenessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1, **probe}},
        terminationGracePeriodSeconds=1,
    )
    restarted = wait_for_object(
        kube,
        create_pod(kube, namespace, pod),
        lambda p: container_status(p).get("restartCount", 0) >= 1,
        30,
        "a restart after failed liveness probes",
    )
    assert container_status(restarted)["lastState"]["terminated"]["exitCode"] == exit_code


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
    kube.create(
        f"/api/v1/namespaces/{namespace}/pods", make_pod("polite", ["python", "-c", polite])
    )
    stubborn_pod = make_pod("stubborn", ["python", "-c", STUBBORN], terminationGracePeriodSeconds=2)
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


def test_a_prestop_sleep_delays_sigterm_within_the_grace_period(
    kube: KubeApi, namespace: str, tmp_path: Path
) -> None:
    marker = tmp_path / "sigterm_at"
    polite = textwrap.dedent(
        f"""
        import signal, sys, time
        def stop(*_):
            open({str(marker)!r}, "w").write(repr(time.time()))
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        time.sleep(600)
        """
    )
    pod = make_pod("sleepy", ["python", "-c", polite], terminationGracePeriodSeconds=30)
    pod["spec"]["containers"][0]["lifecycle"] = {"preStop": {"sleep": {"seconds": 2}}}
    path = create_pod(kube, namespace, pod)
    wait_for_object(kube, path, is_ready, 30, "sleepy Ready")
    time.sleep(0.5)  # let it install its handler
    deleted = time.time()
    kube.delete(path)
    wait_until(lambda: kube.get(path) is None, 20, "sleepy gone")
    assert 1.8 <= float(marker.read_text()) - deleted < 10

    hooked = make_pod("hooked", ["python", "-c", SLEEPER])
    hooked["spec"]["containers"][0]["lifecycle"] = {
        "preStop": {"exec": {"command": ["sleep", "1"]}}
    }
    stuck = wait_waiting(kube, create_pod(kube, namespace, hooked), "refused", with_message=True)
    waiting = container_status(stuck)["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError"
    assert "only the sleep action" in waiting["message"]


def test_pod_without_command_gets_a_clear_error(kube: KubeApi, namespace: str) -> None:
    pod = make_pod("nocmd", [])
    del pod["spec"]["containers"][0]["command"]
    path = create_pod(kube, namespace, pod)
    stuck = wait_waiting(kube, path, "a container waiting with a reason", with_message=True)
    waiting = container_status(stuck)["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError"
    assert "set `command`" in waiting["message"]


def test_kubectl_logs_reads_current_and_previous_runs(
    kubectl: KubectlRunner, kube: KubeApi, namespace: str, node_agent: NodeAgentClient
) -> None:
    script = "import time, uuid; print('run', uuid.uuid4(), flush=True); time.sleep(600)"
    kube.create(
        f"/api/v1/namespaces/{namespace}/pods", make_pod("talker", ["python", "-c", script])
    )
    path = f"/api/v1/namespaces/{namespace}/pods/talker"
    wait_for_object(kube, path, is_ready, 30, "Ready")

    def logs(*extra: str) -> str:
        return kubectl("kubectl", "logs", "-n", namespace, "talker", *extra).stdout

    wait_until(lambda: logs().startswith("run "), 10, "the first line in the log")
    first = logs()
    node_agent.kill_pod(namespace, "talker")
    wait_for_object(
        kube,
        path,
        lambda p: container_status(p).get("restartCount") == 1 and is_ready(p),
        30,
        "restart",
    )
    wait_until(lambda: logs().startswith("run "), 10, "the second run's line")
    assert logs("--previous") == first
    assert logs() != first
    missing = kubectl("kubectl", "logs", "-n", namespace, "talker", "-c", "nope", check=False)
    assert missing.returncode != 0 and "nope" in missing.stderr


def test_pod_reaches_the_api_as_its_service_account_under_rbac(
    kube: KubeApi, namespace: str, node_agent: NodeAgentClient
) -> None:
    script = textwrap.dedent(
        """
        from kubernetes import client, config
        from kubernetes.client.exceptions import ApiException
        config.load_config()
        api = client.CoreV1Api()
        try:
            pods = api.list_namespaced_pod(NS)
            print("listed", len(pods.items))
        except ApiException as exc:
            print("status", exc.status)
        """
    ).replace("NS", repr(namespace))

    def run(name: str) -> str:
        pod = make_pod(name, ["python", "-c", script], restartPolicy="Never")
        path = create_pod(kube, namespace, pod)
        wait_for_phase(kube, path, "Succeeded", "Failed", timeout_s=60)
        return node_agent.pod_log(namespace, name).strip().splitlines()[-1]

    assert run("denied") == "status 403"  # the default account may not list pods
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    kube.create(
        f"{rbac}/roles",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
        },
    )
    kube.create(
        f"{rbac}/rolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "default-reads-pods"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
        },
    )
    assert run("allowed").startswith("listed ")
