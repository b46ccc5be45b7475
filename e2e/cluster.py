"""A real Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and the node agent.

    python -m e2e.cluster build            # build (or find) the pinned binaries
    python -m e2e.cluster up [--nodes N]   # start everything, write a kubeconfig
    python -m e2e.cluster env              # shell exports for kubectl / helm
    python -m e2e.cluster down             # stop what `up` started, remove its state

Everything listens on 127.0.0.1 at ports picked free at start, so clusters of
different sessions never clash. The state folder holds certificates, tokens,
etcd's data, logs and `cluster.json`, which records every started process by
pid; `down` stops exactly those (and their process groups).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from e2e import pki, processes
from e2e.controlplane.build import KUBERNETES_VERSION, Binaries, BuildError, ensure_binaries
from e2e.nodeagent.client import NodeAgentClient
from e2e.processes import ProcessRecord
from pdcluster.runtime.ports import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STATE_DIR = REPO_ROOT / ".pdcluster" / "e2e-cluster"
STATE_FILE = "cluster.json"
# Service ClusterIPs are only data here (there is no kube-proxy); a loopback range
# means a client that dials one by mistake stays on this machine.
SERVICE_CIDR = "127.254.0.0/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


@dataclass(frozen=True)
class ClusterSettings:
    """How to start a cluster. Times are seconds."""

    state_dir: Path = DEFAULT_STATE_DIR
    num_nodes: int = 2
    # Kill the components if the starting process dies (pytest sessions); a
    # CLI `up` leaves them running for later commands instead.
    die_with_parent: bool = False
    start_timeout_s: float = 120.0
    extra_agent_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.num_nodes <= 250:
            raise ValueError(f"num_nodes must be between 1 and 250, got {self.num_nodes}")


@dataclass(frozen=True)
class ClusterInfo:
    """A running cluster, as recorded in `<state_dir>/cluster.json`."""

    state_dir: Path
    server: str
    kubeconfig: Path
    ca_cert: Path
    admin_token: str
    bin_dir: Path
    node_agent_url: str
    nodes: tuple[str, ...]
    processes: tuple[ProcessRecord, ...] = field(default=())

    @property
    def binaries(self) -> Binaries:
        return Binaries(self.bin_dir)

    def node_agent(self) -> NodeAgentClient:
        return NodeAgentClient(self.node_agent_url)

    def tool_env(self) -> dict[str, str]:
        """Environment for kubectl/helm subprocesses: this cluster's kubeconfig, our binaries."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = os.pathsep.join(
            [str(self.bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]
        )
        env["HELM_CACHE_HOME"] = str(self.state_dir / "helm" / "cache")
        env["HELM_CONFIG_HOME"] = str(self.state_dir / "helm" / "config")
        env["HELM_DATA_HOME"] = str(self.state_dir / "helm" / "data")
        return env

    def to_json(self) -> dict[str, object]:
        return {
            "kubernetes_version": KUBERNETES_VERSION,
            "state_dir": str(self.state_dir),
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ca_cert": str(self.ca_cert),
            "admin_token": self.admin_token,
            "bin_dir": str(self.bin_dir),
            "node_agent_url": self.node_agent_url,
            "nodes": list(self.nodes),
            "processes": [record.to_json() for record in self.processes],
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> ClusterInfo:
        raw_processes = data["processes"]
        raw_nodes = data["nodes"]
        assert isinstance(raw_processes, list) and isinstance(raw_nodes, list)
        return cls(
            state_dir=Path(str(data["state_dir"])),
            server=str(data["server"]),
            kubeconfig=Path(str(data["kubeconfig"])),
            ca_cert=Path(str(data["ca_cert"])),
            admin_token=str(data["admin_token"]),
            bin_dir=Path(str(data["bin_dir"])),
            node_agent_url=str(data["node_agent_url"]),
            nodes=tuple(str(n) for n in raw_nodes),
            processes=tuple(ProcessRecord.from_json(p) for p in raw_processes),
        )


class ClusterError(RuntimeError):
    """A component failed to start, or the state folder is in use; the message says which."""


def load(state_dir: Path) -> ClusterInfo:
    path = state_dir / STATE_FILE
    try:
        return ClusterInfo.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ClusterError(
            f"no cluster recorded in {state_dir} (run `python -m e2e.cluster up`)"
        ) from None


def is_running(state_dir: Path) -> bool:
    try:
        info = load(state_dir)
    except ClusterError:
        return False
    return any(processes.is_alive(record) for record in info.processes)


class _Starter:
    """Starts the components in order, remembering each so a failure stops them all."""

    def __init__(self, settings: ClusterSettings, binaries: Binaries) -> None:
        self.settings = settings
        self.binaries = binaries
        self.state_dir = settings.state_dir
        self.logs = self.state_dir / "logs"
        self.records: list[ProcessRecord] = []
        self._popen: dict[str, object] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        proc, record = processes.spawn(
            name,
            argv,
            self.logs / f"{name}.log",
            env=env,
            cwd=self.state_dir,
            die_with_parent=self.settings.die_with_parent,
        )
        self._popen[name] = proc
        self.records.append(record)
        self._write_pids()

    def exited(self, name: str) -> str | None:
        """Why name is no longer running (with its log tail), or None while it runs."""
        record = next(r for r in self.records if r.name == name)
        processes.reap(record.pid)
        if processes.is_alive(record):
            return None
        return f"{name} exited; last lines of {self.logs / (name + '.log')}:\n" + processes.tail(
            self.logs / f"{name}.log"
        )

    def _write_pids(self) -> None:
        # Written after every start so `down` can clean up even if `up` dies midway.
        (self.state_dir / "pids.json").write_text(json.dumps([r.to_json() for r in self.records]))

    def stop_all(self) -> None:
        for record in reversed(self.records):
            processes.stop(record)


def up(settings: ClusterSettings) -> ClusterInfo:
    """Start a cluster in settings.state_dir (which must not hold a running one)."""
    state_dir = settings.state_dir.resolve()
    settings = ClusterSettings(
        state_dir=state_dir,
        num_nodes=settings.num_nodes,
        die_with_parent=settings.die_with_parent,
        start_timeout_s=settings.start_timeout_s,
        extra_agent_args=settings.extra_agent_args,
    )
    if is_running(state_dir):
        raise ClusterError(f"a cluster is already running in {state_dir}; run `down` first")
    _check_ours(state_dir)
    _stop_recorded(state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)
    (state_dir / "pids.json").write_text("[]")  # marks the folder as a cluster's from the start
    try:
        binaries = ensure_binaries()
    except BuildError as exc:
        raise ClusterError(str(exc)) from exc
    starter = _Starter(settings, binaries)
    try:
        info = _start_components(starter)
    except BaseException:
        starter.stop_all()
        raise
    (state_dir / STATE_FILE).write_text(json.dumps(info.to_json(), indent=2) + "\n")
    return info


def _start_components(starter: _Starter) -> ClusterInfo:
    settings, state_dir, binaries = starter.settings, starter.state_dir, starter.binaries
    timeout = settings.start_timeout_s
    certs = pki.make_pki(state_dir / "pki")
    identities = pki.make_identities()
    token_file = state_dir / "tokens.csv"
    token_file.write_text(pki.render_token_file(identities))
    token_file.chmod(0o600)

    etcd_port, etcd_peer_port = free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    peer_url = f"http://127.0.0.1:{etcd_peer_port}"
    starter.start(
        "etcd",
        [
            str(binaries.path("etcd")),
            "--name=pdc-e2e",
            f"--data-dir={state_dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=pdc-e2e={peer_url}",
            "--unsafe-no-fsync",  # test data: durability is not worth the disk latency
            "--log-level=warn",
        ],
    )
    processes.wait_until(
        lambda: processes.http_get_ok(f"{etcd_url}/health"),
        timeout,
        "etcd /health",
        alive=lambda: starter.exited("etcd"),
    )

    api_port = free_port()
    server = f"https://127.0.0.1:{api_port}"
    starter.start(
        "kube-apiserver",
        [
            str(binaries.path("kube-apiserver")),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--cert-dir={state_dir / 'apiserver-certs'}",
            f"--tls-cert-file={certs.serving_cert}",
            f"--tls-private-key-file={certs.serving_key}",
            f"--client-ca-file={certs.ca_cert}",
            f"--token-auth-file={token_file}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={certs.sa_pub}",
            f"--service-account-signing-key-file={certs.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Endpoints may not hold loopback addresses, and 127.0.0.1 is all we have.
            "--endpoint-reconciler-type=none",
            # Nodes have no resolvable host name: reach the agent's kubelet port by address.
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ],
    )
    admin = identities["admin"]
    processes.wait_until(
        lambda: processes.https_get_ok(f"{server}/readyz", certs.ca_cert, admin.token),
        timeout,
        "kube-apiserver /readyz",
        alive=lambda: starter.exited("kube-apiserver"),
    )

    def kubeconfig(name: str, identity: pki.Identity) -> Path:
        path = state_dir / f"{name}.kubeconfig"
        path.write_text(pki.render_kubeconfig(server, certs.ca_cert, identity.user, identity.token))
        path.chmod(0o600)
        return path

    admin_kubeconfig = state_dir / "kubeconfig"
    admin_kubeconfig.write_text(
        pki.render_kubeconfig(server, certs.ca_cert, admin.user, admin.token)
    )
    admin_kubeconfig.chmod(0o600)

    def start_component(name: str, *flags: str) -> int:
        """Start kube-<name> on a free loopback port as its own identity; the port."""
        port = free_port()
        starter.start(
            f"kube-{name}",
            [
                str(binaries.path(f"kube-{name}")),
                f"--kubeconfig={kubeconfig(name, identities[name])}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                *flags,
                "--leader-elect=false",
                "--v=1",
            ],
        )
        return port

    cm_port = start_component(
        "controller-manager",
        f"--cert-dir={state_dir / 'controller-manager-certs'}",
        f"--service-account-private-key-file={certs.sa_key}",
        f"--root-ca-file={certs.ca_cert}",
        f"--cluster-signing-cert-file={certs.ca_cert}",
        f"--cluster-signing-key-file={certs.ca_key}",
        "--use-service-account-credentials=true",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
    )
    sched_port = start_component("scheduler")
    for name, port in (("kube-controller-manager", cm_port), ("kube-scheduler", sched_port)):
        processes.wait_until(
            functools.partial(processes.https_get_ok, f"https://127.0.0.1:{port}/healthz", None),
            timeout,
            f"{name} /healthz",
            alive=functools.partial(starter.exited, name),
        )

    agent_port = free_port()
    agent_url = f"http://127.0.0.1:{agent_port}"
    nodes = tuple(f"pdc-node-{i}" for i in range(1, settings.num_nodes + 1))
    starter.start(
        "node-agent",
        [
            sys.executable,
            "-c",
            _AGENT_BOOTSTRAP,
            f"--kubeconfig={kubeconfig('node-agent', identities['node-agent'])}",
            f"--state-dir={state_dir / 'nodeagent'}",
            f"--control-port={agent_port}",
            f"--nodes={','.join(nodes)}",
            *settings.extra_agent_args,
        ],
    )
    agent = NodeAgentClient(agent_url)
    processes.wait_until(
        lambda: agent.is_ready(),
        timeout,
        "node agent to register its nodes",
        alive=lambda: starter.exited("node-agent"),
    )
    return ClusterInfo(
        state_dir=state_dir,
        server=server,
        kubeconfig=admin_kubeconfig,
        ca_cert=certs.ca_cert,
        admin_token=admin.token,
        bin_dir=binaries.bin_dir,
        node_agent_url=agent_url,
        nodes=nodes,
        processes=tuple(starter.records),
    )


# e2e/ is not installed, so the agent needs the repository on sys.path: appended, not
# prepended (PYTHONPATH would be), so no folder of the repository comes before an
# installed or standard-library module.
_AGENT_BOOTSTRAP = (
    f"import sys; sys.path.append({str(REPO_ROOT)!r}); "
    "from e2e.nodeagent.__main__ import main; sys.exit(main())"
)


def _stop_recorded(state_dir: Path) -> list[str]:
    """Stop every process a state folder records; newest first, so the agent ends its pods."""
    records: list[ProcessRecord] = []
    for name in (STATE_FILE, "pids.json"):
        try:
            data = json.loads((state_dir / name).read_text())
        except (OSError, ValueError):
            continue
        raw = data["processes"] if isinstance(data, dict) else data
        records.extend(ProcessRecord.from_json(item) for item in raw)
    stopped = []
    seen: set[int] = set()
    for record in reversed(records):
        if record.pid in seen:
            continue
        seen.add(record.pid)
        if processes.is_alive(record):
            stopped.append(record.name)
        # The agent needs time to stop its pods gracefully before it exits.
        processes.stop(record, grace_s=20.0 if record.name == "node-agent" else 5.0)
    _stop_orphan_pods(state_dir)
    return stopped


def _stop_orphan_pods(state_dir: Path) -> None:
    """Pods whose agent died without stopping them: their pid files are left behind."""
    pods_dir = state_dir / "nodeagent" / "pods"
    for pid_file in pods_dir.glob("*/*/pid.json") if pods_dir.is_dir() else []:
        try:
            record = ProcessRecord.from_json(json.loads(pid_file.read_text()))
        except (OSError, ValueError, KeyError):
            continue
        processes.stop(record, grace_s=2.0)


def _check_ours(state_dir: Path) -> None:
    """Refuse to take over (and later delete) a folder that is not a cluster's state."""
    if not state_dir.exists() or not any(state_dir.iterdir()):
        return
    if not ((state_dir / STATE_FILE).exists() or (state_dir / "pids.json").exists()):
        raise ClusterError(
            f"{state_dir} exists and is not a cluster state folder; pick an empty or new one"
        )


def down(state_dir: Path) -> list[str]:
    """Stop everything recorded in state_dir and remove the folder. Returns what was running."""
    state_dir = state_dir.resolve()
    if not state_dir.exists():
        return []
    _check_ours(state_dir)
    stopped = _stop_recorded(state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    return stopped


def render_env(info: ClusterInfo) -> str:
    lines = [
        f"export KUBECONFIG={info.kubeconfig}",
        f"export PATH={info.bin_dir}:{Path(sys.executable).parent}:$PATH",
        f"export PDCLUSTER_E2E_CLUSTER={info.state_dir}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.cluster", description=__doc__.splitlines()[0]
    )
    parser.add_argument("command", choices=["build", "up", "down", "env", "status"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--nodes", type=int, default=2, help="number of fake nodes (up)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(ensure_binaries().bin_dir)
        elif args.command == "up":
            started = time.monotonic()
            info = up(ClusterSettings(state_dir=args.state_dir, num_nodes=args.nodes))
            print(
                f"cluster up in {time.monotonic() - started:.1f} s: {info.server}, "
                f"nodes {', '.join(info.nodes)}",
                file=sys.stderr,
            )
            print(render_env(info), end="")
        elif args.command == "env":
            print(render_env(load(args.state_dir)), end="")
        elif args.command == "status":
            info = load(args.state_dir)
            for record in info.processes:
                state = "running" if processes.is_alive(record) else "stopped"
                print(f"{record.name:<24} pid {record.pid:<8} {state}")
        else:
            stopped = down(args.state_dir)
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}", file=sys.stderr)
    except (ClusterError, BuildError, TimeoutError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
