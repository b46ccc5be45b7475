"""The autoscaling loop's pure glue: scrape targets, scaler plans, waits; and the
reconcile's status writes leaving status.<role>.autoscaling to the loop."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdcluster.operator.api import PDClusterStatus, RoleStatus
from pdcluster.operator.autoscale.scaler_sync import SyncReason
from pdcluster.operator.autoscale.step import AutoscaleHistory, AutoscaleStep
from pdcluster.operator.autoscale.wiring import (
    MAX_WAIT_S,
    MIN_WAIT_S,
    ScalerObjectError,
    existing_instances,
    plan_scaler,
    scrape_targets,
    stale_scalers,
    token_secret,
    wait_seconds,
)
from pdcluster.operator.builders import build_role_scaler
from pdcluster.operator.reconcile.status import status_changed, status_patch
from pdcluster.runtime.spec import Role

from .helpers import AUTOSCALING_DECISION, UID, make_cluster
from .podmaker import deleting, not_ready, worker_pod

P, D = Role.prefill, Role.decode
AUTO = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "target": {"metric": "ttftP90Seconds", "value": 0.5},
}
SPEC: dict[str, Any] = {"prefill": {"replicas": 2, "autoscaling": AUTO}, "decode": {}}
REF = make_cluster(SPEC).ref


def scaler_obj(replicas: int, synced: int | None, role: Role = P) -> dict[str, Any]:
    obj = copy.deepcopy(build_role_scaler(make_cluster(SPEC), role))
    obj["spec"]["replicas"] = replicas
    if synced is not None:
        obj["status"] = {"syncedReplicas": synced}
    return obj


def pod(role: Role, index: int, ip: str, **kw: Any) -> dict[str, Any]:
    return worker_pod(role, index, ip=ip, spec=SPEC, **kw)


# ---------------------------------------------------------------- scrape targets
def test_targets_are_the_ready_leader_pods_of_the_asked_roles() -> None:
    pods = [
        pod(P, 0, "127.0.0.10"),
        pod(P, 1, "127.0.0.11"),
        pod(D, 0, "127.0.0.12"),
    ]
    targets = scrape_targets(pods, REF, [P])
    names = sorted(p["metadata"]["name"] for p in pods[:2])
    assert sorted(targets[P]) == names
    assert sorted(targets[P].values()) == [
        "http://127.0.0.10:8000/metrics",
        "http://127.0.0.11:8000/metrics",
    ]
    assert D not in targets


def test_not_ready_deleting_addressless_foreign_and_follower_pods_are_no_targets() -> None:
    follower = pod(P, 4, "127.0.0.14")
    follower["metadata"]["labels"]["pdcluster.io/pod-index"] = "1"
    other_cluster = pod(P, 5, "127.0.0.15")
    other_cluster["metadata"]["labels"]["pdcluster.io/cluster"] = "other"
    pods = [
        not_ready(pod(P, 0, "127.0.0.10")),
        deleting(pod(P, 1, "127.0.0.11")),
        pod(P, 2, None),
        pod(P, 3, "127.0.0.13", phase="Pending"),
        follower,
        other_cluster,
        {"metadata": {"name": "junk"}},
    ]
    assert scrape_targets(pods, REF, [P, D]) == {P: {}, D: {}}


def test_a_pods_http_port_annotation_is_used() -> None:
    targets = scrape_targets([pod(P, 0, "127.0.0.10", http_port=9100)], REF, [P])
    assert list(targets[P].values()) == ["http://127.0.0.10:9100/metrics"]


def test_existing_instances_count_instances_not_being_deleted() -> None:
    pods = [
        pod(P, 0, "127.0.0.10"),
        not_ready(pod(P, 1, "127.0.0.11")),
        deleting(pod(P, 2, "127.0.0.12")),
        pod(D, 0, None, phase="Pending", ready=False),
    ]
    assert existing_instances(pods, REF) == {P: 2, D: 1}
    assert existing_instances([], REF) == {}


def test_token_secret_is_read_from_a_worker_pod() -> None:
    assert token_secret([pod(P, 0, "127.0.0.10")], REF) == "demo-token"
    assert token_secret([], REF) is None


def test_pods_another_pdcluster_controls_are_not_the_clusters() -> None:
    """Labels alone do not make a pod the cluster's: its controller owner's uid must
    be the PDCluster's, or its Secret and its /metrics would get the cluster token."""
    other = pod(P, 0, "127.0.0.20")
    other["metadata"]["ownerReferences"][0]["uid"] = "uid-another-pdcluster"
    other["spec"]["volumes"] = [
        {**v, "secret": {**v["secret"], "secretName": "someone-elses"}} if "secret" in v else v
        for v in other["spec"]["volumes"]
    ]
    assert scrape_targets([other], REF, [P]) == {P: {}}
    assert existing_instances([other], REF) == {}
    assert token_secret([other], REF) is None
    assert token_secret([other, pod(P, 1, "127.0.0.21")], REF) == "demo-token"


