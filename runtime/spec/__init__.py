"""The `PDCluster` manifest as typed models — the one schema for every consumer.

The Kubernetes operator (CRD generation, reconcile), the local mode
(`pdcluster up -f ...`) and the runtime settings handed to each pod all read
these models, so a manifest means the same thing everywhere. Field names are
camelCase on the wire (YAML/JSON) and snake_case in Python.

Invariants checked here (mirrored as CEL rules in the CRD):
- every role topology has dp, tp, cp, pp >= 1;
- decode cp == 1; decode pp == 1 or == prefill pp;
- `gpusPerPod`, when set, divides the ranks per instance (dp*tp*cp*pp)
  and is at most that count (runtime/pod_layout.py); left out, an instance
  is one pod;
- `scheduling.schedulerName` is a DNS-1123 subdomain and
  `placement.topologyKey` a label key;
- a cluster is either colocated (one `colocated` role) or disaggregated
  (both `prefill` and `decode`), never a mix;
- autoscaling: minReplicas <= maxReplicas; the target metric belongs to the
  role (`AUTOSCALING_METRICS`); only prefill and decode autoscale; with
  `autoscaling.maxTotalGPUs`, the roles' minimums fit the budget together and
  each role's maximum fits beside the other role's minimum;
- `engine.kind: vllm`: only what vLLM can run (`serving_engine.vllm_refusal`).

A section with a module of its own lives beside this one in the package
(`base.py` holds the shared model base); this module assembles the whole
manifest and re-exports every name callers import from `runtime.spec`.

Pure module: no I/O beyond parsing text that the caller already read.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdcluster.runtime.bounds import require_at_least
from pdcluster.runtime.pod_layout import PodLayout, PodLayoutError, compute_pod_layout

# The sections with a module of their own, re-exported (`X as X`): callers import
# every manifest name from runtime.spec.
from pdcluster.runtime.spec.base import SpecError as SpecError
from pdcluster.runtime.spec.base import SpecModel as SpecModel
from pdcluster.runtime.spec.disruption import DRAIN_MARGIN_SECONDS as DRAIN_MARGIN_SECONDS
from pdcluster.runtime.spec.disruption import DisruptionBudgetSpec as DisruptionBudgetSpec
from pdcluster.runtime.spec.disruption import DrainSpec as DrainSpec
from pdcluster.runtime.spec.disruption import RolloutSpec as RolloutSpec
from pdcluster.runtime.spec.disruption import WorkerDrainSpec as WorkerDrainSpec
from pdcluster.runtime.spec.model_source import MODEL_MOUNT_PATH as MODEL_MOUNT_PATH
from pdcluster.runtime.spec.model_source import ModelSource as ModelSource
from pdcluster.runtime.spec.model_source import ModelSourceKind as ModelSourceKind
from pdcluster.runtime.spec.model_source import ModelSourceSpec as ModelSourceSpec
from pdcluster.runtime.spec.model_source import parse_model_uri as parse_model_uri
from pdcluster.runtime.spec.observability import LogFormat as LogFormat
from pdcluster.runtime.spec.observability import ObservabilitySpec as ObservabilitySpec
from pdcluster.runtime.spec.observability import SloSpec as SloSpec
from pdcluster.runtime.spec.observability import TracingSpec as TracingSpec
from pdcluster.runtime.spec.pod_overlay import PodOverlaySpec as PodOverlaySpec
from pdcluster.runtime.spec.serving_engine import EngineKind as EngineKind
from pdcluster.runtime.spec.serving_engine import KVBufferDevice as KVBufferDevice
from pdcluster.runtime.spec.serving_engine import ServingEngineSpec as ServingEngineSpec
from pdcluster.runtime.spec.serving_engine import VllmKVConnector as VllmKVConnector
from pdcluster.runtime.spec.serving_engine import VllmSpec as VllmSpec
from pdcluster.runtime.spec.serving_engine import vllm_refusal

API_GROUP = "pdcluster.io"
API_VERSION = "v1alpha1"
KIND = "PDCluster"


class KVDtype(enum.StrEnum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float64 = "float64"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _KV_ITEMSIZES[self]

    @classmethod
    def itemsize_of(cls, name: str) -> int | None:
        """Bytes per element of the dtype named `name`; None when it names no KVDtype.
        (A table lookup: `KVDtype(name)` goes through the enum machinery, ~20 us
        cold, and the transfer sender asks once per job.)"""
        return _KV_ITEMSIZES.get(name)


# The one table of element sizes (frames, transfer budgets and checks read it).
_KV_ITEMSIZES: dict[str, int] = {  # keyed by the members, which are strs
    KVDtype.float32: 4,
    KVDtype.float16: 2,
    KVDtype.bfloat16: 2,
    KVDtype.float64: 8,
}


class KVLayout(enum.StrEnum):
    # Per layer, K and V each as [num_pages, page_size, num_kv_heads, head_dim].
    NHD = "NHD"
    # Per layer, K and V each as [num_pages, num_kv_heads, page_size, head_dim].
    HND = "HND"


class TransferBackend(enum.StrEnum):
    tcp = "tcp"
    shm = "shm"
    # NIXL agents (UCX): one-sided WRITEs into the peer's registered pool.
    nixl = "nixl"

    @property
    def is_one_sided(self) -> bool:
        """Writes land in the peer's memory without the peer taking part (docs/design.md §7, §9)."""
        return self is not TransferBackend.tcp


