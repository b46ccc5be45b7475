"""Losing one pod of a multi-pod prefill instance is "failing, not gone"
(operator/failover/gangs.py).

Pod 1 of a two-pod prefill instance exits while pod 0 (the leader, whose
ranks may still be writing into decode's pages) runs: decode must fail the
instance's rooms now and keep their pages until the survivors ack or are
gone. So the instance is reported `gone: false` until every pod of its gang
has ended or is gone, and pod 1's own ranks are reported gone by its own
address; every report names the incarnation it is about.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.operator.builders import build_worker_pod
from pdcluster.operator.failover.gangs import Report, compute_reports, is_gang_gone
from pdcluster.runtime.spec import Role

from .helpers import make_cluster
from .podmaker import deleting, facts, terminated, worker_pod
from .test_failover_gone import RecordingAdmin, make_failover

TWO_POD: dict[str, Any] = {
    "prefill": {"topology": {"tp": 2}, "gpusPerPod": 1},
    "decode": {},
}
LEADER_IP, FOLLOWER_IP = "127.0.0.10", "127.0.0.11"
INSTANCE = f"{LEADER_IP}:8998"


def leader(uid: str = "uid-leader", ip: str = LEADER_IP) -> dict[str, Any]:
    return worker_pod(Role.prefill, 0, uid=uid, ip=ip, spec=TWO_POD)


def follower(uid: str = "uid-follower", leader_ip: str = LEADER_IP) -> dict[str, Any]:
    pod = copy.deepcopy(build_worker_pod(make_cluster(TWO_POD), Role.prefill, 0, 1, leader_ip))
    base = worker_pod(Role.prefill, 0, uid=uid, ip=FOLLOWER_IP, spec=TWO_POD)
    pod["metadata"].update(uid=uid, creationTimestamp=base["metadata"]["creationTimestamp"])
    pod["status"] = base["status"]
    return pod


def calls(admin: RecordingAdmin) -> list[tuple[str, str | None, bool]]:
    return [
        (peer, incarnation, gone)
        for (peer, _, gone), incarnation in zip(admin.calls, admin.incarnations, strict=True)
    ]


async def started() -> tuple[RecordingAdmin, Any]:
    admin = RecordingAdmin()
    _, failover = make_failover(admin)
    await failover.on_pod_event("ADDED", worker_pod(Role.decode, ip="127.0.0.1", spec=TWO_POD))
    await failover.on_pod_event("ADDED", leader())
    await failover.on_pod_event("ADDED", follower())
    return admin, failover


def test_a_lost_follower_leaves_its_instance_failing_not_gone_until_the_leader_is() -> None:
    async def scenario() -> None:
        admin, failover = await started()
        # Pod 1 is killed (exit 137): its ranks cannot write, pod 0's still can.
        await failover.on_pod_event("MODIFIED", terminated(follower()))
        assert calls(admin) == [
            (INSTANCE, "uid-leader", False),
            (FOLLOWER_IP, "uid-follower", True),
        ]
        # The gang restart: the operator deletes pod 0; terminating, it may still write.
        failover.expect_deletion("uid-leader")
        await failover.on_pod_event("MODIFIED", deleting(leader()))
        await failover.on_pod_event("DELETED", deleting(terminated(follower())))
        assert len(admin.calls) == 2
        # Pod 0 is gone too: nothing of the gang can write any more.
        await failover.on_pod_event("DELETED", deleting(terminated(leader())))
        assert calls(admin)[2:] == [(INSTANCE, "uid-leader", True)]
        await failover.aclose()

    asyncio.run(scenario())


def test_a_lost_leader_with_a_running_follower_is_not_gone_either() -> None:
    async def scenario() -> None:
        admin, failover = await started()
        await failover.on_pod_event("MODIFIED", terminated(leader()))
        # No address of its own to report: the leader's IP is the instance's.
        assert calls(admin) == [(INSTANCE, "uid-leader", False)]
        failover.expect_deletion("uid-follower")
        await failover.on_pod_event("MODIFIED", terminated(follower()))
        assert calls(admin)[1:] == [
            (INSTANCE, "uid-leader", True),
            (FOLLOWER_IP, "uid-follower", True),
        ]
        await failover.aclose()

    asyncio.run(scenario())


def test_the_next_start_of_the_instance_is_another_gang() -> None:
    """The restarted gang may be pending (or even at the old leader's IP) while the
    old one's last pod ends: only the old gang's pods decide the old gang's fate."""

    async def scenario() -> None:
        admin, failover = await started()
        await failover.on_pod_event("MODIFIED", terminated(follower()))
        failover.expect_deletion("uid-leader")
        await failover.on_pod_event("MODIFIED", deleting(leader()))
        await failover.on_pod_event("DELETED", deleting(terminated(follower())))
        # The new gang: a new leader pod at the same IP, and its follower.
        await failover.on_pod_event("ADDED", leader(uid="uid-leader-2"))
        await failover.on_pod_event("ADDED", follower(uid="uid-follower-2"))
        await failover.on_pod_event("DELETED", deleting(terminated(leader())))
        assert calls(admin)[-1] == (INSTANCE, "uid-leader", True)
        await failover.aclose()

    asyncio.run(scenario())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["leader", "follower"]),
            st.sampled_from(["deleting", "terminated", "gone"]),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_the_instance_is_never_gone_while_a_pod_of_its_gang_may_run(
    steps: list[tuple[str, str]],
) -> None:
    async def scenario() -> None:
        admin, failover = await started()
        state = {"leader": set(), "follower": set()}  # what happened to each pod
        make = {"leader": leader, "follower": follower}
        for who, what in steps:
            if "gone" in state[who]:
                continue
            state[who].add(what)
            pod = make[who]()
            if "terminated" in state[who]:
                pod = terminated(pod)
            if state[who] & {"deleting", "gone"}:
                pod = deleting(pod)
            before = len(admin.calls)
            await failover.on_pod_event("DELETED" if what == "gone" else "MODIFIED", pod)

            def cannot_run(name: str) -> bool:
                return bool(state[name] & {"terminated", "gone"})

            for peer, incarnation, gone in calls(admin)[before:]:
                if peer == INSTANCE and gone:
                    assert cannot_run("leader") and cannot_run("follower"), (steps, admin.calls)
                if peer == FOLLOWER_IP:
                    assert incarnation == "uid-follower" and cannot_run("follower")
        if all(state[n] & {"terminated", "gone"} for n in state):
            told = [(p, g) for p, _, g in calls(admin) if p == INSTANCE]
            assert told and told[-1] == (INSTANCE, True), (steps, admin.calls)
        await failover.aclose()

    asyncio.run(scenario())


def test_what_each_lost_pod_is_reported_as() -> None:
    lead, other = facts(leader()), facts(follower())
    decode_pod = facts(worker_pod(Role.decode, 1, uid="uid-d", ip="127.0.0.21"))
    assert compute_reports(other, pod_gone=True, gang_id="uid-leader", gang_gone=False) == [
        Report(INSTANCE, "uid-leader", False),
        Report(FOLLOWER_IP, "uid-follower", True),
    ]
    # Terminating, it may still write: its own address waits too.
    assert compute_reports(other, pod_gone=False, gang_id="uid-leader", gang_gone=False) == [
        Report(INSTANCE, "uid-leader", False)
    ]
    assert compute_reports(lead, pod_gone=True, gang_id="uid-leader", gang_gone=True) == [
        Report(INSTANCE, "uid-leader", True)
    ]
    assert compute_reports(decode_pod, pod_gone=True, gang_id=None, gang_gone=True) == [
        Report("127.0.0.21", "uid-d", True)
    ]
    assert is_gang_gone([lead, other], other, lost_gone=True) is False
    assert is_gang_gone([facts(terminated(leader())), other], other, lost_gone=True) is True
    assert is_gang_gone([other], other, lost_gone=False) is False
