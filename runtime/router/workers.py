"""The router's worker pool: who serves which role, and who is healthy.

Invariants:
- a worker is identified by its normalized base URL; one URL has one role;
- a worker added by discovery starts unhealthy and becomes a candidate only
  after a successful probe of ``/get_server_info`` (which also tells a
  prefill worker's bootstrap port and dp size) and ``/health``;
- ``failure_threshold`` consecutive failed probes (or one failed leg, which
  is a stronger signal) make a worker unhealthy; one successful probe brings
  it back;
- a worker held out (``hold_out``: its supervisor saw it die and restarts
  it) is not a candidate, whatever its probes say, until ``let_in``;
- a prefill that a live decode reports in its ``peers_down`` for a loss the
  operator reported (the decode refuses new rooms on it at once until its
  heartbeat sees it answer) is not a candidate while the report stands
  (``held_down_by``, ``record_peer_down``), whatever its own probes say: a
  request routed to it would fail at the decode. The decode's own heartbeat
  verdict (``prefill_unreachable``) does not keep it out: under it the
  decode holds a new room for one probe and serves it if the prefill answers;
- ``outstanding`` counts legs in flight and never goes negative; a worker
  removed by discovery while legs are in flight keeps its counter on the
  object those legs hold, so a late release cannot touch a newer worker
  that reuses the URL;
- ``add`` (a supervisor started an instance: local-mode autoscaling) puts a
  worker in the pool unhealthy, like discovery; ``remove`` takes one out only
  once no leg is in flight on it (the supervisor drained it first).

Pure module: the probes themselves live in `health.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pdcluster.runtime.spec import Role

# What each role reports as `disaggregation_mode` in /get_server_info.
_MODE_OF_ROLE = {
    Role.prefill: "prefill",
    Role.decode: "decode",
    Role.colocated: "null",
}


def normalize_url(url: str) -> str:
    """Return ``scheme://host:port`` or raise ValueError saying what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"worker URL must be a non-empty string, got {url!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"worker URL {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"worker URL {url!r} has no host")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"worker URL {url!r} has an invalid port") from None
    if port is None:
        raise ValueError(f"worker URL {url!r} must name a port")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"worker URL {url!r} must be a base URL without path or query")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


@dataclass(frozen=True)
class KVEventPorts:
    """Where a vLLM worker publishes its prefix-cache events, on its own host
    (`vllm/kv_events.py`): the PUB socket and the replay socket."""

    publish: int
    replay: int

    def __post_init__(self) -> None:
        for name in ("publish", "replay"):
            port = getattr(self, name)
            if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
                raise ValueError(f"kv events {name} port must be in 1..65535, got {port!r}")
        if self.publish == self.replay:
            raise ValueError(f"kv events publish and replay ports are both {self.publish}")


@dataclass(frozen=True)
class WorkerTarget:
    """A worker that discovery says should exist."""

    url: str
    role: Role
    # Compatibility revision (pod label); prefill and decode pair only when equal.
    revision: str = ""
    # A vLLM worker that publishes its prefix-cache events (cache_aware), or None.
    kv_events: KVEventPorts | None = None
    # vLLM with our connector: the side port (bootstrap server, admin API).
    side_port: int | None = None


@dataclass(frozen=True)
class ServerInfo:
    bootstrap_port: int | None
    dp_size: int


