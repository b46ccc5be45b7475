"""The scheduler half's room book: each vLLM hook becomes the step of our protocol it stands for."""

from __future__ import annotations

import pytest

from pdcluster.runtime.pd.known_peers import KnownPeers
from pdcluster.runtime.pd.prefix_reuse import build_reuse, reuse_keys
from pdcluster.runtime.pd.prompt_digest import prompt_id
from pdcluster.runtime.pd_worker.group import GroupFail, GroupFailPeer, GroupOpen, GroupPages
from pdcluster.runtime.spec import Role
from pdcluster.runtime.vllm_connector.commands import Chunk, RankNews, Refuse
from pdcluster.runtime.vllm_connector.params import RoomParams
from pdcluster.runtime.vllm_connector.scheduler_rooms import SchedulerRooms, parse_rank_verdicts

PS = 4
PROMPT = list(range(10, 21))  # 11 tokens: 3 pages
PEER = "10.0.0.7:8998"
LEG = RoomParams(room=42, bootstrap=PEER, rid="req-1")  # type: ignore[arg-type]


def decode_book() -> SchedulerRooms:
    return SchedulerRooms(Role.decode, PS, known=KnownPeers(frozenset({PEER})))  # type: ignore[arg-type]


def commands(book: SchedulerRooms) -> list[tuple[str | None, object]]:
    return list(book.take().commands)


# ------------------------------------------------------------------ prefill


def test_a_prefill_leg_opens_its_room_on_every_rank_with_the_prompts_reuse_keys():
    book = SchedulerRooms(Role.prefill, PS)
    book.open("v1", LEG, PROMPT, 0.0)
    assert commands(book) == [
        (
            "v1",
            GroupOpen(
                42,
                "req-1",
                11,
                prompt=prompt_id(PROMPT),
                rid_is_local=False,
                page_keys=reuse_keys(PROMPT, PS),
            ),
        )
    ]
    assert book.matched_tokens("v1", 0) == (0, False)  # prefill loads nothing


def test_a_leg_without_the_callers_rid_is_named_by_vllms_own_id():
    book = SchedulerRooms(Role.prefill, PS)
    book.open("v1", RoomParams(42, None), PROMPT, 0.0)
    ((_, cmd),) = commands(book)
    assert isinstance(cmd, GroupOpen) and cmd.rid == "v1" and cmd.rid_is_local


def test_each_computed_chunk_is_announced_once_up_to_the_prompts_end():
    book = SchedulerRooms(Role.prefill, PS)
    book.open("v1", LEG, PROMPT, 0.0)
    book.take()
    book.scheduled("v1", [7, 3], 8)
    book.scheduled("v1", [7, 3], 8)  # the same step's view again: nothing new
    book.scheduled("v1", [7, 3, 9, 5], 12)  # the last chunk (and the sampled token)
    assert commands(book) == [
        ("v1", Chunk(42, "req-1", (7, 3), 8)),
        ("v1", Chunk(42, "req-1", (7, 3, 9), 11)),
    ]
    book.scheduled("v1", [7, 3, 9, 5], 13)  # decoding past the prompt moves nothing
    assert commands(book) == []


def test_a_finished_prefill_keeps_its_blocks_until_every_rank_released_the_room():
    book = SchedulerRooms(Role.prefill, PS)
    book.open("v1", LEG, PROMPT, 0.0)
    book.take()
    assert book.finished("v1", aborted=False) is True
    assert commands(book) == []  # the transfer goes on
    book.on_output([], ["v1"], None, 1.0)
    assert "v1" not in book and len(book) == 0


def test_an_aborted_prefill_fails_its_room_and_still_waits_for_the_ranks():
    book = SchedulerRooms(Role.prefill, PS)
    book.open("v1", LEG, PROMPT, 0.0)
    book.take()
    assert book.finished("v1", aborted=True) is True
    assert commands(book) == [("v1", GroupFail(42, "aborted"))]
    assert "v1" in book


def test_a_preempted_prefill_stops_sending_from_blocks_vllm_took_back():
    book = SchedulerRooms(Role.prefill, PS)
    book.open("v1", LEG, PROMPT, 0.0)
    book.take()
    book.preempted(["v1", "not-ours"])
    step = book.take()
    assert step.preempted == frozenset({"v1"})
    ((req, cmd),) = step.commands
    assert req == "v1" and isinstance(cmd, GroupFail) and cmd.reason.startswith("preempted")
    book.scheduled("v1", [1, 2, 3], 11)  # recomputed later: the failed room sends nothing
    assert commands(book) == []


def test_a_prefill_leg_that_cannot_pair_is_served_alone_and_counted():
    book = SchedulerRooms(Role.prefill, PS)
    book.open("v1", None, PROMPT, 0.0, params_error="kv_transfer_params.rid: bad")
    book.open("v2", LEG, PROMPT, 0.0)
    book.open("v3", LEG, PROMPT, 0.0)  # the same room twice on one engine
    assert [req for req, _ in commands(book)] == ["v2"]
    assert book.refusals == {"bad_kv_transfer_params": 1, "room_conflict": 1}
    assert book.finished("v1", aborted=False) is False  # nothing held for it


def test_a_room_failed_on_one_rank_fails_on_every_rank_once():
    book = SchedulerRooms(Role.prefill, PS)
    book.open("v1", LEG, PROMPT, 0.0)
    book.take()
    news = RankNews({42: "transfer_failed: x"})
    book.on_output([], [], news, 1.0)
    book.on_output([], [], news, 1.1)  # a second rank reports it too
    assert commands(book) == [("v1", GroupFail(42, "transfer_failed: x"))]
    assert book.tally.counts() == {"room_failed:transfer_failed": 1}


# ------------------------------------------------------------------ decode


