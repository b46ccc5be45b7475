"""Node agent settings: one documented dataclass, loaded at the edge (the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from e2e.nodeagent.backoff import BackoffPolicy
from e2e.nodeagent.network import check_block


@dataclass(frozen=True)
class NodeCapacity:
    """What each fake node advertises as capacity and allocatable."""

    cpu: str = "32"
    memory: str = "128Gi"
    pods: int = 110
    gpus: int = 8  # nvidia.com/gpu
    ephemeral_storage: str = "200Gi"

    def as_resources(self) -> dict[str, str]:
        return {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            "nvidia.com/gpu": str(self.gpus),
            "ephemeral-storage": self.ephemeral_storage,
        }


@dataclass(frozen=True)
class AgentSettings:
    """Times are seconds."""

    state_dir: Path
    node_names: tuple[str, ...]
    address_block: int  # pods get 127.<block>.<node index>.<n>
    kubernetes_version: str = "v1.37.2"
    capacity: NodeCapacity = field(default_factory=NodeCapacity)
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    tick_s: float = 0.1  # how often a pod worker looks at its processes
    lease_duration_s: int = 40
    lease_renew_s: float = 10.0
    node_status_heartbeat_s: float = 30.0
    config_retry_s: float = 2.0  # retry a container whose Secret/ConfigMap is missing
    shutdown_grace_s: float = 10.0  # cap on pod grace periods when the agent itself stops
    token_expiration_s: int = 3600

    def __post_init__(self) -> None:
        check_block(self.address_block)
        if not self.node_names:
            raise ValueError("the agent needs at least one node name")
        if len(set(self.node_names)) != len(self.node_names):
            raise ValueError(f"node names must be unique: {self.node_names}")
        if len(self.node_names) > 250:
            raise ValueError("at most 250 nodes per agent")