def parse_server_info(info: Any, role: Role) -> ServerInfo:
    """Check a worker's /get_server_info answer against the role it was given."""
    if not isinstance(info, Mapping):
        raise ValueError(f"server info must be a JSON object, got {type(info).__name__}")
    mode = str(info.get("disaggregation_mode", "null"))
    if mode != _MODE_OF_ROLE[role]:
        raise ValueError(
            f"worker reports disaggregation_mode={mode!r} but is listed as {role.value} "
            f"(expected {_MODE_OF_ROLE[role]!r})"
        )
    dp_size = info.get("dp_size", 1)
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
        raise ValueError(f"server info dp_size must be a positive integer, got {dp_size!r}")
    port = info.get("bootstrap_port")
    if role is Role.prefill:
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise ValueError(
                f"prefill worker must report a bootstrap_port in 1..65535, got {port!r}"
            )
    else:
        port = None
    return ServerInfo(bootstrap_port=port, dp_size=dp_size)


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    bootstrap_port: int | None = None
    dp_size: int = 1
    revision: str = ""
    # vLLM with our connector: where its room facts are (`WorkerTarget.side_port`).
    side_port: int | None = None
    healthy: bool = False
    outstanding: int = 0
    consecutive_failures: int = 0
    has_info: bool = False
    last_error: str = ""
    # Held out by its supervisor (local mode) until it is back: probes cannot readmit it.
    held: bool = False
    # Rotates the dp group chosen for this worker's rooms.
    next_dp_rank: int = field(default=0, repr=False)
    # vLLM: where it publishes its prefix-cache events (cache_aware), or None.
    kv_events: KVEventPorts | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def side_url(self) -> str | None:
        """vLLM with our connector: the base URL of its side port (None: none known)."""
        if self.side_port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.side_port}"

    def take_dp_rank(self) -> int:
        rank = self.next_dp_rank % self.dp_size
        self.next_dp_rank = rank + 1
        return rank

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role.value,
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "bootstrap_port": self.bootstrap_port,
            "dp_size": self.dp_size,
            "last_error": self.last_error,
            "held": self.held,
            "kv_events": None
            if self.kv_events is None
            else {"publish": self.kv_events.publish, "replay": self.kv_events.replay},
        }


@dataclass(frozen=True)
class PoolChange:
    added: tuple[Worker, ...] = ()
    removed: tuple[Worker, ...] = ()


class WorkerPool:
    def __init__(self, failure_threshold: int = 1) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self._workers: dict[str, Worker] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def of_role(self, role: Role) -> list[Worker]:
        return [w for w in self._workers.values() if w.role is role]

    def healthy(self, role: Role) -> list[Worker]:
        return [w for w in self._workers.values() if w.role is role and w.healthy]

    def has_unprobed(self) -> bool:
        """Whether a worker added by discovery still waits for its first probe.

        A new pod is Ready in Kubernetes before the router has probed it; in
        that moment (a rollout retiring the old pod at the same time) a
        request may wait briefly for it rather than be refused.
        """
        return any(
            not w.healthy and not w.has_info and w.consecutive_failures == 0
            for w in self._workers.values()
        )

    def sync(self, targets: Iterable[WorkerTarget]) -> PoolChange:
        """Make the pool hold exactly ``targets``; keep state of workers that stay."""
        wanted: dict[str, Role] = {}
        revisions: dict[str, str] = {}
        kv_events: dict[str, KVEventPorts | None] = {}
        side_ports: dict[str, int | None] = {}
        for target in targets:
            url = normalize_url(target.url)
            revisions[url] = target.revision
            kv_events[url] = target.kv_events
            side_ports[url] = target.side_port
            previous = wanted.get(url)
            if previous is not None and previous is not target.role:
                raise ValueError(
                    f"worker {url} is listed as both {previous.value} and {target.role.value}"
                )
            wanted[url] = target.role
        removed = [
            w for url, w in self._workers.items() if url not in wanted or wanted[url] is not w.role
        ]
        for worker in removed:
            del self._workers[worker.url]
        added = []
        for url, role in wanted.items():
            if url not in self._workers:
                worker = Worker(
                    url=url, role=role, revision=revisions[url], kv_events=kv_events[url]
                )
                self._workers[url] = worker
                added.append(worker)
            else:
                worker = self._workers[url]
                worker.revision = revisions[url]
                worker.kv_events = kv_events[url]
            worker.side_port = side_ports[url]
        return PoolChange(added=tuple(added), removed=tuple(removed))

    def record_probe_success(self, worker: Worker, info: ServerInfo | None) -> bool:
        """Apply a good probe; return True when the worker just became healthy."""
        if info is not None:
            self.apply_info(worker, info)
        worker.consecutive_failures = 0
        if not worker.has_info or worker.held:
            return False
        was_healthy = worker.healthy
        worker.healthy = True
        worker.last_error = ""
        return not was_healthy

    def record_probe_failure(self, worker: Worker, reason: str) -> bool:
        """Apply a failed probe; return True when the worker just became unhealthy."""
        worker.consecutive_failures += 1
        worker.last_error = reason
        if worker.healthy and worker.consecutive_failures >= self.failure_threshold:
            worker.healthy = False
            # A restarted worker may come back with a new bootstrap port.
            worker.has_info = False
            return True
        if not worker.healthy:
            worker.has_info = False
        return False

    @staticmethod
    def apply_info(worker: Worker, info: ServerInfo) -> None:
        worker.bootstrap_port = info.bootstrap_port
        worker.dp_size = info.dp_size
        worker.has_info = True
        worker.next_dp_rank %= info.dp_size

    @staticmethod
    def record_peer_down(worker: Worker, reason: str) -> bool:
        """A good probe of a prefill that a decode refuses rooms on now: not a
        candidate until a probe finds the report gone. Returns True when it was one."""
        worker.consecutive_failures = 0
        worker.last_error = reason
        was_healthy = worker.healthy
        worker.healthy = False
        return was_healthy

    def mark_unreachable(self, worker: Worker, reason: str) -> bool:
        """A leg could not reach the worker: drop it now, probes bring it back."""
        worker.last_error = reason
        worker.consecutive_failures = max(worker.consecutive_failures, self.failure_threshold)
        was_healthy = worker.healthy
        worker.healthy = False
        worker.has_info = False
        return was_healthy

    def hold_out(self, worker: Worker, reason: str) -> bool:
        """The worker is gone and being restarted: out of the pool until `let_in`.
        Returns True when it was a candidate."""
        worker.held = True
        return self.mark_unreachable(worker, reason)

    def add(self, url: str, role: Role, kv_events: KVEventPorts | None = None) -> Worker:
        """Add a worker by hand (it starts unhealthy: its first good probe admits it).
        Adding one that is there with the same role returns it; another role is an error."""
        url = normalize_url(url)
        worker = self._workers.get(url)
        if worker is not None:
            if worker.role is not role:
                raise ValueError(f"worker {url} is in the pool as {worker.role.value}")
            return worker
        worker = Worker(url=url, role=role, kv_events=kv_events)
        self._workers[url] = worker
        return worker

    def remove(self, worker: Worker) -> None:
        """Take a drained worker out; one with legs in flight stays (ValueError)."""
        if self._workers.get(worker.url) is not worker:
            raise ValueError(f"worker {worker.url} is not in the pool")
        if worker.outstanding:
            raise ValueError(
                f"worker {worker.url} still has {worker.outstanding} leg(s) in flight: "
                "hold it out and wait for them to end first"
            )
        del self._workers[worker.url]

    @staticmethod
    def let_in(worker: Worker) -> None:
        """It is back: the next good probe makes it a candidate again."""
        worker.held = False

    @staticmethod
    def acquire(worker: Worker) -> None:
        worker.outstanding += 1

    @staticmethod
    def release(worker: Worker) -> None:
        if worker.outstanding <= 0:
            raise RuntimeError(f"release without acquire on {worker.url}")
        worker.outstanding -= 1


