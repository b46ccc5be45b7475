"""Local mode plan: which processes a PDCluster manifest becomes on one machine.

Pure: from a validated manifest and a list of free ports, build the process
specs (argv, env, addresses). The launcher only executes the plan. Every
instance of a role is one worker process on 127.0.0.1 per pod of the
instance (`gpusPerPod`, runtime/pod_layout.py; one pod when it is left
out) that starts that pod's ranks; rank 0 on pod 0 (the leader) hosts the
HTTP server and, for prefill, the bootstrap server. The pods of a
multi-pod instance are named `<role>-<i>-<k>` like the operator's, share
the instance's ports (each is bound by one rank of one pod: with dp = 1
pods k > 0 listen on none of them, they dial the leader's) and are told
the leader's address in `$PDCLUSTER_LEADER_ADDRESS`. An instance with
dp > 1 also gets a store port per dp group and an internal HTTP port per
dp group after the first, drawn here with every other port
(`--dp-dist-ports`, `--dp-ports`, runtime/dp_ports.py): the pod hosting a
group's rank 0 binds them.

With `engine.kind: vllm` an instance is one `vllm serve` process
(runtime/vllm/serve_command.py) started through `child_guard` (our
interpreter), so it stops with the launcher like ours do; it listens on its
HTTP port and, for prefill and decode, on a NIXL side-channel port drawn
here; a role routed by cache_aware also publishes its prefix-cache events
on two more (`--kv-events-config`: a PUB port, which vLLM binds on every
interface, and a replay port on 127.0.0.1), which the router is told with
`--kv-events URL=PUB,REPLAY`. vLLM's dp ranks bind internal ports local mode does not draw, so a
vLLM instance runs with `topology.dp` 1 here (Kubernetes runs any dp).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from pdcluster.runtime.pod_rendezvous import LEADER_ADDRESS_ENV
from pdcluster.runtime.spec import (
    EngineKind,
    PDCluster,
    Role,
    RoleSpec,
    VllmKVConnector,
    WorkerApiAccess,
)
from pdcluster.runtime.vllm.serve_command import (
    API_KEY_ENV,
    DEFAULT_KV_EVENTS_PORTS,
    DEFAULT_SIDE_CHANNEL_PORT,
    SIDE_CHANNEL_HOST_ENV,
    build_vllm_serve,
    publishes_kv_events,
    vllm_argv,
)

HOST = "127.0.0.1"


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # e.g. "prefill-0", "router"
    role: Role | Literal["router"]
    instance: int
    argv: tuple[str, ...]
    port: int  # HTTP port
    bootstrap_port: int | None = None
    num_ranks: int = 1  # ranks this process (pod) runs
    env: dict[str, str] = field(default_factory=dict)
    pod: int = 0  # pod index within its instance (0: the leader)
    num_pods: int = 1
    first_rank: int = 0
    # The instance's torch store ports (one per dp group, the first is --dist-port)
    # and its dp leaders' internal HTTP ports (groups 1..dp-1).
    dist_ports: tuple[int, ...] = ()
    dp_ports: tuple[int, ...] = ()
    engine: EngineKind = EngineKind.builtin
    # What the launcher's liveness prober asks (vLLM has no /health/live).
    liveness_path: str = "/health/live"
    # The variable that carries the cluster token into the process, besides
    # PDCLUSTER_TOKEN (vLLM's API key); None: none.
    api_key_env: str | None = None
    # vLLM's NIXL side channel (prefill and decode).
    side_channel_ports: tuple[int, ...] = ()
    # vLLM's prefix-cache events (PUB, replay), when the router follows them.
    kv_events_ports: tuple[int, ...] = ()
    # vLLM with our connector: its side port (prefill's bootstrap server, both
    # roles' admin API); a prefill's `bootstrap_port` is the same port.
    side_port: int | None = None

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port of its instance this process's pod set may bind."""
        own = (
            self.port,
            *self.dist_ports,
            *self.dp_ports,
            *self.side_channel_ports,
            *self.kv_events_ports,
        )
        extra = {p for p in (self.bootstrap_port, self.side_port) if p is not None}
        return (*own, *sorted(extra))

    @property
    def admin_url(self) -> str:
        """Where its admin API is (`fail_peer`, `prefill_peers`, `get_server_info`):
        the side port of vLLM with our connector, else the HTTP API."""
        return f"http://{HOST}:{self.side_port}" if self.side_port is not None else self.url

    @property
    def is_leader(self) -> bool:
        """Whether this is its instance's leader pod (its URL is the instance's)."""
        return self.pod == 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass(frozen=True)
class LocalPlan:
    cluster: str
    workers: tuple[ProcessSpec, ...]
    router: ProcessSpec

    @property
    def leaders(self) -> tuple[ProcessSpec, ...]:
        """One worker process per instance: the one serving its HTTP API."""
        return tuple(w for w in self.workers if w.is_leader)

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        return (*self.workers, self.router)

    @property
    def endpoint(self) -> str:
        return self.router.url


