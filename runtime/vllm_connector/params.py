"""A request's room, as our router hands it to a vLLM engine in `kv_transfer_params`.

vLLM carries one free-form dict per request from the API to the connector
(`kv_transfer_params`). Our router puts the same pairing fields there that
our own workers read from a request body, on both legs, sent at once:

    {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998,
     "bootstrap_room": 123456789, "rid": "req-…", "data_parallel_rank": 0}

`bootstrap_room` is the pairing key; `bootstrap_host`/`bootstrap_port` name
the prefill instance's side port (its bootstrap server, which a decode needs
and a prefill ignores); `rid` (optional) is the caller's request id, bound
to the room only when both legs carry it; `data_parallel_rank` (optional)
may only repeat `room % prefill dp`.

A request without `bootstrap_room` is not a PD leg (served locally, nothing
moves). Any other malformed field raises `RoomParamsError` naming it; the
connector then fails the request's room instead of guessing.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from pdcluster.runtime.pd.known_peers import PeerSetError, normalize_address
from pdcluster.runtime.pd.messages import MAX_ROOM
from pdcluster.runtime.pd.peer_address import BootstrapAddress

ROOM_KEY: Final = "bootstrap_room"
MAX_RID_CHARS: Final = 256
MAX_DP_RANK: Final = 1023


class RoomParamsError(ValueError):
    """`kv_transfer_params` name a room but a field is unusable; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"kv_transfer_params.{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class RoomParams:
    """One leg's room: the pairing key and where its prefill instance is."""

    room: int
    # The prefill instance's side port (decode reads it; None when not sent).
    bootstrap: BootstrapAddress | None
    # The caller's rid; None: the worker names the leg itself (never sent).
    rid: str | None = None
    prefill_dp: int | None = None


def parse_room_params(params: Mapping[str, Any] | None) -> RoomParams | None:
    """The room of a request's `kv_transfer_params`; None when it names none."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise RoomParamsError("*", f"must be an object, got {type(params).__name__}")
    if params.get(ROOM_KEY) is None:
        return None
    room = params[ROOM_KEY]
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise RoomParamsError(ROOM_KEY, f"must be an integer in [0, {MAX_ROOM}], got {room!r}")
    host, port = params.get("bootstrap_host"), params.get("bootstrap_port")
    bootstrap: BootstrapAddress | None = None
    if host is not None or port is not None:
        if host is None or port is None:
            missing = "bootstrap_host" if host is None else "bootstrap_port"
            raise RoomParamsError(missing, "is required with the other bootstrap field")
        try:
            bootstrap = normalize_address(host, port)
        except PeerSetError as err:
            field = "bootstrap_port" if "port" in str(err) else "bootstrap_host"
            raise RoomParamsError(field, str(err)) from None
    rid = params.get("rid")
    if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_CHARS):
        raise RoomParamsError("rid", f"must be a string of 1..{MAX_RID_CHARS} characters")
    dp = params.get("data_parallel_rank")
    if dp is not None and (
        isinstance(dp, bool) or not isinstance(dp, int) or not 0 <= dp <= MAX_DP_RANK
    ):
        raise RoomParamsError("data_parallel_rank", f"must be an integer in [0, {MAX_DP_RANK}]")
    return RoomParams(room, bootstrap, rid, dp)
