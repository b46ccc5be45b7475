"""This rank's NIXL agent: the only module that calls NIXL's Python API.

Every rank registers its whole KV pool (one contiguous tensor: host memory
on CPU, VRAM on CUDA; the tensor's device decides) with its own agent, named
after the rank, its pid and a random suffix so a restarted rank is never
taken for the old one. `region()` is what a decode rank sends in its layout
registration (`messages.NixlRegion`, our own msgspec struct: nothing a peer
sends is unpickled); `add_peer` loads a peer's metadata from one.

The rest are thin typed calls the `nixl` transport builds on: descriptor
lists prepared once per registration (`prep_units`), WRITEs naming prepared
units (`page_unit_write`) or built from per-frame descriptors
(`descriptor_write`), posting (`post`), polling (`state_of`) and releasing
(`release`) their handles. What a WRITE means for a room (when a frame is
done, which notification waits for it) is the transport's (`nixl.py`,
`nixl_writes.py`); descriptors are planned by the pure `nixl_plan.py`.

A prefill agent only initiates WRITEs: it runs without NIXL's progress
thread, since the transport's own thread checking the handles is what moves
UCX forward on that side. A decode agent keeps it: over TCP, UCX emulates a
remote write with messages the target's worker must process. That thread
waits in poll() on the UCX workers' event descriptors, woken by any event or
after NIXL's `pthrDelay`; NIXL's Python API sets that delay to 0, which turns
the wait into a spin: an idle decode would burn a whole core for as long as
it lives (on a two-core box, half of what its engine computes with). The
agent is created with `PROGRESS_WAKE_US` instead (`_agent_config_with_wake`):
events still wake the thread at once, and with none it costs a poll per
wake-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import numpy as np

from pdcluster.runtime.engine.kv_pool import KVPool, KVPoolShape
from pdcluster.runtime.pd.messages import NIXL_REGION_VERSION, NixlRegion
from pdcluster.runtime.transfer.nixl_plan import RegionGeometry, has_page_units, page_units
from pdcluster.runtime.transfer.ucx_report import is_tcp_fallback, parse_ucx_lanes, transports_of

log = logging.getLogger(__name__)

# The longest NIXL's progress thread sleeps between two rounds when no UCX event wakes
# it (microseconds; NIXL rounds it up to whole milliseconds). 1 ms: an idle agent
# costs a few per cent of a core, and a missed wake-up (NIXL keeps the timeout for a
# UCX case where poll() does not wake) costs at most a millisecond.
PROGRESS_WAKE_US = 1000
# Guards the swap of NIXL's config class while an agent is being created.
_CONFIG_SWAP = threading.Lock()


def flush_ucx_log() -> None:
    """Flush UCX's log file (it is block-buffered): call the loaded libucs's ucs_log_flush."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((ln.split()[-1] for ln in maps if "/libucs" in ln), None)
        if path is not None:
            ctypes.CDLL(path).ucs_log_flush()
    except (OSError, AttributeError) as err:
        log.debug("nixl: cannot flush UCX's log: %s", err)


@contextlib.contextmanager
def _agent_config_with_wake(wake_us: int) -> Iterator[None]:
    """While an agent is created: NIXL's config carries `wake_us` as the progress
    thread's delay, whatever NIXL's Python API sets (it sets 0, a spin).

    The API builds its `nixlAgentConfig` inside `nixl_agent.__init__` and creates
    the agent from it in the next line, so the delay can only be kept by the
    config itself: a subclass that holds `pthrDelay` at `wake_us`, put in place
    of the bindings' class for that one call. Bindings that refuse the subclass
    leave NIXL's default, with a warning.
    """
    from nixl import _api

    bindings = _api.nixlBind
    base = bindings.nixlAgentConfig
    try:

        class _WakeConfig(base):  # type: ignore[misc, valid-type]
            def __setattr__(self, name: str, value: Any) -> None:
                super().__setattr__(name, wake_us if name == "pthrDelay" else value)

    except TypeError as err:
        log.warning("nixl: the progress thread keeps NIXL's delay (%s)", err)
        yield
        return
    with _CONFIG_SWAP:
        bindings.nixlAgentConfig = _WakeConfig
        try:
            yield
        finally:
            bindings.nixlAgentConfig = base


def geometry_of(shape: KVPoolShape) -> RegionGeometry:
    """How a pool of `shape` lies in its registered region (every field is the shape's)."""
    return RegionGeometry(**{f.name: getattr(shape, f.name) for f in fields(RegionGeometry)})


def _descs(offsets: np.ndarray, nbytes: np.ndarray, base: int, device_id: int) -> np.ndarray:
    """[n, 3] int64 (address, bytes, device) rows, NIXL's descriptor array."""
    return np.stack([offsets + base, nbytes, np.full(len(offsets), device_id, np.int64)], axis=1)


