"""Ranks exchange their control endpoints at start-up as typed, fixed-size frames
(pd_worker/group.py): what a peer sends there is decoded by a schema, never
unpickled, and a frame that is not its sender's own well-formed one is refused."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd_worker.group import (
    ENDPOINT_FRAME_BYTES,
    GroupProtocolError,
    pack_endpoint,
    unpack_endpoints,
)


def test_endpoints_round_trip_in_rank_order() -> None:
    frames = [pack_endpoint(r, f"tcp://10.0.0.{r}:5{r}00") for r in range(3)]
    assert all(len(f) == ENDPOINT_FRAME_BYTES for f in frames)
    assert unpack_endpoints(frames) == [
        "tcp://10.0.0.0:5000",
        "tcp://10.0.0.1:5100",
        "tcp://10.0.0.2:5200",
    ]


class Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("unpickled!",))


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (pickle.dumps(Payload()).ljust(ENDPOINT_FRAME_BYTES, b"\0"), "rank 0"),  # a pickle
        (b"\xff\xff" + b"\0" * (ENDPOINT_FRAME_BYTES - 2), "malformed"),  # length past the frame
        (b"\x05\0" + b"junk!" + b"\0" * (ENDPOINT_FRAME_BYTES - 7), "rank 0"),
        (pack_endpoint(1, "tcp://10.0.0.1:1"), "rank 0 sent rank 1's frame"),
        (pack_endpoint(0, "tcp://10.0.0.1:1")[:-1], "malformed"),  # short
    ],
)
def test_a_frame_that_is_not_its_senders_endpoint_is_refused(frame: bytes, why: str) -> None:
    with pytest.raises(GroupProtocolError, match=why):
        unpack_endpoints([frame])


@pytest.mark.parametrize("endpoint", ["", "10.0.0.1:5", "http://x:1", "tcp://" + "a" * 300])
def test_only_a_tcp_endpoint_that_fits_is_packed(endpoint: str) -> None:
    with pytest.raises(GroupProtocolError, match="bad_endpoint"):
        pack_endpoint(0, endpoint)


@given(st.lists(st.from_regex(r"tcp://[a-z0-9.]{1,40}:[0-9]{1,5}", fullmatch=True), max_size=8))
def test_any_set_of_endpoints_round_trips(endpoints: list[str]) -> None:
    frames = [pack_endpoint(r, e) for r, e in enumerate(endpoints)]
    assert unpack_endpoints(frames) == endpoints