class Role(enum.StrEnum):
    """What a worker instance does; each names the `spec` field that configures it."""

    prefill = "prefill"
    decode = "decode"
    colocated = "colocated"

    @classmethod
    def parse(cls, value: object) -> Role:
        """`value` as a Role; SpecError naming the accepted values otherwise."""
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        accepted = ", ".join(r.value for r in cls)
        raise SpecError(f"unknown role {value!r}: expected one of {accepted}")


class AllocationPolicy(enum.StrEnum):
    early = "early"
    prefill_complete = "prefill_complete"


class FailurePolicy(enum.StrEnum):
    fail = "fail"
    recompute = "recompute"


class SelectionPolicy(enum.StrEnum):
    round_robin = "round_robin"
    least_outstanding = "least_outstanding"
    random = "random"
    # The worker holding the longest cached prefix (prefill, decode or colocated).
    cache_aware = "cache_aware"


class ModelSpec(SpecModel):
    """Which model every role serves.

    `name: tiny` is the built-in deterministic model (no download). Otherwise
    `path` points to a local Hugging Face-style directory (config.json,
    *.safetensors, tokenizer.json) of a Llama/Qwen2-architecture model, or
    `source` names the storage the pods mount it from (model_source.py).
    """

    name: str = Field(default="tiny", min_length=1, max_length=253)
    path: str | None = None
    source: ModelSourceSpec | None = None
    # Dtype the engine computes in; float64 makes cross-topology checks exact.
    # Left out: bfloat16 when a role of the cluster runs on cuda, float32
    # otherwise (`PDClusterSpec.compute_dtype`: one dtype for every role, so a
    # prefill and a decode instance always agree).
    compute_dtype: KVDtype | None = None
    seed: int = Field(default=0, ge=0, description="seed of the built-in tiny model's weights")

    @model_validator(mode="after")
    def _path_or_tiny(self) -> ModelSpec:
        if self.path and self.source is not None:
            raise ValueError(
                "model: set `path` or `source`, not both (the source decides the path)"
            )
        if self.name != "tiny" and not self.path and self.source is None:
            raise ValueError(
                f"model {self.name!r} needs `path` or `source` (only 'tiny' is built in)"
            )
        return self


