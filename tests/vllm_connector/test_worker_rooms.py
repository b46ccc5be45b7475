"""A rank's room reports turned into vLLM's finished / failed sets: once each, never early."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd_worker.group import GroupReport
from pdcluster.runtime.spec import Role
from pdcluster.runtime.vllm_connector.worker_rooms import WorkerRooms


def rep(room: int, kind: str, reason: str | None = None) -> GroupReport:
    return GroupReport(room, 0, kind, reason)  # type: ignore[arg-type]


def test_a_decode_load_ends_when_every_source_sent_success():
    rooms = WorkerRooms(Role.decode)
    rooms.opened("v1", 7)
    rooms.pages(7)
    rooms.report(rep(7, "complete"))
    done = rooms.take_finished()
    assert done.recving == {"v1"} and not done.failed_recving
    rooms.report(rep(7, "released"))
    assert rooms.take_finished().recving == set() and len(rooms) == 0


def test_a_failed_load_is_reported_only_once_its_pages_may_be_reused():
    rooms = WorkerRooms(Role.decode)
    rooms.opened("v1", 7)
    rooms.pages(7)
    rooms.report(rep(7, "failed", "prefill_pod_lost"))
    assert rooms.take_finished().recving == set()  # a write may still land: wait
    assert rooms.take_news().failed == {7: "prefill_pod_lost"}
    rooms.report(rep(7, "released"))
    done = rooms.take_finished()
    assert done.recving == done.failed_recving == {"v1"}
    assert len(rooms) == 0


def test_a_room_that_failed_before_its_pages_fails_when_they_come():
    rooms = WorkerRooms(Role.decode)
    rooms.opened("v1", 7)
    rooms.report(rep(7, "failed", "bootstrap_unreachable: x"))
    rooms.report(rep(7, "released"))
    assert rooms.take_finished().recving == set()
    rooms.pages(7)  # allocated before the scheduler heard of the failure
    done = rooms.take_finished()
    assert done.recving == done.failed_recving == {"v1"}


def test_a_room_whose_request_ended_before_its_pages_is_never_reported():
    rooms = WorkerRooms(Role.decode)
    rooms.opened("v1", 7)
    rooms.report(rep(7, "failed", "aborted"))
    rooms.report(rep(7, "released"))
    rooms.vllm_finished({"v1"})
    assert rooms.take_finished().recving == set() and len(rooms) == 0


def test_a_refused_room_fails_its_load_at_once():
    rooms = WorkerRooms(Role.decode)
    rooms.refused("v1", 7, "rejected: unknown peer")
    done = rooms.take_finished()
    assert done.recving == done.failed_recving == {"v1"}
    assert rooms.take_news().failed == {7: "rejected: unknown peer"}


def test_prefill_blocks_are_freed_once_released_and_finished_by_vllm():
    rooms = WorkerRooms(Role.prefill)
    rooms.opened("v1", 7)
    rooms.report(rep(7, "start"))
    rooms.report(rep(7, "released"))
    assert rooms.take_finished().sending == set()  # vLLM has not finished it
    rooms.vllm_finished({"v1", "someone-else"})
    assert rooms.take_finished().sending == {"v1"}
    assert len(rooms) == 0


def test_a_prefill_room_refused_at_open_held_nothing():
    rooms = WorkerRooms(Role.prefill)
    rooms.opened("v1", 7)
    rooms.report(rep(7, "failed", "rejected: duplicate room"))
    rooms.vllm_finished({"v1"})
    assert rooms.take_finished().sending == {"v1"}


def test_news_carry_peer_verdicts_and_counters_only_when_they_change():
    rooms = WorkerRooms(Role.decode)
    rooms.peers_down({"p:1": "prefill_unreachable"})
    rooms.counters("decode-tp0", {"reject:bad_magic": 1})
    news = rooms.take_news()
    assert news.peers_down == {"p:1": "prefill_unreachable"}
    assert news.counts == {"decode-tp0": {"reject:bad_magic": 1}}
    rooms.peers_down({"p:1": "prefill_unreachable"})
    rooms.counters("decode-tp0", {"reject:bad_magic": 1})
    assert not rooms.take_news()


# ------------------------------------------------------------------ any order

DECODE_EVENTS = st.lists(
    st.sampled_from(["pages", "failed", "complete", "released", "vllm_finished"]), max_size=12
)


@given(DECODE_EVENTS)
def test_a_decode_request_vllm_waits_for_is_reported_exactly_once(events):
    """Whatever order the table's reports, vLLM's allocation and its end come in:
    a request with pages finishes loading once (failed iff it failed before
    completing, and only after its pages were released); one without pages never."""
    rooms = WorkerRooms(Role.decode)
    rooms.opened("v1", 7)
    recving: list[str] = []
    failed: list[str] = []
    state = dict.fromkeys(["pages", "failed", "complete", "released", "finished"], False)
    for event in events:
        if event == "pages":
            if state["pages"] or state["finished"] or recving:
                continue  # vLLM allocates once, and never after it was told or it ended
            state["pages"] = True
            rooms.pages(7)
        elif event == "vllm_finished":
            state["finished"] = True
            rooms.vllm_finished({"v1"})
        else:
            if state["released"] or (
                event != "released" and (state["failed"] or state["complete"])
            ):
                continue  # the room table's order: one conclusion, then released
            if event == "complete" and not state["pages"]:
                continue  # no KV arrives before decode sent its pages
            state[event] = True
            rooms.report(rep(7, event, "x" if event == "failed" else None))
        done = rooms.take_finished()
        recving += done.recving
        failed += done.failed_recving
        if done.failed_recving:
            assert state["released"]  # never before the pages may be reused
    assert len(recving) <= 1
    if recving:
        assert state["pages"]
        assert bool(failed) == state["failed"]
    elif state["pages"] and (state["complete"] or (state["failed"] and state["released"])):
        raise AssertionError("a concluded load with pages was never reported")


PREFILL_EVENTS = st.lists(
    st.sampled_from(["start", "failed", "released", "vllm_finished"]), max_size=10
)


@given(PREFILL_EVENTS)
def test_prefill_blocks_are_freed_exactly_once_and_never_while_held(events):
    rooms = WorkerRooms(Role.prefill)
    rooms.opened("v1", 7)
    started = released = finished = False
    sent = 0
    for event in events:
        if event == "vllm_finished":
            finished = True
            rooms.vllm_finished({"v1"})
        elif event == "start":
            if started or released:
                continue
            started = True
            rooms.report(rep(7, "start"))
        elif event == "failed":
            rooms.report(rep(7, "failed", "x"))
            if not started:
                released = True  # the table refused it at open: nothing held
        else:
            if not started:
                continue
            released = True
            rooms.report(rep(7, "released"))
        got = rooms.take_finished().sending
        if got:
            assert released and finished
        sent += len(got)
    assert sent <= 1
    assert sent == (1 if released and finished else 0)


def test_has_finished_says_whether_take_finished_has_anything():
    rooms = WorkerRooms(Role.decode)
    rooms.opened("v1", 7)
    rooms.pages(7)
    assert not rooms.has_finished
    rooms.report(rep(7, "complete"))
    assert rooms.has_finished
    rooms.take_finished()
    assert not rooms.has_finished
