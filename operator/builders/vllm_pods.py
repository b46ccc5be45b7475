"""The worker container of a `spec.engine.kind: vllm` instance: `vllm serve`.

The pod around it is the one every worker gets (workers.py: labels, owner,
`restartPolicy: Never`, security context, scheduling, the gang rules); the
container differs from ours:

- image `engine.vllm.image` (else `spec.image`), `command: [vllm, serve]`,
  the arguments and variables of runtime/vllm/serve_command.py, listening on
  the pod's own address (`$(POD_IP)`) at the worker HTTP port;
- ports: `http`, and for prefill and decode the NIXL side channel
  (`nixl-side`, one per dp group: `nixl-side-<d>`), which vLLM announces as
  `$(POD_IP)` (`VLLM_NIXL_SIDE_CHANNEL_HOST`); the workers' NetworkPolicy
  already admits any port from the cluster's own pods;
- a role routed by `cache_aware`: vLLM publishes its prefix-cache events on
  ports `kv-events` and `kv-replay`, which the pod's annotations name to the
  router's discovery (`kv_event_annotations`);
- with `engine.vllm.kvConnector: PDClusterConnector`, our connector's side
  port (`bootstrap`, the port our prefill workers' bootstrap server has) on
  prefill and decode: prefill's bootstrap server and both roles' admin API
  (annotated `pdcluster.io/bootstrap-port` and `pdcluster.io/admin-port`, so
  the router and the failover fast path find it), and the cluster token as
  our workers read it (`PDCLUSTER_TOKEN_FILE`); no NIXL side channel;
- probes on vLLM's `/health` (startup, readiness, liveness: it answers 503
  once its engine died);
- the cluster token as vLLM reads it, `VLLM_API_KEY` (unless
  `auth.workerApi: open`), taken from the token file every worker mounts:
  vLLM reads no key file, so `sh -c` reads the file into the variable and
  execs `vllm serve` (`TOKEN_COMMAND`); the token stays out of the pod spec
  (`kubectl describe`), as for our workers;
- HOME on the writable volume (vLLM's and Hugging Face's caches), vLLM's
  usage reporting off;
- a stop that loses no request: a `preStop` sleep of the role's
  `drain.announceSeconds` (rounded up), during which the pod, already
  terminating, still serves while every router drops it (ours watches the
  pod; others follow the Endpoints, where a terminating pod is not ready),
  then on SIGTERM vLLM finishes what it has for up to the drain budget
  (`--shutdown-timeout`; vLLM's own default aborts every request at once).
  The pod's grace period covers both (disruption.py).

One pod per instance (multi-pod vLLM instances are refused at admission), so
the leader is the only pod. GPU requests come from `build_resources`.

Pure module.
"""

from __future__ import annotations

import math
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.builders import meta, podsecurity
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.runtime.spec import Role, RoleSpec, VllmKVConnector, WorkerApiAccess
from pdcluster.runtime.vllm.serve_command import (
    API_KEY_ENV,
    DEFAULT_KV_EVENTS_PORTS,
    DEFAULT_SIDE_CHANNEL_PORT,
    SIDE_CHANNEL_HOST_ENV,
    build_vllm_serve,
    publishes_kv_events,
    side_channel_ports,
)

SIDE_CHANNEL_PORT = DEFAULT_SIDE_CHANNEL_PORT
KV_EVENTS_PORT, KV_REPLAY_PORT = DEFAULT_KV_EVENTS_PORTS
TOKEN_FILE = f"{podsecurity.TOKEN_DIR}/{meta.TOKEN_KEY}"
# `sh -c SCRIPT TOKEN_FILE ARGS...`: $0 is the file, "$@" the arguments of
# `vllm serve`. `$$` is Kubernetes' escape for a `$` it must not expand.
TOKEN_COMMAND = ["sh", "-c", f'{API_KEY_ENV}="$$(cat "$0")" exec vllm serve "$@"', TOKEN_FILE]
# A model may take long to download and load: up to PERIOD * FAILURES = 30 min.
STARTUP_PROBE_PERIOD_S = 5
STARTUP_PROBE_FAILURES = 360


