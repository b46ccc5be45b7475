"""Operator timings on the local Kubernetes control plane (e2e/): how fast a
PDCluster comes up, and how fast a killed prefill pod's rooms fail at decode.

    .venv/bin/python bench/operator_timings.py [--apply-trials 3] [--kill-trials 5] [--cluster DIR]
        [--prefill-pods 1,2]

Starts a control plane (or uses the one `python -m e2e.cluster up --state-dir
DIR` left running) and one operator process, then:

- apply trials: create a 1P1D PDCluster in a fresh namespace and time
  `children` (every child object exists), `ready` (status phase Ready) and
  `serving` (the router pod answers a completion);
- kill trials, on one cluster: freeze the prefill, send a request straight to
  decode naming it (decode opens the room and waits for KV), SIGKILL the
  prefill and time `pod Failed` (the API shows the pod Failed: the node
  agent's part), `decode answered` (the client gets the room's failure) and
  `Ready again` (the restarted instance serves). The operator's own part
  (pod event received → every decode answered fail_peer) comes from its
  `pdcluster_operator_failover_seconds` histogram. Heartbeats are set to
  30 s, so nothing but the fast path fails the room that fast.

`--prefill-pods 1,2` runs both phases once per prefill layout: 1 is one
pod per instance, N > 1 a prefill instance of tp=N over N pods
(`gpusPerPod: 1`, a gang: the kill trial kills its leader and waits for
the whole instance to come back with new pods).

Prints one table per phase and layout (median, min, max over trials) and a
JSON line.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
# The e2e package lives at the repository root; appended, so no folder of the
# repository comes before an installed or standard-library module.
sys.path.append(str(ROOT))

from e2e import cluster as cluster_mod  # noqa: E402
from e2e.cluster import ClusterInfo, ClusterSettings  # noqa: E402
from e2e.decode_request import DecodeRequest  # noqa: E402
from e2e.nodeagent.kubeapi import KubeApi  # noqa: E402
from e2e.operator_process import operator_process  # noqa: E402
from e2e.processes import wait_until  # noqa: E402

NAME = "bench"
PDC = "/apis/pdcluster.io/v1alpha1/namespaces/{ns}/pdclusters"
CHILDREN = [
    "/api/v1/namespaces/{ns}/configmaps/bench-config",
    "/api/v1/namespaces/{ns}/secrets/bench-token",
    "/api/v1/namespaces/{ns}/serviceaccounts/bench-runtime",
    "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/bench-runtime",
    "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/bench-runtime",
    "/apis/apps/v1/namespaces/{ns}/deployments/bench-router",
    "/api/v1/namespaces/{ns}/services/bench-router",
]


def manifest(prefill_pods: int = 1) -> dict[str, Any]:
    prefill: dict[str, Any] = {"replicas": 1, "restart": {"backoffSeconds": 1}}
    if prefill_pods > 1:
        prefill.update(topology={"tp": prefill_pods}, gpusPerPod=1)
    return {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": "tiny"},
            "kvCache": {"numPages": 64},
            "transfer": {
                "heartbeat": {"intervalSeconds": 30},
                "bootstrapTimeoutSeconds": 120,
                "waitingTimeoutSeconds": 120,
            },
            "prefill": prefill,
            "decode": {"replicas": 1},
        },
    }


@contextmanager
def control_plane(state: str | None) -> Iterator[ClusterInfo]:
    if state:
        yield cluster_mod.load(Path(state))
        return
    with tempfile.TemporaryDirectory(prefix="pdc-bench-") as tmp:
        info = cluster_mod.up(ClusterSettings(state_dir=Path(tmp), num_nodes=2))
        try:
            yield info
        finally:
            cluster_mod.down(Path(tmp))


def histogram(metrics_url: str, name: str, role: str) -> tuple[float, float]:
    """(sum, count) of a histogram's series for `role`."""
    out = {"sum": 0.0, "count": 0.0}
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        for part in out:
            if line.startswith(f'{name}_{part}{{role="{role}"}}'):
                out[part] = float(line.rsplit(" ", 1)[1])
    return out["sum"], out["count"]