class KVCacheSpec(SpecModel):
    page_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV page")
    # Left out: the compute dtype (`PDClusterSpec.kv_dtype`).
    dtype: KVDtype | None = None
    layout: KVLayout = KVLayout.NHD
    num_pages: int | None = Field(
        default=None,
        ge=2,
        le=1 << 24,
        description=(
            "KV pages per rank; left out: on cuda what fits gpuMemoryUtilization of the GPU "
            "once the weights are loaded, on cpu 512"
        ),
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description=(
            "share of its GPU a rank may use (weights, KV pool, a step's activations) "
            "when numPages is left out"
        ),
    )


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages holding the KV of `num_tokens` tokens: ceil(num_tokens / page_size)."""
    require_at_least("pages_for", num_tokens=(num_tokens, 0), page_size=(page_size, 1))
    return -(-num_tokens // page_size)


class HeartbeatSpec(SpecModel):
    interval_seconds: float = Field(default=5.0, gt=0, le=3600)
    failure_threshold: int = Field(default=2, ge=1, le=100)
    # A prefill instance no room used for this long stops being probed and
    # its bootstrap client is dropped; its next room brings both back.
    idle_seconds: float = Field(default=300.0, gt=0, le=86400)


_UCX_DEVICES = r"^[\w,.:-]+$"


class UcxSpec(SpecModel):
    """UCX settings of the `nixl` backend, passed to every worker process.

    Unset fields leave UCX's own choice (all transports it finds). The
    transports actually selected are reported in `/get_server_info`.
    """

    # UCX_TLS, e.g. "rc,cuda_ipc,cuda_copy" (RDMA + NVLink) or "tcp,cma".
    tls: str | None = Field(default=None, min_length=1, max_length=256, pattern=r"^[\w,^:-]+$")
    # UCX_NET_DEVICES, e.g. "mlx5_0:1,mlx5_1:1".
    net_devices: str | None = Field(
        default=None, min_length=1, max_length=256, pattern=_UCX_DEVICES
    )
    # UCX_NET_DEVICES per local rank of a pod (the rank's GPU index): entry i
    # is what rank i of each pod uses, e.g. the NIC nearest its GPU
    # ["mlx5_0:1", "mlx5_1:1", ...]. Instead of `netDevices`, not with it.
    rank_net_devices: list[
        Annotated[str, Field(min_length=1, max_length=256, pattern=_UCX_DEVICES)]
    ] = Field(default_factory=list, max_length=64)
    # The manifest asks for RDMA or GPU-direct: a transfer that fell back to
    # TCP is reported as a Warning instead of passing silently.
    require_rdma: bool = False

    @model_validator(mode="after")
    def _one_device_choice(self) -> UcxSpec:
        if self.net_devices is not None and self.rank_net_devices:
            raise ValueError("transfer.ucx: set netDevices or rankNetDevices, not both")
        return self

    def net_devices_for(self, local_rank: int) -> str | None:
        """UCX_NET_DEVICES of the pod's rank `local_rank` (None: UCX's own choice)."""
        if not self.rank_net_devices:
            return self.net_devices
        if not 0 <= local_rank < len(self.rank_net_devices):
            raise SpecError(
                f"transfer.ucx.rankNetDevices has {len(self.rank_net_devices)} entries; "
                f"local rank {local_rank} has none"
            )
        return self.rank_net_devices[local_rank]


class TransferSpec(SpecModel):
    backend: TransferBackend = TransferBackend.tcp
    allocation_policy: AllocationPolicy = AllocationPolicy.early
    bootstrap_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    waiting_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    # prefill_complete: how long decode waits for prefill's "KV computed".
    prefill_wait_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    # Added to the waiting (and prefill wait) timeout per prompt token: a long
    # prompt takes longer to compute and to move (see RoomSettings).
    waiting_per_token_milliseconds: float = Field(default=1.0, ge=0, le=1000)
    abort_release_timeout_seconds: float = Field(default=10.0, gt=0, le=3600)
    heartbeat: HeartbeatSpec = HeartbeatSpec()
    checksum: bool = False
    failure_policy: FailurePolicy = FailurePolicy.fail
    max_rooms: int = Field(
        default=4096,
        ge=1,
        le=1 << 16,
        description="rooms a prefill dp group computes and transfers at once; more legs queue",
    )
    room_queue_limit: int = Field(
        default=4096,
        ge=0,
        le=1 << 16,
        description="prefill legs waiting (FIFO) for a room slot; past it: 503 with Retry-After",
    )
    ucx: UcxSpec = UcxSpec()


# Ranks (processes) one instance may run: dp*tp*cp*pp. Each axis alone is
# bounded; without this their product would allow 64**4 processes per instance.
MAX_RANKS_PER_INSTANCE = 64


class Topology(SpecModel):
    dp: int = Field(default=1, ge=1, le=64)
    tp: int = Field(default=1, ge=1, le=64)
    cp: int = Field(default=1, ge=1, le=64)
    pp: int = Field(default=1, ge=1, le=64)

    @property
    def num_ranks(self) -> int:
        return self.dp * self.tp * self.cp * self.pp


class RestartPolicySpec(SpecModel):
    backoff_seconds: float = Field(default=1.0, ge=0, le=3600)
    max_backoff_seconds: float = Field(default=60.0, ge=0, le=86400)
    budget: int = Field(default=10, ge=0, le=10000, description="restarts allowed per hour")
    not_ready_grace_seconds: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description=(
            "a pod of an instance that passed its startup probe and stays NotReady this long "
            "restarts the whole instance (at once when its status does not say since when)"
        ),
    )


class EngineSpec(SpecModel):
    max_running_requests: int = Field(default=64, ge=1, le=4096)
    max_batch_tokens: int = Field(default=2048, ge=16, le=1 << 20)
    chunk_size: int = Field(default=512, ge=16, le=1 << 20, description="prefill chunk, tokens")
    max_prompt_tokens: int = Field(default=4096, ge=1, le=1 << 22)
    max_new_tokens: int = Field(default=1024, ge=1, le=1 << 20)
    stall_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="work pending and no engine step finished this long: engine_stalled",
    )
    cuda_graphs: bool = Field(
        default=True,
        description=(
            "on cuda, replay decode steps from CUDA graphs (one per batch size up to "
            "maxRunningRequests, captured at start); off: every step launches its kernels"
        ),
    )
    prefix_cache: bool = Field(
        default=True,
        description=(
            "keep full prompt pages in a prefix cache: an engine skips recomputing a "
            "cached prefix (colocated, PD prefill), and a PD decode keeps the prompt pages "
            "it received and has prefill send only what it does not hold yet"
        ),
    )


class AutoscalingMetric(enum.StrEnum):
    """What a role's autoscaler holds at its target value."""

    # prefill: p90 time to first token over the last interval, seconds.
    ttft_p90_seconds = "ttftP90Seconds"
    # prefill: prompt tokens accepted and not yet computed, per Ready instance.
    queued_prefill_tokens_per_instance = "queuedPrefillTokensPerInstance"
    # decode: p90 time per output token over the last interval, seconds.
    tpot_p90_seconds = "tpotP90Seconds"
    # decode: requests being served, per Ready instance.
    running_requests_per_instance = "runningRequestsPerInstance"
    # decode: fraction of KV pages in use, averaged over Ready instances (0..1).
    kv_page_usage = "kvPageUsage"