# ---------------------------------------------------------------- scaler plans
def test_a_missing_scaler_is_created_at_the_clusters_replicas_and_recorded_as_synced() -> None:
    plan = plan_scaler(make_cluster(SPEC), P, None, existing=1)
    assert plan.create is not None
    assert plan.create["metadata"]["name"] == "demo-prefill"
    assert plan.create["spec"]["replicas"] == 2
    assert plan.create["metadata"]["ownerReferences"][0]["kind"] == "PDCluster"
    assert plan.sync.is_noop and plan.sync.synced == 2
    assert plan.status_patch() == {
        "status": {
            "replicas": 1,
            "selector": "pdcluster.io/cluster=demo,pdcluster.io/role=prefill",
            "syncedReplicas": 2,
        }
    }


def test_a_missing_scaler_for_replicas_outside_the_bounds_is_created_at_the_bound() -> None:
    spec = {"prefill": {"replicas": 5, "autoscaling": AUTO}, "decode": {}}
    plan = plan_scaler(make_cluster(spec), P, None, existing=5)
    assert plan.create is not None and plan.create["spec"]["replicas"] == 3
    assert plan.sync.cluster_replicas == 3 and plan.sync.scaler_replicas is None
    assert plan.sync.reason is SyncReason.clamped
    assert [e.reason for e in plan.sync.events] == ["ReplicasClamped"]


def test_kubectl_scale_on_the_scaler_is_copied_to_the_cluster() -> None:
    plan = plan_scaler(make_cluster(SPEC), P, scaler_obj(3, synced=2), existing=2)
    assert plan.create is None
    assert (plan.sync.cluster_replicas, plan.sync.scaler_replicas) == (3, None)
    assert plan.sync.reason is SyncReason.from_scaler
    assert plan.status.synced_replicas == 3


def test_an_autoscaler_patch_of_the_cluster_is_copied_to_the_scaler() -> None:
    plan = plan_scaler(make_cluster(SPEC), P, scaler_obj(1, synced=1), existing=1)
    assert (plan.sync.cluster_replicas, plan.sync.scaler_replicas) == (None, 2)
    assert plan.sync.reason is SyncReason.from_cluster


def test_both_edited_the_scaler_wins_with_an_event() -> None:
    plan = plan_scaler(make_cluster(SPEC), P, scaler_obj(1, synced=3), existing=2)
    assert (plan.sync.cluster_replicas, plan.sync.scaler_replicas) == (1, None)
    assert [e.reason for e in plan.sync.events] == ["ReplicasConflict"]


# maxTotalGPUs 4: prefill autoscales 1..2 (tp2: 2 GPUs an instance), decode is left alone.
BUDGETED: dict[str, Any] = {
    "autoscaling": {"maxTotalGPUs": 4},
    "prefill": {"replicas": 1, "topology": {"tp": 2}, "autoscaling": {**AUTO, "maxReplicas": 1}},
    "decode": {"replicas": 1},
}


def budgeted_scaler(role: Role, replicas: int, synced: int) -> dict[str, Any]:
    obj = copy.deepcopy(build_role_scaler(make_cluster(BUDGETED), role))
    obj["spec"]["replicas"], obj["status"] = replicas, {"syncedReplicas": synced}
    return obj


