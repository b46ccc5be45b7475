"""The per-role scaler: its CRD, its manifest, and which edit wins a sync."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.operator.api import RoleScalerSpec
from pdcluster.operator.autoscale.scaler_sync import (
    Changed,
    GpuBudget,
    SyncReason,
    changed_since,
    compute_scaler_sync,
    decide_scaler_sync,
)
from pdcluster.operator.builders import (
    build_role_scaler,
    build_role_scaler_status,
    build_role_scalers,
)
from pdcluster.operator.crd.crdgen import build_scaler_crd, render_crd_yaml
from pdcluster.operator.crd.structural import check_structural, walk
from pdcluster.runtime.spec import Role, RoleAutoscalingSpec
from tests.operator.autoscale_sim import scaling

from .helpers import PD, UID, make_cluster, need

ROOT = Path(__file__).resolve().parents[2]
FILE = "pdcluster.io_pdclusterrolescalers.yaml"
P, D = Role.prefill, Role.decode
BOUNDED = scaling(P, lo=2, hi=4)


@pytest.mark.parametrize(
    "path", [ROOT / "crds" / FILE, ROOT / "charts" / "pdcluster-operator" / "crds" / FILE]
)
def test_committed_scaler_crd_matches_a_fresh_generation(path: Path) -> None:
    assert path.read_text() == render_crd_yaml("PDClusterRoleScaler"), "run `make crds`"


def test_scaler_crd_is_valid_and_scale_paths_point_at_its_schema() -> None:
    crd = build_scaler_crd()
    need("kubernetes_validate").validate(crd, "1.37.0", strict=True)
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    assert [p for p in check_structural(schema) if not p.startswith("<root>.metadata")] == []
    scale = version["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    paths = {p for p, _ in walk(schema, "")}
    assert set(scale.values()) <= paths
    assert crd["metadata"]["name"] == "pdclusterrolescalers.pdcluster.io"
    spec = schema["properties"]["spec"]["properties"]
    assert spec["cluster"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"


def test_one_scaler_per_role_owned_by_the_cluster() -> None:
    cluster = make_cluster({"prefill": {"replicas": 2}, "decode": {"replicas": 3}})
    prefill, decode = build_role_scalers(cluster)
    assert (prefill["metadata"]["name"], decode["metadata"]["name"]) == (
        "demo-prefill",
        "demo-decode",
    )
    assert prefill["spec"] == {"cluster": "demo", "role": "prefill", "replicas": 2}
    assert decode["spec"]["replicas"] == 3
    (owner,) = decode["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("PDCluster", UID, True)
    assert decode["metadata"]["labels"]["pdcluster.io/role"] == "decode"
    # What the builder renders is what the CRD's schema accepts.
    RoleScalerSpec.model_validate(decode["spec"])
    (colocated,) = build_role_scalers(make_cluster({"colocated": {}}))
    assert colocated["metadata"]["name"] == "demo-colocated"
    with pytest.raises(ValueError, match="no colocated role"):
        build_role_scaler(make_cluster(PD), Role.colocated)


def test_scaler_status_names_the_role_pods_for_the_scale_selector() -> None:
    status = build_role_scaler_status(make_cluster(PD), D, existing=2, synced=2)
    assert status.to_wire() == {
        "replicas": 2,
        "selector": "pdcluster.io/cluster=demo,pdcluster.io/role=decode",
        "syncedReplicas": 2,
    }
    with pytest.raises(ValueError, match=">= 0"):
        build_role_scaler_status(make_cluster(PD), D, existing=-1, synced=None)


@pytest.mark.parametrize(
    ("synced", "cluster", "scaler", "expected"),
    [
        (None, 3, 3, Changed.cluster),  # no record: the cluster is the source
        (None, 3, 1, Changed.cluster),
        (2, 2, 2, Changed.neither),
        (2, 3, 2, Changed.cluster),
        (2, 2, 5, Changed.scaler),
        (2, 3, 5, Changed.both),
        (2, 4, 4, Changed.both),
    ],
)
def test_which_side_changed_since_the_last_sync(
    synced: int | None, cluster: int, scaler: int, expected: Changed
) -> None:
    assert changed_since(synced, cluster, scaler) is expected


# Every combination: (changed, cluster, scaler, autoscaling) ->
# (cluster patch, scaler patch, synced, reason, event reasons).
CASES = [
    # Autoscaling off: hands off, the table alone decides.
    (Changed.neither, 2, 2, None, (None, None, 2, SyncReason.in_sync, [])),
    (Changed.cluster, 3, 2, None, (None, 3, 3, SyncReason.from_cluster, [])),
    (Changed.scaler, 2, 5, None, (5, None, 5, SyncReason.from_scaler, [])),
    (Changed.both, 3, 5, None, (5, None, 5, SyncReason.conflict, ["ReplicasConflict"])),
    (Changed.both, 4, 4, None, (None, None, 4, SyncReason.in_sync, [])),
    (Changed.cluster, 0, 2, None, (None, 0, 0, SyncReason.from_cluster, [])),
    (Changed.scaler, 2, 9, None, (9, None, 9, SyncReason.from_scaler, [])),  # no bounds
    # Autoscaling on, inside [2, 4]: the same as off.
    (Changed.neither, 3, 3, BOUNDED, (None, None, 3, SyncReason.in_sync, [])),
    (Changed.cluster, 4, 3, BOUNDED, (None, 4, 4, SyncReason.from_cluster, [])),
    (Changed.scaler, 3, 2, BOUNDED, (2, None, 2, SyncReason.from_scaler, [])),
    (Changed.both, 3, 4, BOUNDED, (4, None, 4, SyncReason.conflict, ["ReplicasConflict"])),
    # Autoscaling on, outside: the value taken is clamped on both sides.
    (Changed.scaler, 3, 9, BOUNDED, (4, 4, 4, SyncReason.clamped, ["ReplicasClamped"])),
    (Changed.scaler, 3, 0, BOUNDED, (2, 2, 2, SyncReason.clamped, ["ReplicasClamped"])),
    (Changed.cluster, 1, 3, BOUNDED, (2, 2, 2, SyncReason.clamped, ["ReplicasClamped"])),
    (Changed.neither, 6, 6, BOUNDED, (4, 4, 4, SyncReason.clamped, ["ReplicasClamped"])),
    (
        Changed.both,
        3,
        8,
        BOUNDED,
        (4, 4, 4, SyncReason.clamped, ["ReplicasConflict", "ReplicasClamped"]),
    ),
]


@pytest.mark.parametrize(("changed", "cluster", "scaler", "autoscaling", "expected"), CASES)
def test_sync_decision_for_every_combination(
    changed: Changed,
    cluster: int,
    scaler: int,
    autoscaling: RoleAutoscalingSpec | None,
    expected: tuple[object, ...],
) -> None:
    sync = decide_scaler_sync(P, cluster, scaler, changed, autoscaling)
    got = (
        sync.cluster_replicas,
        sync.scaler_replicas,
        sync.synced,
        sync.reason,
        [e.reason for e in sync.events],
    )
    assert got == expected


def test_the_table_covers_every_change_and_the_scaler_wins_a_conflict() -> None:
    covered = {c for c, *_ in CASES}
    assert covered == set(Changed)
    sync = decide_scaler_sync(D, 3, 5, Changed.both, None)
    assert "3 and scaler replicas 5 both changed" in sync.events[0].message
    assert "the scaler wins" in sync.events[0].message
    clamp = decide_scaler_sync(P, 3, 9, Changed.scaler, BOUNDED)
    assert clamp.events[0].message == (
        "prefill: replicas 9 from the scaler is outside autoscaling bounds [2, 4]: set to 4"
    )


def test_inconsistent_or_negative_input_is_refused() -> None:
    with pytest.raises(ValueError, match="neither side changed"):
        decide_scaler_sync(P, 2, 3, Changed.neither, None)
    with pytest.raises(ValueError, match=">= 0"):
        decide_scaler_sync(P, -1, 3, Changed.cluster, None)


@given(
    synced=st.none() | st.integers(0, 8),
    cluster=st.integers(0, 8),
    scaler=st.integers(0, 8),
    bounded=st.booleans(),
)
def test_after_a_sync_both_sides_hold_the_synced_value_and_a_second_sync_is_a_noop(
    synced: int | None, cluster: int, scaler: int, bounded: bool
) -> None:
    autoscaling = BOUNDED if bounded else None
    sync = compute_scaler_sync(P, cluster, scaler, synced, autoscaling)
    after_cluster = cluster if sync.cluster_replicas is None else sync.cluster_replicas
    after_scaler = scaler if sync.scaler_replicas is None else sync.scaler_replicas
    assert after_cluster == after_scaler == sync.synced
    if bounded:
        assert 2 <= sync.synced <= 4
    again = compute_scaler_sync(P, after_cluster, after_scaler, sync.synced, autoscaling)
    assert again.is_noop and again.events == ()


def test_a_scale_write_then_a_cluster_write_each_reach_the_other_side() -> None:
    """kubectl scale on the scaler, then an edit of the PDCluster: each is copied over."""
    cluster, scaler, synced = 1, 1, None
    # Created (no record yet), then `kubectl scale --replicas=3`, then the PDCluster set to 2.
    for cluster, scaler, want in [(1, 1, 1), (1, 3, 3), (2, 3, 2)]:
        sync = compute_scaler_sync(D, cluster, scaler, synced, None)
        cluster = sync.cluster_replicas if sync.cluster_replicas is not None else cluster
        scaler = sync.scaler_replicas if sync.scaler_replicas is not None else scaler
        synced = sync.synced
        assert cluster == scaler == want


@given(
    synced=st.none() | st.integers(0, 8),
    cluster=st.integers(0, 8),
    scaler=st.integers(0, 12),
    total=st.integers(1, 16),
    per_instance=st.integers(1, 4),
    others=st.integers(0, 16),
    bounded=st.booleans(),
)
def test_a_value_from_the_scaler_never_spends_gpus_the_budget_forbids(
    synced: int | None,
    cluster: int,
    scaler: int,
    total: int,
    per_instance: int,
    others: int,
    bounded: bool,
) -> None:
    """Taken from the scaler, the replicas fit maxTotalGPUs beside the other roles,
    or are no more than the PDCluster already had; the cluster's own value is
    never cut by the budget here (the planner scales down)."""
    budget = GpuBudget(total, per_instance, others)
    autoscaling = BOUNDED if bounded else None
    changed = changed_since(synced, cluster, scaler)
    sync = compute_scaler_sync(P, cluster, scaler, synced, autoscaling, budget)
    unbudgeted = compute_scaler_sync(P, cluster, scaler, synced, autoscaling)

    def fits(replicas: int) -> bool:
        return replicas * per_instance + others <= total

    moved = changed in (Changed.scaler, Changed.both)  # the scaler's value is taken

    assert sync.synced <= unbudgeted.synced
    if moved:
        assert fits(sync.synced) or sync.synced <= cluster
    if fits(unbudgeted.synced) or unbudgeted.synced <= cluster or not moved:
        assert sync == unbudgeted  # nothing to hold back
    else:
        assert sync.reason is SyncReason.clamped and sync.events[-1].reason == "ReplicasClamped"
