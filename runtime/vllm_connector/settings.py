"""The connector's settings: vLLM's `kv_connector_extra_config`, checked once at start.

    --kv-transfer-config '{"kv_connector": "PDClusterConnector",
      "kv_connector_module_path": "pdcluster.runtime.vllm_connector.connector",
      "kv_role": "kv_producer",
      "kv_connector_extra_config": {"sidePort": 8998, "advertiseHost": "10.0.0.7",
                                    "transfer": {"backend": "nixl"}}}'

The `transfer` section is the manifest's (`spec.transfer`: backend, timeouts,
heartbeat, failure policy…), read by the same model, so a vLLM pod and one
of ours run the same room machines with the same numbers. Keys are camelCase
as in the manifest (snake_case is accepted too). The cluster token never
travels here (vLLM logs its config): it is read from the environment as by
our own workers (`PDCLUSTER_TOKEN_FILE` / `PDCLUSTER_TOKEN`).

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError

from pdcluster.runtime.pd.bootstrap_registry import INCARNATION_ENV
from pdcluster.runtime.spec import AllocationPolicy, Role, TransferBackend, TransferSpec
from pdcluster.runtime.spec.base import SpecError, SpecModel

# vLLM's kv_role → our role; kv_both has no meaning in a PD pair.
ROLES: dict[str, Role] = {"kv_producer": Role.prefill, "kv_consumer": Role.decode}


class ConnectorSettings(SpecModel):
    """What `kv_connector_extra_config` may hold (see the module doc)."""

    # The side port: prefill's bootstrap server and both roles' admin API.
    side_port: int = Field(ge=1, le=65535)
    # Where the side port and the ranks' ZMQ endpoints listen.
    host: str = Field(default="0.0.0.0", min_length=1, max_length=253)
    # How peers reach this pod (its IP): ZMQ endpoints and the bootstrap address.
    # Unset: `POD_IP` from the environment (pods), else `host` (127.0.0.1 for 0.0.0.0).
    advertise_host: str | None = Field(default=None, min_length=1, max_length=253)
    cluster: str = Field(default="pdcluster", min_length=1, max_length=63)
    transfer: TransferSpec = TransferSpec()
    # CURVE on the ranks' ZMQ endpoints (keys derived from the cluster token).
    zmq_curve: bool = False
    # Decode: the prefill side ports it may contact. Left out: whatever the
    # operator or launcher publishes later (PUT /admin/prefill_peers); until
    # then every address is taken as given (a test without a launcher).
    prefill_peers: list[str] | None = Field(default=None, max_length=1024)
    # Which start of this pod (its uid): registered with the bootstrap server
    # (prefill) or in the KV layout (decode), so a loss report about this pod
    # is told from one about its predecessor at the same address. Unset:
    # `PDCLUSTER_INCARNATION` from the environment (the operator sets it),
    # else none (local mode).
    incarnation: str | None = Field(default=None, min_length=1, max_length=128)


def load_settings(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Checked settings, the advertised host and incarnation resolved from `env`; SpecError naming
    the field otherwise."""
    data = dict(extra or {})
    try:
        settings = ConnectorSettings.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "kv_connector_extra_config"
        raise SpecError(f"kv_connector_extra_config.{where}: {first['msg']}") from None
    if settings.transfer.backend is TransferBackend.shm:
        raise SpecError(
            "kv_connector_extra_config.transfer.backend: shm writes into our engine's "
            "shared-memory pool; inside vLLM use tcp or nixl"
        )
    if settings.advertise_host is None:
        pod_ip = (env or {}).get("POD_IP")
        fallback = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        settings = settings.model_copy(update={"advertise_host": pod_ip or fallback})
    if settings.incarnation is None and (env or {}).get(INCARNATION_ENV):
        settings = settings.model_copy(update={"incarnation": (env or {})[INCARNATION_ENV]})
    if settings.transfer.allocation_policy is not AllocationPolicy.early:
        raise SpecError(
            "kv_connector_extra_config.transfer.allocationPolicy: vLLM allocates a decode "
            "request's blocks when it admits it, so only `early` applies"
        )
    return settings


def role_of(kv_role: str | None) -> Role:
    """Our role for vLLM's `kv_role`; SpecError for any other."""
    role = ROLES.get(kv_role or "")
    if role is None:
        raise SpecError(
            f"kv_transfer_config.kv_role: the PDCluster connector needs kv_producer (prefill) "
            f"or kv_consumer (decode), got {kv_role!r}"
        )
    return role