@pytest.mark.parametrize(
    ("scaled_to", "taken"),
    [(5, 2), (2, 2), (1, 1), (0, 0)],
)
def test_kubectl_scale_of_a_role_never_takes_the_cluster_past_max_total_gpus(
    scaled_to: int, taken: int
) -> None:
    """prefill holds 2 of the 4 GPUs: decode (1 GPU an instance) may grow to 2."""
    plan = plan_scaler(make_cluster(BUDGETED), D, budgeted_scaler(D, scaled_to, 1), existing=1)
    assert plan.sync.synced == taken
    assert plan.sync.cluster_replicas == (None if taken == 1 else taken)
    if scaled_to > taken:
        assert plan.sync.scaler_replicas == taken
        assert plan.sync.reason is SyncReason.clamped
        (event,) = plan.sync.events
        assert event.reason == "ReplicasClamped"
        assert event.message == (
            f"decode: replicas {scaled_to} from the scaler would need {scaled_to} GPUs with "
            f"2 held by the other roles, over autoscaling.maxTotalGPUs (4): set to {taken}"
        )
    else:
        assert plan.sync.scaler_replicas is None and plan.sync.events == ()


def test_a_scaler_with_a_lost_status_takes_the_clusters_replicas() -> None:
    raw = scaler_obj(3, synced=None)
    raw["status"] = {"syncedReplicas": "three"}
    plan = plan_scaler(make_cluster(SPEC), P, raw, existing=2)
    assert (plan.sync.cluster_replicas, plan.sync.scaler_replicas) == (None, 2)


@pytest.mark.parametrize("replicas", [None, -1, "2", True])
def test_a_malformed_scaler_is_a_clear_error(replicas: Any) -> None:
    raw = scaler_obj(1, synced=1)
    raw["spec"]["replicas"] = replicas
    with pytest.raises(ScalerObjectError, match="demo-prefill: spec.replicas"):
        plan_scaler(make_cluster(SPEC), P, raw, existing=1)


def test_a_scaler_for_a_role_the_cluster_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="no colocated role"):
        plan_scaler(make_cluster(SPEC), Role.colocated, None, existing=0)


def test_scalers_of_roles_the_cluster_no_longer_has_are_stale() -> None:
    prefill, decode = scaler_obj(1, 1, P), scaler_obj(1, 1, D)
    for obj, uid in ((prefill, "s-p"), (decode, "s-d")):
        obj["metadata"]["uid"] = uid
    foreign = copy.deepcopy(prefill)
    foreign["metadata"]["ownerReferences"][0]["uid"] = "another-cluster"
    going = copy.deepcopy(decode)
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert stale_scalers([prefill, decode], UID, [P, D]) == []
    assert stale_scalers([prefill, decode], UID, [Role.colocated]) == [
        ("demo-prefill", "s-p"),
        ("demo-decode", "s-d"),
    ]
    assert stale_scalers([foreign, going, {"metadata": {}}], UID, [Role.colocated]) == []


# ---------------------------------------------------------------- waits
def _step(next_due_at: float | None) -> AutoscaleStep:
    return AutoscaleStep((), (), {}, AutoscaleHistory(), next_due_at)


def test_the_loop_waits_until_the_next_role_is_due_within_limits() -> None:
    assert wait_seconds(_step(110.0), 100.0) == 10.0
    assert wait_seconds(_step(99.0), 100.0) == MIN_WAIT_S
    assert wait_seconds(_step(1000.0), 100.0) == MAX_WAIT_S
    assert wait_seconds(_step(None), 100.0) == MAX_WAIT_S
    assert wait_seconds(None, 100.0) == MAX_WAIT_S


# ---------------------------------------------------------------- status ownership


def test_the_reconciles_status_writes_leave_the_autoscaling_decision_alone() -> None:
    ours = PDClusterStatus(prefill=RoleStatus(desired=2, ready=1, autoscaling=AUTOSCALING_DECISION))
    wire = status_patch(ours)["status"]
    assert "autoscaling" not in wire["prefill"]
    assert wire["prefill"]["desired"] == 2
    newer = AUTOSCALING_DECISION.model_copy(update={"desired": 3}).model_dump(by_alias=True)
    stored = {**wire, "prefill": {**wire["prefill"], "autoscaling": newer}}
    # The loop's newer decision is no reason to write, nor overwritten by one.
    assert not status_changed(stored, ours)
    assert status_changed({**stored, "prefill": {**stored["prefill"], "ready": 2}}, ours)