def test_a_decode_leg_loads_the_prompt_minus_vllms_cached_prefix_into_its_blocks():
    book = decode_book()
    book.open("v1", LEG, PROMPT, 0.0)
    ((_, opened),) = commands(book)
    assert opened == GroupOpen(42, "req-1", 11, PEER, None, prompt=prompt_id(PROMPT))
    assert book.matched_tokens("v1", 4) == (7, True)  # one cached page of 4
    book.allocated("v1", [9, 8, 7, 6], 7)  # vLLM may allocate a lookahead block
    assert commands(book) == [("v1", GroupPages(42, [9, 8, 7], build_reuse(PROMPT, 1, PS)))]
    assert book.matched_tokens("v1", 0) == (0, False)  # loading: never asked twice
    book.allocated("v1", [9, 8, 7, 6, 5], 0)  # the second call, after the load
    assert commands(book) == []


def test_a_loaded_request_preempted_later_computes_its_prompt_itself():
    book = decode_book()
    book.open("v1", LEG, PROMPT, 0.0)
    book.allocated("v1", [1, 2, 3], 11)
    book.take()
    book.on_output(["v1"], [], None, 1.0)
    assert book.matched_tokens("v1", 0) == (0, False)
    assert book.finished("v1", aborted=False) is False
    assert len(book) == 0


def test_a_decode_leg_aborted_before_its_blocks_fails_the_room_and_is_forgotten():
    book = decode_book()
    book.open("v1", LEG, PROMPT, 0.0)
    book.take()
    assert book.finished("v1", aborted=True) is False
    assert commands(book) == [("v1", GroupFail(42, "aborted"))]
    assert len(book) == 0


def test_a_decode_leg_aborted_while_loading_waits_for_the_ranks_to_let_go():
    book = decode_book()
    book.open("v1", LEG, PROMPT, 0.0)
    book.allocated("v1", [1, 2, 3], 11)
    book.take()
    assert book.finished("v1", aborted=True) is False  # vLLM itself delays the free
    assert commands(book) == [("v1", GroupFail(42, "aborted"))]
    assert "v1" in book
    book.on_output(["v1"], [], None, 1.0)
    assert len(book) == 0


def test_a_decode_room_that_cannot_open_fails_its_load_when_vllm_gives_it_blocks():
    book = decode_book()
    book.open("v1", RoomParams(1, "10.9.9.9:1"), PROMPT, 0.0)  # type: ignore[arg-type]
    book.open("v2", RoomParams(2, None), PROMPT, 0.0)
    book.open("v3", None, PROMPT, 0.0, params_error="kv_transfer_params.bootstrap_port: bad")
    assert commands(book) == []  # never opened on a rank: the token stays home
    for req in ("v1", "v2", "v3"):
        assert book.matched_tokens(req, 0) == (11, True)
        book.allocated(req, [1, 2, 3], 11)
    reasons = {req: cmd.reason for req, cmd in commands(book) if isinstance(cmd, Refuse)}
    assert reasons["v1"].startswith("rejected: bootstrap server 10.9.9.9:1 is not a known")
    assert reasons["v2"].startswith("bad_kv_transfer_params: bootstrap_host")
    assert reasons["v3"].startswith("bad_kv_transfer_params: kv_transfer_params.bootstrap_port")


def test_until_its_peers_are_published_a_decode_contacts_none():
    book = SchedulerRooms(Role.decode, PS)
    book.open("v1", LEG, PROMPT, 0.0)
    book.allocated("v1", [1, 2, 3], 11)
    ((_, refused),) = commands(book)
    assert isinstance(refused, Refuse) and "not been told its prefill peers" in refused.reason


def test_the_operators_report_reaches_every_rank_in_order():
    book = decode_book()
    book.open("v1", LEG, PROMPT, 0.0)
    book.fail_peer(GroupFailPeer(PEER, "prefill_pod_lost"))
    assert [type(cmd) for _, cmd in commands(book)] == [GroupOpen, GroupFailPeer]
    assert not book.has_commands


def test_peer_verdicts_and_rank_counters_are_kept_for_the_side_port():
    book = decode_book()
    book.on_output([], [], RankNews({}, {PEER: "prefill_unreachable"}, {"decode-tp0": {"x": 1}}), 0)
    book.on_output([], [], RankNews({}, None, {"decode-tp1": {"y": 2}}), 1.0)
    assert book.peers_down == {PEER: "prefill_unreachable"}
    assert book.rank_counts == {"decode-tp0": {"x": 1}, "decode-tp1": {"y": 2}}


def test_ranks_send_their_verdicts_between_steps_and_the_latest_of_each_stands():
    book = decode_book()
    book.on_output([], [], RankNews(peers_down={PEER: "prefill_pod_lost"}), 0.0)
    assert book.peers_down == {PEER: "prefill_pod_lost"}
    # An idle engine runs no step: the ranks send what changed themselves.
    book.rank_peers_down("decode-tp0", {})
    book.rank_peers_down("decode-tp1", {PEER: "prefill_pod_lost"})
    assert book.peers_down == {PEER: "prefill_pod_lost"}  # one rank still holds it
    book.rank_peers_down("decode-tp1", {})
    assert book.peers_down == {}


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"peers_down": {}},
        {"rank": "", "peers_down": {}},
        {"rank": "r", "peers_down": []},
        {"rank": "r", "peers_down": {"p": 1}},
        {"rank": "r", "peers_down": {"p": "x" * 300}},
    ],
)
def test_a_malformed_verdict_body_is_refused(body):
    with pytest.raises(ValueError):
        parse_rank_verdicts(body)
    assert parse_rank_verdicts({"rank": "r", "peers_down": {"p": "why"}}) == ("r", {"p": "why"})