class Bench:
    def __init__(self, info: ClusterInfo, metrics_url: str, prefill_pods: int = 1) -> None:
        self.info = info
        self.prefill_pods = prefill_pods
        self.kube = KubeApi(info.server, info.admin_token, info.ca_cert)
        self.agent = info.node_agent()
        self.metrics_url = metrics_url

    def namespace(self) -> str:
        ns = f"bench-{secrets.token_hex(3)}"
        self.kube.create(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        )
        wait_until(
            lambda: self.kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default") is not None,
            30,
            "the default service account",
        )
        return ns

    def drop(self, ns: str) -> None:
        """Delete the namespace and wait, so its pods stop competing for the CPU."""
        self.kube.delete(f"/api/v1/namespaces/{ns}")
        wait_until(
            lambda: self.kube.get(f"/api/v1/namespaces/{ns}") is None, 120, f"namespace {ns}"
        )

    def pods(self, ns: str, role: str) -> list[dict[str, Any]]:
        selector = f"pdcluster.io/cluster={NAME},pdcluster.io/role={role}"
        listed = self.kube.get(f"/api/v1/namespaces/{ns}/pods", {"labelSelector": selector})
        items = (listed or {}).get("items", [])
        alive = [p for p in items if not p["metadata"].get("deletionTimestamp")]
        return sorted(
            alive, key=lambda p: int(p["metadata"]["labels"].get("pdcluster.io/pod-index", 0))
        )

    def phase(self, ns: str) -> str:
        obj = self.kube.get(f"{PDC.format(ns=ns)}/{NAME}") or {}
        return str((obj.get("status") or {}).get("phase", ""))

    def complete(self, ns: str) -> bool:
        routers = self.pods(ns, "router")
        ip = routers[0].get("status", {}).get("podIP") if routers else None
        if not ip:
            return False
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        try:
            resp = httpx.post(f"http://{ip}:8000/v1/completions", json=body, timeout=30)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def until(self, condition: Callable[[], bool], what: str, timeout_s: float = 180) -> float:
        wait_until(condition, timeout_s, what, interval_s=0.02)
        return time.monotonic()

    def apply_trial(self) -> dict[str, float]:
        ns = self.namespace()
        try:
            t0 = time.monotonic()
            self.kube.create(PDC.format(ns=ns), manifest(self.prefill_pods))

            def children() -> bool:
                if any(self.kube.get(p.format(ns=ns)) is None for p in CHILDREN):
                    return False
                return bool(self.pods(ns, "prefill") and self.pods(ns, "decode"))

            t_children = self.until(children, "every child")
            t_ready = self.until(lambda: self.phase(ns) == "Ready", "phase Ready")
            t_serving = self.until(lambda: self.complete(ns), "a completion via the router")
            return {
                "children": t_children - t0,
                "ready": t_ready - t0,
                "serving": t_serving - t0,
            }
        finally:
            self.drop(ns)

    def kill_trial(self, ns: str, token: str) -> dict[str, float]:
        self.until(lambda: self.phase(ns) == "Ready", "Ready before the kill")
        prefill, decode = self.pods(ns, "prefill")[0], self.pods(ns, "decode")[0]
        old_uids = {p["metadata"]["uid"] for p in self.pods(ns, "prefill")}
        name, prefill_ip = prefill["metadata"]["name"], prefill["status"]["podIP"]
        decode_url = f"http://{decode['status']['podIP']}:8000"
        admin = {"Authorization": f"Bearer {token}"}
        before = histogram(self.metrics_url, "pdcluster_operator_failover_seconds", "prefill")
        self.agent.freeze_pod(ns, name)
        request = DecodeRequest(decode_url, prefill_ip, admin, timeout_s=120)
        self.until(request.room_open, "decode to open the room", 30)
        failed_at: list[float] = []
        watcher = threading.Thread(target=self._watch_failed, args=(ns, name, failed_at))
        watcher.start()
        killed = time.monotonic()
        self.agent.kill_pod(ns, name)
        answered = request.join(120)
        watcher.join(30)
        if answered.get("status") != 502 or "prefill_pod_lost" not in answered.get("text", ""):
            raise RuntimeError(f"decode did not fail the room by the fast path: {answered}")
        after = histogram(self.metrics_url, "pdcluster_operator_failover_seconds", "prefill")

        def replaced() -> bool:  # every pod of the gang is new
            uids = {p["metadata"]["uid"] for p in self.pods(ns, "prefill")}
            return len(uids) == self.prefill_pods and not uids & old_uids

        t_ready = self.until(lambda: replaced() and self.phase(ns) == "Ready", "Ready again")
        operator_s = (after[0] - before[0]) / max(1.0, after[1] - before[1])
        return {
            "pod Failed in the API": (failed_at[0] if failed_at else float("nan")) - killed,
            "operator: event to peers told": operator_s,
            "decode answered": answered["at"] - killed,
            "Ready again": t_ready - killed,
        }

    def _watch_failed(self, ns: str, name: str, out: list[float]) -> None:
        api = KubeApi(self.info.server, self.info.admin_token, self.info.ca_cert)
        path = f"/api/v1/namespaces/{ns}/pods"
        try:
            version = api.get(path)["metadata"]["resourceVersion"]  # type: ignore[index]
            for _, obj in api.watch(path, version, timeout_s=30):
                if obj["metadata"]["name"] == name and obj["status"].get("phase") == "Failed":
                    out.append(time.monotonic())
                    return
        finally:
            api.close()


