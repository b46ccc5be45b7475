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


def count_ports(manifest: PDCluster) -> int:
    """Ports the plan needs: per worker HTTP + distributed store (+ bootstrap), router."""
    n = 1
    for role, rs in _role_items(manifest):
        n += rs.replicas * (3 if role is Role.prefill else 2)
    return n


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
    base = [python, "-m", "pdcluster.runtime.cli"]
    for role, rs in _role_items(manifest):
        for i in range(rs.replicas):
            port, dist_port = next(free), next(free)
            argv = [
                *base,
                "worker",
                "-f",
                manifest_path,
                "--role",
                role.value,
                "--instance",
                str(i),
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
                peers = [f"{HOST}:{w.bootstrap_port}" for w in workers if w.role is Role.prefill]
                argv += ["--prefill-peers", ",".join(peers)]
            workers.append(
                ProcessSpec(
                    name=f"{role}-{i}",
                    role=role,
                    instance=i,
                    argv=tuple(argv),
                    port=port,
                    bootstrap_port=bport,
                    num_ranks=rs.topology.num_ranks,
                )
            )
    rport = next(free) if router_port is None else router_port
    rargv = [*base, "router", "-f", manifest_path, "--host", HOST, "--port", str(rport)]
    for w in workers:
        rargv += [f"--{w.role}", w.url]
    router = ProcessSpec(name="router", role="router", instance=0, argv=tuple(rargv), port=rport)
    return LocalPlan(manifest.metadata.name, tuple(workers), router)