# Which metric may drive which role (the one table; CEL rules read it too).
AUTOSCALING_METRICS: dict[Role, tuple[AutoscalingMetric, ...]] = {
    Role.prefill: (
        AutoscalingMetric.ttft_p90_seconds,
        AutoscalingMetric.queued_prefill_tokens_per_instance,
    ),
    Role.decode: (
        AutoscalingMetric.tpot_p90_seconds,
        AutoscalingMetric.running_requests_per_instance,
        AutoscalingMetric.kv_page_usage,
    ),
}


class AutoscalingTarget(SpecModel):
    metric: AutoscalingMetric
    value: float = Field(gt=0, le=1e9, description="the metric's target value")

    @model_validator(mode="after")
    def _usage_is_a_fraction(self) -> AutoscalingTarget:
        if self.metric is AutoscalingMetric.kv_page_usage and self.value > 1:
            raise ValueError(f"a kvPageUsage target is a fraction in (0, 1], got {self.value}")
        return self


class ScaleUpSpec(SpecModel):
    stabilization_seconds: float = Field(
        default=30.0,
        ge=0,
        le=86400,
        description="scale up only to the lowest recommendation of this window",
    )


class ScaleDownSpec(SpecModel):
    stabilization_seconds: float = Field(
        default=300.0,
        ge=0,
        le=86400,
        description="scale down only to the highest recommendation of this window",
    )


class RoleAutoscalingSpec(SpecModel):
    """The built-in autoscaler of one role (docs/kubernetes.md, Autoscaling)."""

    min_replicas: int = Field(default=1, ge=1, le=1024)
    max_replicas: int = Field(ge=1, le=1024)
    interval_seconds: float = Field(default=15.0, ge=1, le=3600)
    target: AutoscalingTarget
    tolerance: float = Field(
        default=0.1, ge=0, lt=1, description="no change while |metric/target - 1| <= this"
    )
    scale_up: ScaleUpSpec = ScaleUpSpec()
    scale_down: ScaleDownSpec = ScaleDownSpec()
    max_step: int = Field(
        default=1, ge=1, le=1024, description="instances added or removed at once"
    )

    @model_validator(mode="after")
    def _bounds(self) -> RoleAutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas ({self.min_replicas}) must be at most "
                f"maxReplicas ({self.max_replicas})"
            )
        return self


