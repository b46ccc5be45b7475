"""Writes aggregated Events on PDClusters (see `events.py` for the policy)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from pdcluster.operator.kube.client import ApiError, KubeApi
from pdcluster.operator.kube.events import (
    EventAggregator,
    EventKey,
    EventWrite,
    build_event,
    count_patch,
    event_name,
)
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.names import MANAGED_BY
from pdcluster.operator.reconcile.cluster import ClusterRef

log = logging.getLogger(__name__)


class EventRecorder:
    def __init__(
        self,
        api: KubeApi,
        clock: Callable[[], float],
        min_interval_s: float = 30.0,
        host: str | None = None,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self._api = api
        self._metrics = metrics
        self._clock = clock
        self._aggregator = EventAggregator(min_interval_s=min_interval_s)
        self._refs: dict[str, ClusterRef] = {}
        self._host = host or socket.gethostname()

    async def record(
        self, ref: ClusterRef, type_: str, reason: str, message: str, times: int = 1
    ) -> None:
        key = EventKey(ref.uid, type_, reason, message)
        self._refs[ref.uid] = ref
        if self._metrics is not None:
            self._metrics.events.labels(type_, reason).inc(times)
        write = self._aggregator.record(key, self._clock(), event_name(ref, key), times)
        if write is not None:
            await self._write(ref, key, write)

    async def flush(self) -> None:
        """Write counts that piled up since the last write of each Event."""
        for key, write in self._aggregator.flush(self._clock()):
            ref = self._refs.get(key.object_uid)
            if ref is not None:
                await self._write(ref, key, write)

    def forget(self, uid: str) -> None:
        self._aggregator.forget_object(uid)
        self._refs.pop(uid, None)

    async def _write(self, ref: ClusterRef, key: EventKey, write: EventWrite) -> None:
        # An Event is a report, not state: failing to write one must never
        # fail the reconcile that produced it.
        try:
            if write.create:
                body = build_event(ref, key, write, MANAGED_BY, self._host)
                try:
                    await self._api.create(body)
                    return
                except ApiError as err:
                    if not err.is_conflict:
                        raise
                # Written by an earlier operator process: continue its count.
                existing = await self._api.get("Event", ref.namespace, write.name)
                prior = existing.get("count", 0) if existing else 0
                total = write.count + (prior if isinstance(prior, int) else 0)
                patch = {**count_patch(write), "count": total}
                await self._api.patch("Event", ref.namespace, write.name, patch)
            else:
                await self._api.patch("Event", ref.namespace, write.name, count_patch(write))
        except ApiError as err:
            log.warning(
                "could not write event %s on %s/%s: %s", key.reason, ref.namespace, ref.name, err
            )
