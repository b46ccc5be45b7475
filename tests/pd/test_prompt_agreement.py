"""Both legs of a room must hold the same prompt: prefill compares before any write.

The digest is defined once (`prompt_digest`); decode sends its `PromptId` in
`TransferMeta`, the prefill rank compares it with its own leg's whichever
arrives first, and a mismatch fails the room on both sides with a reason
naming both lengths, before a byte moves (the compute started with the leg is released).
"""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import (
    REJECT_VERSION,
    ProtocolError,
    TransferMeta,
    decode,
    encode,
)
from pdcluster.runtime.pd.prompt_digest import (
    PromptId,
    prompt_digest,
    prompt_id,
    prompt_mismatch,
    prompt_problem,
)
from pdcluster.runtime.pd.room_common import RoomLeg, RoomStateError

from .sim import Net, d_endpoint, p_endpoint, transfer_meta

D0 = RankCoord()
ROOM = 4242
RID = "rid-prompt-01"
PROMPT = [1, 17, 300, 5, 9, 2, 44, 8, 61, 3, 12, 7]  # 12 tokens
LONGER = [*PROMPT, 99]  # 13 tokens
SWAPPED = [17, 1, *PROMPT[2:]]  # 12 tokens, other ids

ids_strategy = st.lists(st.integers(0, (1 << 31) - 1), min_size=1, max_size=64)


# ------------------------------------------------------------------ the digest


def test_digest_is_blake2b_128_of_little_endian_int64() -> None:
    ids = [0, 1, 255, 256, (1 << 31) - 1]
    raw = b"".join(struct.pack("<q", i) for i in ids)
    assert prompt_digest(ids) == hashlib.blake2b(raw, digest_size=16).digest()


@given(ids_strategy, ids_strategy)
def test_digest_tells_prompts_apart(a: list[int], b: list[int]) -> None:
    assert (prompt_digest(a) == prompt_digest(b)) == (a == b)


def test_long_prompt_digest_matches_one_shot_hash() -> None:
    ids = list(range(40_000))  # longer than one packing chunk
    raw = struct.pack(f"<{len(ids)}q", *ids)
    assert prompt_digest(ids) == hashlib.blake2b(raw, digest_size=16).digest()


def test_empty_prompt_has_no_id() -> None:
    with pytest.raises(ValueError, match="empty"):
        prompt_id([])


def test_mismatch_reasons_name_both_lengths() -> None:
    assert prompt_mismatch(prompt_id(PROMPT), prompt_id(PROMPT)) is None
    assert (
        prompt_mismatch(prompt_id(PROMPT), prompt_id(LONGER))
        == "prompt_mismatch: prefill has 12 tokens, decode 13"
    )
    same_len = prompt_mismatch(prompt_id(PROMPT), prompt_id(SWAPPED))
    assert same_len == (
        "prompt_mismatch: prefill and decode both have 12 tokens but different token ids"
    )


def test_problem_waits_for_both_sides() -> None:
    ours = prompt_id(PROMPT)
    assert prompt_problem(None, [prompt_id(LONGER)]) is None
    assert prompt_problem(ours, [None]) is None
    assert prompt_problem(ours, [ours, prompt_id(LONGER)]) is not None


def test_transfer_meta_carries_the_prompt_on_the_wire() -> None:
    meta = transfer_meta(ROOM, RID, d_endpoint(D0), [1, 2], D0, prompt=prompt_id(PROMPT))
    back = decode(encode(meta))
    assert isinstance(back, TransferMeta) and back.prompt == prompt_id(PROMPT)


# ------------------------------------------------------------------ the table


def _failed_reasons(net: Net, endpoint: str) -> list[str]:
    return [a.reason for a in net.actions(endpoint, A.RoomFailed)]


def _assert_failed_before_any_write(net: Net, reason: str) -> None:
    for rank in net.prefill:
        ep = p_endpoint(rank)
        # The compute started with the leg is released; no KV ever leaves.
        assert net.actions(ep, A.StartCompute) == [A.StartCompute(ROOM, RID)]
        assert net.actions(ep, A.ReleaseSource) == [A.ReleaseSource(ROOM, RID)]
        assert net.actions(ep, A.SendHeldKV) == []
        assert _failed_reasons(net, ep) == [reason]
        assert not net.prefill[rank].can_send(ROOM)
    for rank in net.decode:
        # Decode's reason says which prefill rank failed the room, then why.
        (got,) = _failed_reasons(net, d_endpoint(rank))
        assert got.endswith(f"failed: {reason}")
        assert net.actions(d_endpoint(rank), A.TransferComplete) == []


