"""`scheduling.gang: podGroup`: one PodGroup per instance generation, created
before its pods, kept across gang restarts, deleted once its generation is
gone; roles wait, and say why, while the apiserver serves no PodGroups
(operator/reconcile/pod_groups.py)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from pdcluster.operator import names
from pdcluster.operator.api import PDClusterStatus
from pdcluster.operator.builders.meta import ObjectKey
from pdcluster.operator.builders.scheduling import POD_GROUP_API_VERSION
from pdcluster.operator.builders.workers import InstanceKey
from pdcluster.operator.kube.client import ApiError
from pdcluster.operator.kube.recorder import EventRecorder
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.reconcile.actions import Create, Delete, Reason
from pdcluster.operator.reconcile.controller import Controller
from pdcluster.operator.reconcile.observed import ObservedObject, PodGroupApi
from pdcluster.operator.reconcile.pod_groups import (
    is_pod_group_kept,
    pod_group_generation,
    pod_groups_unavailable_message,
)
from pdcluster.operator.reconcile.status import compute_status
from pdcluster.operator.render import render_objects
from pdcluster.operator.settings import OperatorSettings
from pdcluster.runtime.spec import Role

from .helpers import NS, UID, FakeApi, Sim, body, make_cluster

GANG = {"gang": "podGroup"}
# prefill: one instance of two pods in one PodGroup; decode: one pod, no gang.
SPEC: dict[str, Any] = {
    "prefill": {
        "topology": {"tp": 2},
        "gpusPerPod": 1,
        "scheduling": GANG,
        "restart": {"backoffSeconds": 1},
    },
    "decode": {},
}
CRD_MISSING = "PodGroup CRD scheduling.x-k8s.io not installed"


def with_prefill(**fields: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["prefill"].update(fields)
    return spec


def converge(sim: Sim, passes: int = 6) -> None:
    for _ in range(passes):
        sim.step()
        sim.store.make_all_ready()


def pod_groups(sim: Sim) -> dict[str, dict[str, Any]]:
    return {n: sim.store.objects[("PodGroup", n)] for n in sim.store.names("PodGroup")}


def group_name(sim: Sim, role: Role, index: int) -> str:
    desired = sim.desired.role(role)
    assert desired is not None
    return names.instance_name("demo", role, index, desired.template_hash)


def group_label(pod: dict[str, Any]) -> str | None:
    value: str | None = pod["metadata"]["labels"].get(names.LABEL_POD_GROUP)
    return value


def pod_group_writes(sim: Sim) -> list[tuple[str, str, str]]:
    return [w for w in sim.store.writes if w[1] == "PodGroup"]


# ------------------------------------------------------------- the object itself
def test_the_pod_group_is_created_before_the_pods_and_every_pod_names_it() -> None:
    sim = Sim(SPEC)
    plan, _ = sim.step()
    creates = [a for a in plan.actions if isinstance(a, Create)]
    kinds = [
        a.key.kind
        for a in creates
        if a.manifest["metadata"]["labels"].get(names.LABEL_ROLE) == "prefill"
    ]
    # The leader alone on the first pass (the other pod waits for its IP), its group first.
    assert kinds == ["PodGroup", "Pod", "Service"]
    converge(sim)
    name = group_name(sim, Role.prefill, 0)
    assert list(pod_groups(sim)) == [name]  # decode asks for no gang
    group = pod_groups(sim)[name]
    assert group["apiVersion"] == POD_GROUP_API_VERSION and group["kind"] == "PodGroup"
    assert group["spec"] == {"minMember": 2}
    (owner,) = group["metadata"]["ownerReferences"]
    assert owner["uid"] == UID and owner["kind"] == "PDCluster" and owner["controller"] is True
    labels = group["metadata"]["labels"]
    assert labels[names.LABEL_CLUSTER] == "demo" and labels[names.LABEL_ROLE] == "prefill"
    assert labels[names.LABEL_INSTANCE_INDEX] == "0"
    prefill = sim.store.pods(role="prefill")
    assert len(prefill) == 2 and {group_label(p) for p in prefill} == {name}
    assert [group_label(p) for p in sim.store.pods(role="decode")] == [None]
    # Converged: the PodGroup was written once, and the plan is quiet.
    assert pod_group_writes(sim) == [("create", "PodGroup", name)]
    assert sim.plan().writes == ()


@pytest.mark.parametrize(
    ("prefill_gang", "decode_gang", "replicas"),
    list(itertools.product([False, True], [False, True], [0, 1, 3])),
)
def test_pod_groups_are_exactly_the_gang_roles_instances(
    prefill_gang: bool, decode_gang: bool, replicas: int
) -> None:
    def role(gang: bool) -> dict[str, Any]:
        return {"replicas": replicas, **({"scheduling": GANG} if gang else {})}

    sim = Sim({"prefill": role(prefill_gang), "decode": role(decode_gang)})
    converge(sim)
    gang_roles = [r for r, g in ((Role.prefill, prefill_gang), (Role.decode, decode_gang)) if g]
    expected = {group_name(sim, r, i) for r in gang_roles for i in range(replicas)}
    assert set(pod_groups(sim)) == expected
    for r in (Role.prefill, Role.decode):
        pods = sim.store.pods(role=r.value)
        assert len(pods) == replicas
        for pod in pods:
            index = int(pod["metadata"]["labels"][names.LABEL_INSTANCE_INDEX])
            want = group_name(sim, r, index) if r in gang_roles else None
            assert group_label(pod) == want


def test_render_shows_the_pod_group_before_its_pods() -> None:
    kinds = [
        o["kind"]
        for o in render_objects(make_cluster(SPEC))
        if o["metadata"]["labels"].get(names.LABEL_ROLE) == "prefill"
    ]
    assert kinds == ["PodGroup", "Service", "Pod", "Pod"]


# ------------------------------------------------------------------ its lifetime
def test_a_gang_restart_keeps_the_pod_group_and_the_new_pods_name_it() -> None:
    sim = Sim(SPEC)
    converge(sim)
    name = group_name(sim, Role.prefill, 0)
    uid = pod_groups(sim)[name]["metadata"]["uid"]
    follower = next(
        p
        for p in sim.store.pods(role="prefill")
        if p["metadata"]["labels"][names.LABEL_LEADER] == "false"
    )
    sim.store.set_pod(follower["metadata"]["name"], "Failed", False)
    plan, events = sim.step()
    assert "InstanceRestarted" in {e.reason for e in events}
    assert sim.store.pods(role="prefill") == []  # the whole gang went
    assert not any(isinstance(a, Delete) and a.key.kind == "PodGroup" for a in plan.actions)
    sim.now += 60  # past the back-off
    converge(sim)
    assert pod_groups(sim)[name]["metadata"]["uid"] == uid  # the same object, never rewritten
    assert pod_group_writes(sim) == [("create", "PodGroup", name)]
    assert {group_label(p) for p in sim.store.pods(role="prefill")} == {name}


def test_scaling_down_deletes_the_pod_group_once_its_pods_are_gone() -> None:
    sim = Sim(with_prefill(replicas=2))
    converge(sim)
    kept, dropped = group_name(sim, Role.prefill, 0), group_name(sim, Role.prefill, 1)
    assert set(pod_groups(sim)) == {kept, dropped}
    sim.set_spec(with_prefill(replicas=1))
    # The pods go first, the leader before the others (a drain); the PodGroup
    # stays while one of them is still observed.
    for _ in range(2):
        plan, _ = sim.step()
        deleted = {a.key.kind for a in plan.actions if isinstance(a, Delete)}
        assert "Pod" in deleted and "PodGroup" not in deleted
    plan, _ = sim.step()
    assert [a.key for a in plan.actions if isinstance(a, Delete)] == [
        ObjectKey("PodGroup", dropped)
    ]
    assert set(pod_groups(sim)) == {kept}


def test_a_rollout_gives_the_new_template_its_own_pod_group_and_drops_the_old_one() -> None:
    sim = Sim(SPEC)
    converge(sim)
    old = group_name(sim, Role.prefill, 0)
    sim.set_spec(with_prefill(engine={"maxRunningRequests": 8}))
    new = group_name(sim, Role.prefill, 0)
    assert new != old
    sim.step()
    sim.store.make_all_ready()
    # Both generations run side by side (surge), each in its own gang.
    assert set(pod_groups(sim)) == {old, new}
    converge(sim)
    assert set(pod_groups(sim)) == {new}
    assert {group_label(p) for p in sim.store.pods(role="prefill")} == {new}


def test_switching_the_gang_off_rolls_the_pods_and_deletes_the_pod_groups() -> None:
    sim = Sim(SPEC)
    converge(sim)
    sim.set_spec(with_prefill(scheduling={"gang": "none"}))
    converge(sim)
    assert pod_groups(sim) == {}
    pods = sim.store.pods(role="prefill")
    assert len(pods) == 2 and {group_label(p) for p in pods} == {None}


def test_deleting_the_role_deletes_its_pod_groups() -> None:
    sim = Sim({"colocated": {"topology": {"tp": 2}, "gpusPerPod": 1, "scheduling": GANG}})
    converge(sim)
    assert list(pod_groups(sim)) == [group_name(sim, Role.colocated, 0)]
    sim.set_spec({"prefill": {}, "decode": {}})
    converge(sim)
    assert pod_groups(sim) == {} and sim.store.pods(role="colocated") == []


def observed_group(labels: dict[str, str]) -> ObservedObject:
    return ObservedObject(ObjectKey("PodGroup", "g"), "uid-g", UID, labels, {}, False)


def test_the_keep_rule_over_generations_slots_and_templates() -> None:
    sim = Sim(with_prefill(replicas=2))
    prefill = sim.desired.role(Role.prefill)
    assert prefill is not None
    current = prefill.template_hash
    for index, template, has_pods in itertools.product([0, 1, 2], [current, "0ld0ld00"], [0, 1]):
        key = InstanceKey(Role.prefill, index, template)
        kept = is_pod_group_kept(key, sim.desired, {key} if has_pods else set())
        # Kept while its pods exist, or as the current generation of a wanted slot.
        assert kept == bool(has_pods or (index < 2 and template == current)), key
    # decode asks for no gang: only pods keep a decode PodGroup.
    decode = sim.desired.role(Role.decode)
    assert decode is not None
    key = InstanceKey(Role.decode, 0, decode.template_hash)
    assert not is_pod_group_kept(key, sim.desired, set())
    assert is_pod_group_kept(key, sim.desired, {key})
    assert not is_pod_group_kept(None, sim.desired, set())


@pytest.mark.parametrize(
    "labels",
    [
        {},
        {names.LABEL_ROLE: "router", names.LABEL_INSTANCE_INDEX: "0", names.LABEL_TEMPLATE: "a"},
        {names.LABEL_ROLE: "prefill", names.LABEL_INSTANCE_INDEX: "-1", names.LABEL_TEMPLATE: "a"},
        {names.LABEL_ROLE: "prefill", names.LABEL_INSTANCE_INDEX: "0"},
    ],
)
def test_a_pod_group_whose_labels_do_not_parse_has_no_generation(labels: dict[str, str]) -> None:
    assert pod_group_generation(observed_group(labels)) is None


def test_a_foreign_pod_group_under_our_name_blocks_the_instance() -> None:
    sim = Sim(SPEC)
    name = group_name(sim, Role.prefill, 0)
    sim.store.foreign("PodGroup", name, names.cluster_labels("demo"))
    plan, events = sim.step()
    assert ObjectKey("PodGroup", name) in plan.foreign
    assert "ForeignObject" in {e.reason for e in events}
    # Its pods would join someone else's gang: none is created, decode still is.
    assert sim.store.pods(role="prefill") == [] and len(sim.store.pods(role="decode")) == 1
    assert sim.store.objects[("PodGroup", name)]["metadata"]["uid"] == f"foreign-{name}"


# ---------------------------------------------------- an apiserver without PodGroups
@pytest.mark.parametrize(
    ("api", "words"),
    [
        (PodGroupApi.not_installed, CRD_MISSING),
        (PodGroupApi.forbidden, "may not list podgroups.scheduling.x-k8s.io"),
    ],
)
def test_without_the_pod_group_api_the_gang_role_creates_no_pods_and_says_why(
    api: PodGroupApi, words: str
) -> None:
    sim = Sim(SPEC)
    sim.pod_group_api = api
    plan, events = sim.step()
    assert sim.store.pods(role="prefill") == [] and pod_groups(sim) == {}
    assert len(sim.store.pods(role="decode")) == 1  # gang: none is not held back
    (warning,) = [e for e in events if e.reason == Reason.PodGroupUnavailable]
    assert warning.type == "Warning" and words in warning.message
    assert "prefill.scheduling.gang" in warning.message and "gang: none" in warning.message
    assert plan.pod_groups_unavailable == warning.message
    hashes = {r.role: r.template_hash for r in sim.desired.roles}
    status = compute_status(
        sim.cluster, plan, hashes, sim.desired.revision, PDClusterStatus(), sim.now
    )
    degraded = status.condition("Degraded")
    assert degraded is not None and degraded.status == "True"
    assert degraded.reason == "PodGroupUnavailable" and words in degraded.message
    # Once the API serves PodGroups, the role starts: its group first.
    sim.pod_group_api = PodGroupApi.served
    converge(sim)
    assert list(pod_groups(sim)) == [group_name(sim, Role.prefill, 0)]
    assert len(sim.store.pods(role="prefill")) == 2


def test_losing_the_pod_group_api_leaves_running_pods_alone() -> None:
    sim = Sim(SPEC)
    converge(sim)
    sim.pod_group_api = PodGroupApi.not_installed
    plan, events = sim.step()
    assert plan.writes == ()  # nothing deleted, nothing created
    assert Reason.PodGroupUnavailable in {e.reason for e in events}
    assert len(sim.store.pods(role="prefill")) == 2


def test_without_a_gang_role_a_missing_pod_group_api_changes_nothing() -> None:
    served, missing = Sim({"prefill": {}, "decode": {}}), Sim({"prefill": {}, "decode": {}})
    missing.pod_group_api = PodGroupApi.not_installed
    a, b = served.step()[0], missing.step()[0]
    assert a.actions == b.actions and b.pod_groups_unavailable is None


def test_the_message_names_every_waiting_role() -> None:
    text = pod_groups_unavailable_message(PodGroupApi.not_installed, (Role.prefill, Role.decode))
    assert text.startswith(CRD_MISSING)
    assert "no prefill and decode pods" in text
    assert "prefill.scheduling.gang and decode.scheduling.gang are podGroup" in text


# ------------------------------------------------------------ the controller's list
def controller_with(spec: dict[str, Any]) -> tuple[FakeApi, Controller]:
    api = FakeApi()
    api.store.objects[("PDCluster", "demo")] = body(spec)
    recorder = EventRecorder(api, clock=lambda: 1_000_000.0, min_interval_s=30, host="test")
    settings = OperatorSettings(metrics_port=0)
    return api, Controller(api, settings, OperatorMetrics(), recorder, clock=lambda: 1_000_000.0)


@pytest.mark.parametrize(
    ("status", "words"),
    [(404, CRD_MISSING), (403, "may not list podgroups.scheduling.x-k8s.io (403)")],
)
async def test_a_pass_whose_pod_group_list_is_refused_reports_it_and_holds_the_role(
    status: int, words: str
) -> None:
    api, controller = controller_with(SPEC)
    api.fail_always["list:PodGroup"] = ApiError(status, "NotFound", "the server could not find")
    await controller.reconcile((NS, "demo"))
    assert api.store.pods(role="prefill") == [] and len(api.store.pods(role="decode")) == 1
    (event,) = [e for e in api.events() if e["reason"] == "PodGroupUnavailable"]
    assert event["type"] == "Warning" and words in event["message"]
    cond = next(
        c
        for c in api.store.objects[("PDCluster", "demo")]["status"]["conditions"]
        if c["type"] == "Degraded"
    )
    assert cond["status"] == "True" and cond["reason"] == "PodGroupUnavailable"
    # The CRD arrives: the next pass creates the group and the leader.
    del api.fail_always["list:PodGroup"]
    await controller.reconcile((NS, "demo"))
    assert api.store.names("PodGroup") == [
        api.store.pods(role="prefill")[0]["metadata"]["labels"][names.LABEL_POD_GROUP]
    ]


async def test_any_other_pod_group_list_failure_fails_the_pass() -> None:
    api, controller = controller_with(SPEC)
    api.fail_always["list:PodGroup"] = ApiError(500, "InternalError", "etcd is down")
    with pytest.raises(ApiError):
        await controller.reconcile((NS, "demo"))
    assert api.store.names("Pod") == []
