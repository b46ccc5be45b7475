"""Wire messages: round trips, and every kind of bad frame becomes ProtocolError."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.pd import messages as m
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll

ranks = st.builds(
    RankCoord,
    dp=st.integers(0, 63),
    cp=st.integers(0, 63),
    tp=st.integers(0, 63),
    pp=st.integers(0, 63),
)
rooms = st.integers(0, m.MAX_ROOM)
text = st.text(min_size=1, max_size=40)
compats = st.builds(
    CompatInfo,
    page_size=st.integers(1, 1024),
    kv_dtype=text,
    kv_layout=text,
    allocation_policy=text,
    model_fingerprint=text,
)


@st.composite
def nixl_regions_(draw: st.DrawFn) -> m.NixlRegion:
    base = draw(st.integers(1, 1 << 62))
    return m.NixlRegion(
        version=m.NIXL_REGION_VERSION,
        agent_name=draw(st.text(min_size=1, max_size=40)),
        agent_metadata=draw(st.binary(min_size=1, max_size=600)),
        mem_type=draw(st.sampled_from(["DRAM", "VRAM"])),
        device_id=draw(st.integers(0, 7)),
        base_address=base,
        nbytes=draw(st.integers(1, 1 << 47)),
    )


nixl_regions = nixl_regions_()


@st.composite
def layouts(draw: st.DrawFn) -> m.KVLayoutRegister:
    l0 = draw(st.integers(0, 100))
    h0 = draw(st.integers(0, 100))
    return m.KVLayoutRegister(
        token=draw(st.text(max_size=20)),
        decode_rank=draw(ranks),
        decode_endpoint=draw(text),
        compat=draw(compats),
        num_pages=draw(st.integers(1, 1 << 20)),
        layer_start=l0,
        layer_end=l0 + draw(st.integers(1, 50)),
        head_start=h0,
        head_end=h0 + draw(st.integers(1, 50)),
        shm_pool_path=draw(st.none() | text),
        nixl=draw(st.none() | nixl_regions),
    )


def decode_rank_message(
    kind: type, **fields: st.SearchStrategy[object]
) -> st.SearchStrategy[m.Message]:
    """A message a decode rank sends about a room: room, generation, rid and its own
    rank and endpoint, plus `fields`."""
    return st.builds(
        kind,
        room=rooms,
        generation=rooms,
        rid=text,
        decode_rank=ranks,
        decode_endpoint=text,
        **fields,
    )


messages = st.one_of(
    layouts(),
    st.builds(
        m.LayoutAck, rank=ranks, endpoint=text, accepted=st.booleans(), reason=st.none() | text
    ),
    decode_rank_message(
        m.TransferMeta,
        dst_pages=st.lists(st.integers(0, (1 << 31) - 1), min_size=1, max_size=50),
        num_destinations=st.integers(1, 64),
    ),
    decode_rank_message(m.Bootstrap, num_destinations=st.integers(1, 64)),
    decode_rank_message(m.Abort, reason=text),
    st.builds(m.Ready, room=rooms, generation=rooms, rank=ranks),
    st.builds(
        m.Status,
        room=rooms,
        generation=rooms,
        rank=ranks,
        state=st.sampled_from(list(KVPoll)),
        reason=st.none() | text,
        first_token=st.none() | st.integers(0, (1 << 31) - 1),
        checksum=st.none() | st.integers(0, m.MAX_ROOM),
        first_logprobs=st.none()
        | st.builds(
            m.FirstLogprobs,
            logprob=st.floats(max_value=0.0, allow_nan=False),
            top=st.lists(
                st.tuples(st.integers(0, (1 << 31) - 1), st.floats(max_value=0.0, allow_nan=False)),
                max_size=m.MAX_TOP_LOGPROBS,
            ).map(tuple),
        ),
    ),
    st.builds(m.AbortAck, room=rooms, rank=ranks, generation=rooms),
)


@given(messages)
def test_every_message_round_trips(msg: m.Message) -> None:
    frame = m.encode(msg)
    assert frame.startswith(m.HEADER) and m.is_control_frame(frame)
    assert m.decode(frame) == msg
    assert m.decode(memoryview(frame)) == msg


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    stats = m.ProtocolStats()
    try:
        m.decode(data, stats)
    except m.ProtocolError as err:
        assert stats.snapshot() == {err.reason: 1}


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_bodies_behind_a_valid_header_only_raise_protocol_error(body: bytes) -> None:
    try:
        m.decode(m.HEADER + body)
    except m.ProtocolError:
        pass


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(["type", "room", "rank", "state", "x"]), json_like))
def test_structured_garbage_only_raises_protocol_error(obj: dict) -> None:
    frame = m.HEADER + msgspec.msgpack.encode(obj)
    with pytest.raises(m.ProtocolError):
        m.decode(frame)


def _frame(obj: object) -> bytes:
    return m.HEADER + msgspec.msgpack.encode(obj)


GOOD_STATUS = {"type": "status", "room": 1, "generation": 2, "rank": {}, "state": 4}


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", m.REJECT_TRUNCATED),
        (m.HEADER, m.REJECT_TRUNCATED),
        (b"GET / HTTP/1.1\r\n", m.REJECT_BAD_MAGIC),
        (m.MAGIC + bytes([m.PROTOCOL_VERSION + 1]) + b"\x80", m.REJECT_VERSION),
        (m.HEADER + b"\xc1", m.REJECT_MALFORMED),
        (_frame({"type": "pickle"}), m.REJECT_UNKNOWN_TYPE),
        (_frame({"room": 1}), m.REJECT_UNKNOWN_TYPE),
        (_frame([1, 2, 3]), m.REJECT_INVALID_FIELD),
        (_frame({**GOOD_STATUS, "room": -1}), m.REJECT_INVALID_FIELD),
        (_frame({**GOOD_STATUS, "room": 1 << 63}), m.REJECT_INVALID_FIELD),
        (_frame({**GOOD_STATUS, "state": 9}), m.REJECT_INVALID_FIELD),
        (_frame({**GOOD_STATUS, "room": "1"}), m.REJECT_INVALID_FIELD),
        (_frame({**GOOD_STATUS, "extra": 1}), m.REJECT_INVALID_FIELD),
        (_frame({**GOOD_STATUS, "rank": {"tp": -1}}), m.REJECT_INVALID_FIELD),
        (b"PDC\x01" + b"\x00" * (m.MAX_FRAME_BYTES), m.REJECT_OVERSIZED),
    ],
)
def test_bad_frames_are_rejected_with_a_reason_and_counted(frame: bytes, reason: str) -> None:
    stats = m.ProtocolStats()
    with pytest.raises(m.ProtocolError) as err:
        m.decode(frame, stats)
    assert err.value.reason == reason
    assert stats.snapshot() == {reason: 1} and stats.total == 1


def test_layout_with_empty_ranges_is_invalid() -> None:
    good = {
        "type": "layout",
        "token": "t",
        "decode_rank": {},
        "decode_endpoint": "tcp://x:1",
        "compat": {
            "page_size": 16,
            "kv_dtype": "float32",
            "kv_layout": "NHD",
            "allocation_policy": "early",
            "model_fingerprint": "f",
        },
        "num_pages": 8,
        "layer_start": 0,
        "layer_end": 4,
        "head_start": 0,
        "head_end": 4,
    }
    assert isinstance(m.decode(_frame(good)), m.KVLayoutRegister)
    with pytest.raises(m.ProtocolError, match="empty layer range"):
        m.decode(_frame({**good, "layer_end": 0}))


def test_first_logprobs_are_bounded_and_optional() -> None:
    too_many = {"logprob": -1.0, "top": [[1, -1.0]] * (m.MAX_TOP_LOGPROBS + 1)}
    with pytest.raises(m.ProtocolError):
        m.decode(_frame({**GOOD_STATUS, "first_logprobs": too_many}))
    # A Status from a peer that sends none decodes as before.
    status = m.decode(_frame(GOOD_STATUS))
    assert isinstance(status, m.Status) and status.first_logprobs is None


def test_a_status_never_carries_payload_bytes() -> None:
    bad = {**GOOD_STATUS, "reason": b"\x00" * 10}
    with pytest.raises(m.ProtocolError):
        m.decode(_frame(bad))


def test_encode_refuses_frames_peers_would_reject() -> None:
    meta = m.TransferMeta(
        room=1,
        generation=1,
        rid="r",
        decode_rank=RankCoord(),
        decode_endpoint="tcp://x:1",
        dst_pages=[(1 << 31) - 1]
        * 250_000,  # beyond the page limit, so also beyond the frame limit
        num_destinations=1,
    )
    with pytest.raises(m.ProtocolError) as err:
        m.encode(meta)
    assert err.value.reason == m.REJECT_OVERSIZED


def test_the_largest_allowed_page_list_fits_in_a_frame() -> None:
    meta = m.TransferMeta(
        room=m.MAX_ROOM,
        generation=m.MAX_ROOM,
        rid="r" * 256,
        decode_rank=RankCoord(),
        decode_endpoint="e" * 256,
        dst_pages=[(1 << 31) - 1] * m.MAX_PAGES_PER_ROOM,
        num_destinations=1,
    )
    assert m.decode(m.encode(meta)) == meta


def _layout_with_nixl(**region: object) -> bytes:
    fields: dict[str, object] = {
        "version": m.NIXL_REGION_VERSION,
        "agent_name": "decode-0",
        "agent_metadata": b"nixlSerDes|Agent",
        "mem_type": "DRAM",
        "device_id": 0,
        "base_address": 4096,
        "nbytes": 1 << 20,
    }
    fields.update(region)
    return _frame(
        {
            "type": "layout",
            "token": "t",
            "decode_rank": {"dp": 0, "cp": 0, "tp": 0, "pp": 0},
            "decode_endpoint": "tcp://127.0.0.1:1",
            "compat": msgspec.to_builtins(CompatInfo(16, "float32", "NHD", "early", "f", "nixl")),
            "num_pages": 4,
            "layer_start": 0,
            "layer_end": 2,
            "head_start": 0,
            "head_end": 2,
            "nixl": fields,
        }
    )


def test_a_layout_carries_the_nixl_region_as_our_own_fields() -> None:
    msg = m.decode(_layout_with_nixl())
    assert isinstance(msg, m.KVLayoutRegister) and msg.nixl is not None
    assert msg.nixl.agent_metadata == b"nixlSerDes|Agent" and msg.nixl.nbytes == 1 << 20


@pytest.mark.parametrize(
    "region",
    [
        {"version": 2},  # a NIXL region this rank cannot read
        {"mem_type": "FILE"},
        {"base_address": 0},
        {"base_address": m.MAX_ROOM - 10, "nbytes": 100},  # ends past the address space
        {"agent_metadata": b""},
        {"agent_metadata": b"x" * (m.MAX_NIXL_METADATA_BYTES + 1)},
        {"pickle": b"\x80\x04."},  # unknown fields are refused, not ignored
    ],
)
def test_a_bad_nixl_region_is_a_protocol_error(region: dict) -> None:
    stats = m.ProtocolStats()
    with pytest.raises(m.ProtocolError):
        m.decode(_layout_with_nixl(**region), stats)
