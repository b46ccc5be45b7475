"""One worker instance of a `kind: vllm` cluster as a `vllm serve` command.

`build_vllm_serve(spec, role, port=...)` maps the manifest onto vLLM's flags
and environment; the operator puts them into the pod (`command: [vllm,
serve]`), local mode into a process (`vllm_argv`, with either a `vllm`
executable or an interpreter that imports vLLM). The mapping (docs/vllm.md):

- `model.path`, `model.name` → the served model, `--served-model-name name [path]`;
- `model.computeDtype` → `--dtype` (the KV cache follows it);
- `kvCache.pageSize` → `--block-size`;
- `<role>.topology.tp / pp / dp` → `--tensor-parallel-size`,
  `--pipeline-parallel-size`, `--data-parallel-size`;
- `<role>.engine.prefixCache` → `--enable-prefix-caching` or `--no-...`;
- the role, `engine.vllm.kvConnector`, `kvBufferDevice` and
  `transfer.failurePolicy` → `--kv-transfer-config` (`kv_role` kv_producer or
  kv_consumer; decode's `kv_load_failure_policy`);
- `transfer.ucx.tls / netDevices` → `UCX_TLS`, `UCX_NET_DEVICES` (NIXL's UCX);
- the KV side channel (`side_channel_port`) → `VLLM_NIXL_SIDE_CHANNEL_PORT`
  (dp group d listens on that port + d);
- `router.policy.<role>: cache_aware` → `--kv-events-config`: vLLM
  publishes its prefix-cache events (`kv_events.publisher_config`) on
  `kv_events_ports` (a PUB port and a replay port), which the router follows
  (`router/vllm_prefix_feed.py`);
- with `kvConnector: PDClusterConnector`: our module and its settings in the
  connector's `kv_connector_extra_config` (`runtime/vllm_connector/settings.py`):
  the side port (`bootstrap_port`: prefill's bootstrap server, both roles'
  admin API), the manifest's `transfer` section, `auth.zmqCurve`;
- `observability.tracing` (enabled) → `--otlp-traces-endpoint <endpoint>/v1/traces`
  and `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`: vLLM's request spans
  join the router's trace through each leg's `traceparent`;
- `shutdown_timeout_s` (the operator's pods: the role's drain budget) →
  `--shutdown-timeout`: on SIGTERM vLLM finishes the requests it has, for
  up to that long, instead of aborting them (its default, 0); local mode
  stops a vLLM only once its router let it go, or with the whole cluster;
- `engine.vllm.extraArgs`, `env` → appended as given.

Left to the caller, because only it knows them: the side channel's host
(`VLLM_NIXL_SIDE_CHANNEL_HOST`: the pod IP, 127.0.0.1 locally; our
connector reads `POD_IP`) and the cluster token (`VLLM_API_KEY`, unless
`auth.workerApi: open`; our connector reads `PDCLUSTER_TOKEN_FILE` or
`PDCLUSTER_TOKEN` as our workers do).

Pure module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcluster.runtime.spec import (
    KVBufferDevice,
    PDClusterSpec,
    Role,
    SelectionPolicy,
    SpecError,
    VllmKVConnector,
)
from pdcluster.runtime.spec.model_source import engine_model
from pdcluster.runtime.vllm.kv_events import publisher_config

# vLLM's default NIXL side-channel port (its `VLLM_NIXL_SIDE_CHANNEL_PORT`).
DEFAULT_SIDE_CHANNEL_PORT = 5600
# Our connector's side port when the caller names none: our workers' bootstrap port.
DEFAULT_BOOTSTRAP_PORT = 8998
# Where vLLM loads our connector from (`kv_connector_module_path`).
PDCLUSTER_CONNECTOR_MODULE = "pdcluster.runtime.vllm_connector.connector"
# The OpenAI server as a module, for an interpreter named instead of `vllm`.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Where an instance routed by cache_aware publishes its prefix-cache events
# (vLLM's own default PUB port, and the next one for replays).
DEFAULT_KV_EVENTS_PORTS = (5557, 5558)
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
API_KEY_ENV = "VLLM_API_KEY"

_KV_ROLE = {Role.prefill: "kv_producer", Role.decode: "kv_consumer"}


@dataclass(frozen=True)
class VllmServe:
    """`vllm serve <model> <flags...>` with `env` set."""

    model: str
    flags: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    # The NIXL side channel of dp group 0 (group d: + d); None without a connector.
    side_channel_port: int | None = None
    # (PUB port, replay port) of its prefix-cache events; None: it publishes none.
    kv_events_ports: tuple[int, int] | None = None

    @property
    def serve_args(self) -> list[str]:
        """The arguments after `vllm serve`."""
        return [self.model, *self.flags]


def kv_transfer_config(
    spec: PDClusterSpec, role: Role, *, bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` of a prefill or decode instance."""
    rs = spec.role_spec(role)
    if rs is None or role not in _KV_ROLE:
        raise SpecError(f"a {role.value} instance has no KV connector")
    vllm = spec.engine.vllm
    buffer = vllm.kv_buffer_device or KVBufferDevice(rs.device)
    config: dict[str, Any] = {
        "kv_connector": vllm.kv_connector.value,
        "kv_role": _KV_ROLE[role],
        "kv_buffer_device": buffer.value,
    }
    if vllm.kv_connector is VllmKVConnector.pdcluster:
        config["kv_connector_module_path"] = PDCLUSTER_CONNECTOR_MODULE
        config["kv_connector_extra_config"] = {
            "sidePort": bootstrap_port,
            "transfer": spec.transfer.model_dump(mode="json", by_alias=True),
            "zmqCurve": bool(spec.auth.zmq_curve),
        }
    if role is Role.decode:
        # What decode does with a prompt whose KV never arrives (fail | recompute).
        config["kv_load_failure_policy"] = spec.transfer.failure_policy.value
    return config