# The decode heartbeat's own verdict: a new room waits for one probe instead of failing.
HEARTBEAT_VERDICT = "prefill_unreachable"


def bootstrap_address(worker: Worker) -> str | None:
    """How decodes name this prefill in ``peers_down``: ``host:bootstrap_port``."""
    if worker.role is not Role.prefill or worker.bootstrap_port is None:
        return None
    host = worker.host
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{worker.bootstrap_port}"


def parse_peers_down(info: Any) -> dict[str, str]:
    """A decode's ``/get_server_info`` ``peers_down`` (peer -> reason); {} when absent or malformed.

    A decode that reports nothing readable holds no verdict worth keeping a
    prefill out for (local mode's supervisor reads it the same way).
    """
    down = info.get("peers_down") if isinstance(info, Mapping) else None
    if not isinstance(down, Mapping):
        return {}
    return {str(p): str(r) for p, r in down.items() if isinstance(p, str)}


def held_down_by(worker: Worker, peers_down: Mapping[str, Mapping[str, str]]) -> str | None:
    """Why a decode refuses rooms on this prefill now, or None (see the invariants).

    ``peers_down``: decode URL -> that decode's ``peers_down``. A report names
    the prefill by its bootstrap address, or by its bare host (every
    instance on that host).
    """
    address = bootstrap_address(worker)
    if address is None:
        return None
    bare = address.rsplit(":", 1)[0]
    for decode_url in sorted(peers_down):
        for peer, reason in sorted(peers_down[decode_url].items()):
            if peer in (address, bare) and reason != HEARTBEAT_VERDICT:
                return f"decode {decode_url} holds it down ({reason})"
    return None
