"""During a rollout a prefill pairs only with a decode of the same revision."""

from __future__ import annotations

import pytest

from pdcluster.runtime.router.discovery import (
    REVISION_LABEL,
    KubernetesDiscoverySettings,
    decide_pod,
)
from pdcluster.runtime.router.errors import NoHealthyWorkerError
from pdcluster.runtime.router.leg_plan import pairable
from pdcluster.runtime.router.workers import Worker
from pdcluster.runtime.spec import Role


def w(url: str, role: Role, revision: str) -> Worker:
    return Worker(url=url, role=role, revision=revision, healthy=True, bootstrap_port=8998)


P, D = Role.prefill, Role.decode


def test_only_revisions_with_both_roles_are_candidates() -> None:
    prefills = [w("http://p-old", P, "a"), w("http://p-new", P, "b")]
    decodes = [w("http://d-old", D, "a")]
    ps, ds = pairable(prefills, decodes)
    assert [p.url for p in ps] == ["http://p-old"]
    assert [d.url for d in ds] == ["http://d-old"]


def test_both_revisions_serve_while_both_have_pairs() -> None:
    prefills = [w("http://p-old", P, "a"), w("http://p-new", P, "b")]
    decodes = [w("http://d-old", D, "a"), w("http://d-new", D, "b")]
    ps, ds = pairable(prefills, decodes)
    assert {p.revision for p in ps} == {d.revision for d in ds} == {"a", "b"}


def test_no_common_revision_is_a_clear_error() -> None:
    with pytest.raises(NoHealthyWorkerError):
        pairable([w("http://p", P, "a")], [w("http://d", D, "b")])


def test_static_workers_without_revision_all_pair() -> None:
    ps, ds = pairable([w("http://p", P, "")], [w("http://d", D, "")])
    assert len(ps) == len(ds) == 1


def test_discovery_reads_the_revision_label() -> None:
    pod = {
        "metadata": {
            "name": "c-prefill-0",
            "labels": {"pdcluster.io/role": "prefill", REVISION_LABEL: "abc123"},
        },
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    decision = decide_pod(pod, KubernetesDiscoverySettings(namespace="ns", default_port=8000))
    assert decision.target is not None and decision.target.revision == "abc123"
