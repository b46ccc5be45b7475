"""Local-mode planning: a manifest becomes the right processes and ports."""

from pathlib import Path

import pytest

from pdcluster.runtime.local.plan import ProcessSpec, build_local_plan, count_ports
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


def test_a_multi_pod_instance_is_one_process_per_pod_sharing_the_instance_ports() -> None:
    m = cluster(
        {
            "prefill": {"replicas": 2, "topology": {"tp": 2}, "gpusPerPod": 1},
            "decode": {"topology": {"tp": 2}},
        }
    )
    ports = list(range(40000, 40000 + count_ports(m)))
    plan = build_local_plan(m, "/m.yaml", ports, python="py")
    names = [w.name for w in plan.workers]
    assert names == ["prefill-0-0", "prefill-0-1", "prefill-1-0", "prefill-1-1", "decode-0"]
    p0, p1 = plan.workers[0], plan.workers[1]
    assert (p0.pod, p0.first_rank, p0.num_ranks, p0.is_leader) == (0, 0, 1, True)
    assert (p1.pod, p1.first_rank, p1.num_ranks, p1.is_leader) == (1, 1, 1, False)
    # Pod 1 dials the leader's ports: same argv but its pod index, and the leader's address.
    assert p1.argv == (*p0.argv[:-2], "--pod-index", "1")
    assert p0.argv[-2:] == ("--pod-index", "0")
    assert (p1.port, p1.bootstrap_port) == (p0.port, p0.bootstrap_port)
    assert p1.env == {"PDCLUSTER_LEADER_ADDRESS": "127.0.0.1"} and p0.env == {}
    # The router and decode see instances (their leaders), not pods.
    assert [w.name for w in plan.leaders] == ["prefill-0-0", "prefill-1-0", "decode-0"]
    assert plan.router.argv.count("--prefill") == 2
    decode_argv = plan.workers[-1].argv
    peers = decode_argv[decode_argv.index("--prefill-peers") + 1].split(",")
    assert peers == [
        f"127.0.0.1:{p0.bootstrap_port}",
        f"127.0.0.1:{plan.workers[2].bootstrap_port}",
    ]
    assert plan.workers[-1].pod == 0 and plan.workers[-1].num_pods == 1


def test_ps_shows_each_pod_and_its_ranks() -> None:
    from pdcluster.runtime.local.launcher import format_state

    m = cluster({"prefill": {"topology": {"tp": 4}, "gpusPerPod": 2}, "decode": {}})
    plan = build_local_plan(m, "/m.yaml", list(range(40000, 40010)), python="py")
    procs = [
        {
            "name": w.name,
            "role": str(w.role),
            "num_ranks": w.num_ranks,
            "pod": w.pod,
            "num_pods": w.num_pods,
            "first_rank": w.first_rank,
            "pid": 1,
            "alive": True,
            "url": w.url,
            "bootstrap_port": w.bootstrap_port,
        }
        for w in plan.workers
    ]
    text = format_state({"cluster": "c", "endpoint": plan.endpoint, "processes": procs})
    rows = {line.split()[0]: line.split() for line in text.splitlines()[2:]}
    assert rows["prefill-0-0"][2:4] == ["0/2", "0-1"]
    assert rows["prefill-0-1"][2:4] == ["1/2", "2-3"]
    assert rows["decode-0"][2:4] == ["-", "1"]


def _argv_ports(argv: tuple[str, ...]) -> list[int]:
    """Every port a worker's argv names (what its ranks will bind)."""
    out: list[int] = []
    for flag in ("--port", "--dist-port", "--bootstrap-port", "--dp-ports", "--dp-dist-ports"):
        if flag in argv:
            out += [int(p) for p in argv[argv.index(flag) + 1].split(",")]
    return out


def _bound_ports(w: ProcessSpec) -> list[int]:
    """The ports its argv names, and vLLM's NIXL side channel (a variable)."""
    side = w.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    return _argv_ports(w.argv) + ([int(side)] if side else [])


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_no_two_processes_of_an_example_plan_share_a_port(path: Path) -> None:
    import yaml

    m = parse_manifest(yaml.safe_load(path.read_text()))
    ports = list(range(40000, 40000 + count_ports(m)))
    plan = build_local_plan(m, str(path), ports, python="py", vllm="vllm")
    # An instance's pods share its ports (each port is bound by one rank of one pod);
    # different instances and the router share none.
    taken: dict[int, str] = {plan.router.port: "router"}
    for w in plan.leaders:
        argv_ports = _bound_ports(w)
        assert sorted(argv_ports) == sorted(w.ports), w.name
        rs = m.spec.role_spec(w.role)  # type: ignore[arg-type]
        assert rs is not None
        dp = rs.topology.dp
        if m.spec.engine.is_vllm:  # one `vllm serve`: no store or dp ports of ours
            assert w.dist_ports == () and w.dp_ports == () and len(w.side_channel_ports) == dp
        else:
            assert len(w.dist_ports) == dp and len(w.dp_ports) == dp - 1, w.name
        for port in w.ports:
            assert port not in taken, f"{w.name} and {taken.get(port)} share port {port}"
            taken[port] = w.name
    for w in plan.workers:
        leader = next(x for x in plan.leaders if (x.role, x.instance) == (w.role, w.instance))
        assert w.ports == leader.ports and _argv_ports(w.argv) == _argv_ports(leader.argv)
    assert set(taken) == set(ports), "every port drawn is handed to exactly one instance"


def test_a_dp2_instance_gets_its_dp_ports_from_the_plan() -> None:
    m = cluster({"prefill": {"topology": {"dp": 3}}, "decode": {"topology": {"dp": 2}}})
    plan = build_local_plan(m, "/m.yaml", list(range(40000, 40000 + count_ports(m))), python="py")
    prefill, decode = plan.leaders
    assert len(prefill.dist_ports) == 3 and len(prefill.dp_ports) == 2
    argv = list(prefill.argv)
    assert argv[argv.index("--dp-ports") + 1] == ",".join(map(str, prefill.dp_ports))
    assert argv[argv.index("--dp-dist-ports") + 1] == ",".join(map(str, prefill.dist_ports[1:]))
    assert int(argv[argv.index("--dist-port") + 1]) == prefill.dist_ports[0]
    assert len(decode.dist_ports) == 2 and len(decode.dp_ports) == 1
    assert not set(prefill.ports) & set(decode.ports)


def test_an_instance_with_too_few_or_repeated_ports_is_an_error() -> None:
    from pdcluster.runtime.local.plan import build_instance_specs, instance_ports
    from pdcluster.runtime.spec import Role

    m = cluster({"prefill": {"topology": {"dp": 2}}, "decode": {}})
    assert instance_ports(m, Role.prefill) == 5
    with pytest.raises(ValueError, match="dp=2 needs 5 ports"):
        build_instance_specs(m, "/m.yaml", Role.prefill, 0, [1, 2, 3], [], "py")
    with pytest.raises(ValueError, match="distinct"):
        build_instance_specs(m, "/m.yaml", Role.prefill, 0, [1, 2, 3, 4, 4], [], "py")