class NixlAgent:
    """This rank's NIXL agent with its KV pool registered (one per rank process)."""

    def __init__(self, owner: str, pool: KVPool, *, progress_thread: bool = True) -> None:
        """`progress_thread=False` for an agent that only initiates WRITEs (a prefill
        rank): its transport's polling progresses UCX; a WRITE target needs the thread."""
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        # Unique per process: a restarted rank must never be mistaken for the old agent.
        self.name = f"{owner}#{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The sender thread posts WRITEs while the progress thread polls them.
        config = nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        with _agent_config_with_wake(PROGRESS_WAKE_US):
            self.agent = nixl_agent(self.name, config)
        self.pool = pool
        buffer = pool.buffer
        if not buffer.is_contiguous():
            raise ValueError("a NIXL-registered KV pool must be one contiguous tensor")
        self.mem_type = "VRAM" if buffer.device.type == "cuda" else "DRAM"
        self.device_id = buffer.device.index or 0
        self.base_address = buffer.data_ptr()
        self.nbytes = buffer.numel() * buffer.element_size()
        self._reg = self.agent.register_memory(
            [(self.base_address, self.nbytes, self.device_id, "")], self.mem_type
        )

    def region(self) -> NixlRegion:
        return NixlRegion(
            version=NIXL_REGION_VERSION,
            agent_name=self.name,
            agent_metadata=self.agent.get_agent_metadata(),
            mem_type="VRAM" if self.mem_type == "VRAM" else "DRAM",
            device_id=self.device_id,
            base_address=self.base_address,
            nbytes=self.nbytes,
        )

    def report(self, require_rdma: bool = False) -> dict[str, Any]:
        """What was negotiated: the UCX lanes and transports of this process's peers."""
        from pdcluster.runtime.transfer.nixl_support import ucx_log_path

        path = ucx_log_path()
        text = ""
        if path is not None:
            flush_ucx_log()
            try:
                with open(path, errors="replace") as f:
                    text = f.read()
            except OSError:
                pass
        lanes = parse_ucx_lanes(text)
        fallback = is_tcp_fallback(lanes)
        return {
            "agent": self.name,
            "mem_type": self.mem_type,
            "ucx_tls": os.environ.get("UCX_TLS"),
            "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"),
            "ucx_lanes": lanes,
            "ucx_transports": transports_of(lanes),
            "tcp_fallback": fallback,
            # The manifest asked for RDMA / GPU-direct and got TCP: a silent slowdown.
            "rdma_missing": require_rdma and fallback,
        }

    # ---- peers -----------------------------------------------------------

    def add_peer(self, region: NixlRegion) -> str:
        """Load a peer's agent from its region; the name NIXL knows it by. ValueError
        if NIXL refuses the metadata or it names another agent than the region."""
        try:
            remote = self.agent.add_remote_agent(region.agent_metadata)
        except Exception as err:
            raise ValueError(f"NIXL refused the peer's agent metadata: {err}") from None
        if isinstance(remote, bytes):
            remote = remote.decode()
        if remote != region.agent_name:
            self.agent.remove_remote_agent(remote)
            raise ValueError(
                f"the peer's NIXL metadata names agent {remote!r}, "
                f"its registration {region.agent_name!r}"
            )
        return str(remote)

    def remove_peer(self, remote: str) -> None:
        self.agent.remove_remote_agent(remote)

    def prep_units(
        self, name: str, geo: RegionGeometry, base: int, device_id: int, mem_type: str
    ) -> Any:
        """A prepared descriptor list of every page unit of a pool at `base` (ours under
        `NIXL_INIT_AGENT`, a peer's under its agent name); None for a pool whose
        order has no page units (its frames move by descriptors)."""
        if not has_page_units(geo):
            return None
        units = page_units(geo)
        return self.agent.prep_xfer_dlist(
            name, _descs(units[:, 0], units[:, 1], base, device_id), mem_type
        )

    def release_units(self, units: Any) -> None:
        if units is not None:
            self.agent.release_dlist_handle(units)

    # ---- WRITEs ----------------------------------------------------------

    def page_unit_write(
        self, units: Any, local: np.ndarray, peer_units: Any, remote: np.ndarray
    ) -> Any:
        """A WRITE of our prepared units `local` into the peer's `remote` (int32 indices)."""
        return self.agent.make_prepped_xfer("WRITE", units, local, peer_units, remote)

    def descriptor_write(self, table: np.ndarray, region: NixlRegion, remote: str) -> Any:
        """A WRITE from per-frame descriptors ([n, 3] src offset, dst offset, bytes)."""
        nx = self.agent
        local = _descs(table[:, 0], table[:, 2], self.base_address, self.device_id)
        peer = _descs(table[:, 1], table[:, 2], region.base_address, region.device_id)
        return nx.initialize_xfer(
            "WRITE",
            nx.get_xfer_descs(local, self.mem_type),
            nx.get_xfer_descs(peer, region.mem_type),
            remote,
        )

    def post(self, handle: Any) -> tuple[str, str]:
        """Post a WRITE: its state (DONE, PROC or ERR) and, for ERR, why."""
        try:
            state = self.agent.transfer(handle)
        except Exception as err:
            return "ERR", str(err)
        return state, "the UCX backend refused the WRITE"

    def state_of(self, handle: Any) -> str:
        """DONE, PROC or ERR: NIXL's state of a posted WRITE."""
        state: str = self.agent.check_xfer_state(handle)
        return state

    def release(self, handle: Any) -> bool:
        """Release a WRITE's handle; False while NIXL still holds it in flight (an
        abort the backend has not confirmed yet)."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as err:
            log.debug("nixl: releasing a transfer handle failed (still in flight?): %s", err)
            return False
        return True

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as err:  # the process is ending: log, never raise
            log.warning("nixl: deregistering the KV pool failed: %s", err)
