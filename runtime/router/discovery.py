"""Which workers exist: static lists, or Kubernetes pods mapped to workers.

Static discovery validates the URL lists once. Kubernetes discovery is split:
this module decides (pod object → worker target or a reason to skip it, and
a cache that applies watch events), `kube_watch.py` does the API calls.

Invariants:
- a cluster is colocated (only `colocated` workers) or disaggregated
  (prefill and decode), never a mix;
- a pod becomes a worker only when it is not being deleted, is Running, has
  condition Ready=True, has a pod IP, a known role label and a valid port,
  and is the HTTP-serving pod of its instance (pod index 0 when labelled);
  workers are addressed by pod IP, never by cluster DNS;
- the pod cache keys pods by namespace/name and keeps the newest object, so
  a relist after missed watch events converges to what the API server says.

Pure module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.bounds import require_positive
from pdcluster.runtime.router.workers import KVEventPorts, WorkerTarget, normalize_url
from pdcluster.runtime.spec import Role

ROLE_LABEL = "pdcluster.io/role"
PORT_ANNOTATION = "pdcluster.io/http-port"
# A worker's side port (our bootstrap server and admin API beside vLLM's HTTP).
SIDE_PORT_ANNOTATION = "pdcluster.io/bootstrap-port"
POD_INDEX_LABEL = "pdcluster.io/pod-index"
# A vLLM pod that publishes its prefix-cache events (cache_aware): its PUB and
# replay ports (`vllm/kv_events.py`), set by the operator.
KV_EVENTS_PORT_ANNOTATION = "pdcluster.io/kv-events-port"
KV_REPLAY_PORT_ANNOTATION = "pdcluster.io/kv-replay-port"


def parse_kv_events(text: str) -> tuple[str, KVEventPorts]:
    """`URL=PUB,REPLAY` (the router's `--kv-events`): where a static vLLM
    worker publishes its cache events; ValueError naming what is wrong."""
    url, sep, ports = text.rpartition("=")
    publish, comma, replay = ports.partition(",")
    if not sep or not comma or not publish.isdigit() or not replay.isdigit():
        raise ValueError(f"--kv-events {text!r}: expected URL=PUB_PORT,REPLAY_PORT")
    return normalize_url(url), KVEventPorts(int(publish), int(replay))


def static_targets(
    prefill: Sequence[str] = (),
    decode: Sequence[str] = (),
    colocated: Sequence[str] = (),
    kv_events: Mapping[str, KVEventPorts] | None = None,
    side_ports: Mapping[str, int] | None = None,
) -> list[WorkerTarget]:
    """Validate static worker lists; raise ValueError naming the problem.
    `kv_events`: worker URL → where that vLLM worker publishes its cache events;
    `side_ports`: vLLM with our connector, each worker's side port by URL."""
    if colocated and (prefill or decode):
        raise ValueError("list either colocated workers or prefill+decode workers, not both")
    if not colocated:
        if not prefill and not decode:
            raise ValueError("no workers: give prefill and decode URLs, or colocated URLs")
        if not prefill or not decode:
            missing = "prefill" if not prefill else "decode"
            raise ValueError(f"a disaggregated router needs at least one {missing} URL")
    targets: list[WorkerTarget] = []
    seen: dict[str, Role] = {}
    sides = {normalize_url(url): port for url, port in (side_ports or {}).items()}
    for role, urls in (
        (Role.prefill, prefill),
        (Role.decode, decode),
        (Role.colocated, colocated),
    ):
        for raw in urls:
            url = normalize_url(raw)
            if url in seen:
                raise ValueError(f"worker {url} is listed twice ({seen[url].value}, {role.value})")
            seen[url] = role
            targets.append(WorkerTarget(url=url, role=role, side_port=sides.get(url)))
    if kv_events:
        ports = {normalize_url(url): p for url, p in kv_events.items()}
        unknown = sorted(set(ports) - set(seen))
        if unknown:
            raise ValueError(f"kv events given for {', '.join(unknown)}, not a listed worker")
        targets = [dataclasses.replace(t, kv_events=ports.get(t.url)) for t in targets]
    return targets


@dataclass(frozen=True)
class KubernetesDiscoverySettings:
    """Where and how to find worker pods. Times in seconds."""

    namespace: str = "default"
    # Pods of one PDCluster, e.g. "pdcluster.io/cluster=demo".
    label_selector: str = ""
    role_label: str = ROLE_LABEL
    # Annotation (or label, same key) holding the worker's HTTP port.
    port_annotation: str = PORT_ANNOTATION
    # Used when a pod names no port.
    default_port: int | None = 8000
    pod_index_label: str = POD_INDEX_LABEL
    scheme: str = "http"
    # The watch is restarted with a fresh list this often, so missed events
    # cannot leave the pool wrong for longer than this.
    relist_interval_s: float = 30.0
    kubeconfig: str | None = None

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("kubernetes discovery needs a namespace")
        if self.default_port is not None and not 1 <= self.default_port <= 65535:
            raise ValueError(f"default_port must be in 1..65535, got {self.default_port}")
        if self.scheme not in ("http", "https"):
            raise ValueError(f"scheme must be http or https, got {self.scheme!r}")
        require_positive(self, "relist_interval_s")


# Pods of one compatibility revision pair with each other only (rollouts).
REVISION_LABEL = "pdcluster.io/revision"


@dataclass(frozen=True)
class PodDecision:
    name: str
    target: WorkerTarget | None
    # Why the pod is not a worker (empty when it is one).
    reason: str = ""


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _is_ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    for cond in conditions:
        if isinstance(cond, Mapping) and cond.get("type") == "Ready":
            return str(cond.get("status")) == "True"
    return False


def _parse_port(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        port = raw
    elif isinstance(raw, str) and raw.strip().isdigit():
        port = int(raw.strip())
    else:
        return None
    return port if 1 <= port <= 65535 else None


def decide_pod(pod: Mapping[str, Any], settings: KubernetesDiscoverySettings) -> PodDecision:
    """Map one pod (API JSON form, camelCase keys) to a worker target or a reason."""
    meta = _mapping(pod.get("metadata"))
    status = _mapping(pod.get("status"))
    name = str(meta.get("name", "?"))
    labels = _mapping(meta.get("labels"))
    annotations = _mapping(meta.get("annotations"))

    def skip(reason: str) -> PodDecision:
        return PodDecision(name=name, target=None, reason=reason)

    if meta.get("deletionTimestamp"):
        return skip("terminating")
    role_value = labels.get(settings.role_label)
    try:
        role = Role(str(role_value))
    except ValueError:
        return skip(f"label {settings.role_label}={role_value!r} is not a worker role")
    index = labels.get(settings.pod_index_label)
    if index is not None and str(index) != "0":
        return skip(f"pod index {index} does not serve HTTP")
    if status.get("phase") != "Running":
        return skip(f"phase {status.get('phase')!r}")
    if not _is_ready(status):
        return skip("not Ready")
    ip = status.get("podIP")
    if not isinstance(ip, str) or not ip:
        return skip("no pod IP")
    raw_port = annotations.get(settings.port_annotation, labels.get(settings.port_annotation))
    if raw_port is None:
        port = settings.default_port
        if port is None:
            return skip(f"no {settings.port_annotation} annotation and no default port")
    else:
        port = _parse_port(raw_port)
        if port is None:
            return skip(f"{settings.port_annotation}={raw_port!r} is not a port")
    host = f"[{ip}]" if ":" in ip else ip
    try:
        url = normalize_url(f"{settings.scheme}://{host}:{port}")
    except ValueError as err:
        return skip(str(err))
    revision = str(labels.get(REVISION_LABEL, ""))
    side = annotations.get(SIDE_PORT_ANNOTATION)
    side_port = None if side is None else _parse_port(side)
    target = WorkerTarget(
        url=url,
        role=role,
        revision=revision,
        kv_events=_kv_events(annotations),
        side_port=side_port,
    )
    return PodDecision(name=name, target=target)


def _kv_events(annotations: Mapping[str, Any]) -> KVEventPorts | None:
    """The pod's event ports; None when it publishes none (or names them wrong:
    it is then routed by load, not refused)."""
    publish = _parse_port(annotations.get(KV_EVENTS_PORT_ANNOTATION))
    replay = _parse_port(annotations.get(KV_REPLAY_PORT_ANNOTATION))
    if publish is None or replay is None or publish == replay:
        return None
    return KVEventPorts(publish, replay)


def targets_from_pods(
    pods: Iterable[Mapping[str, Any]], settings: KubernetesDiscoverySettings
) -> list[WorkerTarget]:
    """Workers for a set of pods; a URL claimed twice keeps its first pod."""
    by_url: dict[str, WorkerTarget] = {}
    for pod in pods:
        target = decide_pod(pod, settings).target
        if target is not None and target.url not in by_url:
            by_url[target.url] = target
    return list(by_url.values())


def _key(pod: Mapping[str, Any]) -> str:
    meta = _mapping(pod.get("metadata"))
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class PodCache:
    """Pods seen through list + watch; decides nothing beyond membership."""

    def __init__(self) -> None:
        self._pods: dict[str, Mapping[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def replace(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A fresh list: forget pods deleted while no watch was running."""
        self._pods = {_key(p): p for p in pods}

    def apply(self, event_type: str, pod: Mapping[str, Any]) -> bool:
        """Apply one watch event; return True when the cache changed."""
        key = _key(pod)
        if event_type in ("ADDED", "MODIFIED"):
            if self._pods.get(key) == pod:
                return False
            self._pods[key] = pod
            return True
        if event_type == "DELETED":
            return self._pods.pop(key, None) is not None
        # BOOKMARK and ERROR carry no pod change; ERROR makes the loop relist.
        return False

    def pods(self) -> list[Mapping[str, Any]]:
        return list(self._pods.values())
