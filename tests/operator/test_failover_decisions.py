"""Failover decisions without I/O: pod facts, loss detection, peers, failure counts."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.operator.failover.admin_client import AdminResult
from pdcluster.operator.failover.failure_counts import FailureCounts, parse_failures
from pdcluster.operator.failover.fast_path import loss_message
from pdcluster.operator.failover.losses import Loss, LossCause, LossTracker
from pdcluster.operator.failover.peers import PodIndex
from pdcluster.operator.failover.pod_facts import parse_pod_facts, parse_time
from pdcluster.runtime.spec import Role

from .helpers import UID
from .podmaker import T0, deleting, facts, not_ready, terminated, worker_pod


# ---------------------------------------------------------------- pod facts
def test_prefill_pod_is_named_by_its_bootstrap_address_decode_by_its_host() -> None:
    prefill = facts(worker_pod(Role.prefill, 2, ip="127.0.3.4"))
    assert prefill.peer == "127.0.3.4:8998"
    assert prefill.http_url == "http://127.0.3.4:8000"
    assert (prefill.cluster, prefill.cluster_uid, prefill.instance) == ("demo", UID, 2)
    assert prefill.token_secret == "demo-token"
    assert prefill.ready and not prefill.has_ended
    decode = facts(worker_pod(Role.decode, ip="127.0.3.5"))
    assert decode.peer == "127.0.3.5" and decode.bootstrap_port is None
    assert facts(worker_pod(Role.decode, ip=None)).peer is None


def test_only_a_prefill_pod_with_an_ip_has_a_bootstrap_address() -> None:
    assert facts(worker_pod(Role.prefill, ip="127.0.3.4")).bootstrap_address == "127.0.3.4:8998"
    assert facts(worker_pod(Role.prefill, ip=None)).bootstrap_address is None
    assert facts(worker_pod(Role.decode, ip="127.0.3.5")).bootstrap_address is None


def test_terminated_and_deleting_pods_carry_when_it_happened() -> None:
    gone = facts(terminated(worker_pod(Role.prefill), finished="2026-01-01T00:01:00.5Z"))
    assert gone.has_ended and gone.terminated_at == parse_time("2026-01-01T00:01:00.5Z")
    assert not gone.ready
    # The deletion was asked for grace seconds before deletionTimestamp.
    deleted = facts(deleting(worker_pod(Role.decode), at="2026-01-01T00:02:30Z", grace=30))
    assert deleted.deleting
    assert deleted.deletion_requested_at == parse_time("2026-01-01T00:02:00Z")


def _without(raw: dict[str, Any], *path: str) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    node = out
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return out


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: _without(p, "metadata", "ownerReferences"),
        lambda p: _without(p, "metadata", "labels", "pdcluster.io/role"),
        lambda p: _without(p, "metadata", "labels", "pdcluster.io/instance"),
        lambda p: _without(p, "metadata", "uid"),
        lambda p: {**p, "metadata": {**p["metadata"], "ownerReferences": "junk"}},
        lambda p: {
            **p,
            "metadata": {
                **p["metadata"],
                "labels": {**p["metadata"]["labels"], "pdcluster.io/role": "router"},
            },
        },
    ],
    ids=["no-owner", "no-role", "no-instance", "no-uid", "bad-owner", "router"],
)
def test_pods_that_are_not_cluster_workers_are_ignored(mutate) -> None:
    assert parse_pod_facts(mutate(worker_pod(Role.prefill))) is None


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=20,
    )
)
def test_garbage_status_never_raises(junk) -> None:
    raw = worker_pod(Role.prefill)
    raw["status"] = junk
    pod = parse_pod_facts(raw)
    assert pod is not None and not pod.ready


# ---------------------------------------------------------------- loss tracker
GRACE = 5.0


def test_a_killed_pod_is_one_loss_however_many_events_repeat_it() -> None:
    tracker = LossTracker(GRACE)
    pod = worker_pod(Role.prefill)
    assert tracker.observe(facts(pod), 0.0).loss is None
    dead = terminated(pod)
    verdict = tracker.observe(facts(dead), 1.0)
    assert verdict.loss is not None and verdict.loss.cause == LossCause.failed
    assert verdict.loss.happened_at == parse_time("2026-01-01T00:01:00Z")
    # Then the operator deletes it, and the watch delivers DELETED: nothing new.
    assert tracker.observe(facts(deleting(dead)), 2.0).loss is None
    assert tracker.observe(facts(deleting(dead)), 3.0, gone=True).loss is None


def test_a_deleted_pod_is_lost_when_the_deletion_starts() -> None:
    tracker = LossTracker(GRACE)
    pod = worker_pod(Role.decode)
    tracker.observe(facts(pod), 0.0)
    loss = tracker.observe(facts(deleting(pod)), 1.0).loss
    assert loss is not None and loss.cause == LossCause.deleted and not loss.planned
    assert tracker.observe(facts(terminated(deleting(pod))), 2.0).loss is None


def test_a_deletion_the_operator_asked_for_is_planned_and_reported_once_drained() -> None:
    tracker = LossTracker(GRACE)
    pod = worker_pod(Role.prefill)
    tracker.observe(facts(pod), 0.0)
    tracker.expect_deletion("uid-prefill-0")
    # Still draining its in-flight requests: its peers' rooms must stay open.
    assert tracker.observe(facts(deleting(pod)), 1.0).loss is None
    assert tracker.observe(facts(not_ready(deleting(pod))), 2.0).loss is None
    loss = tracker.observe(facts(terminated(deleting(pod))), 3.0).loss
    assert loss is not None and loss.planned and loss.cause == LossCause.failed
    assert tracker.observe(facts(deleting(pod)), 4.0, gone=True).loss is None


def test_a_planned_deletion_is_reported_when_the_pod_is_gone() -> None:
    tracker = LossTracker(GRACE)
    pod = worker_pod(Role.decode)
    tracker.expect_deletion("uid-decode-0")
    assert tracker.observe(facts(deleting(pod)), 1.0).loss is None
    loss = tracker.observe(facts(deleting(pod)), 2.0, gone=True).loss
    assert loss is not None and loss.planned and loss.cause == LossCause.deleted


def test_not_ready_counts_only_after_the_grace_and_once_per_episode() -> None:
    tracker = LossTracker(GRACE)
    pod = worker_pod(Role.prefill)
    tracker.observe(facts(pod), 0.0)
    hung = facts(not_ready(pod))
    first = tracker.observe(hung, 10.0)
    assert first.loss is None and first.recheck_at == 10.0 + GRACE
    assert tracker.observe(hung, 14.9).loss is None
    loss = tracker.observe(hung, 15.0).loss
    assert loss is not None and loss.cause == LossCause.not_ready
    assert tracker.observe(hung, 30.0) == tracker.observe(hung, 31.0)
    assert tracker.observe(hung, 30.0).loss is None
    # Ready again, then hung again: a new episode, reported again.
    tracker.observe(facts(pod), 40.0)
    assert tracker.observe(hung, 41.0).loss is None
    assert tracker.observe(hung, 46.0).loss is not None
    # It finally exits: that is a loss of its own.
    assert tracker.observe(facts(terminated(pod)), 50.0).loss is not None


def test_a_pod_never_seen_ready_is_starting_not_lost() -> None:
    tracker = LossTracker(GRACE)
    starting = facts(worker_pod(Role.prefill, ready=False))
    assert tracker.observe(starting, 0.0) == tracker.observe(starting, 1000.0)
    assert tracker.observe(starting, 1000.0).loss is None


def test_tracker_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="not_ready_grace_s"):
        LossTracker(-1)
    with pytest.raises(ValueError, match="max_pods"):
        LossTracker(1, max_pods=0)


EVENTS = st.sampled_from(["ready", "not_ready", "failed", "deleting", "gone", "planned"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(EVENTS, st.floats(0, 20)), max_size=30))
def test_any_event_order_reports_the_terminal_loss_at_most_once(steps) -> None:
    tracker = LossTracker(GRACE)
    base = worker_pod(Role.prefill)
    now, terminal, ready_seen = 0.0, 0, False
    states = {
        "ready": base,
        "not_ready": not_ready(base),
        "failed": terminated(base),
        "deleting": deleting(base),
        "gone": deleting(base),
    }
    for kind, dt in steps:
        now += dt
        if kind == "planned":
            tracker.expect_deletion("uid-prefill-0")
            continue
        verdict = tracker.observe(facts(states[kind]), now, gone=kind == "gone")
        ready_seen |= kind == "ready"
        loss = verdict.loss
        if loss is None:
            continue
        if loss.cause == LossCause.not_ready:
            assert ready_seen and kind == "not_ready"
        else:
            terminal += 1
            assert kind in ("failed", "deleting", "gone")
            # A planned deletion is reported only once the pod has ended or is gone.
            assert not (loss.planned and kind == "deleting")
    assert terminal <= 1


# ---------------------------------------------------------------- peers
def test_prefill_loss_is_told_to_running_decodes_of_the_same_cluster_only() -> None:
    index = PodIndex()
    prefill = facts(worker_pod(Role.prefill, ip="127.0.0.1"))
    decodes = [facts(worker_pod(Role.decode, i, ip=f"127.0.1.{i}")) for i in range(3)]
    no_ip = facts(worker_pod(Role.decode, 3, ip=None))
    ended = facts(terminated(worker_pod(Role.decode, 4, ip="127.0.1.4")))
    other = worker_pod(Role.decode, 5, ip="127.0.1.5")
    other["metadata"]["ownerReferences"][0]["uid"] = "an-older-cluster-of-that-name"
    for pod in [prefill, *decodes, no_ip, ended, facts(other)]:
        index.update(pod)
    assert [p.name for p in index.peers_of(prefill)] == [p.name for p in decodes]
    # Decode lost: its prefill peers are told.
    assert index.peers_of(decodes[0]) == [prefill]
    index.update(decodes[1], gone=True)
    assert decodes[1] not in index.peers_of(prefill)
    index.forget_cluster(prefill.key)
    assert index.peers_of(prefill) == [] and index.clusters() == []


def test_colocated_workers_have_no_peers() -> None:
    index = PodIndex()
    pod = facts(worker_pod(Role.colocated, spec={"colocated": {}}))
    index.update(pod)
    assert index.peers_of(pod) == [] and index.reachable(pod.key) == []


# ---------------------------------------------------------------- failure counts
def test_failures_body_keeps_only_room_failure_counts() -> None:
    body = {
        "failures": {
            "room_failed:prefill_pod_lost": 3,
            "room_failed:": 4,
            "other": 5,
            "room_failed:neg": -1,
            "room_failed:text": "7",
            "room_failed:flag": True,
        }
    }
    assert parse_failures(body) == {"prefill_pod_lost": 3}
    for junk in (None, [], {"failures": []}, {"failures": None}, "x"):
        assert parse_failures(junk) == {}


def test_increases_are_reported_once_and_a_restarted_counter_counts_from_zero() -> None:
    counts = FailureCounts()
    assert counts.update("a", {"x": 2}) == {"x": 2}
    assert counts.update("a", {"x": 2}) == {}
    assert counts.update("a", {"x": 5, "y": 1}) == {"x": 3, "y": 1}
    assert counts.update("a", {"x": 1, "y": 1}) == {"x": 1}
    counts.baseline("b", {"x": 9})
    assert counts.update("b", {"x": 10}) == {"x": 1}
    counts.retain(["b"])
    assert not counts.knows("a") and counts.knows("b")


@given(st.lists(st.dictionaries(st.sampled_from("abc"), st.integers(0, 5)), max_size=20))
def test_reported_increases_add_up_to_the_final_counts(steps) -> None:
    counts = FailureCounts()
    running: dict[str, int] = {}
    total: dict[str, int] = {}
    for step in steps:
        snapshot = {k: running.get(k, 0) + v for k, v in step.items()}
        running.update(snapshot)
        for reason, n in counts.update("pod", running).items():
            total[reason] = total.get(reason, 0) + n
    assert total == {k: v for k, v in running.items() if v}


# ---------------------------------------------------------------- messages
def test_loss_message_is_stable_and_says_who_did_not_answer() -> None:
    pod = facts(worker_pod(Role.prefill))
    loss = Loss(pod, LossCause.failed, parse_time(T0))
    ok = AdminResult("http://127.0.1.1:8000", True, 200)
    bad = AdminResult("http://127.0.1.2:8000", False, 0, "ConnectError")
    text = loss_message(loss, [ok, bad], GRACE)
    assert "prefill instance 0 lost" in text and pod.name in text
    assert "1/2 decode workers" in text and "http://127.0.1.2:8000" in text
    assert loss_message(loss, [ok, bad], GRACE) == text
    assert "no decode worker held rooms" in loss_message(loss, [], GRACE)
    hung = Loss(pod, LossCause.not_ready, None)
    assert "not been Ready for 5s" in loss_message(hung, [ok], GRACE)
