"""Router settings: one frozen dataclass, validated once, loaded at the edge.

Times are in seconds, sizes in bytes. A config names its workers either as
static URL lists or as Kubernetes discovery settings; with Kubernetes,
`disaggregated` says which kind of cluster the pods form. `failure_policy`
mirrors the manifest's `spec.transfer.failurePolicy`: under `recompute` a
failed prefill leg is left to the decode leg, which computes the prompt
itself (see relay.py).

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdcluster.runtime.bounds import require_positive
from pdcluster.runtime.router.discovery import KubernetesDiscoverySettings, static_targets
from pdcluster.runtime.router.workers import KVEventPorts
from pdcluster.runtime.spec import (
    EngineKind,
    FailurePolicy,
    LogFormat,
    PDClusterSpec,
    Role,
    SelectionPolicy,
    TracingSpec,
    VllmKVConnector,
)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class RouterConfig:
    # Name clients put in `model`; also listed by /v1/models.
    model_name: str = "tiny"
    # Other names accepted for the same model (e.g. the served model path).
    model_aliases: tuple[str, ...] = ()
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    colocated_urls: tuple[str, ...] = ()
    kubernetes: KubernetesDiscoverySettings | None = None
    # Needed with Kubernetes discovery; derived from the URL lists otherwise.
    disaggregated: bool | None = None
    prefill_policy: str = SelectionPolicy.round_robin.value
    decode_policy: str = SelectionPolicy.round_robin.value
    colocated_policy: str = SelectionPolicy.round_robin.value
    # Seed of the `random` policy (None: seeded from the OS).
    policy_seed: int | None = None
    # Bearer keys; empty means the API is open. /health and /metrics stay open.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The cluster token, sent as a Bearer header on every call to a worker.
    worker_token: str = field(default="", repr=False)
    # Whole-request deadline, streaming included: no request outlives it.
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    health_check_interval_s: float = 2.0
    health_check_timeout_s: float = 2.0
    # Consecutive failed probes before a worker leaves the pool.
    health_failure_threshold: int = 2
    abort_timeout_s: float = 2.0
    max_connections: int = 1024
    # The cluster's `spec.transfer.failurePolicy` (fail | recompute).
    failure_policy: str = FailurePolicy.fail.value
    # cache_aware: legs in flight by which the cached worker may exceed the
    # least-loaded candidate before the request goes by load instead.
    max_load_gap: int = 4
    # cache_aware: "tiny" or a model directory with tokenizer.json, to turn
    # text prompts into token ids; None: only token-id prompts are matched.
    tokenizer: str | None = None
    # The PDCluster's name: the `pdcluster` label of `pdcluster_router_info`.
    cluster_name: str = ""
    # The p90 TTFT the manifest promises (`spec.ttft_slo_seconds`), exported for the alert.
    ttft_slo_s: float | None = None
    tracing: TracingSpec = field(default_factory=TracingSpec)
    log_format: LogFormat | None = None
    # The engine the workers run (`spec.engine.kind`): vLLM workers are probed
    # on /health alone and their legs go one after the other (leg_plan.LegFlow).
    engine: EngineKind = EngineKind.builtin
    # cache_aware over vLLM workers: where each statically listed worker
    # publishes its prefix-cache events (Kubernetes: pod annotations), and
    # vLLM's block size (`kvCache.pageSize`, its `--block-size`).
    kv_events: tuple[tuple[str, KVEventPorts], ...] = ()
    vllm_block_size: int = 16
    # vLLM's KV connector (`spec.engine.vllm.kvConnector`): with ours the legs
    # go at once, paired by a room in their `kv_transfer_params`.
    kv_connector: VllmKVConnector = VllmKVConnector.nixl
    # vLLM with our connector: each static worker's side port (its bootstrap
    # server and admin API), by worker URL; Kubernetes discovery reads it from
    # the pod's `pdcluster.io/bootstrap-port` annotation.
    side_ports: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        has_lists = bool(self.prefill_urls or self.decode_urls or self.colocated_urls)
        if self.kubernetes is not None:
            if has_lists:
                raise ValueError("use static worker URLs or kubernetes discovery, not both")
            if self.disaggregated is None:
                raise ValueError("kubernetes discovery needs `disaggregated` set (True or False)")
        else:
            static_targets(
                self.prefill_urls, self.decode_urls, self.colocated_urls, dict(self.kv_events)
            )
            if self.disaggregated is not None and self.disaggregated != bool(
                self.prefill_urls or self.decode_urls
            ):
                raise ValueError("`disaggregated` contradicts the worker URL lists")
        for name in ("prefill_policy", "decode_policy", "colocated_policy"):
            value = getattr(self, name)
            if value not in {p.value for p in SelectionPolicy}:
                valid = ", ".join(p.value for p in SelectionPolicy)
                raise ValueError(f"{name}={value!r} is not one of: {valid}")
        if (
            not isinstance(self.max_load_gap, int)
            or isinstance(self.max_load_gap, bool)
            or self.max_load_gap < 0
        ):
            raise ValueError(f"max_load_gap must be an integer >= 0, got {self.max_load_gap!r}")
        if not isinstance(self.engine, EngineKind):
            valid = ", ".join(e.value for e in EngineKind)
            raise ValueError(f"engine={self.engine!r} is not one of: {valid}")
        if self.kv_events and self.kubernetes is not None:
            raise ValueError("kv_events name static workers; Kubernetes pods carry their own")
        if len(dict(self.kv_events)) != len(self.kv_events):
            raise ValueError("kv_events lists a worker twice")
        if not isinstance(self.vllm_block_size, int) or self.vllm_block_size < 1:
            raise ValueError(f"vllm_block_size must be >= 1, got {self.vllm_block_size!r}")
        for url, port in self.side_ports.items():
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise ValueError(f"side port of {url} must be in 1..65535, got {port!r}")
        if self.failure_policy not in {p.value for p in FailurePolicy}:
            valid = ", ".join(p.value for p in FailurePolicy)
            raise ValueError(f"failure_policy={self.failure_policy!r} is not one of: {valid}")
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not contain empty keys")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        require_positive(
            self,
            "request_timeout_s",
            "connect_timeout_s",
            "health_check_interval_s",
            "health_check_timeout_s",
            "abort_timeout_s",
        )
        if self.health_failure_threshold < 1:
            raise ValueError(
                f"health_failure_threshold must be >= 1, got {self.health_failure_threshold}"
            )
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    @property
    def is_disaggregated(self) -> bool:
        if self.disaggregated is not None:
            return self.disaggregated
        return bool(self.prefill_urls or self.decode_urls)

    @property
    def reads_server_info(self) -> bool:
        """Whether workers answer /get_server_info (bootstrap port, dp size, role)."""
        return self.engine is EngineKind.builtin

    @property
    def uses_side_ports(self) -> bool:
        """vLLM with our connector: a worker's room facts are on its side port."""
        return self.engine is EngineKind.vllm and self.kv_connector is VllmKVConnector.pdcluster

    @property
    def aborts_by_rid(self) -> bool:
        """Whether workers take `/abort_request {rid}` (vLLM: closing the leg aborts it)."""
        return self.engine is EngineKind.builtin

    @property
    def is_prefill_failure_final(self) -> bool:
        """Whether a failed prefill leg ends the request (False: decode recomputes)."""
        return self.failure_policy != FailurePolicy.recompute.value

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    @classmethod
    def from_spec(
        cls,
        spec: PDClusterSpec,
        *,
        prefill_urls: Sequence[str] = (),
        decode_urls: Sequence[str] = (),
        colocated_urls: Sequence[str] = (),
        kubernetes: KubernetesDiscoverySettings | None = None,
        api_keys: Sequence[str] = (),
        side_ports: Mapping[str, int] | None = None,
        cluster_name: str = "",
    ) -> RouterConfig:
        """Settings of a PDCluster manifest plus the addresses the caller knows."""
        aliases = (spec.model.path,) if spec.model.path else ()
        return cls(
            model_name=spec.model.name,
            model_aliases=aliases,
            prefill_urls=tuple(prefill_urls),
            decode_urls=tuple(decode_urls),
            colocated_urls=tuple(colocated_urls),
            kubernetes=kubernetes,
            disaggregated=spec.is_disaggregated if kubernetes is not None else None,
            prefill_policy=spec.router.policy.prefill.value,
            decode_policy=spec.router.policy.decode.value,
            colocated_policy=spec.router.policy.decode.value,
            api_keys=tuple(api_keys),
            request_timeout_s=spec.router.request_timeout_seconds,
            health_check_interval_s=spec.router.health_check_interval_seconds,
            failure_policy=spec.transfer.failure_policy.value,
            max_load_gap=spec.router.policy.max_load_gap,
            tokenizer="tiny" if spec.model.name == "tiny" else spec.model.path or None,
            cluster_name=cluster_name,
            ttft_slo_s=spec.ttft_slo_seconds,
            tracing=spec.observability.tracing,
            log_format=spec.observability.log_format,
            engine=spec.engine.kind,
            vllm_block_size=spec.kv_cache.page_size,
            kv_connector=spec.engine.vllm.kv_connector,
            side_ports=dict(side_ports or {}),
        )

    @property
    def cache_aware_roles(self) -> tuple[Role, ...]:
        """The roles whose workers are routed by cache_aware (and followed)."""
        aware = SelectionPolicy.cache_aware.value
        if self.is_disaggregated:
            chosen = ((Role.prefill, self.prefill_policy), (Role.decode, self.decode_policy))
            return tuple(role for role, policy in chosen if policy == aware)
        return (Role.colocated,) if self.colocated_policy == aware else ()
