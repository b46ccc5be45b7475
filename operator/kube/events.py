"""Kubernetes Events on the PDCluster, aggregated.

The same (type, reason, message) on the same object is one Event whose
`count` grows; the operator writes it at most once per `min_interval_s`
and otherwise only counts. So a reconcile that finds the same foreign
object every pass, or a runtime that reports a thousand transfer failures,
costs one Event and a few patches — never one Event per occurrence.

`EventAggregator` decides (pure: it only updates its own table); the
recorder in `controller.py` performs the writes it returns.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.operator.api import API_VERSION_FULL, KIND, format_time
from pdcluster.operator.names import MANAGED_BY, short_hash
from pdcluster.operator.reconcile.cluster import ClusterRef

MAX_MESSAGE = 1024


@dataclass(frozen=True)
class EventKey:
    object_uid: str
    type: str
    reason: str
    message: str


@dataclass
class _Entry:
    name: str
    count: int
    first: float
    last: float
    written_count: int = 0
    written_at: float | None = None


@dataclass(frozen=True)
class EventWrite:
    """Create the Event (`create`) or patch its count and last time."""

    name: str
    create: bool
    count: int
    first: float
    last: float


@dataclass
class EventAggregator:
    min_interval_s: float = 30.0
    # Entries untouched for this long are forgotten (their Event stays in the API).
    forget_after_s: float = 3600.0
    _entries: dict[EventKey, _Entry] = field(default_factory=dict)

    def record(
        self, key: EventKey, now: float, event_name: str, times: int = 1
    ) -> EventWrite | None:
        """`times` occurrences at `now` (e.g. 12 rooms failed since the last poll)."""
        if times < 1:
            raise ValueError(f"times must be >= 1, got {times}")
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(name=event_name, count=0, first=now, last=now)
            self._entries[key] = entry
        entry.count += times
        entry.last = now
        return self._due(entry, now)

    def _due(self, entry: _Entry, now: float) -> EventWrite | None:
        if entry.written_at is not None:
            if entry.count == entry.written_count or now - entry.written_at < self.min_interval_s:
                return None
        write = EventWrite(
            name=entry.name,
            create=entry.written_at is None,
            count=entry.count,
            first=entry.first,
            last=entry.last,
        )
        entry.written_count, entry.written_at = entry.count, now
        return write

    def flush(self, now: float) -> list[tuple[EventKey, EventWrite]]:
        """Writes for counts that piled up since the last write; forgets old entries."""
        out: list[tuple[EventKey, EventWrite]] = []
        for key, entry in list(self._entries.items()):
            write = self._due(entry, now)
            if write is not None:
                out.append((key, write))
            elif now - entry.last > self.forget_after_s:
                del self._entries[key]
        return out

    def forget_object(self, object_uid: str) -> None:
        for key in [k for k in self._entries if k.object_uid == object_uid]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


def event_name(ref: ClusterRef, key: EventKey) -> str:
    digest = short_hash(f"{key.object_uid}/{key.type}/{key.reason}/{key.message}", 12)
    return f"{ref.name}.{digest}"


def build_event(
    ref: ClusterRef, key: EventKey, write: EventWrite, component: str, host: str
) -> dict[str, Any]:
    """A core/v1 Event about the PDCluster."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": write.name, "namespace": ref.namespace},
        "involvedObject": {
            "apiVersion": API_VERSION_FULL,
            "kind": KIND,
            "name": ref.name,
            "namespace": ref.namespace,
            "uid": ref.uid,
        },
        "type": key.type,
        "reason": key.reason,
        "message": key.message[:MAX_MESSAGE],
        "count": write.count,
        "firstTimestamp": format_time(write.first),
        "lastTimestamp": format_time(write.last),
        "source": {"component": component, "host": host},
        "reportingComponent": MANAGED_BY,
        "reportingInstance": host,
    }


def count_patch(write: EventWrite) -> dict[str, Any]:
    return {"count": write.count, "lastTimestamp": format_time(write.last)}