class ClusterAutoscalingSpec(SpecModel):
    max_total_gpus: int | None = Field(
        default=None,
        alias="maxTotalGPUs",
        ge=1,
        le=1 << 20,
        description="GPUs (ranks) of prefill and decode together",
    )


# How the pods of one instance are scheduled together (the CRD's description
# of `gang` is in operator/crd/field_docs.py).
class GangScheduling(enum.StrEnum):
    # Each pod on its own (the default scheduler's behaviour).
    none = "none"
    # A scheduler-plugins PodGroup per instance (minMember = its pods).
    pod_group = "podGroup"


# DNS-1123 subdomain (scheduler names) and label key (optional prefix/name).
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class SchedulingSpec(SpecModel):
    gang: GangScheduling = GangScheduling.none
    scheduler_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN
    )


class PlacementSpec(SpecModel):
    topology_key: str | None = Field(default=None, min_length=1, max_length=317, pattern=_LABEL_KEY)


class RoleSpec(SpecModel):
    replicas: int = Field(default=1, ge=0, le=1024, description="instances of this role")
    topology: Topology = Topology()
    gpus_per_pod: int | None = Field(default=None, ge=1, le=64)
    device: Literal["cpu", "cuda"] = "cpu"
    resources: dict[str, Any] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    scheduling: SchedulingSpec = SchedulingSpec()
    placement: PlacementSpec = PlacementSpec()
    restart: RestartPolicySpec = RestartPolicySpec()
    engine: EngineSpec = EngineSpec()
    autoscaling: RoleAutoscalingSpec | None = None
    pod: PodOverlaySpec = PodOverlaySpec()
    rollout: RolloutSpec = RolloutSpec()
    disruption_budget: DisruptionBudgetSpec = DisruptionBudgetSpec()
    drain: WorkerDrainSpec = WorkerDrainSpec()

    @model_validator(mode="after")
    def _ranks_fill_pods(self) -> RoleSpec:
        ranks = self.topology.num_ranks
        if ranks > MAX_RANKS_PER_INSTANCE:
            raise ValueError(
                f"ranks per instance ({ranks} = dp*tp*cp*pp) must be at most "
                f"{MAX_RANKS_PER_INSTANCE}"
            )
        try:
            compute_pod_layout(ranks, self.gpus_per_pod)
        except PodLayoutError as err:
            raise ValueError(str(err)) from None
        return self

    @property
    def pod_layout(self) -> PodLayout:
        """How one instance's ranks spread over pods (runtime/pod_layout.py)."""
        return compute_pod_layout(self.topology.num_ranks, self.gpus_per_pod)

    @property
    def pods_per_instance(self) -> int:
        return self.pod_layout.num_pods

    @property
    def gpus_per_instance(self) -> int:
        """GPUs one instance holds in the autoscaling budget: one per rank, whatever `device`."""
        return self.topology.num_ranks


class RouterPolicySpec(SpecModel):
    prefill: SelectionPolicy = SelectionPolicy.round_robin
    # Also the policy of a colocated cluster's workers.
    decode: SelectionPolicy = SelectionPolicy.round_robin
    max_load_gap: int = Field(
        default=4,
        ge=0,
        le=4096,
        description=(
            "cache_aware: the worker with the longest cached prefix is chosen only while its "
            "legs in flight exceed the least-loaded candidate's by at most this many; "
            "beyond it the request goes by least_outstanding"
        ),
    )


class RouterServiceSpec(SpecModel):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=8000, ge=1, le=65535)


class RouterSpec(SpecModel):
    replicas: int = Field(default=1, ge=0, le=64)
    policy: RouterPolicySpec = RouterPolicySpec()
    service: RouterServiceSpec = RouterServiceSpec()
    health_check_interval_seconds: float = Field(default=2.0, gt=0, le=3600)
    request_timeout_seconds: float = Field(default=300.0, gt=0, le=86400)
    resources: dict[str, Any] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    pod: PodOverlaySpec = PodOverlaySpec()
    disruption_budget: DisruptionBudgetSpec = DisruptionBudgetSpec()
    drain: DrainSpec = DrainSpec()


class WorkerApiAccess(enum.StrEnum):
    token = "token"
    open = "open"