def publishes_kv_events(spec: PDClusterSpec, role: Role) -> bool:
    """Whether the router follows `role`'s cache (its policy is cache_aware;
    a colocated role is routed by `router.policy.decode`)."""
    policy = spec.router.policy
    chosen = policy.prefill if role is Role.prefill else policy.decode
    return spec.engine.is_vllm and chosen is SelectionPolicy.cache_aware


# vLLM picks its OTLP exporter by this variable (gRPC unless told otherwise).
OTLP_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def build_vllm_serve(
    spec: PDClusterSpec,
    role: Role,
    *,
    port: int,
    host: str = "0.0.0.0",
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT,
    kv_events_ports: tuple[int, int] = DEFAULT_KV_EVENTS_PORTS,
    kv_replay_host: str = "*",
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
    prefill_peers: Sequence[str] | None = None,
    shutdown_timeout_s: int | None = None,
) -> VllmServe:
    """The `vllm serve` command of one `role` instance listening on `host:port`.
    `kv_events_ports` and `kv_replay_host`: where it publishes its cache events
    when the router follows them (`publishes_kv_events`). `prefill_peers` (our
    connector's decode, local mode): the prefill side ports it may contact from
    the start (pods get them from the operator instead). `shutdown_timeout_s`:
    how long it finishes its requests after SIGTERM (None: vLLM aborts them)."""
    if not spec.engine.is_vllm:
        raise SpecError("engine.kind is not vllm: the workers run `pdcluster worker`")
    rs = spec.role_spec(role)
    if rs is None:
        raise SpecError(f"the cluster has no {role.value} role")
    model = spec.model
    # A folder the pod mounted, or a hub id read from the mounted cache
    # (model.source: runtime/spec/model_source.py; the operator mounts it).
    served = engine_model(model.path, model.source)
    names = [model.name] if model.name == served.location else [model.name, served.location]
    topology = rs.topology
    flags = [
        "--served-model-name",
        *names,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        spec.compute_dtype.value,
        "--block-size",
        str(spec.kv_cache.page_size),
        "--tensor-parallel-size",
        str(topology.tp),
        "--pipeline-parallel-size",
        str(topology.pp),
        "--data-parallel-size",
        str(topology.dp),
        "--enable-prefix-caching" if rs.engine.prefix_cache else "--no-enable-prefix-caching",
    ]
    env: dict[str, str] = {}
    side: int | None = None
    if role in _KV_ROLE:
        config = kv_transfer_config(spec, role, bootstrap_port=bootstrap_port)
        if prefill_peers is not None and "kv_connector_extra_config" in config:
            config["kv_connector_extra_config"]["prefillPeers"] = list(prefill_peers)
        flags += ["--kv-transfer-config", json.dumps(config)]
        if spec.engine.vllm.kv_connector is VllmKVConnector.nixl:
            side = side_channel_port
            env[SIDE_CHANNEL_PORT_ENV] = str(side)
        if spec.transfer.backend.value == "nixl":
            ucx = spec.transfer.ucx
            if ucx.tls:
                env["UCX_TLS"] = ucx.tls
            if ucx.net_devices:
                env["UCX_NET_DEVICES"] = ucx.net_devices
    events: tuple[int, int] | None = None
    if publishes_kv_events(spec, role):
        events = kv_events_ports
        config = publisher_config(*events, replay_host=kv_replay_host)
        flags += ["--kv-events-config", json.dumps(config)]
    if served.revision is not None:
        flags += ["--revision", served.revision]
    tracing = spec.observability.tracing
    if tracing.enabled:
        # vLLM's own request spans, children of the router's leg spans through the
        # legs' traceparent; exported over OTLP/HTTP like ours.
        flags += ["--otlp-traces-endpoint", tracing.traces_url]
        env[OTLP_PROTOCOL_ENV] = "http/protobuf"
    if shutdown_timeout_s is not None:
        flags += ["--shutdown-timeout", str(shutdown_timeout_s)]
    flags += spec.engine.vllm.extra_args
    env.update(spec.engine.vllm.env)
    return VllmServe(
        model=served.location,
        flags=tuple(flags),
        env=env,
        side_channel_port=side,
        kv_events_ports=events,
    )


def side_channel_ports(serve: VllmServe, dp: int) -> tuple[int, ...]:
    """The NIXL side-channel ports an instance listens on: one per dp group."""
    if serve.side_channel_port is None:
        return ()
    return tuple(serve.side_channel_port + d for d in range(dp))


def is_interpreter(program: str) -> bool:
    """Whether `program` names a Python interpreter (else: a `vllm` executable)."""
    name = program.rstrip("/").rsplit("/", 1)[-1]
    return name.startswith("python")


def vllm_argv(program: str, serve: VllmServe) -> list[str]:
    """The process's argv: `<vllm> serve <model> ...`, or `<python> -m <api server>
    --model <model> ...` when `program` is an interpreter with vLLM installed."""
    if is_interpreter(program):
        return [program, "-m", API_SERVER_MODULE, "--model", serve.model, *serve.flags]
    return [program, "serve", *serve.serve_args]