def build_vllm_container(
    cluster: Cluster,
    role: Role,
    spec: RoleSpec,
    *,
    identity_env: list[dict[str, Any]],
) -> dict[str, Any]:
    """The `worker` container of one vLLM instance's pod (resources and security
    context are added by the caller, as for every worker)."""
    serve = build_vllm_serve(
        cluster.spec,
        role,
        port=meta.HTTP_PORT,
        host=meta.BIND_HOST,
        side_channel_port=SIDE_CHANNEL_PORT,
        kv_events_ports=(KV_EVENTS_PORT, KV_REPLAY_PORT),
        bootstrap_port=meta.BOOTSTRAP_PORT,
        shutdown_timeout_s=math.ceil(
            spec.drain.budget_seconds(cluster.spec.router.request_timeout_seconds)
        ),
    )
    env: list[dict[str, Any]] = [
        meta.env_field(meta.POD_IP_ENV, "status.podIP"),
        meta.env_value("HOME", podsecurity.HOME_DIR),
        meta.env_value("VLLM_NO_USAGE_STATS", "1"),
        *identity_env,
    ]
    ports = [{"name": "http", "containerPort": meta.HTTP_PORT, "protocol": "TCP"}]
    for d, port in enumerate(side_channel_ports(serve, spec.topology.dp)):
        name = "nixl-side" if d == 0 else f"nixl-side-{d}"
        ports.append({"name": name, "containerPort": port, "protocol": "TCP"})
    if serve.kv_events_ports is not None:
        for name, port in zip(("kv-events", "kv-replay"), serve.kv_events_ports, strict=True):
            ports.append({"name": name, "containerPort": port, "protocol": "TCP"})
    if serve.side_channel_port is not None:
        env.append(meta.env_value(SIDE_CHANNEL_HOST_ENV, f"$({meta.POD_IP_ENV})"))
    if side_port(cluster, role) is not None:
        ports.append({"name": "bootstrap", "containerPort": meta.BOOTSTRAP_PORT, "protocol": "TCP"})
        env.append(meta.env_value(podsecurity.TOKEN_FILE_ENV, TOKEN_FILE))
    env += [meta.env_value(k, v) for k, v in sorted(serve.env.items())]
    guarded = cluster.spec.auth.worker_api is WorkerApiAccess.token
    container: dict[str, Any] = {
        "name": "worker",
        "image": cluster.spec.engine.vllm.image or cluster.spec.image,
        "command": list(TOKEN_COMMAND) if guarded else ["vllm", "serve"],
        "args": serve.serve_args,
        "env": env,
        "ports": ports,
        "startupProbe": meta.http_probe(STARTUP_PROBE_PERIOD_S, STARTUP_PROBE_FAILURES),
        "readinessProbe": meta.http_probe(2, 3),
        "livenessProbe": meta.http_probe(10, 3, timeout_s=5),
    }
    announce_s = math.ceil(spec.drain.announce_seconds)
    if announce_s > 0:
        # Kubernetes' own sleep (no binary in the image needed).
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": announce_s}}}
    return container


def kv_event_annotations(cluster: Cluster, role: Role) -> dict[str, str]:
    """The pod annotations that tell the router where a vLLM instance publishes
    its cache events (none when its role is not routed by cache_aware)."""
    if not publishes_kv_events(cluster.spec, role):
        return {}
    return {
        names.ANNOTATION_KV_EVENTS_PORT: str(KV_EVENTS_PORT),
        names.ANNOTATION_KV_REPLAY_PORT: str(KV_REPLAY_PORT),
    }


def vllm_labels() -> dict[str, str]:
    return {names.LABEL_ENGINE: "vllm"}


def side_port(cluster: Cluster, role: Role) -> int | None:
    """Our connector's side port on a `role` pod; None with vLLM's connector or
    without a KV role (colocated)."""
    ours = cluster.spec.engine.vllm.kv_connector is VllmKVConnector.pdcluster
    return meta.BOOTSTRAP_PORT if ours and role in (Role.prefill, Role.decode) else None


def vllm_annotations(cluster: Cluster, role: Role, num_pods: int) -> dict[str, str]:
    """A vLLM pod's annotations: its ports (the cache events' when the router
    follows them), and with our connector its side port as the bootstrap port
    (the router's pairing) and the admin port (the fast path)."""
    annotations = {
        names.ANNOTATION_HTTP_PORT: str(meta.HTTP_PORT),
        names.ANNOTATION_INSTANCE_SIZE: str(num_pods),
        **kv_event_annotations(cluster, role),
    }
    port = side_port(cluster, role)
    if port is not None:
        annotations[names.ANNOTATION_BOOTSTRAP_PORT] = str(port)
        annotations[names.ANNOTATION_ADMIN_PORT] = str(port)
    return annotations