class AuthSpec(SpecModel):
    # Name of a Secret holding `token`; empty → the operator creates one.
    token_secret_name: str = ""
    # Router API keys are optional; none means the router API is open.
    router_api_key_secret_name: str = ""
    # CURVE on every rank's ZMQ endpoint. Unset: on for pods the operator
    # builds (it writes `true` into the manifest they read), off in local mode.
    zmq_curve: bool | None = None
    # Workers' /generate, /abort_request and /v1/*: `token` needs the cluster
    # token as a Bearer header; `open` only for a PD router that cannot send one.
    worker_api: WorkerApiAccess = WorkerApiAccess.token


class PDClusterSpec(SpecModel):
    model: ModelSpec = ModelSpec()
    image: str = "pdcluster:0.1.0"
    engine: ServingEngineSpec = ServingEngineSpec()
    kv_cache: KVCacheSpec = KVCacheSpec()
    transfer: TransferSpec = TransferSpec()
    prefill: RoleSpec | None = None
    decode: RoleSpec | None = None
    colocated: RoleSpec | None = None
    router: RouterSpec = RouterSpec()
    auth: AuthSpec = AuthSpec()
    autoscaling: ClusterAutoscalingSpec = ClusterAutoscalingSpec()
    observability: ObservabilitySpec = ObservabilitySpec()

    @model_validator(mode="after")
    def _roles(self) -> PDClusterSpec:
        disaggregated = self.prefill is not None or self.decode is not None
        if disaggregated and self.colocated is not None:
            raise ValueError("use either `colocated` or `prefill`+`decode`, not both")
        if not disaggregated and self.colocated is None:
            raise ValueError("spec needs `prefill` and `decode` roles (or a `colocated` role)")
        if disaggregated:
            if self.prefill is None or self.decode is None:
                missing = "prefill" if self.prefill is None else "decode"
                raise ValueError(f"a disaggregated cluster needs a `{missing}` role")
            d, p = self.decode.topology, self.prefill.topology
            if d.cp != 1:
                raise ValueError(f"decode.topology.cp must be 1 (got {d.cp}): cp is prefill-only")
            if d.pp not in (1, p.pp):
                raise ValueError(
                    f"decode.topology.pp must be 1 or equal prefill.topology.pp ({p.pp}), "
                    f"got {d.pp}"
                )
        self._check_cache_aware()
        self._check_autoscaling()
        self._check_rank_net_devices()
        refusal = vllm_refusal(self)
        if refusal is not None:
            raise ValueError(refusal)
        return self

    def _check_rank_net_devices(self) -> None:
        """Every rank of a pod needs its NIC entry (entry i: local rank i)."""
        entries = len(self.transfer.ucx.rank_net_devices)
        if not entries:
            return
        for role in Role:
            spec = self.role_spec(role)
            if spec is not None and spec.pod_layout.ranks_per_pod > entries:
                raise ValueError(
                    f"transfer.ucx.rankNetDevices has {entries} entries but a {role.value} pod "
                    f"runs {spec.pod_layout.ranks_per_pod} ranks: one entry per local rank"
                )

    def _check_cache_aware(self) -> None:
        """cache_aware routes by the keys a role's workers publish, which only
        a worker with the prefix cache on has."""
        policy = self.router.policy
        routed = (
            (("prefill", self.prefill, policy.prefill), ("decode", self.decode, policy.decode))
            if self.colocated is None
            else (("colocated", self.colocated, policy.decode),)
        )
        for role, spec, chosen in routed:
            if chosen is SelectionPolicy.cache_aware and spec is not None:
                if not spec.engine.prefix_cache:
                    key = "prefill" if role == "prefill" else "decode"
                    raise ValueError(
                        f"router.policy.{key}: cache_aware needs {role}.engine.prefixCache: "
                        "true (with the cache off a worker publishes no cached pages)"
                    )

    def _check_autoscaling(self) -> None:
        if self.colocated is not None and self.colocated.autoscaling is not None:
            raise ValueError(
                "colocated.autoscaling is not supported: only prefill and decode scale"
            )
        roles = {r: s for r in (Role.prefill, Role.decode) if (s := self.role_spec(r)) is not None}
        for role, spec in roles.items():
            scaling = spec.autoscaling
            if scaling is not None and scaling.target.metric not in AUTOSCALING_METRICS[role]:
                accepted = ", ".join(m.value for m in AUTOSCALING_METRICS[role])
                raise ValueError(
                    f"{role.value}.autoscaling.target.metric {scaling.target.metric.value!r} "
                    f"does not scale {role.value}: expected one of {accepted}"
                )
        budget = self.autoscaling.max_total_gpus
        if budget is None or not any(s.autoscaling for s in roles.values()):
            return

        def floor(spec: RoleSpec) -> int:  # GPUs the role holds at least
            low = spec.autoscaling.min_replicas if spec.autoscaling else spec.replicas
            return low * spec.gpus_per_instance

        if (need := sum(floor(s) for s in roles.values())) > budget:
            raise ValueError(
                f"autoscaling.maxTotalGPUs ({budget}) is below the GPUs of both roles at their "
                f"minimum ({need})"
            )
        for role, spec in roles.items():
            if spec.autoscaling is None:
                continue
            others = sum(floor(s) for r, s in roles.items() if r is not role)
            top = spec.autoscaling.max_replicas * spec.gpus_per_instance
            if top + others > budget:
                raise ValueError(
                    f"{role.value}.autoscaling.maxReplicas ({spec.autoscaling.max_replicas}) "
                    f"needs {top} GPUs; with the other role at its minimum ({others}) that "
                    f"exceeds autoscaling.maxTotalGPUs ({budget})"
                )

    @property
    def is_disaggregated(self) -> bool:
        return self.colocated is None

    @property
    def ttft_slo_seconds(self) -> float | None:
        """The p90 TTFT the cluster promises: `observability.slo`, else a prefill
        `ttftP90Seconds` autoscaling target (None: the manifest states none)."""
        stated = self.observability.slo.ttft_p90_seconds
        if stated is not None:
            return stated
        scaling = self.prefill.autoscaling if self.prefill is not None else None
        if scaling is not None and scaling.target.metric is AutoscalingMetric.ttft_p90_seconds:
            return scaling.target.value
        return None

    @property
    def compute_dtype(self) -> KVDtype:
        """`model.computeDtype`, or its default: bfloat16 when a role runs on cuda."""
        if self.model.compute_dtype is not None:
            return self.model.compute_dtype
        roles = (self.prefill, self.decode, self.colocated)
        on_gpu = any(r is not None and r.device == "cuda" for r in roles)
        return KVDtype.bfloat16 if on_gpu else KVDtype.float32

    @property
    def kv_dtype(self) -> KVDtype:
        """`kvCache.dtype`, or the compute dtype."""
        return self.kv_cache.dtype or self.compute_dtype

    def roles(self) -> Iterator[tuple[Role, RoleSpec]]:
        """The roles this cluster has, with their specs (prefill before decode)."""
        for role in Role:
            spec = self.role_spec(role)
            if spec is not None:
                yield role, spec

    def role_spec(self, role: Role) -> RoleSpec | None:
        """The spec of `role` (None when this cluster has no such role)."""
        spec: RoleSpec | None = getattr(self, role.value)
        return spec


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str = "default"


