"""What the failover fast path needs to know about one worker pod, read from its object.

The pod watch hands raw pod objects here; everything downstream (loss
detection, the peer index, the admin calls) sees only `PodFacts`. Parsing is
lenient about what the kubelet writes (missing status, unknown phase) and
strict about identity: a pod counts only when its controller owner is a
PDCluster and its role and instance labels parse.

Times are epoch seconds read from the API (whole seconds on most clusters),
None when the object does not carry them.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.api import KIND, read_api_time
from pdcluster.operator.builders.meta import BOOTSTRAP_PORT, HTTP_PORT
from pdcluster.operator.builders.podsecurity import TOKEN_VOLUME
from pdcluster.runtime.pd.peer_address import BootstrapAddress, PeerRef
from pdcluster.runtime.pod_rendezvous import RendezvousError, parse_leader_address
from pdcluster.runtime.spec import EngineKind, Role

# Pods built before the token came as a file read it from this variable.
TOKEN_ENV = "PDCLUSTER_TOKEN"


@dataclass(frozen=True)
class PodFacts:
    namespace: str
    name: str
    uid: str
    cluster: str
    cluster_uid: str
    role: Role
    instance: int
    pod_ip: str | None
    http_port: int
    # The bootstrap server's port (prefill only).
    bootstrap_port: int | None
    phase: str
    ready: bool
    # When the Ready condition last changed (either way).
    ready_changed_at: float | None
    deleting: bool
    # When the deletion was asked for (deletionTimestamp minus the grace period).
    deletion_requested_at: float | None
    # The worker container exited (restartPolicy Never: the instance is gone).
    terminated: bool
    terminated_at: float | None
    # Secret holding the cluster token (the pod's token volume, or its PDCLUSTER_TOKEN env).
    token_secret: str | None
    created_at: float | None
    # The pod of its multi-pod instance (0: the leader) and, for a pod k > 0,
    # the leader's IP it was started with: peers know an instance by its leader.
    pod_index: int = 0
    leader_address: str | None = None
    # The engine the pod runs (its `pdcluster.io/engine` label; absent: ours).
    engine: EngineKind = EngineKind.builtin
    # Where the pod serves our admin API (fail_peer, failures, prefill peers,
    # /health, /get_server_info): our workers on their HTTP port, a vLLM pod
    # with our connector on its side port (`pdcluster.io/admin-port`), a vLLM
    # pod with vLLM's connector nowhere (None).
    admin_port: int | None = HTTP_PORT

    @property
    def has_admin_api(self) -> bool:
        """Whether the pod serves our admin API: ours and vLLM with our connector do."""
        return self.admin_port is not None

    @property
    def key(self) -> tuple[str, str]:
        """The cluster this pod belongs to: (namespace, cluster name)."""
        return (self.namespace, self.cluster)

    @property
    def has_ended(self) -> bool:
        return self.terminated or self.phase in ("Failed", "Succeeded")

    @property
    def is_leader(self) -> bool:
        return self.pod_index == 0

    @property
    def instance_ip(self) -> str | None:
        """The address peers know this pod's instance by: the leader pod's IP."""
        return self.pod_ip if self.is_leader else self.leader_address

    @property
    def http_url(self) -> str | None:
        return f"http://{self.pod_ip}:{self.http_port}" if self.pod_ip else None

    @property
    def admin_url(self) -> str | None:
        if not self.pod_ip or self.admin_port is None:
            return None
        return f"http://{self.pod_ip}:{self.admin_port}"

    @property
    def bootstrap_address(self) -> BootstrapAddress | None:
        """A prefill pod's instance's bootstrap server, `leaderIP:bootstrapPort`: how
        decode names it (a pod k > 0 is known by its leader's)."""
        ip = self.instance_ip
        if not ip or self.role != Role.prefill:
            return None
        return BootstrapAddress(f"{ip}:{self.bootstrap_port or BOOTSTRAP_PORT}")

    @property
    def peer(self) -> PeerRef | None:
        """How `fail_peer` names what this pod's loss is about: a prefill pod by its
        instance's bootstrap address (decode rooms name the instance), a decode
        pod by its own bare address (prefill matches the endpoints of its ranks by
        host). A prefill pod k > 0 is also reported by its own address
        (failover/gangs.py)."""
        if self.role == Role.prefill:
            return self.bootstrap_address
        return self.pod_ip


def parse_time(value: Any) -> float | None:
    """RFC 3339 (with or without fractions) to epoch seconds; None when absent or bad."""
    return read_api_time(value, naive_is_utc=True)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _port(value: Any, default: int | None) -> int | None:
    text = str(value) if isinstance(value, str | int) and not isinstance(value, bool) else ""
    if text.isdigit() and 1 <= int(text) <= 65535:
        return int(text)
    return default


def _owner(meta: Mapping[str, Any]) -> str | None:
    refs = meta.get("ownerReferences")
    for ref in refs if isinstance(refs, list) else []:
        if isinstance(ref, Mapping) and ref.get("controller") is True and ref.get("kind") == KIND:
            uid = ref.get("uid")
            return uid if isinstance(uid, str) and uid else None
    return None


def _ready(status: Mapping[str, Any]) -> tuple[bool, float | None]:
    conditions = status.get("conditions")
    for cond in conditions if isinstance(conditions, list) else []:
        if isinstance(cond, Mapping) and cond.get("type") == "Ready":
            return cond.get("status") == "True", parse_time(cond.get("lastTransitionTime"))
    return False, None


def _terminated(status: Mapping[str, Any]) -> tuple[bool, float | None]:
    statuses = status.get("containerStatuses")
    ended: list[float | None] = []
    for cs in statuses if isinstance(statuses, list) else []:
        term = _mapping(_mapping(_mapping(cs).get("state")).get("terminated"))
        if term:
            ended.append(parse_time(term.get("finishedAt")))
    if not ended:
        return False, None
    times = [t for t in ended if t is not None]
    return True, min(times) if times else None


def _token_secret(spec: Mapping[str, Any]) -> str | None:
    volumes = spec.get("volumes")
    for volume in volumes if isinstance(volumes, list) else []:
        if isinstance(volume, Mapping) and volume.get("name") == TOKEN_VOLUME:
            name = _mapping(volume.get("secret")).get("secretName")
            return name if isinstance(name, str) and name else None
    containers = spec.get("containers")
    for container in containers if isinstance(containers, list) else []:
        env = _mapping(container).get("env")
        for var in env if isinstance(env, list) else []:
            if isinstance(var, Mapping) and var.get("name") == TOKEN_ENV:
                ref = _mapping(_mapping(var.get("valueFrom")).get("secretKeyRef"))
                name = ref.get("name")
                return name if isinstance(name, str) and name else None
    return None


def _deletion_requested_at(meta: Mapping[str, Any]) -> float | None:
    at = parse_time(meta.get("deletionTimestamp"))
    grace = meta.get("deletionGracePeriodSeconds")
    if at is None:
        return None
    return at - grace if isinstance(grace, int) and grace >= 0 else at


def _leader_address(annotations: Mapping[str, Any]) -> str | None:
    value = annotations.get(names.ANNOTATION_LEADER_ADDRESS)
    if not isinstance(value, str) or not value:
        return None
    try:
        return parse_leader_address(value)
    except RendezvousError:
        return None


def parse_pod_facts(raw: Mapping[str, Any]) -> PodFacts | None:
    """Facts of a PDCluster worker pod; None for any other pod (router, foreign, malformed)."""
    meta, spec, status = (_mapping(raw.get(k)) for k in ("metadata", "spec", "status"))
    labels = _mapping(meta.get("labels"))
    annotations = _mapping(meta.get("annotations"))
    try:
        role = Role(str(labels.get(names.LABEL_ROLE, "")))
    except ValueError:
        return None
    cluster, instance = labels.get(names.LABEL_CLUSTER), str(labels.get(names.LABEL_INSTANCE_INDEX))
    name, namespace, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
    owner = _owner(meta)
    if not (isinstance(cluster, str) and cluster and instance.isdigit() and owner):
        return None
    if not all(isinstance(v, str) and v for v in (name, namespace, uid)):
        return None
    pod_index = str(labels.get(names.LABEL_POD_INDEX, "0"))
    ready, ready_changed_at = _ready(status)
    terminated, terminated_at = _terminated(status)
    pod_ip, phase = status.get("podIP"), status.get("phase")
    engine = _engine(labels.get(names.LABEL_ENGINE))
    http_port = _port(annotations.get(names.ANNOTATION_HTTP_PORT), HTTP_PORT) or HTTP_PORT
    # Our workers answer on their HTTP port; a vLLM pod only where annotated.
    admin_port = _port(
        annotations.get(names.ANNOTATION_ADMIN_PORT),
        http_port if engine is EngineKind.builtin else None,
    )
    return PodFacts(
        namespace=str(namespace),
        name=str(name),
        uid=str(uid),
        cluster=cluster,
        cluster_uid=owner,
        role=role,
        instance=int(instance),
        pod_ip=pod_ip if isinstance(pod_ip, str) and pod_ip else None,
        http_port=http_port,
        bootstrap_port=(
            _port(annotations.get(names.ANNOTATION_BOOTSTRAP_PORT), BOOTSTRAP_PORT)
            if role == Role.prefill
            else None
        ),
        phase=phase if isinstance(phase, str) else "Pending",
        ready=ready and phase == "Running",
        ready_changed_at=ready_changed_at,
        deleting=meta.get("deletionTimestamp") is not None,
        deletion_requested_at=_deletion_requested_at(meta),
        terminated=terminated,
        terminated_at=terminated_at,
        token_secret=_token_secret(spec),
        created_at=parse_time(meta.get("creationTimestamp")),
        pod_index=int(pod_index) if pod_index.isdigit() else 0,
        leader_address=_leader_address(annotations),
        engine=engine,
        admin_port=admin_port,
    )


def _engine(value: Any) -> EngineKind:
    try:
        return EngineKind(str(value)) if value is not None else EngineKind.builtin
    except ValueError:
        return EngineKind.builtin