def _role_items(manifest: PDCluster) -> Iterator[tuple[Role, RoleSpec]]:
    spec = manifest.spec
    if spec.colocated is not None:
        yield Role.colocated, spec.colocated
        return
    assert spec.prefill is not None and spec.decode is not None
    yield Role.prefill, spec.prefill
    yield Role.decode, spec.decode


def num_worker_ports(role: Role, dp: int = 1, engine: EngineKind = EngineKind.builtin) -> int:
    """Ports one instance needs: HTTP + one torch store per dp group (+ bootstrap for
    prefill) + the internal HTTP port of each dp group's leader after the first;
    a vLLM instance: HTTP (+ its NIXL side channel for prefill and decode)."""
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    if engine is EngineKind.vllm:
        return 1 if role is Role.colocated else 2
    return (2 if role is Role.prefill else 1) + dp + (dp - 1)


def instance_ports(manifest: PDCluster, role: Role) -> int:
    """`num_worker_ports` of one instance of `role` in `manifest` (+ 2 for the
    cache events of a vLLM instance the router follows)."""
    dp = role_spec_of(manifest, role).topology.dp
    events = 2 if publishes_kv_events(manifest.spec, role) else 0
    return num_worker_ports(role, dp, manifest.spec.engine.kind) + events


def count_ports(manifest: PDCluster) -> int:
    """Ports the plan needs: every worker's, and the router's."""
    n = 1
    for role, rs in _role_items(manifest):
        n += rs.replicas * instance_ports(manifest, role)
    return n


def role_spec_of(manifest: PDCluster, role: Role) -> RoleSpec:
    for r, rs in _role_items(manifest):
        if r is role:
            return rs
    raise ValueError(f"the manifest has no {role.value} role")


def build_instance_specs(
    manifest: PDCluster,
    manifest_path: str,
    role: Role,
    instance: int,
    ports: list[int],
    prefills: list[ProcessSpec],
    python: str,
    vllm: str | None = None,
) -> list[ProcessSpec]:
    """The processes (one per pod, the leader first) of one instance of `role`, also
    of one started later by autoscaling: `ports` holds `instance_ports(manifest, role)`
    free ports; a decode may contact only `prefills`; `vllm` runs vLLM (a `vllm`
    executable or an interpreter with vLLM) when the manifest says `engine.kind: vllm`."""
    rs = role_spec_of(manifest, role)
    dp = rs.topology.dp
    need = instance_ports(manifest, role)
    if len(ports) != need:
        raise ValueError(f"a {role.value} instance with dp={dp} needs {need} ports")
    if len(set(ports)) != len(ports):
        raise ValueError(f"the ports of a {role.value} instance must be distinct: {ports}")
    if manifest.spec.engine.is_vllm:
        return [_vllm_instance(manifest, role, instance, ports, prefills, python, vllm)]
    free = iter(ports)
    port, dist_port = next(free), next(free)
    argv = [
        python,
        "-m",
        "pdcluster.runtime.cli",
        "worker",
        "-f",
        manifest_path,
        "--role",
        role.value,
        "--instance",
        str(instance),
        "--host",
        HOST,
        "--port",
        str(port),
        "--dist-port",
        str(dist_port),
    ]
    dp_ports: tuple[int, ...] = ()
    if dp > 1:
        # Drawn here with every other port: a worker picking its own at start
        # could take one handed to a process that has not bound it yet.
        dist_more = [next(free) for _ in range(dp - 1)]
        dp_ports = tuple(next(free) for _ in range(dp - 1))
        argv += ["--dp-dist-ports", _port_list(dist_more), "--dp-ports", _port_list(dp_ports)]
        dist_ports = (dist_port, *dist_more)
    else:
        dist_ports = (dist_port,)
    bport = None
    if role is Role.prefill:
        bport = next(free)
        argv += ["--bootstrap-port", str(bport)]
    elif role is Role.decode:
        # The only bootstrap servers decode may contact (and send the token to).
        argv += ["--prefill-peers", ",".join(prefill_peers(prefills))]
    return _pods(role, instance, rs, tuple(argv), port, bport, dist_ports, dp_ports)


# The module that keeps a vLLM process tied to the launcher (runtime/local/child_guard.py).
CHILD_GUARD = "pdcluster.runtime.local.child_guard"


