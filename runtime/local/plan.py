"""Local mode plan: which processes a PDCluster manifest becomes on one machine.

Pure: from a validated manifest and a list of free ports, build the process
specs (argv, env, addresses). The launcher only executes the plan. Every
instance of a role is one worker process on 127.0.0.1 that starts its own
ranks; rank 0 of each prefill instance hosts the bootstrap server.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from pdcluster.runtime.spec import PDCluster, Role, RoleSpec

HOST = "127.0.0.1"


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # e.g. "prefill-0", "router"
    role: Role | Literal["router"]
    instance: int
    argv: tuple[str, ...]
    port: int  # HTTP port
    bootstrap_port: int | None = None
    num_ranks: int = 1
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass(frozen=True)
class LocalPlan:
    cluster: str
    workers: tuple[ProcessSpec, ...]
    router: ProcessSpec

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


def num_worker_ports(role: Role) -> int:
    """Ports one instance needs: HTTP + distributed store (+ bootstrap for prefill)."""
    return 3 if role is Role.prefill else 2


def count_ports(manifest: PDCluster) -> int:
    """Ports the plan needs: every worker's, and the router's."""
    n = 1
    for role, rs in _role_items(manifest):
        n += rs.replicas * num_worker_ports(role)
    return n


def role_spec_of(manifest: PDCluster, role: Role) -> RoleSpec:
    for r, rs in _role_items(manifest):
        if r is role:
            return rs
    raise ValueError(f"the manifest has no {role.value} role")


def build_worker_spec(
    manifest: PDCluster,
    manifest_path: str,
    role: Role,
    instance: int,
    ports: list[int],
    prefills: list[ProcessSpec],
    python: str,
) -> ProcessSpec:
    """One instance of `role` (also one started later, by autoscaling): `ports` holds
    `num_worker_ports(role)` free ports; a decode may contact only `prefills`."""
    rs = role_spec_of(manifest, role)
    if len(ports) != num_worker_ports(role):
        raise ValueError(f"a {role.value} instance needs {num_worker_ports(role)} ports")
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
    bport = None
    if role is Role.prefill:
        bport = next(free)
        argv += ["--bootstrap-port", str(bport)]
    elif role is Role.decode:
        # The only bootstrap servers decode may contact (and send the token to).
        argv += ["--prefill-peers", ",".join(prefill_peers(prefills))]
    return ProcessSpec(
        name=f"{role}-{instance}",
        role=role,
        instance=instance,
        argv=tuple(argv),
        port=port,
        bootstrap_port=bport,
        num_ranks=rs.topology.num_ranks,
    )


def prefill_peers(prefills: list[ProcessSpec]) -> list[str]:
    """host:port of the prefills' bootstrap servers (what a decode may contact)."""
    return [f"{HOST}:{p.bootstrap_port}" for p in prefills if p.bootstrap_port is not None]


def build_local_plan(
    manifest: PDCluster,
    manifest_path: str,
    ports: list[int],
    *,
    python: str,
    router_port: int | None = None,
) -> LocalPlan:
    """Turn a manifest into processes. `ports` must hold count_ports() free ports."""
    need = count_ports(manifest)
    if len(ports) < need:
        raise ValueError(f"plan needs {need} ports, got {len(ports)}")
    free = iter(ports)
    workers: list[ProcessSpec] = []
    for role, rs in _role_items(manifest):
        for i in range(rs.replicas):
            n = num_worker_ports(role)
            peers = [w for w in workers if w.role is Role.prefill]
            spec = build_worker_spec(
                manifest, manifest_path, role, i, [next(free) for _ in range(n)], peers, python
            )
            workers.append(spec)
    rport = next(free) if router_port is None else router_port
    base = [python, "-m", "pdcluster.runtime.cli"]
    rargv = [*base, "router", "-f", manifest_path, "--host", HOST, "--port", str(rport)]
    for w in workers:
        rargv += [f"--{w.role}", w.url]
    router = ProcessSpec(name="router", role="router", instance=0, argv=tuple(rargv), port=rport)
    return LocalPlan(manifest.metadata.name, tuple(workers), router)
