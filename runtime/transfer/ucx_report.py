"""Which UCX transports NIXL actually selected, read from UCX's own log (pure).

With `UCX_LOG_LEVEL=info` UCX logs one line per endpoint configuration it
builds, naming the transport and device of each lane, e.g.

    ucp_worker.c:1997 UCX  INFO    <agent> intra-node cfg#1 rma_am(tcp/lo)  am(tcp/lo cma/memory)

`parse_ucx_lanes` turns those lines (the agent's own `self` loop-back
configuration excluded) into lane -> transports; `is_tcp_fallback` says
whether a cluster that asked for RDMA or GPU-direct got none of it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pdcluster.runtime.spec import TransferBackend, TransferSpec, UcxSpec

_CFG = re.compile(r"\scfg#\d+\s+(?P<lanes>.*)$")
_LANE = re.compile(r"(?P<lane>[a-z_]+)\((?P<tls>[^)]*)\)")

# UCX transports that move bytes by RDMA or GPU-direct (NVLink, CUDA IPC, GDRCopy).
RDMA_TRANSPORTS = frozenset(
    {
        "rc",
        "rc_verbs",
        "rc_mlx5",
        "dc",
        "dc_mlx5",
        "ud",
        "ud_verbs",
        "ud_mlx5",
        "cuda_ipc",
        "gdr_copy",
        "rocm_ipc",
        "srd",
    }
)


def parse_ucx_lanes(log_text: str) -> dict[str, list[str]]:
    """lane kind (rma_am, am, ...) -> sorted `transport/device` entries, over every peer config."""
    lanes: dict[str, set[str]] = {}
    for line in log_text.splitlines():
        match = _CFG.search(line)
        if match is None or " self cfg#" in line:
            continue
        for lane in _LANE.finditer(match.group("lanes")):
            entries = lane.group("tls").split()
            lanes.setdefault(lane.group("lane"), set()).update(entries)
    return {kind: sorted(entries) for kind, entries in sorted(lanes.items())}


def transports_of(lanes: Mapping[str, list[str]]) -> list[str]:
    """The transport names (no devices) the lanes use, sorted."""
    return sorted({entry.split("/", 1)[0] for entries in lanes.values() for entry in entries})


def is_tcp_fallback(lanes: Mapping[str, list[str]]) -> bool:
    """Peers were reached (some lanes) but no lane uses an RDMA or GPU-direct transport."""
    used = set(transports_of(lanes))
    return bool(used) and not (used & RDMA_TRANSPORTS)


# UCX_TLS aliases that stand for RDMA or GPU-direct transports (UCX's own names).
RDMA_TLS_ALIASES = frozenset({"rc_v", "rc_x", "dc_x", "ud_v", "ud_x", "ib", "cuda", "rocm"})


def rdma_request(ucx: UcxSpec) -> str | None:
    """Why the UCX settings ask for RDMA or GPU-direct (None: they do not)."""
    if ucx.require_rdma:
        return "requireRdma"
    tls = (ucx.tls or "").strip()
    if not tls or tls.startswith("^"):
        return None
    names = [t.split(":", 1)[0].strip() for t in tls.split(",")]
    named = [n for n in names if n in RDMA_TRANSPORTS or n in RDMA_TLS_ALIASES]
    return f"tls names {','.join(named)}" if named else None


def is_rdma_requested(transfer: TransferSpec) -> bool:
    """The manifest asks for RDMA or GPU-direct: nixl, and `rdma_request` names why."""
    return transfer.backend is TransferBackend.nixl and rdma_request(transfer.ucx) is not None
