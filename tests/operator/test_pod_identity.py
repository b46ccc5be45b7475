"""Worker pod names and labels, and reading (role, instance, pod index) back from them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.operator import names
from pdcluster.operator.names import PodIdentity
from pdcluster.runtime.spec import Role

clusters = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", fullmatch=True)
identities = st.builds(
    PodIdentity,
    role=st.sampled_from(list(Role)),
    instance=st.integers(0, 1023),
    template_hash=st.from_regex(r"[0-9a-f]{8}", fullmatch=True),
    pod_index=st.integers(0, 63),
)


@given(clusters, identities)
def test_a_pod_name_reads_back_to_its_identity(cluster: str, identity: PodIdentity) -> None:
    name = identity.name(cluster)
    assert len(name) <= names.MAX_NAME
    assert names.pod_identity_from_name(cluster, name) == identity


@given(identities)
def test_pod_labels_read_back_to_their_identity(identity: PodIdentity) -> None:
    labels = {**names.pod_identity_labels(identity), names.LABEL_CLUSTER: "demo"}
    assert names.pod_identity_from_labels(labels) == identity


@given(clusters, identities, identities)
def test_distinct_pods_of_a_cluster_get_distinct_names(
    cluster: str, a: PodIdentity, b: PodIdentity
) -> None:
    assert (a.name(cluster) == b.name(cluster)) == (a == b)


def test_the_pods_of_one_instance_share_its_selector_and_no_other_does() -> None:
    pods = [PodIdentity(Role.prefill, 2, "abcd1234", k) for k in range(3)]
    others = [
        PodIdentity(Role.decode, 2, "abcd1234", 0),
        PodIdentity(Role.prefill, 3, "abcd1234", 0),
        PodIdentity(Role.prefill, 2, "00000000", 0),
    ]
    selector = names.instance_selector("demo", Role.prefill, 2, "abcd1234")

    def selected(identity: PodIdentity) -> bool:
        labels = {**names.pod_identity_labels(identity), names.LABEL_CLUSTER: "demo"}
        return all(labels.get(k) == v for k, v in selector.items())

    assert all(selected(p) for p in pods)
    assert not any(selected(p) for p in others)


def test_the_name_spells_cluster_role_instance_template_and_pod_index() -> None:
    assert PodIdentity(Role.decode, 1, "abcd1234", 2).name("demo") == "demo-decode-1-abcd1234-2"
    assert names.instance_name("demo", Role.decode, 1, "abcd1234") == "demo-decode-1-abcd1234"


@pytest.mark.parametrize(
    "name",
    [
        "other-prefill-0-abcd1234-0",  # another cluster's pod
        "demo-router",
        "demo-prefill-0-abcd1234",  # an instance name, no pod index
        "demo-router-0-abcd1234-0",  # not a worker role
        "demo-prefill-01-abcd1234-0",  # an index written with a leading zero
        "demo-prefill-0-ABCD1234-0",
        "demo-prefill-0-abcd1234--1",
        "xdemo-prefill-0-abcd1234-0",
    ],
)
def test_a_name_that_is_not_a_worker_pod_of_the_cluster_reads_as_none(name: str) -> None:
    assert names.pod_identity_from_name("demo", name) is None


@pytest.mark.parametrize(
    "change",
    [
        {names.LABEL_ROLE: "router"},
        {names.LABEL_INSTANCE_INDEX: "-1"},
        {names.LABEL_INSTANCE_INDEX: "01"},
        {names.LABEL_POD_INDEX: "x"},
        {names.LABEL_TEMPLATE: ""},
    ],
)
def test_malformed_or_missing_labels_read_as_none(change: dict[str, str]) -> None:
    labels = names.pod_identity_labels(PodIdentity(Role.prefill, 0, "abcd1234", 1))
    assert names.pod_identity_from_labels({**labels, **change}) is None
    missing = {k: v for k, v in labels.items() if k not in change}
    assert names.pod_identity_from_labels(missing) is None
