"""Deterministic child names and the hashes that decide which pods restart."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.operator import names
from pdcluster.operator.names import InvalidNameError
from pdcluster.operator.reconcile.revision import (
    compute_cluster_revision,
    compute_router_hash,
    compute_template_hash,
)
from pdcluster.runtime.spec import Role

from .helpers import PD, make_cluster

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
AUTOSCALING_TARGET = {"metric": "ttftP90Seconds", "value": 0.5}
cluster_names = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)


@given(
    cluster=cluster_names,
    role=st.sampled_from(list(Role)),
    index=st.integers(0, 1023),
    template=st.from_regex(r"[0-9a-f]{8}", fullmatch=True),
    pod=st.integers(0, 63),
)
def test_every_child_name_is_a_valid_service_and_pod_name(cluster, role, index, template, pod):
    for name in (
        names.pod_name(cluster, role, index, template, pod),
        names.bootstrap_service_name(cluster, index, template),
        names.router_name(cluster),
        names.config_map_name(cluster),
        names.token_secret_name(cluster),
        names.runtime_account_name(cluster),
    ):
        assert len(name) <= 63 and DNS_1035.match(name), name


@given(
    cluster=cluster_names,
    a=st.tuples(st.integers(0, 1023), st.integers(0, 63)),
    b=st.tuples(st.integers(0, 1023), st.integers(0, 63)),
)
def test_distinct_pods_get_distinct_names(cluster, a, b):
    name_a = names.pod_name(cluster, Role.prefill, a[0], "abcd1234", a[1])
    name_b = names.pod_name(cluster, Role.prefill, b[0], "abcd1234", b[1])
    assert (name_a == name_b) == (a == b)


def test_long_cluster_names_keep_the_suffix_and_stay_apart() -> None:
    one, two = "x" * 60 + "one", "x" * 60 + "two"
    a = names.pod_name(one, Role.decode, 7, "abcd1234", 1)
    b = names.pod_name(two, Role.decode, 7, "abcd1234", 1)
    assert a != b and a.endswith("-decode-7-abcd1234-1") and len(a) <= 63
    assert names.router_name("short") == "short-router"
    assert names.router_name("9lives") == "c9lives-router"  # Services need a leading letter


def test_names_that_cannot_fit_are_refused() -> None:
    with pytest.raises(InvalidNameError, match="empty"):
        names.fit_name("", "router")
    with pytest.raises(InvalidNameError, match="no room"):
        names.fit_name("demo", "x" * 70)
    with pytest.raises(InvalidNameError, match="valid object name"):
        names.fit_name("Demo", "router")


def test_scaling_changes_no_hash() -> None:
    base = make_cluster(PD).spec
    scaled = make_cluster(
        {"prefill": {"replicas": 4}, "decode": {"replicas": 9}, "router": {"replicas": 3}}
    ).spec
    for role in (Role.prefill, Role.decode):
        assert compute_template_hash(base, role) == compute_template_hash(scaled, role)
    assert compute_cluster_revision(base) == compute_cluster_revision(scaled)
    assert compute_router_hash(base) == compute_router_hash(scaled)


def test_writing_a_default_explicitly_changes_no_hash() -> None:
    explicit = make_cluster(
        {
            "prefill": {"topology": {"tp": 1}, "gpusPerPod": 1},
            "decode": {},
            "kvCache": {"pageSize": 16},
        }
    ).spec
    implicit = make_cluster(PD).spec
    assert compute_template_hash(explicit, Role.prefill) == compute_template_hash(
        implicit, Role.prefill
    )
    assert compute_cluster_revision(explicit) == compute_cluster_revision(implicit)


@pytest.mark.parametrize(
    ("prefill", "expected"),
    [
        # Hashes computed before gpusPerPod could be left out (it defaulted to 1):
        # the same manifests must keep them, or an operator upgrade rolls every pod.
        ({}, "285520ff"),
        ({"topology": {"tp": 2}}, "7adeb2d8"),
        ({"topology": {"tp": 2}, "gpusPerPod": 1}, "7adeb2d8"),
        ({"topology": {"tp": 2}, "gpusPerPod": 2}, "42a0036f"),
    ],
)
def test_gpus_per_pod_hashes_as_before_it_could_be_left_out(
    prefill: dict[str, Any], expected: str
) -> None:
    spec = make_cluster({"prefill": prefill, "decode": {}}).spec
    assert compute_template_hash(spec, Role.prefill) == expected


@pytest.mark.parametrize(
    ("change", "revision", "prefill", "decode"),
    [
        ({"image": "pdcluster:0.2.0"}, True, True, True),
        ({"kvCache": {"pageSize": 32}}, True, True, True),
        ({"transfer": {"checksum": True}}, True, True, True),
        ({"prefill": {"topology": {"tp": 2}}}, False, True, False),
        ({"decode": {"engine": {"maxRunningRequests": 8}}}, False, False, True),
        ({"decode": {"nodeSelector": {"pool": "b"}}}, False, False, True),
        ({"router": {"policy": {"prefill": "random"}}}, False, False, False),
        ({"prefill": {"pod": {"capabilities": ["IPC_LOCK"]}}}, False, True, False),
        ({"model": {"name": "m", "source": {"uri": "pvc://models/m"}}}, True, True, True),
        ({"decode": {"rollout": {"maxSurge": 0, "maxUnavailable": 1}}}, False, False, False),
        ({"decode": {"disruptionBudget": {"maxUnavailable": 2}}}, False, False, False),
        ({"prefill": {"drain": {"timeoutSeconds": 900}}}, False, False, False),
        (
            {
                "prefill": {"autoscaling": {"maxReplicas": 3, "target": AUTOSCALING_TARGET}},
                "autoscaling": {"maxTotalGPUs": 8},
            },
            False,
            False,
            False,
        ),
    ],
    ids=[
        "image",
        "kv-cache",
        "transfer",
        "prefill-topology",
        "decode-engine",
        "decode-sched",
        "router",
        "pod-overlay",
        "model-source",
        "rollout",
        "disruption-budget",
        "drain",
        "autoscaling",
    ],
)
def test_each_change_restarts_exactly_the_pods_that_read_it(change, revision, prefill, decode):
    base = make_cluster(PD).spec
    spec = {**PD, **change}
    changed = make_cluster(spec).spec
    assert (compute_cluster_revision(base) != compute_cluster_revision(changed)) == revision
    assert (
        compute_template_hash(base, Role.prefill) != compute_template_hash(changed, Role.prefill)
    ) == prefill
    assert (
        compute_template_hash(base, Role.decode) != compute_template_hash(changed, Role.decode)
    ) == decode


def test_template_hash_of_an_absent_role_is_an_error() -> None:
    with pytest.raises(ValueError, match="no colocated role"):
        compute_template_hash(make_cluster(PD).spec, Role.colocated)