@pytest.mark.parametrize(
    ("decode_prompt", "reason"),
    [
        (LONGER, "prompt_mismatch: prefill has 12 tokens, decode 13"),
        (
            SWAPPED,
            "prompt_mismatch: prefill and decode both have 12 tokens but different token ids",
        ),
    ],
)
@pytest.mark.parametrize("leg_first", [True, False], ids=["leg-first", "metadata-first"])
def test_mismatch_fails_the_room_on_both_sides_before_any_write(
    decode_prompt: list[int], reason: str, leg_first: bool
) -> None:
    net = Net()
    net.open_decode(ROOM, RID, 0.0, prompt_id(decode_prompt))
    if leg_first:
        net.open_prefill(ROOM, RID, len(PROMPT), 0.0, prompt_id(PROMPT))
    net.assign(ROOM, [3, 4, 5, 6], 0.1)
    net.pump(0.1)
    if not leg_first:
        assert net.prefill[D0].state(ROOM) is KVPoll.Bootstrapping  # nothing known to compare
        net.open_prefill(ROOM, RID, len(PROMPT), 0.2, prompt_id(PROMPT))
        net.pump(0.2)
    _assert_failed_before_any_write(net, reason)


@pytest.mark.parametrize("leg_first", [True, False], ids=["leg-first", "metadata-first"])
def test_equal_prompts_start_compute(leg_first: bool) -> None:
    net = Net()
    net.open_decode(ROOM, RID, 0.0, prompt_id(PROMPT))
    if leg_first:
        net.open_prefill(ROOM, RID, len(PROMPT), 0.0, prompt_id(PROMPT))
    net.assign(ROOM, [3, 4, 5], 0.1)
    net.pump(0.1)
    if not leg_first:
        net.open_prefill(ROOM, RID, len(PROMPT), 0.2, prompt_id(PROMPT))
    assert net.actions(p_endpoint(D0), A.StartCompute) == [A.StartCompute(ROOM, RID)]
    net.send_all(ROOM, 0.3)
    net.pump(0.3)
    assert len(net.actions(d_endpoint(D0), A.TransferComplete)) == 1
    assert _failed_reasons(net, d_endpoint(D0)) == []


def test_every_prefill_rank_of_a_tp_group_compares() -> None:
    net = Net(prefill_shape=InstanceShape(tp=2))
    net.open_decode(ROOM, RID, 0.0, prompt_id(LONGER))
    net.open_prefill(ROOM, RID, len(PROMPT), 0.0, prompt_id(PROMPT))
    net.assign(ROOM, [3, 4, 5, 6], 0.1)
    net.pump(0.1)
    _assert_failed_before_any_write(net, "prompt_mismatch: prefill has 12 tokens, decode 13")


def test_prefill_complete_fails_before_sending_the_held_kv() -> None:
    net = Net(policy="prefill_complete")
    net.open_decode(ROOM, RID, 0.0, prompt_id(SWAPPED))
    net.open_prefill(ROOM, RID, len(PROMPT), 0.0, prompt_id(PROMPT))
    net.pump(0.0)
    net.handle(p_endpoint(D0), net.prefill[D0].kv_computed(ROOM, 0.1))
    net.pump(0.1)
    net.assign(ROOM, [3, 4, 5], 0.2)
    net.pump(0.2)
    reason = "prompt_mismatch: prefill and decode both have 12 tokens but different token ids"
    assert net.actions(p_endpoint(D0), A.SendHeldKV) == []
    assert _failed_reasons(net, p_endpoint(D0)) == [reason]
    assert _failed_reasons(net, d_endpoint(D0)) == [f"prefill {D0} failed: {reason}"]


def test_open_refuses_a_prompt_id_of_another_length() -> None:
    net = Net()
    table = net.prefill[D0]
    with pytest.raises(RoomStateError):
        table.open_room(RoomLeg(ROOM, RID, 5, PromptId(num_tokens=6, digest=bytes(16))), 0.0)
    assert ROOM not in table


def test_a_version_1_frame_is_refused_not_read_without_its_prompt() -> None:
    # Version 1 had no PromptId: a peer speaking it is refused at the header,
    # never compared with nothing.
    meta = transfer_meta(ROOM, RID, d_endpoint(D0), [1], D0)
    frame = encode(meta)
    old = frame[:3] + bytes([1]) + frame[4:]
    with pytest.raises(ProtocolError) as err:
        decode(old)
    assert err.value.reason == REJECT_VERSION
