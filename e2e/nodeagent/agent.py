"""The node agent (I/O): registers fake Nodes, keeps their leases fresh, and
runs the pods bound to them through one PodWorker each.

Pods are watched across all namespaces and filtered by `spec.nodeName`. A
worker is keyed by pod UID, so a pod deleted and recreated under the same
name gets a new worker and never inherits the old one's processes.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import logging
import random
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from e2e.nodeagent.container import environ_for_pods
from e2e.nodeagent.kubeapi import ApiError, KubeApi
from e2e.nodeagent.kubeletapi import serve_kubelet_api
from e2e.nodeagent.network import MAX_BLOCK, MIN_BLOCK, PodAddressPool, node_address
from e2e.nodeagent.pod import PodEnvironment, PodWorker, pod_key
from e2e.nodeagent.podapi import delete_pod_object
from e2e.nodeagent.settings import AgentSettings
from e2e.pki import make_self_signed
from pdcluster.runtime.ports import free_port

log = logging.getLogger("nodeagent")

LEASE_NAMESPACE = "kube-node-lease"
BLOCK_LOCK_DIR = Path("/tmp/pdcluster-e2e-address-blocks")


def reserve_address_block(preferred: int | None = None) -> tuple[int, IO[str]]:
    """Claim a free 127.B.0.0/16 block for this agent's lifetime (held by a file lock)."""
    BLOCK_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    candidates = list(range(MIN_BLOCK, MAX_BLOCK + 1))
    random.shuffle(candidates)
    if preferred is not None:
        candidates = [preferred]
    for block in candidates:
        handle = open(BLOCK_LOCK_DIR / f"{block}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return block, handle
    raise RuntimeError(f"no free address block (another agent holds block {preferred})")


def _micro_time(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _time(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeAgent:
    def __init__(self, settings: AgentSettings, api: KubeApi) -> None:
        self.settings = settings
        self.api = api
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, PodWorker] = {}  # by pod UID
        self._pools = {
            name: PodAddressPool(settings.address_block, index)
            for index, name in enumerate(settings.node_names, start=1)
        }
        self._node_ips = {
            name: node_address(settings.address_block, index)
            for index, name in enumerate(settings.node_names, start=1)
        }
        self.kubelet_port = 0  # set by run(), advertised in each node's daemonEndpoints
        venv_bin = Path(sys.executable).parent
        self._base_env = environ_for_pods(venv_bin)

    # ------------------------------------------------------------ nodes

    def _node_status(self, now: float) -> dict[str, Any]:
        heartbeat = _time(now)

        def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": heartbeat,
                "lastTransitionTime": _time(self._registered_at),
            }

        resources = self.settings.capacity.as_resources()
        return {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                condition(
                    "MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure"
                ),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "no PID pressure"),
                condition(
                    "Ready", "True", "KubeletReady", "pdcluster node agent is posting ready status"
                ),
            ],
            "nodeInfo": {
                "machineID": "pdcluster-e2e",
                "systemUUID": "pdcluster-e2e",
                "bootID": "pdcluster-e2e",
                "kernelVersion": "local",
                "osImage": "pdcluster node agent (pods are local processes)",
                "containerRuntimeVersion": "pdcluster-nodeagent://0.1",
                "kubeletVersion": self.settings.kubernetes_version,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def register_nodes(self) -> None:
        self._registered_at = time.time()
        for name in self.settings.node_names:
            path = f"/api/v1/nodes/{name}"
            if self.api.get(path) is None:
                self.api.create(
                    "/api/v1/nodes",
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "metadata": {
                            "name": name,
                            "labels": {
                                "kubernetes.io/hostname": name,
                                "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64",
                                "pdcluster.io/node-agent": "true",
                            },
                        },
                    },
                )
            status = self._node_status(time.time())
            status["daemonEndpoints"] = {"kubeletEndpoint": {"Port": self.kubelet_port}}
            status["addresses"] = [
                {"type": "InternalIP", "address": self._node_ips[name]},
                {"type": "Hostname", "address": name},
            ]
            self.api.patch(f"{path}/status", {"status": status})
            self._renew_lease(name)
        self.ready.set()
        log.info("registered nodes %s", ", ".join(self.settings.node_names))

    def _renew_lease(self, node: str) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{node}"
        now = _micro_time(time.time())
        lease = self.api.get(path)
        if lease is None:
            self.api.create(
                f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": node, "namespace": LEASE_NAMESPACE},
                    "spec": {
                        "holderIdentity": node,
                        "leaseDurationSeconds": self.settings.lease_duration_s,
                        "renewTime": now,
                    },
                },
            )
            return
        lease["spec"]["renewTime"] = now
        lease["spec"]["holderIdentity"] = node
        self.api.put(path, lease)

    def _heartbeat_loop(self) -> None:
        last_status = time.monotonic()
        while not self.stop_event.wait(self.settings.lease_renew_s):
            for node in self.settings.node_names:
                try:
                    self._renew_lease(node)
                    if time.monotonic() - last_status >= self.settings.node_status_heartbeat_s:
                        self.api.patch(
                            f"/api/v1/nodes/{node}/status",
                            {"status": self._node_status(time.time())},
                        )
                except (ApiError, OSError) as exc:
                    log.warning("heartbeat for %s failed: %s", node, exc)
            if time.monotonic() - last_status >= self.settings.node_status_heartbeat_s:
                last_status = time.monotonic()

    # ------------------------------------------------------------ pods

    def _environment(self, node: str) -> PodEnvironment:
        pool = self._pools[node]

        def allocate() -> str:
            with self._lock:
                return pool.allocate()

        def release(address: str) -> None:
            with self._lock:
                pool.release(address)

        return PodEnvironment(
            api=self.api,
            settings=self.settings,
            node_name=node,
            host_ip=self._node_ips[node],
            allocate_ip=allocate,
            release_ip=release,
            base_env=self._base_env,
        )

    def _handle(self, event_type: str, pod: dict[str, Any]) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        if node not in self._pools:
            return
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self._workers.get(uid)
        if event_type == "DELETED":
            if worker is not None:
                worker.mark_gone()
            return
        if worker is not None:
            worker.update(pod)
            return
        phase = (pod.get("status") or {}).get("phase")
        if pod["metadata"].get("deletionTimestamp"):
            # Nothing of it runs here, so there is nothing to wait for.
            metadata = pod["metadata"]
            try:
                delete_pod_object(self.api, metadata["namespace"], metadata["name"], uid)
            except ApiError as exc:
                log.warning("pod %s: delete failed: %s", pod_key(pod), exc)
            return
        if phase in ("Succeeded", "Failed"):
            return  # finished before this agent started: nothing to run
        worker = PodWorker(pod, self._environment(node))
        with self._lock:
            self._workers[uid] = worker
        worker.start()

    def _prune(self, live_uids: set[str]) -> None:
        with self._lock:
            finished = [uid for uid, w in self._workers.items() if not w.is_alive()]
            for uid in finished:
                del self._workers[uid]
            missing = [w for uid, w in self._workers.items() if uid not in live_uids]
        for worker in missing:
            worker.mark_gone()

    def _watch_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                listing = self.api.request("GET", "/api/v1/pods")
                uids = set()
                for pod in listing.get("items") or []:
                    uids.add(pod["metadata"]["uid"])
                    self._handle("ADDED", pod)
                self._prune(uids)
                version = listing["metadata"]["resourceVersion"]
                for event_type, obj in self.api.watch("/api/v1/pods", version, timeout_s=60):
                    if self.stop_event.is_set():
                        return
                    if event_type == "ERROR":
                        log.info("pod watch ended: %s", obj.get("message"))
                        break
                    if event_type == "BOOKMARK":
                        continue
                    self._handle(event_type, obj)
                    self._prune_finished()
            except Exception as exc:  # the apiserver restarting must not end the agent
                if self.stop_event.is_set():
                    return
                log.warning("pod watch failed, relisting: %s", exc)
                self.stop_event.wait(1.0)

    def _prune_finished(self) -> None:
        with self._lock:
            for uid in [uid for uid, w in self._workers.items() if not w.is_alive()]:
                del self._workers[uid]

    # ------------------------------------------------------------ lifecycle and hooks

    def serve_kubelet_api(self) -> None:
        """Serve pod logs on every node address (what `kubectl logs` reaches through the API)."""
        addresses = list(self._node_ips.values())
        cert, key = make_self_signed(
            self.settings.state_dir / "pki", "kubelet", [f"IP:{a}" for a in addresses]
        )
        self.kubelet_port = free_port(addresses[0])
        serve_kubelet_api(self, addresses, self.kubelet_port, cert, key)

    def run(self) -> None:
        """Register, then serve until stop_event is set; stops every pod before returning."""
        self.serve_kubelet_api()
        self.register_nodes()
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        watcher = threading.Thread(target=self._watch_loop, name="pod-watch", daemon=True)
        watcher.start()
        self.stop_event.wait()
        self.shutdown()

    def shutdown(self) -> None:
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.stop_for_agent_shutdown()
        for worker in workers:
            worker.join(timeout=self.settings.shutdown_grace_s + 5.0)

    def find_worker(self, namespace: str, name: str) -> PodWorker:
        key = f"{namespace}/{name}"
        with self._lock:
            matching = [w for w in self._workers.values() if w.key == key and w.is_alive()]
        if not matching:
            raise KeyError(f"pod {key} is not running on this agent's nodes")
        return matching[-1]

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            workers = [w for w in self._workers.values() if w.is_alive()]
        return [
            {
                "pod": w.key,
                "uid": w.uid,
                "node": w.env.node_name,
                "podIP": w.pod_ip,
                "containers": [
                    {
                        "name": run.name,
                        "pid": run.record.pid if run.record and run.is_running else None,
                        "running": run.is_running,
                        "frozen": run.frozen,
                        "runs": run.num_runs,
                    }
                    for run in w.init_containers + w.containers
                ],
            }
            for w in workers
        ]


__all__ = ["NodeAgent", "reserve_address_block", "pod_key"]
