"""Waiting deadlines grow with the prompt (pure).

A fixed `waiting_s` that suits a short prompt fails a long one that is only
slow to compute and move: the budget is the timeout (a floor) plus a
per-token allowance, on decode (waiting for KV, and for Ready under
`prefill_complete`) and on prefill (its own transfer phase).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.room_common import RoomError, RoomLeg
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.spec import TransferSpec

from .sim import BOOTSTRAP, Net, d_endpoint

D0 = P0 = RankCoord()
ROOM = 55
RID = "rid-00000055"


@pytest.mark.parametrize(
    ("waiting_s", "per_token_s", "num_tokens", "want"),
    [
        (60.0, 0.001, 0, 60.0),
        (60.0, 0.001, 1, 60.001),
        (60.0, 0.001, 32_768, 92.768),
        (10.0, 0.0, 1_000_000, 10.0),
        (5.0, 0.5, 4, 7.0),
    ],
)
def test_budget_is_the_floor_plus_a_per_token_allowance(
    waiting_s: float, per_token_s: float, num_tokens: int, want: float
) -> None:
    s = RoomSettings(waiting_s=waiting_s, prefill_wait_s=waiting_s, waiting_per_token_s=per_token_s)
    assert s.waiting_budget_s(num_tokens) == pytest.approx(want)
    assert s.prefill_wait_budget_s(num_tokens) == pytest.approx(want)


@given(st.integers(0, 1 << 22), st.integers(0, 1 << 22))
def test_a_longer_prompt_never_gets_less_time(a: int, b: int) -> None:
    s = RoomSettings()
    short, long = sorted((a, b))
    assert s.waiting_s <= s.waiting_budget_s(short) <= s.waiting_budget_s(long)


def test_the_spec_setting_is_in_milliseconds_and_defaults_to_one() -> None:
    assert RoomSettings.from_spec(TransferSpec()).waiting_per_token_s == pytest.approx(0.001)
    spec = TransferSpec.model_validate({"waitingPerTokenMilliseconds": 2.5})
    assert RoomSettings.from_spec(spec).waiting_per_token_s == pytest.approx(0.0025)


@pytest.mark.parametrize("bad", [-0.001, 1.5, float("nan")])
def test_a_bad_per_token_budget_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="waiting_per_token_s"):
        RoomSettings(waiting_per_token_s=bad)


S = RoomSettings(bootstrap_s=5.0, waiting_s=10.0, prefill_wait_s=7.0, waiting_per_token_s=0.02)
TOKENS = 200  # 4 s on top of each floor (50 pages of 4 tokens)
PAGES = list(range(50))


def decode_room(net: Net, num_tokens: int) -> None:
    table = net.decode[D0]
    table.add_room(RoomLeg(ROOM, RID, num_tokens=num_tokens), BOOTSTRAP, 0.0)
    net.handle(d_endpoint(D0), table.resolve(ROOM, net.sources(D0, ROOM), 0.0))


def test_decode_waits_for_kv_as_long_as_its_prompt_needs() -> None:
    net = Net(settings=S)
    decode_room(net, TOKENS)
    table = net.decode[D0]
    table.assign_pages(ROOM, PAGES, 1.0)
    table.tick(1.0 + S.waiting_s + 0.01)  # past the floor: a long prompt still has time
    assert table.state(ROOM) is KVPoll.WaitingForInput
    table.tick(1.0 + S.waiting_budget_s(TOKENS) - 0.01)
    assert table.state(ROOM) is KVPoll.WaitingForInput
    table.tick(1.0 + S.waiting_budget_s(TOKENS) + 0.01)
    assert table.failure_reason(ROOM) == "waiting_timeout"


def test_decode_under_prefill_complete_waits_for_ready_by_the_prompt_too() -> None:
    net = Net(settings=S, policy="prefill_complete")
    decode_room(net, TOKENS)
    table = net.decode[D0]
    assert table.tick(S.prefill_wait_s + 0.01) == []
    assert table.state(ROOM) is KVPoll.Bootstrapping
    acts = table.tick(S.prefill_wait_budget_s(TOKENS) + 0.01)
    assert [a.reason for a in acts if isinstance(a, A.RoomFailed)] == ["prefill_wait_timeout"]


def test_prefill_bounds_its_transfer_phase_by_the_prompt() -> None:
    net = Net(settings=S)
    decode_room(net, TOKENS)
    net.handle(d_endpoint(D0), net.decode[D0].assign_pages(ROOM, PAGES, 0.0))
    net.open_prefill(ROOM, RID, TOKENS, 0.0)
    net.pump(0.0)
    prefill = net.prefill[P0]
    assert prefill.state(ROOM) is KVPoll.WaitingForInput
    prefill.tick(S.waiting_s + 0.01)
    assert prefill.state(ROOM) is KVPoll.WaitingForInput
    acts = prefill.tick(S.waiting_budget_s(TOKENS) + 0.01)
    assert [a.reason for a in acts if isinstance(a, A.RoomFailed)] == ["transfer_timeout"]


@pytest.mark.parametrize("bad", [-1, True, 2.5])
def test_a_bad_prompt_length_is_refused_and_adds_no_room(bad: object) -> None:
    table = Net(settings=S).decode[D0]
    with pytest.raises(RoomError, match="num_tokens"):
        table.add_room(RoomLeg(ROOM, RID, num_tokens=bad), BOOTSTRAP, 0.0)  # type: ignore[arg-type]
    assert ROOM not in table