def summarize(title: str, trials: list[dict[str, float]]) -> None:
    print(f"\n{title} ({len(trials)} trials)")
    print("| step | median | min | max |")
    print("| --- | ---: | ---: | ---: |")
    for key in trials[0]:
        values = [t[key] for t in trials]
        row = [statistics.median(values), min(values), max(values)]
        unit = 1000 if max(values) < 2 else 1
        cells = " | ".join(f"{v * 1000:.0f} ms" if unit == 1000 else f"{v:.1f} s" for v in row)
        print(f"| {key} | {cells} |")


def run_layout(
    bench: Bench, apply_trials: int, kill_trials: int
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """The apply trials, then the kill trials on one cluster, for one prefill layout."""
    applies = [bench.apply_trial() for _ in range(apply_trials)]
    ns = bench.namespace()
    try:
        bench.kube.create(PDC.format(ns=ns), manifest(bench.prefill_pods))
        bench.until(lambda: bench.phase(ns) == "Ready", "the kill cluster Ready")
        secret = bench.kube.get(f"/api/v1/namespaces/{ns}/secrets/{NAME}-token") or {}
        token = base64.b64decode(secret["data"]["token"]).decode()
        kills = [bench.kill_trial(ns, token) for _ in range(kill_trials)]
    finally:
        bench.drop(ns)
    return applies, kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--apply-trials", type=int, default=3)
    parser.add_argument("--kill-trials", type=int, default=5)
    parser.add_argument("--cluster", default=os.environ.get("PDCLUSTER_E2E_CLUSTER"))
    parser.add_argument(
        "--prefill-pods", default="1", help="comma-separated pods per prefill instance, e.g. 1,2"
    )
    args = parser.parse_args()
    try:
        layouts = [int(n) for n in args.prefill_pods.split(",")]
    except ValueError:
        parser.error(f"--prefill-pods: {args.prefill_pods!r} is not a list of numbers, e.g. 1,2")
    if any(n < 1 for n in layouts):
        parser.error("--prefill-pods: every layout needs at least one pod")
    results: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="pdc-bench-op-") as tmp,
        control_plane(args.cluster) as info,
        operator_process(info.kubeconfig, Path(tmp) / "operator.log") as (_, metrics_url),
    ):
        for pods in layouts:
            applies, kills = run_layout(
                Bench(info, metrics_url, pods), args.apply_trials, args.kill_trials
            )
            label = f"{pods} pod{'s' if pods > 1 else ''} per prefill instance"
            summarize(f"apply → ..., {label}", applies)
            summarize(f"prefill leader SIGKILL → ..., {label}", kills)
            results[str(pods)] = {"apply": applies, "kill": kills}
        print(json.dumps(results if len(layouts) > 1 else results[str(layouts[0])]))


if __name__ == "__main__":
    main()
