"""Local-mode planning: a manifest becomes the right processes and ports."""

import pytest

from pdcluster.runtime.local.plan import build_local_plan, count_ports
from pdcluster.runtime.spec import parse_manifest


def cluster(spec: dict):
    return parse_manifest(
        {
            "apiVersion": "pdcluster.io/v1alpha1",
            "kind": "PDCluster",
            "metadata": {"name": "c"},
            "spec": spec,
        }
    )


def test_two_prefill_two_decode() -> None:
    m = cluster({"prefill": {"replicas": 2, "topology": {"tp": 2}}, "decode": {"replicas": 2}})
    ports = list(range(40000, 40000 + count_ports(m)))
    plan = build_local_plan(m, "/m.yaml", ports, python="py")
    assert [w.name for w in plan.workers] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    used = [p for w in plan.workers for p in (w.port, w.bootstrap_port) if p] + [plan.router.port]
    assert len(used) == len(set(used)), "ports must not be shared"
    assert all(w.bootstrap_port for w in plan.workers if w.role == "prefill")
    assert not any(w.bootstrap_port for w in plan.workers if w.role == "decode")
    assert plan.workers[0].num_ranks == 2
    argv = plan.router.argv
    assert argv.count("--prefill") == 2 and argv.count("--decode") == 2
    assert plan.endpoint == f"http://127.0.0.1:{plan.router.port}"


def test_colocated_and_fixed_router_port() -> None:
    m = cluster({"colocated": {"replicas": 1}})
    plan = build_local_plan(m, "/m.yaml", list(range(50000, 50010)), python="py", router_port=8123)
    assert [w.role for w in plan.workers] == ["colocated"]
    assert plan.router.port == 8123


def test_too_few_ports_is_an_error() -> None:
    m = cluster({"prefill": {}, "decode": {}})
    with pytest.raises(ValueError, match="needs"):
        build_local_plan(m, "/m.yaml", [1, 2], python="py")


def test_decode_is_told_exactly_the_prefill_bootstrap_servers() -> None:
    m = cluster({"prefill": {"replicas": 2}, "decode": {"replicas": 2}})
    plan = build_local_plan(m, "/m.yaml", list(range(41000, 41000 + count_ports(m))), python="py")
    want = ",".join(f"127.0.0.1:{w.bootstrap_port}" for w in plan.workers if w.role == "prefill")
    for w in plan.workers:
        argv = list(w.argv)
        if w.role == "decode":
            assert argv[argv.index("--prefill-peers") + 1] == want
        else:
            assert "--prefill-peers" not in argv
