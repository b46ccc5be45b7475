"""`spec.engine`: which engine the worker pods run, and its settings.

`kind: builtin` (the default) is our reference engine (`pdcluster worker`).
`kind: vllm` runs stock vLLM (`vllm serve`) in every worker pod: the
manifest's topology, model and KV settings become vLLM flags
(`runtime/vllm/serve_command.py`), and with a disaggregated cluster a KV
connector moves the KV (`kvConnector`):
- `NixlConnector`, vLLM's own: the router sends the prefill leg first and
  hands its `kv_transfer_params` to the decode leg
  (`runtime/router/vllm_relay.py`);
- `PDClusterConnector`, ours inside vLLM (`runtime/vllm_connector/`): the
  router mints a room and sends both legs at once, and our room tables,
  bootstrap registry, heartbeats, ABORT/ACK and transfer engine (`tcp` or
  `nixl`) run inside vLLM, with the admin API on each pod's bootstrap port.

What vLLM cannot do with the rest of the manifest is refused here, each
message naming the field (`vllm_refusal`), and mirrored as CEL rules in the
CRD (`operator/crd/cel_rules.py`):
- the model comes from `model.path` (a directory or a Hugging Face id), never
  the built-in tiny weights; vLLM has no float64, and keeps the KV cache in
  the model's dtype (`kvCache.dtype` must equal `model.computeDtype`);
- vLLM picks its own KV layout (`kvCache.layout` stays NHD);
- `NixlConnector` moves KV over NIXL (a disaggregated cluster says
  `transfer.backend: nixl`) and has no per-page checksum (`transfer.checksum`
  stays false); `PDClusterConnector` moves it over `tcp` or `nixl` (not
  `shm`, which writes into our engine's pool), allocates decode pages when
  vLLM admits the request (`transfer.allocationPolicy` stays early) and
  pairs tensor-parallel engines (`topology.dp` and `pp` stay 1);
- an instance is one pod (`gpusPerPod` left out or equal to its ranks) and
  context parallelism is not mapped (`topology.cp` 1);
- vLLM reports no queued prompt tokens (no `queuedPrefillTokensPerInstance`
  autoscaling); `cache_aware` follows its prefix-cache events, one engine
  per instance (`topology.dp` 1 on a role it routes);
- `kvBufferDevice: cuda` needs the roles on `device: cuda`;
- `extraArgs` may not set a flag the manifest already decides
  (`OWNED_FLAGS`), nor `env` a variable the pods are given (`OWNED_ENV`).

Pure module.
"""

from __future__ import annotations

import enum
import re
from typing import TYPE_CHECKING, Annotated

from pydantic import Field, field_validator

from pdcluster.runtime.spec.base import SpecModel

if TYPE_CHECKING:  # the whole manifest imports this module
    from pdcluster.runtime.spec import PDClusterSpec


class EngineKind(enum.StrEnum):
    builtin = "builtin"
    vllm = "vllm"


class VllmKVConnector(enum.StrEnum):
    """The KV connector a disaggregated vLLM cluster runs (vLLM's `kv_connector`)."""

    # vLLM's NIXL connector: decode pulls (READs) the prompt's KV from the
    # prefill that computed it, named in the prefill's `kv_transfer_params`.
    nixl = "NixlConnector"
    # Ours inside vLLM: both legs at once, paired by a room; prefill pushes
    # the KV chunk by chunk with our transfer engine (tcp | nixl).
    pdcluster = "PDClusterConnector"


class KVBufferDevice(enum.StrEnum):
    """Where vLLM's connector keeps the KV it moves (its `kv_buffer_device`)."""

    cpu = "cpu"
    cuda = "cuda"