class PDCluster(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["pdcluster.io/v1alpha1"] = Field(
        default="pdcluster.io/v1alpha1", alias="apiVersion"
    )
    kind: Literal["PDCluster"] = "PDCluster"
    metadata: ObjectMeta
    spec: PDClusterSpec
    status: dict[str, Any] | None = None


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "<root>"
        lines.append(f"{where}: {item['msg']}")
    return "; ".join(lines)


def parse_manifest(data: dict[str, Any]) -> PDCluster:
    """Validate a decoded manifest; raise SpecError naming each bad field."""
    if not isinstance(data, dict):
        raise SpecError(f"a PDCluster manifest must be a mapping, got {type(data).__name__}")
    try:
        return PDCluster.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"invalid PDCluster: {_format_validation_error(err)}") from None


def parse_spec(data: dict[str, Any]) -> PDClusterSpec:
    """Validate just a `spec` mapping (what the operator receives)."""
    try:
        return PDClusterSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"invalid PDCluster spec: {_format_validation_error(err)}") from None


def load_manifest_text(text: str) -> PDCluster:
    """Parse YAML text holding exactly one PDCluster document."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError(f"manifest is not valid YAML: {err}") from None
    clusters = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(clusters) != 1:
        raise SpecError(f"expected exactly one {KIND} document, found {len(clusters)}")
    return parse_manifest(clusters[0])
