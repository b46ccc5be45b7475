"""Decode-side prefix reuse on the wire: decode names the leading pages it
already holds (count + key of the last), prefill checks them against its own
prompt before anything is computed or written, and writes only what follows.

Version 3 of the protocol carries this; a version-2 frame is refused at the
header, and a version-2 peer's published compatibility fields (no
`protocol_version`) fail the room at the handshake, naming both versions.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.compat import CompatError, CompatInfo, check_compat
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.messages import (
    PROTOCOL_VERSION,
    REJECT_INVALID_FIELD,
    REJECT_VERSION,
    ProtocolError,
    TransferMeta,
    decode,
    encode,
)
from pdcluster.runtime.pd.prefix_reuse import (
    ReusedPrefix,
    build_reuse,
    first_sent_token,
    num_reusable_pages,
    num_sent_tokens,
    reuse_keys,
    reuse_problem,
)
from pdcluster.runtime.pd.prompt_digest import prompt_id
from pdcluster.runtime.pd.room_common import RoomError, RoomLeg

from .sim import PAGE_SIZE, Net, d_endpoint, from_decode, p_endpoint

D0 = RankCoord()
ROOM = 5151
RID = "rid-reuse-01"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]  # 14 tokens: 3 full pages of 4 + 2
OTHER = [2, 7, 1, 8, *PROMPT[4:]]  # same length, another first page

tokens = st.lists(st.integers(0, 1000), min_size=0, max_size=40)


# ------------------------------------------------------------------ the rules


@pytest.mark.parametrize(
    ("hits", "num_tokens", "page_size", "expected"),
    [
        (0, 14, 4, 0),  # nothing cached
        (2, 14, 4, 2),  # some pages
        (3, 14, 4, 3),  # every full page: the partial last page still travels
        (3, 12, 4, 2),  # page-aligned prompt: the page of the last token travels
        (5, 12, 4, 2),  # more hits than the prompt has pages before its last token
        (1, 1, 4, 0),
        (0, 0, 4, 0),
        (4, 16, 1, 4),
        (16, 16, 1, 15),
    ],
)
def test_decode_reuses_at_most_the_pages_before_the_last_token(
    hits: int, num_tokens: int, page_size: int, expected: int
) -> None:
    assert num_reusable_pages(hits, num_tokens, page_size) == expected


@pytest.mark.parametrize(
    ("args", "name"),
    [((-1, 4, 4), "num_hit_pages"), ((1, -4, 4), "num_tokens"), ((1, 4, 0), "page_size")],
)
def test_bad_counts_are_refused_by_name(args: tuple[int, int, int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        num_reusable_pages(*args)
    with pytest.raises(ValueError, match="num_hit_pages"):
        num_reusable_pages(True, 4, 4)  # type: ignore[arg-type]


def test_reuse_names_the_last_held_page_by_its_chain_key() -> None:
    assert build_reuse(PROMPT, 0, PAGE_SIZE) is None
    reuse = build_reuse(PROMPT, 2, PAGE_SIZE)
    assert reuse == ReusedPrefix(num_pages=2, last_key=reuse_keys(PROMPT, PAGE_SIZE)[1])
    assert first_sent_token(reuse, PAGE_SIZE) == 8
    assert num_sent_tokens(len(PROMPT), reuse, PAGE_SIZE) == 6
    assert num_sent_tokens(len(PROMPT), None, PAGE_SIZE) == len(PROMPT)
    with pytest.raises(ValueError, match="last token must be sent"):
        build_reuse(PROMPT[:12], 3, PAGE_SIZE)


@given(tokens, tokens, st.integers(1, 5), st.integers(1, 4))
def test_keys_agree_exactly_when_the_prefixes_do(
    a: list[int], b: list[int], n: int, page_size: int
) -> None:
    ka, kb = reuse_keys(a, page_size), reuse_keys(b, page_size)
    if len(ka) >= n and len(kb) >= n:
        same = a[: n * page_size] == b[: n * page_size]
        assert (ka[n - 1] == kb[n - 1]) == same


def test_prefill_refuses_a_reuse_that_is_not_its_prompt() -> None:
    keys = reuse_keys(PROMPT, PAGE_SIZE)
    assert reuse_problem(keys, len(PROMPT), None, PAGE_SIZE) is None
    assert reuse_problem(keys, len(PROMPT), build_reuse(PROMPT, 3, PAGE_SIZE), PAGE_SIZE) is None
    wrong = build_reuse(OTHER, 2, PAGE_SIZE)
    assert "page 1 is not prefill's" in (reuse_problem(keys, len(PROMPT), wrong, PAGE_SIZE) or "")
    whole = ReusedPrefix(num_pages=3, last_key=keys[2])
    problem = reuse_problem(keys, 12, whole, PAGE_SIZE)
    assert problem is not None and problem.startswith("reuse_mismatch: decode reuses 3 pages")
    assert "knows 0 page keys" in (reuse_problem((), len(PROMPT), wrong, PAGE_SIZE) or "")


# ------------------------------------------------------------------ the wire


def _meta(pages: list[int], reuse: ReusedPrefix | None, rank: RankCoord = D0) -> TransferMeta:
    return from_decode(
        TransferMeta,
        ROOM,
        1,
        RID,
        d_endpoint(rank),
        rank,
        dst_pages=pages,
        num_destinations=1,
        prompt=prompt_id(PROMPT),
        reuse=reuse,
    )


def test_transfer_meta_carries_the_reuse_on_the_wire() -> None:
    reuse = build_reuse(PROMPT, 2, PAGE_SIZE)
    back = decode(encode(_meta([9, 4, 1, 2], reuse)))
    assert isinstance(back, TransferMeta) and back.reuse == reuse
    assert decode(encode(_meta([9, 4, 1, 2], None))) == _meta([9, 4, 1, 2], None)


def test_a_reuse_covering_every_page_is_refused_as_an_invalid_field() -> None:
    with pytest.raises(ValueError, match="none of the 2 destination pages"):
        _meta([1, 2], ReusedPrefix(num_pages=2, last_key=bytes(16)))
    good = encode(_meta([1, 2, 3], ReusedPrefix(num_pages=2, last_key=bytes(16))))
    forged = good.replace(bytes([0x93, 1, 2, 3]), bytes([0x92, 1, 2]))
    with pytest.raises(ProtocolError) as err:
        decode(forged)
    assert err.value.reason == REJECT_INVALID_FIELD


def test_a_version_2_frame_is_refused_not_read_without_its_reuse() -> None:
    # A version-2 prefill knows no `reuse` and would write decode's held pages.
    assert PROTOCOL_VERSION >= 3
    frame = encode(_meta([1, 2, 3, 4], None))
    with pytest.raises(ProtocolError) as err:
        decode(frame[:3] + bytes([2]) + frame[4:])
    assert err.value.reason == REJECT_VERSION


def test_a_version_2_peer_fails_the_handshake_naming_both_versions() -> None:
    fields = {
        "page_size": 16,
        "kv_dtype": "float32",
        "kv_layout": "NHD",
        "allocation_policy": "early",
        "model_fingerprint": "m",
    }
    # What a version-2 prefill publishes has no protocol_version field.
    old = msgspec.json.decode(msgspec.json.encode(fields), type=CompatInfo)
    ours = CompatInfo(**fields, protocol_version=PROTOCOL_VERSION)  # type: ignore[arg-type]
    want = f"protocol_version mismatch: prefill=2, decode={PROTOCOL_VERSION}"
    with pytest.raises(CompatError, match=want):
        check_compat(old, ours, ours_name="prefill", theirs_name="decode")


# ------------------------------------------------------------------ the tables


def _open_prefill(net: Net, prompt: list[int], keys: list[bytes] | None = None) -> None:
    keys = reuse_keys(prompt, PAGE_SIZE) if keys is None else keys
    for rank, table in net.prefill_group(ROOM).items():
        leg = RoomLeg(ROOM, RID, len(prompt), prompt_id(prompt), page_keys=tuple(keys))
        net.handle(p_endpoint(rank), table.open_room(leg, 0.0))


def _assign(net: Net, pages: list[int], reuse: ReusedPrefix | None) -> None:
    for rank, table in net.decode.items():
        net.handle(d_endpoint(rank), table.assign_pages(ROOM, pages, 0.1, reuse))


@pytest.mark.parametrize(
    "shape",
    [InstanceShape(), InstanceShape(tp=2)],
    ids=["decode-tp1", "decode-tp2"],
)
def test_every_decode_rank_tells_every_source_what_it_holds(shape: InstanceShape) -> None:
    net = Net(decode_shape=shape)
    net.open_decode(ROOM, RID, 0.0, prompt_id(PROMPT))
    _open_prefill(net, PROMPT)
    reuse = build_reuse(PROMPT, 3, PAGE_SIZE)
    _assign(net, [7, 3, 9, 12], reuse)
    net.pump(0.1)
    (table,) = net.prefill_group(ROOM).values()
    assert net.actions(p_endpoint(D0), A.StartCompute) == [A.StartCompute(ROOM, RID)]
    dests = table.destinations(ROOM)
    assert sorted(d.decode_rank for d in dests) == sorted(net.decode)
    for dest in dests:
        # The whole page table travels (offsets stay those of the prompt);
        # nothing before the reused prefix's end is to be written.
        assert dest.pages == (7, 3, 9, 12)
        assert dest.reuse == reuse
        assert first_sent_token(dest.reuse, PAGE_SIZE) == 12
    net.send_all(ROOM, 0.2)
    net.pump(0.2)
    for rank in net.decode:
        assert len(net.actions(d_endpoint(rank), A.TransferComplete)) == 1


@pytest.mark.parametrize("leg_first", [True, False], ids=["leg-first", "metadata-first"])
def test_a_reuse_of_another_prompt_fails_the_room_before_any_write(leg_first: bool) -> None:
    net = Net()
    net.open_decode(ROOM, RID, 0.0, prompt_id(PROMPT))
    if leg_first:
        _open_prefill(net, PROMPT)
    # Decode counted its pages over another prompt's first page.
    _assign(net, [1, 2, 3, 4], build_reuse(OTHER, 2, PAGE_SIZE))
    net.pump(0.1)
    if not leg_first:
        _open_prefill(net, PROMPT)
        net.pump(0.2)
    # The compute started with the leg is released; no KV ever leaves.
    assert net.actions(p_endpoint(D0), A.StartCompute) == [A.StartCompute(ROOM, RID)]
    assert net.actions(p_endpoint(D0), A.ReleaseSource) == [A.ReleaseSource(ROOM, RID)]
    assert net.actions(p_endpoint(D0), A.SendHeldKV) == []
    (failed,) = net.actions(p_endpoint(D0), A.RoomFailed)
    assert failed.reason == "reuse_mismatch: decode's key of page 1 is not prefill's"
    (got,) = net.actions(d_endpoint(D0), A.RoomFailed)
    assert got.reason.endswith("reuse_mismatch: decode's key of page 1 is not prefill's")


def test_decode_refuses_a_reuse_of_every_page_and_keeps_the_room_waiting() -> None:
    net = Net()
    net.open_decode(ROOM, RID, 0.0, prompt_id(PROMPT))
    table = net.decode[D0]
    with pytest.raises(RoomError, match="leaves nothing to receive"):
        table.assign_pages(ROOM, [1, 2], 0.1, ReusedPrefix(num_pages=2, last_key=bytes(16)))
    assert table.num_pages_held() == 0
    # The same room still takes a valid assignment afterwards.
    _assign(net, [1, 2, 3, 4], build_reuse(PROMPT, 1, PAGE_SIZE))
    assert table.num_pages_held() == 4


def test_a_leg_with_a_malformed_page_key_is_refused() -> None:
    with pytest.raises(RoomError, match="a page key is 16 bytes"):
        RoomLeg(ROOM, RID, 14, page_keys=(b"short",))