# Flags derived from the manifest (runtime/vllm/serve_command.py): `extraArgs`
# may not set them again, in either the `--flag value` or `--flag=value` form.
OWNED_FLAGS: dict[str, str] = {
    "--model": "model.path",
    "--served-model-name": "model.name",
    "--host": "the pod's address",
    "--port": "the worker port",
    "--api-key": "the cluster token (auth.workerApi)",
    "--dtype": "model.computeDtype",
    "--kv-cache-dtype": "kvCache.dtype",
    "--block-size": "kvCache.pageSize",
    "--tensor-parallel-size": "topology.tp",
    "-tp": "topology.tp",
    "--pipeline-parallel-size": "topology.pp",
    "-pp": "topology.pp",
    "--data-parallel-size": "topology.dp",
    "-dp": "topology.dp",
    "--kv-transfer-config": "engine.vllm.kvConnector and transfer.failurePolicy",
    "--enable-prefix-caching": "<role>.engine.prefixCache",
    "--no-enable-prefix-caching": "<role>.engine.prefixCache",
    "--kv-events-config": "router.policy (cache_aware)",
    "--shutdown-timeout": "<role>.drain.timeoutSeconds",
}
# Variables every vLLM pod is given (the token, NIXL's side channel).
OWNED_ENV = ("VLLM_API_KEY", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")
MAX_EXTRA_ARGS = 64
MAX_ARG_LENGTH = 512
MAX_ENV = 64
MAX_ENV_VALUE_LENGTH = 4096
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def owned_flag(arg: str) -> str | None:
    """The manifest field an `extraArgs` entry would override, or None."""
    flag = arg.split("=", 1)[0]
    return OWNED_FLAGS.get(flag)


class VllmSpec(SpecModel):
    """How the worker pods run vLLM (read only with `engine.kind: vllm`)."""

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="image with vLLM (`vllm serve` on its PATH); unset: spec.image",
    )
    kv_connector: VllmKVConnector = Field(
        default=VllmKVConnector.nixl, description="vLLM's KV connector of prefill and decode"
    )
    kv_buffer_device: KVBufferDevice | None = Field(
        default=None,
        description="the connector's kv_buffer_device; unset: each role's `device`",
    )
    extra_args: list[Annotated[str, Field(min_length=1, max_length=MAX_ARG_LENGTH)]] = Field(
        default_factory=list,
        max_length=MAX_EXTRA_ARGS,
        description="more `vllm serve` arguments, after the ones the manifest decides",
    )
    env: dict[str, Annotated[str, Field(max_length=MAX_ENV_VALUE_LENGTH)]] = Field(
        default_factory=dict,
        max_length=MAX_ENV,
        description="more environment variables of every vLLM container",
    )

    @field_validator("extra_args")
    @classmethod
    def _args_not_owned(cls, args: list[str]) -> list[str]:
        for i, arg in enumerate(args):
            field = owned_flag(arg)
            if field is not None:
                raise ValueError(
                    f"extraArgs[{i}]: {arg.split('=', 1)[0]} is set from {field}; "
                    "change that field instead"
                )
        return args

    @field_validator("env")
    @classmethod
    def _env_not_owned(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.match(name) or len(name) > 256:
                raise ValueError(f"env: {name!r} is not a variable name")
            if name in OWNED_ENV:
                raise ValueError(f"env: {name} is set by PDCluster on every vLLM pod")
        return env


class ServingEngineSpec(SpecModel):
    """`spec.engine`: the engine every worker pod runs."""

    kind: EngineKind = Field(
        default=EngineKind.builtin,
        description="builtin: PDCluster's reference engine; vllm: stock `vllm serve`",
    )
    vllm: VllmSpec = VllmSpec()

    @property
    def is_vllm(self) -> bool:
        return self.kind is EngineKind.vllm


def vllm_refusal(spec: PDClusterSpec) -> str | None:
    """Why vLLM cannot run `spec`, naming the field; None when it can (or kind is builtin)."""
    if not spec.engine.is_vllm:
        return None
    model, kv = spec.model, spec.kv_cache
    if not model.path and model.source is None:
        return (
            "model.path: engine.kind vllm serves the model at `path` (a directory or a "
            "Hugging Face id) or from `source`; the built-in tiny model runs on the builtin "
            "engine only"
        )
    if spec.compute_dtype.value == "float64":
        return "model.computeDtype: vLLM computes in float32, float16 or bfloat16, not float64"
    # A KV dtype of its own needs the compute dtype spelled out (and equal): the
    # default compute dtype depends on the roles' devices, which CEL cannot mirror.
    if kv.dtype is not None and kv.dtype is not model.compute_dtype:
        return (
            "kvCache.dtype must equal model.computeDtype with engine.kind vllm "
            "(vLLM keeps the KV cache in the model's dtype); leave it out to follow it"
        )
    if kv.layout.value != "NHD":
        return "kvCache.layout: vLLM chooses its own KV layout; leave it NHD"
    refusal = _connector_refusal(spec)
    if refusal is not None:
        return refusal
    for role, rs in spec.roles():
        if rs.topology.cp != 1:
            return f"{role}.topology.cp: context parallelism is not mapped onto vLLM; use 1"
        if rs.gpus_per_pod is not None and rs.gpus_per_pod != rs.topology.num_ranks:
            return (
                f"{role}.gpusPerPod: a vLLM instance runs in one pod; leave gpusPerPod out "
                "or set it to dp*tp*cp*pp"
            )
        if spec.engine.vllm.kv_buffer_device is KVBufferDevice.cuda and rs.device != "cuda":
            return f"engine.vllm.kvBufferDevice cuda needs {role}.device cuda"
        scaling = rs.autoscaling
        if scaling is not None and scaling.target.metric.value == "queuedPrefillTokensPerInstance":
            return (
                f"{role}.autoscaling.target.metric queuedPrefillTokensPerInstance: vLLM "
                "reports no queued prompt tokens; use ttftP90Seconds"
            )
    policy = spec.router.policy
    for role, rs in spec.roles():
        key = "prefill" if role.value == "prefill" else "decode"
        chosen = policy.prefill if key == "prefill" else policy.decode
        if chosen.value == "cache_aware" and rs.topology.dp != 1:
            return (
                f"router.policy.{key}: cache_aware follows one vLLM engine per instance; "
                f"{role.value}.topology.dp must be 1 (each dp rank publishes its own events)"
            )
    return None


def _connector_refusal(spec: PDClusterSpec) -> str | None:
    """What the chosen KV connector cannot do with `spec.transfer`, naming the field."""
    transfer = spec.transfer
    if spec.engine.vllm.kv_connector is VllmKVConnector.nixl:
        if transfer.checksum:
            return (
                "transfer.checksum: NixlConnector carries no page checksum "
                "(PDClusterConnector does)"
            )
        if spec.is_disaggregated and transfer.backend.value != "nixl":
            return (
                "transfer.backend must be nixl with engine.vllm.kvConnector NixlConnector "
                "(vLLM's connector moves the KV over NIXL)"
            )
        return None
    if transfer.backend.value == "shm":
        return (
            "transfer.backend: PDClusterConnector moves the KV over tcp or nixl; shm writes "
            "into our engine's shared-memory pool"
        )
    if transfer.allocation_policy.value != "early":
        return (
            "transfer.allocationPolicy: PDClusterConnector gets a decode's pages when vLLM "
            "admits the request; only early applies"
        )
    for role, rs in spec.roles():
        for axis in ("dp", "pp"):
            if role.value != "colocated" and getattr(rs.topology, axis) != 1:
                return (
                    f"{role}.topology.{axis}: PDClusterConnector pairs tensor-parallel vLLM "
                    "engines; scale with replicas instead"
                )
    return None
