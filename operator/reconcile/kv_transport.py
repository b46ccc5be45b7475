"""What KV transport each role negotiated, and when that deserves a Warning.

Every PD worker reports its transport in `/get_server_info` → `kv_transport`
(runtime `pd_worker/agent.py`): the backend and, for `nixl`, the UCX lanes
it built to its peers (`transfer/ucx_report.py`). The operator's poller
(`failover/fast_path.py`) reads them into a `TransportTable`; each reconcile
turns one role's reports into `status.<role>.kvTransport` with
`compute_kv_transport`, and into a `KVTransportFallback` Warning when the
manifest asks for RDMA or GPU-direct but UCX moves the KV over TCP.

Invariants (tested):
- the entry's transports and devices are the union over the role's pods
  that answered; `tcpFallback` is true when any of them reached its peers
  over lanes none of which is RDMA or GPU-direct (a pod with no lane yet —
  no peer reached — is no evidence either way);
- the manifest asks for RDMA when the backend is `nixl` and `ucx.requireRdma`
  is set or `ucx.tls` names an RDMA / GPU-direct transport (an exclusion
  list, `^…`, names none);
- no answer from any pod keeps the stored entry (only `rdmaRequested`
  follows the spec), so an operator restart or a restarting instance
  neither clears the status nor warns again;
- one Warning per episode: when the stored entry was not already a
  requested-but-missing RDMA; its message is stable, so repeats aggregate.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster.operator.api import KVTransportStatus
from pdcluster.runtime.spec import Role, TransferSpec
from pdcluster.runtime.transfer.ucx_report import (
    is_rdma_requested,
    is_tcp_fallback,
    rdma_request,
    transports_of,
)

# A worker's answer is bounded: more (or longer) entries than this is no report.
MAX_ENTRIES = 64
MAX_NAME_CHARS = 128


@dataclass(frozen=True)
class TransportReport:
    """One worker's `kv_transport`, as far as the operator uses it."""

    backend: str
    # lane kind (rma_am, am, ...) -> sorted `transport/device` entries.
    lanes: Mapping[str, tuple[str, ...]]

    @property
    def transports(self) -> list[str]:
        return transports_of({k: list(v) for k, v in self.lanes.items()})

    @property
    def devices(self) -> list[str]:
        return sorted({entry for entries in self.lanes.values() for entry in entries})

    @property
    def is_tcp_fallback(self) -> bool:
        return is_tcp_fallback({k: list(v) for k, v in self.lanes.items()})


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS


def parse_transport_report(server_info: Any) -> TransportReport | None:
    """The report in a `/get_server_info` answer; None for anything malformed."""
    if not isinstance(server_info, Mapping):
        return None
    raw = server_info.get("kv_transport")
    if not isinstance(raw, Mapping) or not _is_name(raw.get("backend")):
        return None
    raw_lanes = raw.get("ucx_lanes", {})
    if not isinstance(raw_lanes, Mapping) or len(raw_lanes) > MAX_ENTRIES:
        return None
    lanes: dict[str, tuple[str, ...]] = {}
    for kind, entries in raw_lanes.items():
        if not _is_name(kind) or not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
            return None
        if not all(_is_name(e) for e in entries):
            return None
        lanes[kind] = tuple(sorted(set(entries)))
    return TransportReport(backend=raw["backend"], lanes=lanes)


class TransportTable:
    """The last report of every PD worker pod, per cluster (only updates itself)."""

    def __init__(self) -> None:
        self._reports: dict[tuple[str, str], dict[str, tuple[Role, TransportReport]]] = {}

    def update(
        self, key: tuple[str, str], answers: Mapping[str, tuple[Role, TransportReport | None]]
    ) -> bool:
        """One poll of a cluster: pod uid -> (role, report or None when it did not answer).

        A pod that did not answer keeps its last report. Returns whether the
        table of the cluster changed."""
        table = self._reports.setdefault(key, {})
        before = dict(table)
        for uid, (role, report) in answers.items():
            if report is not None:
                table[uid] = (role, report)
        return table != before

    def retain(self, uids: set[str]) -> None:
        """Forget pods that are gone (and clusters left without any)."""
        for key in list(self._reports):
            table = {u: v for u, v in self._reports[key].items() if u in uids}
            if table:
                self._reports[key] = table
            else:
                del self._reports[key]

    def forget(self, key: tuple[str, str]) -> None:
        """The cluster is being deleted (a new one of the same name starts afresh)."""
        self._reports.pop(key, None)

    def reports(self, key: tuple[str, str]) -> dict[Role, list[TransportReport]]:
        """Role -> reports of its pods, in pod-uid order."""
        out: dict[Role, list[TransportReport]] = {}
        for _, (role, report) in sorted(self._reports.get(key, {}).items()):
            out.setdefault(role, []).append(report)
        return out


@dataclass(frozen=True)
class TransportVerdict:
    status: KVTransportStatus | None
    # The message of a KVTransportFallback Warning to emit, if any.
    warning: str | None = None


def fallback_message(role: Role, transfer: TransferSpec, status: KVTransportStatus) -> str:
    """Stable for one negotiated state, so repeats aggregate into one Event."""
    why = rdma_request(transfer.ucx)
    devices = ", ".join(status.ucx_devices) or "none"
    return (
        f"{role.value}: the manifest asks for RDMA or GPU-direct ({why}) but UCX negotiated "
        f"only {devices}: the KV moves over TCP; check spec.transfer.ucx (tls, netDevices) "
        "and the RDMA devices and drivers of the nodes"
    )


def compute_kv_transport(
    role: Role,
    transfer: TransferSpec,
    reports: Sequence[TransportReport],
    prev: KVTransportStatus | None,
) -> TransportVerdict:
    """`status.<role>.kvTransport` from the role's reports, and a Warning on a new fallback."""
    requested = is_rdma_requested(transfer)
    if not reports:
        if prev is None:
            return TransportVerdict(None)
        return TransportVerdict(prev.model_copy(update={"rdma_requested": requested}))
    status = KVTransportStatus(
        backend=",".join(sorted({r.backend for r in reports})),
        ucx_transports=sorted({t for r in reports for t in r.transports}),
        ucx_devices=sorted({d for r in reports for d in r.devices}),
        tcp_fallback=any(r.is_tcp_fallback for r in reports),
        rdma_requested=requested,
        reported=len(reports),
    )
    if not status.is_rdma_missing:
        return TransportVerdict(status)
    if prev is not None and prev.is_rdma_missing:
        return TransportVerdict(status)
    return TransportVerdict(status, fallback_message(role, transfer, status))
