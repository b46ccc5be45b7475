"""plan_reconcile: from what exists to what the spec wants, one pure pass at a time."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.operator.reconcile.actions import Apply, Create, CreateTokenSecret, Delete, Emit
from pdcluster.operator.reconcile.instances import Health, group_instances
from pdcluster.operator.reconcile.plan import manifest_hash, stamp
from pdcluster.operator.reconcile.restarts import backoff_delay
from pdcluster.runtime.spec import Role, RolloutSpec

from .helpers import PD, Sim, observe_store

GANG = {
    "prefill": {"replicas": 2, "topology": {"tp": 2}, "gpusPerPod": 1},
    "decode": {"replicas": 1},
}


def converge(sim: Sim, passes: int = 10) -> None:
    """Run passes, making pods Ready in between, until a pass writes nothing."""
    for _ in range(passes):
        sim.step()
        sim.store.make_all_ready()  # may let a pass create more (pods after a leader's IP)
        if not sim.plan().writes:
            return
    raise AssertionError("did not converge")


def has_started(pod: dict[str, Any]) -> bool:
    return any(c.get("started") for c in pod.get("status", {}).get("containerStatuses", []))


def reasons(events: list[Emit]) -> list[str]:
    return [e.reason.value for e in events]


def test_first_pass_creates_every_child_then_nothing_more() -> None:
    sim = Sim(GANG)
    plan, events = sim.step()
    store = sim.store
    assert isinstance(plan.actions[0], CreateTokenSecret)
    assert store.names("Secret") == ["demo-token"]
    assert store.names("ConfigMap") == ["demo-config"]
    assert store.names("Deployment") == ["demo-router"]
    assert {"demo-router"} <= set(store.names("Service"))
    # A multi-pod instance starts with its leader: the others need its IP.
    prefill = store.pods(role="prefill")
    assert [p["metadata"]["labels"]["pdcluster.io/pod-index"] for p in prefill] == ["0", "0"]
    assert len(store.pods(role="decode")) == 1
    assert reasons(events).count("InstanceCreated") == 3
    # Nothing changed in between: the next pass plans no write and no event.
    again = sim.plan()
    assert again.actions == ()


def test_pods_after_the_leader_are_created_with_its_ip_once_it_has_one() -> None:
    sim = Sim(GANG)
    sim.step()
    (leader,) = sim.store.pods(role="prefill", instance="0")
    sim.store.set_pod(leader["metadata"]["name"], "Pending", False)  # scheduled, no IP yet
    assert [a for a in sim.plan().writes if a.key.kind == "Pod"] == []
    sim.store.set_pod(leader["metadata"]["name"], "Running", False)
    ip = sim.store.get_obj("Pod", leader["metadata"]["name"])["status"]["podIP"]
    plan, events = sim.step()
    (follower,) = [a.manifest for a in plan.writes if isinstance(a, Create)]
    assert follower["metadata"]["labels"]["pdcluster.io/pod-index"] == "1"
    assert follower["metadata"]["annotations"]["pdcluster.io/leader-address"] == ip
    env = {e["name"]: e.get("value") for e in follower["spec"]["containers"][0]["env"]}
    assert env["PDCLUSTER_LEADER_ADDRESS"] == ip
    assert events == []


def test_a_new_leader_ip_restarts_the_pods_started_for_the_old_one() -> None:
    sim = Sim(GANG)
    converge(sim)
    leader, follower = sim.store.pods(role="prefill", instance="0")
    leader["status"]["podIP"] = "10.9.9.9"  # e.g. its sandbox was recreated
    sim.store.objects[("Pod", leader["metadata"]["name"])] = leader
    plan, events = sim.step()
    deleted = sorted(a.key.name for a in plan.writes if isinstance(a, Delete))
    assert deleted == sorted([leader["metadata"]["name"], follower["metadata"]["name"]])
    assert reasons(events) == ["InstanceRestarted"]


def test_ready_cluster_plans_nothing_and_reports_every_slot_ready() -> None:
    sim = Sim(GANG)
    converge(sim)
    plan = sim.plan()
    assert plan.actions == ()
    assert {(r.role, r.ready, r.updated, r.desired) for r in plan.roles} == {
        (Role.prefill, 2, 2, 2),
        (Role.decode, 1, 1, 1),
    }
    assert plan.router_ready == plan.router_desired == 1


@pytest.mark.parametrize(
    "kind,name",
    [
        ("ConfigMap", "demo-config"),
        ("Service", "demo-router"),
        ("Deployment", "demo-router"),
        ("Role", "demo-runtime"),
    ],
)
def test_deleted_cluster_child_comes_back(kind: str, name: str) -> None:
    sim = Sim(PD)
    converge(sim)
    sim.store.remove(kind, name)
    plan, _ = sim.step()
    # Created, not applied: a create cannot take over an object that appeared meanwhile.
    assert [(type(a), a.key.kind, a.key.name) for a in plan.writes] == [(Create, kind, name)]
    assert sim.store.get_obj(kind, name) is not None


def test_edited_child_is_reapplied_but_an_equal_one_is_not() -> None:
    sim = Sim(PD)
    converge(sim)
    cm = sim.store.objects[("ConfigMap", "demo-config")]
    cm["data"]["manifest.yaml"] = "tampered"  # hash annotation still says "as applied"
    assert sim.plan().writes == ()
    cm["metadata"]["annotations"]["pdcluster.io/applied-hash"] = "something-else"
    (write,) = sim.plan().writes
    assert isinstance(write, Apply) and write.key.name == "demo-config"
    assert write.uid == cm["metadata"]["uid"]  # applied only onto the object we saw


def test_deleted_single_pod_instance_is_recreated_at_once_without_counting_a_restart() -> None:
    sim = Sim(PD)
    converge(sim)
    (pod,) = sim.store.pods(role="decode")
    sim.store.remove("Pod", pod["metadata"]["name"])
    plan, events = sim.step()
    assert [a.key.name for a in plan.writes if isinstance(a, Create)] == [pod["metadata"]["name"]]
    assert plan.report(Role.decode).ledger.total == 0
    assert reasons(events) == ["InstanceCreated"]


def test_failed_rank_restarts_the_whole_gang_after_backoff() -> None:
    sim = Sim(GANG)
    converge(sim)
    victim = sim.store.pods(role="prefill", instance="1")[1]["metadata"]["name"]
    sim.store.set_pod(victim, "Failed", False)
    gang = [p["metadata"]["name"] for p in sim.store.pods(role="prefill", instance="1")]
    plan, events = sim.step()
    deleted = sorted(a.key.name for a in plan.writes if isinstance(a, Delete))
    assert deleted == sorted(gang) and victim in deleted
    assert sim.store.pods(role="prefill", instance="1") == []
    assert sim.store.pods(role="prefill", instance="0") != []  # the other instance is untouched
    assert reasons(events) == ["InstanceRestarted"]
    assert plan.report(Role.prefill).ledger.total == 1
    # First restart: backoffSeconds (1 s) before the gang comes back.
    assert plan.wake_at == pytest.approx(int(sim.now) + 1.0)
    plan, _ = sim.step()
    assert plan.writes == () and plan.report(Role.prefill).waiting_backoff == 1
    sim.now += 1.0
    plan, events = sim.step()
    # The new gang: its leader first, the other pod once the leader has an IP.
    assert len([a for a in plan.writes if isinstance(a, Create) and a.key.kind == "Pod"]) == 1
    assert reasons(events) == ["InstanceCreated"]
    sim.store.make_all_ready()
    plan, _ = sim.step()
    assert len([a for a in plan.writes if isinstance(a, Create) and a.key.kind == "Pod"]) == 1
    sim.store.make_all_ready()
    assert sim.plan().report(Role.prefill).ready == 2


def test_a_pod_not_ready_past_the_grace_restarts_the_whole_gang() -> None:
    # Only the leader has probes: a rank that hangs anywhere makes it NotReady
    # (503 ranks_missing) while every process still runs.
    sim = Sim(GANG)
    converge(sim)
    leader, follower = (p["metadata"]["name"] for p in sim.store.pods(role="prefill", instance="1"))
    sim.store.set_pod(leader, "Running", False)
    turned_at = sim.now
    plan, events = sim.step()
    assert plan.writes == () and events == []
    assert plan.wake_at == turned_at + 30  # restart.notReadyGraceSeconds' default
    (inst,) = [i for i in plan.report(Role.prefill).instances if i.key.index == 1]
    assert inst.health == Health.starting and "unless Ready again" in inst.reason
    sim.now = turned_at + 29
    plan, _ = sim.step()
    assert plan.writes == () and plan.report(Role.prefill).broken == 0
    sim.now = turned_at + 30
    plan, events = sim.step()
    assert sorted(a.key.name for a in plan.writes if isinstance(a, Delete)) == sorted(
        [leader, follower]
    )
    assert reasons(events) == ["InstanceRestarted"]
    assert f"pod {leader} has been NotReady since" in events[0].message
    assert plan.report(Role.prefill).ledger.total == 1
    assert sim.store.pods(role="prefill", instance="0") != []  # the other instance is untouched
    assert plan.wake_at == sim.now + 1  # the restart back-off, as for any fault
    sim.now += 1
    converge(sim)
    assert sim.plan().report(Role.prefill).ready == 2


def test_a_pod_ready_again_within_the_grace_is_kept() -> None:
    sim = Sim(GANG)
    converge(sim)
    leader = sim.store.pods(role="prefill", instance="0")[0]["metadata"]["name"]
    sim.store.set_pod(leader, "Running", False)
    sim.step()
    sim.now += 20
    sim.store.set_pod(leader, "Running", True)
    plan, _ = sim.step()
    sim.now += 60
    plan, events = sim.step()
    assert plan.writes == () and events == [] and plan.wake_at is None
    assert plan.report(Role.prefill).ready == 2 and plan.report(Role.prefill).ledger.total == 0


def test_a_not_ready_gang_with_its_budget_spent_stays_and_warns() -> None:
    sim = Sim({"prefill": {"restart": {"budget": 0, "notReadyGraceSeconds": 5}}, "decode": {}})
    converge(sim)
    (pod,) = sim.store.pods(role="prefill")
    sim.store.set_pod(pod["metadata"]["name"], "Running", False)  # a one-pod gang: same rule
    sim.now += 5
    plan, events = sim.step()
    assert plan.writes == () and reasons(events) == ["RestartBudgetExhausted"]
    assert plan.report(Role.prefill).budget_exhausted


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["fail", "not_ready"]), min_size=1, max_size=7))
def test_faults_in_a_row_never_restart_more_than_the_budget_per_hour(faults: list[str]) -> None:
    """A crashed follower or a leader NotReady past its grace, again and again
    within one hour: every fault restarts the gang until the budget is spent."""
    restart = {"budget": 3, "backoffSeconds": 1, "maxBackoffSeconds": 1, "notReadyGraceSeconds": 5}
    sim = Sim({"prefill": {**GANG["prefill"], "replicas": 1, "restart": restart}, "decode": {}})
    converge(sim)
    restarts = exhausted = 0
    for fault in faults:
        leader, follower = (p["metadata"]["name"] for p in sim.store.pods(role="prefill"))
        if fault == "fail":
            sim.store.set_pod(follower, "Failed", False)
        else:
            sim.store.set_pod(leader, "Running", False)
        sim.now += 5  # the grace ends: a NotReady fault is due now, as a crash was at once
        _, events = sim.step()
        restarts += reasons(events).count("InstanceRestarted")
        exhausted += reasons(events).count("RestartBudgetExhausted")
        sim.now += 1  # the back-off
        converge(sim)
    assert restarts == min(len(faults), 3)
    assert exhausted == max(0, len(faults) - 3)
    assert sim.plan().report(Role.prefill).ledger.total == restarts


def test_gang_member_missing_from_a_formed_gang_restarts_it() -> None:
    sim = Sim(GANG)
    converge(sim)
    first, second = (p["metadata"]["name"] for p in sim.store.pods(role="prefill", instance="0"))
    sim.store.remove("Pod", second)
    plan, events = sim.step()
    assert [a.key.name for a in plan.writes if isinstance(a, Delete)] == [first]
    assert reasons(events) == ["InstanceRestarted"]


def test_half_created_gang_is_completed_not_restarted() -> None:
    sim = Sim(GANG)
    sim.step()
    sim.store.make_all_ready()  # the leaders run (not Ready: their ranks are missing)
    sim.step()
    first, second = (p["metadata"]["name"] for p in sim.store.pods(role="prefill", instance="0"))
    sim.store.remove("Pod", second)  # as if the second create had failed
    plan, events = sim.step()
    assert [a.key.name for a in plan.writes] == [second]
    assert events == []


def test_pods_without_their_leader_are_restarted_not_completed() -> None:
    # The leader of a forming gang vanished: the others point at its old IP.
    sim = Sim(GANG)
    converge(sim)
    leader, follower = sim.store.pods(role="prefill", instance="1")
    sim.store.remove("Pod", leader["metadata"]["name"])
    plan, events = sim.step()
    assert [a.key.name for a in plan.writes if isinstance(a, Delete)] == [
        follower["metadata"]["name"]
    ]
    assert not [a for a in plan.writes if isinstance(a, Create)]
    assert reasons(events) == ["InstanceRestarted"]


def test_consecutive_failures_back_off_exponentially_and_readiness_resets() -> None:
    sim = Sim({"prefill": {"restart": {"backoffSeconds": 2, "maxBackoffSeconds": 5}}, "decode": {}})
    converge(sim)
    waits = []
    for _ in range(4):
        (pod,) = sim.store.pods(role="prefill")
        sim.store.set_pod(pod["metadata"]["name"], "Failed", False)
        plan, _ = sim.step()
        waits.append(plan.wake_at - int(sim.now))
        sim.now = plan.wake_at
        sim.step()  # recreated, but never Ready
    assert waits == [2.0, 4.0, 5.0, 5.0]
    sim.store.make_all_ready()
    plan, _ = sim.step()
    assert plan.report(Role.prefill).ledger.backoff == {}
    assert plan.report(Role.prefill).ledger.total == 4


def test_spent_budget_leaves_the_broken_instance_alone_and_warns() -> None:
    sim = Sim({"prefill": {"restart": {"budget": 1, "backoffSeconds": 0}}, "decode": {}})
    converge(sim)
    for expected in ("InstanceRestarted", "RestartBudgetExhausted"):
        (pod,) = sim.store.pods(role="prefill")
        sim.store.set_pod(pod["metadata"]["name"], "Failed", False)
        plan, events = sim.step()
        assert expected in reasons(events)
        sim.step()
    report = plan.report(Role.prefill)
    assert report.budget_exhausted and report.broken == 1
    assert sim.store.pods(role="prefill")[0]["status"]["phase"] == "Failed"  # kept for inspection
    # The window closes an hour after it opened; then the restart goes ahead.
    assert plan.wake_at is not None and plan.wake_at - sim.now <= 3600
    sim.now = plan.wake_at
    plan, events = sim.step()
    assert reasons(events) == ["InstanceRestarted"]


def test_scaling_creates_and_removes_whole_instances_without_restarts() -> None:
    sim = Sim(PD)
    converge(sim)
    sim.set_spec({"prefill": {}, "decode": {"replicas": 3}})
    plan, _ = sim.step()
    assert {
        p["metadata"]["labels"]["pdcluster.io/instance"] for p in sim.store.pods(role="decode")
    } == {"0", "1", "2"}
    assert not any(isinstance(a, Delete) for a in plan.writes)
    converge(sim)
    sim.set_spec({"prefill": {}, "decode": {"replicas": 1}})
    plan, events = sim.step()
    assert {
        p["metadata"]["labels"]["pdcluster.io/instance"] for p in sim.store.pods(role="decode")
    } == {"0"}
    assert reasons(events) == ["InstanceRemoved", "InstanceRemoved"]
    assert plan.report(Role.decode).ledger.total == 0


def test_switching_to_colocated_removes_prefill_and_decode() -> None:
    sim = Sim(PD)
    converge(sim)
    sim.set_spec({"colocated": {}})
    sim.step()
    roles = {p["metadata"]["labels"]["pdcluster.io/role"] for p in sim.store.list_objs("Pod", "")}
    assert roles == {"colocated"}
    assert not [s for s in sim.store.names("Service") if "-bs" in s]


@pytest.mark.parametrize(
    "kind,name",
    [("Service", "demo-router"), ("ConfigMap", "demo-config"), ("Secret", "demo-token")],
)
def test_foreign_object_with_our_name_is_never_adopted(kind: str, name: str) -> None:
    sim = Sim(PD)
    sim.store.foreign(kind, name, labels={"pdcluster.io/cluster": "demo"})
    before = sim.store.get_obj(kind, name)
    plan, events = sim.step()
    assert (kind, name) not in {
        (a.key.kind, a.key.name) for a in plan.writes if isinstance(a, Apply | Create | Delete)
    }
    assert not (kind == "Secret" and any(isinstance(a, CreateTokenSecret) for a in plan.writes))
    assert sim.store.get_obj(kind, name) == before
    assert f"{kind}/{name}" in [str(k) for k in plan.foreign]
    assert "ForeignObject" in reasons(events)


def test_foreign_pod_in_an_instance_slot_is_reported_and_left_alone() -> None:
    sim = Sim(PD)
    name = sim.desired.instance(Role.decode, 0).pod_names[0]
    sim.store.foreign("Pod", name)
    plan, events = sim.step()
    assert name not in [a.key.name for a in plan.writes if not isinstance(a, CreateTokenSecret)]
    assert sim.store.get_obj("Pod", name)["metadata"]["uid"] == f"foreign-{name}"
    assert "ForeignObject" in reasons(events)


def test_missing_user_token_secret_blocks_pods_until_it_exists() -> None:
    sim = Sim({**PD, "auth": {"tokenSecretName": "mine"}})
    plan, events = sim.step()
    assert plan.token_secret_missing and sim.store.names("Pod") == []
    assert not any(isinstance(a, CreateTokenSecret) for a in plan.actions)
    assert "TokenSecretMissing" in reasons(events)
    sim.store.foreign("Secret", "mine")  # the user creates it
    plan, _ = sim.step()
    assert not plan.token_secret_missing and len(sim.store.names("Pod")) == 2


def test_stale_owned_objects_are_deleted_and_foreign_ones_kept() -> None:
    sim = Sim(GANG)
    converge(sim)
    leftover = dict(sim.store.objects[("ConfigMap", "demo-config")])
    leftover["metadata"] = {**leftover["metadata"], "name": "demo-old", "uid": "u-old"}
    sim.store.objects[("ConfigMap", "demo-old")] = leftover
    sim.store.foreign("ConfigMap", "someone-elses", labels={"pdcluster.io/cluster": "demo"})
    plan, _ = sim.step()
    assert [(a.key.kind, a.key.name) for a in plan.writes] == [("ConfigMap", "demo-old")]
    assert sim.store.get_obj("ConfigMap", "someone-elses") is not None


def capacity(sim: Sim, role: Role) -> int:
    observed = observe_store(sim.store, sim.cluster)
    insts = group_instances(
        (p for p in observed.pods if p.role == role), now=sim.now, not_ready_grace_s=30.0
    )
    return len({i.key.index for i in insts if i.health == Health.ready})


@pytest.mark.parametrize("replicas", [1, 3])
def test_image_change_rolls_one_instance_at_a_time_keeping_capacity(replicas: int) -> None:
    spec: dict[str, Any] = {
        "prefill": {"replicas": replicas, "topology": {"tp": 2}},
        "decode": {"replicas": replicas},
    }
    sim = Sim(spec)
    converge(sim)
    old = {r.role: r.template_hash for r in sim.desired.roles}
    sim.set_spec({**spec, "image": "pdcluster:0.2.0"})
    new = {r.role: r.template_hash for r in sim.desired.roles}
    assert all(old[r] != new[r] for r in old)
    for _ in range(10 * replicas):
        plan, _ = sim.step()
        # Some revision always has a Ready prefill and a Ready decode to pair.
        assert ready_revisions(sim, Role.prefill) & ready_revisions(sim, Role.decode)
        for role in (Role.prefill, Role.decode):
            assert capacity(sim, role) >= replicas  # never below the asked-for capacity
            surged = [
                p
                for p in sim.store.pods(role=role.value)
                if p["metadata"]["labels"]["pdcluster.io/template-hash"] == new[role]
                and p["status"].get("phase") != "Running"
            ]
            per_instance = 2 if role == Role.prefill else 1
            assert len(surged) <= RolloutSpec().max_surge * per_instance
        if not plan.writes:
            break
        sim.store.make_all_ready()
    for role in (Role.prefill, Role.decode):
        hashes = {
            p["metadata"]["labels"]["pdcluster.io/template-hash"]
            for p in sim.store.pods(role=role.value)
        }
        assert hashes == {new[role]}
        assert capacity(sim, role) == replicas
    # Old bootstrap Services went with their instances.
    assert all(new[Role.prefill] in s for s in sim.store.names("Service") if s.endswith("-bs"))


def ready_revisions(sim: Sim, role: Role) -> set[str]:
    return {
        p["metadata"]["labels"]["pdcluster.io/revision"]
        for p in sim.store.pods(role=role.value)
        if p["status"].get("phase") == "Running"
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
    }


def test_revision_change_keeps_a_ready_prefill_decode_pair_of_one_revision() -> None:
    # The router pairs prefill and decode within one revision: retiring the old
    # prefill before a new decode is Ready would leave no pair at all.
    spec: dict[str, Any] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    sim = Sim(spec)
    converge(sim)
    (old_revision,) = ready_revisions(sim, Role.prefill)
    sim.set_spec({**spec, "image": "pdcluster:0.2.0"})
    new_revision = sim.desired.revision
    assert new_revision != old_revision
    sim.step()  # both roles surge one new instance
    for pod in sim.store.pods(role="prefill"):
        sim.store.set_pod(pod["metadata"]["name"], "Running", True)  # new prefill Ready first
    for _ in range(3):
        plan, _ = sim.step()
        assert ready_revisions(sim, Role.prefill) == {old_revision, new_revision}
        assert old_revision in ready_revisions(sim, Role.decode)
    assert plan.roles[0].rolling  # Progressing: the old prefill is held, not forgotten
    sim.store.make_all_ready()  # the new decode is Ready: now both old ones go
    for _ in range(3):
        sim.step()
    for role in (Role.prefill, Role.decode):
        assert ready_revisions(sim, role) == {new_revision}
        assert len(sim.store.pods(role=role.value)) == 1


def test_failed_replacement_holds_the_surge_slot() -> None:
    spec: dict[str, Any] = {"prefill": {"replicas": 3}, "decode": {}}
    sim = Sim(spec)
    converge(sim)
    sim.set_spec({**spec, "image": "pdcluster:broken"})
    sim.step()
    for _ in range(3):
        (new_pod,) = [
            p
            for p in sim.store.pods(role="prefill")
            if p["spec"]["containers"][0]["image"] == "pdcluster:broken"
        ] or [None]
        if new_pod is not None:
            sim.store.set_pod(new_pod["metadata"]["name"], "Failed", False)
        sim.step()
        sim.now += 100
    broken_images = [
        p
        for p in sim.store.pods(role="prefill")
        if p["spec"]["containers"][0]["image"] == "pdcluster:broken"
    ]
    assert len(broken_images) <= 1
    assert capacity(sim, Role.prefill) == 3  # the old instances keep serving


def test_applied_manifests_carry_their_own_hash() -> None:
    sim = Sim(PD)
    plan = sim.plan()
    for action in plan.writes:
        if isinstance(action, Apply):
            annotations = action.manifest["metadata"]["annotations"]
            assert annotations["pdcluster.io/applied-hash"] == manifest_hash(action.manifest)
    manifest = {"kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "1"}}
    assert manifest_hash(stamp(manifest)) == manifest_hash(manifest)


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["fail", "delete", "not_ready", "ready", "scale", "tick"]),
            st.integers(0, 7),
        ),
        max_size=25,
    )
)
def test_random_disruptions_never_touch_foreign_objects_or_duplicate_slots(ops) -> None:
    sim = Sim(GANG)
    sim.store.foreign(
        "Pod", "intruder", labels={"pdcluster.io/cluster": "demo", "pdcluster.io/role": "prefill"}
    )
    replicas = 2
    for op, n in ops:
        pods = [p for p in sim.store.list_objs("Pod", "") if p["metadata"]["name"] != "intruder"]
        if op == "fail" and pods:
            sim.store.set_pod(pods[n % len(pods)]["metadata"]["name"], "Failed", False)
        elif op == "delete" and pods:
            sim.store.remove("Pod", pods[n % len(pods)]["metadata"]["name"])
        elif op == "not_ready" and (started := [p for p in pods if has_started(p)]):
            # Only a pod that passed its startup probe turns NotReady (a kubelet
            # fails one that never passes it; this store does not).
            sim.store.set_pod(started[n % len(started)]["metadata"]["name"], "Running", False)
        elif op == "ready":
            sim.store.make_all_ready()
        elif op == "scale":
            replicas = n % 4
            sim.set_spec({**GANG, "prefill": {**GANG["prefill"], "replicas": replicas}})
        else:
            sim.now += 2**n
        plan, _ = sim.step()
        touched = {a.key.name for a in plan.writes if isinstance(a, Apply | Create | Delete)}
        assert "intruder" not in touched
        assert sim.store.get_obj("Pod", "intruder")["metadata"]["uid"] == "foreign-intruder"
        observed = observe_store(sim.store, sim.cluster)
        slots = [(p.role, p.instance, p.template_hash, p.pod_index) for p in observed.pods]
        assert len(slots) == len(set(slots))
    # Left alone long enough, it heals completely (a gang whose leader went
    # while another pod was still pending is restarted once that pod started,
    # a NotReady one once its grace has passed, and comes back after the
    # restart back-off).
    for _ in range(3):
        sim.now += 10_000
        converge(sim, passes=20)
    ours = [p for p in sim.store.pods(role="prefill") if p["metadata"]["name"] != "intruder"]
    assert len(ours) == 2 * replicas
    assert {p["status"]["phase"] for p in ours} <= {"Running"}
    assert all(p["status"]["conditions"][0]["status"] == "True" for p in ours)


def test_backoff_is_capped_and_monotonic() -> None:
    from pdcluster.runtime.spec import RestartPolicySpec

    policy = RestartPolicySpec(backoff_seconds=0.5, max_backoff_seconds=30)
    delays = [backoff_delay(policy, n) for n in range(1, 200)]
    assert delays[0] == 0.5 and max(delays) == 30
    assert delays == sorted(delays)