def _vllm_instance(
    manifest: PDCluster,
    role: Role,
    instance: int,
    ports: list[int],
    prefills: list[ProcessSpec],
    python: str,
    vllm: str | None,
) -> ProcessSpec:
    """One `vllm serve` process; `ports`: its HTTP port, then its side channel
    (prefill, decode: vLLM's NIXL side channel, or with our connector its side
    port), then its cache events' PUB and replay ports (cache_aware)."""
    if vllm is None:
        raise ValueError("engine.kind vllm needs a vLLM installation to run (--vllm)")
    rs = role_spec_of(manifest, role)
    if rs.topology.dp != 1:
        raise ValueError(
            f"{role.value}.topology.dp is {rs.topology.dp}: local mode runs vLLM instances "
            "with dp 1 (vLLM's dp ranks bind ports of their own); run dp > 1 on Kubernetes"
        )
    port, rest = ports[0], ports[1:]
    # A colocated instance has no connector, hence no side channel.
    side = rest[:1] if role is not Role.colocated else []
    events = rest[len(side) :]
    side_port = side[0] if side else DEFAULT_SIDE_CHANNEL_PORT
    ours = manifest.spec.engine.vllm.kv_connector is VllmKVConnector.pdcluster and bool(side)
    serve = build_vllm_serve(
        manifest.spec,
        role,
        port=port,
        host=HOST,
        side_channel_port=side_port,
        kv_events_ports=(events[0], events[1]) if events else DEFAULT_KV_EVENTS_PORTS,
        kv_replay_host=HOST,
        bootstrap_port=side_port,
        prefill_peers=prefill_peers(prefills) if ours and role is Role.decode else None,
    )
    env = dict(serve.env)
    if serve.side_channel_port is not None:
        env[SIDE_CHANNEL_HOST_ENV] = HOST
    guarded = manifest.spec.auth.worker_api is WorkerApiAccess.token
    return ProcessSpec(
        name=f"{role}-{instance}",
        role=role,
        instance=instance,
        argv=(python, "-m", CHILD_GUARD, "--", *vllm_argv(vllm, serve)),
        port=port,
        num_ranks=rs.topology.num_ranks,
        env=env,
        engine=EngineKind.vllm,
        liveness_path="/health",
        api_key_env=API_KEY_ENV if guarded else None,
        side_channel_ports=() if ours else tuple(side),
        kv_events_ports=serve.kv_events_ports or (),
        side_port=side_port if ours else None,
        bootstrap_port=side_port if ours and role is Role.prefill else None,
    )


def kv_events_arg(spec: ProcessSpec) -> str:
    """The router's `--kv-events URL=PUB,REPLAY` of a vLLM instance."""
    return f"{spec.url}={_port_list(spec.kv_events_ports)}"


def _port_list(ports: list[int] | tuple[int, ...]) -> str:
    return ",".join(str(p) for p in ports)


def prefill_peers(prefills: list[ProcessSpec]) -> list[str]:
    """host:port of the prefills' bootstrap servers (what a decode may contact)."""
    return [
        f"{HOST}:{p.bootstrap_port}"
        for p in prefills
        if p.bootstrap_port is not None and p.is_leader
    ]


def build_local_plan(
    manifest: PDCluster,
    manifest_path: str,
    ports: list[int],
    *,
    python: str,
    vllm: str | None = None,
    router_port: int | None = None,
) -> LocalPlan:
    """Turn a manifest into processes. `ports` must hold count_ports() free ports;
    `vllm`: how to run vLLM (engine.kind vllm)."""
    need = count_ports(manifest)
    if len(ports) < need:
        raise ValueError(f"plan needs {need} ports, got {len(ports)}")
    free = iter(ports)
    workers: list[ProcessSpec] = []
    for role, rs in _role_items(manifest):
        for i in range(rs.replicas):
            n = instance_ports(manifest, role)
            peers = [w for w in workers if w.role is Role.prefill]
            own = [next(free) for _ in range(n)]
            workers.extend(
                build_instance_specs(manifest, manifest_path, role, i, own, peers, python, vllm)
            )
    rport = next(free) if router_port is None else router_port
    base = [python, "-m", "pdcluster.runtime.cli"]
    rargv = [*base, "router", "-f", manifest_path, "--host", HOST, "--port", str(rport)]
    for w in workers:
        if not w.is_leader:
            continue
        rargv += [f"--{w.role}", w.url]
        if w.kv_events_ports:
            rargv += ["--kv-events", kv_events_arg(w)]
        if w.side_port is not None:
            rargv += ["--side-port", f"{w.url}={w.side_port}"]
    router = ProcessSpec(name="router", role="router", instance=0, argv=tuple(rargv), port=rport)
    return LocalPlan(manifest.metadata.name, tuple(workers), router)


def _pods(
    role: Role,
    index: int,
    rs: RoleSpec,
    argv: tuple[str, ...],
    port: int,
    bootstrap_port: int | None,
    dist_ports: tuple[int, ...],
    dp_ports: tuple[int, ...],
) -> list[ProcessSpec]:
    """The processes of one instance: one per pod, the leader first."""
    layout = rs.pod_layout
    if not layout.is_multi_pod:
        return [
            ProcessSpec(
                name=f"{role}-{index}",
                role=role,
                instance=index,
                argv=argv,
                port=port,
                bootstrap_port=bootstrap_port,
                num_ranks=layout.num_ranks,
                dist_ports=dist_ports,
                dp_ports=dp_ports,
            )
        ]
    pods = []
    for k in range(layout.num_pods):
        env = {} if k == 0 else {LEADER_ADDRESS_ENV: HOST}
        ranks = layout.rank_range(k)
        pods.append(
            ProcessSpec(
                name=f"{role}-{index}-{k}",
                role=role,
                instance=index,
                argv=(*argv, "--pod-index", str(k)),
                port=port,
                bootstrap_port=bootstrap_port,
                num_ranks=len(ranks),
                env=env,
                pod=k,
                num_pods=layout.num_pods,
                first_rank=ranks.start,
                dist_ports=dist_ports,
                dp_ports=dp_ports,
            )
        )
    return pods
