"""Where a worker reaches its instance's dp groups (worker_main.WorkerSettings)."""

from __future__ import annotations

from pdcluster.runtime.pod_rendezvous import group_hosts, plan_pod
from pdcluster.runtime.spec import Role, parse_manifest
from pdcluster.runtime.worker_main import WorkerSettings


def settings(topology: dict[str, int], gpus: int | None, pod: int, own: str) -> WorkerSettings:
    manifest = parse_manifest(
        {
            "apiVersion": "pdcluster.io/v1alpha1",
            "kind": "PDCluster",
            "metadata": {"name": "c"},
            "spec": {"prefill": {"topology": topology, "gpusPerPod": gpus}, "decode": {}},
        }
    )
    dp = topology["dp"]
    base = WorkerSettings(
        manifest=manifest,
        role=Role.prefill,
        instance=0,
        host=own,
        advertise_host=own,
        port=8000,
        dist_port=29500,
        bootstrap_port=8998,
        token="t",
        shm_dir=None,
        dp_ports=tuple(29500 + dp + d for d in range(dp - 1)),
        dp_dist_ports=tuple(29500 + d for d in range(1, dp)),
        pod_index=pod,
        leader_host=None if pod == 0 else "10.0.0.0",
    )
    if not base.layout.is_multi_pod:
        return base  # one pod: no address exchange (worker_main._with_group_hosts)
    plan = plan_pod(base.layout, dp, pod)
    known = {k: f"10.0.0.{k}" for k in plan.needs}
    hosts = group_hosts(base.layout, dp, pod, own, base.leader_advertise_host, known)
    return WorkerSettings(**{**base.__dict__, "group_hosts": hosts})


def test_the_front_reaches_remote_dp_leaders_at_their_pods_and_local_ones_on_loopback() -> None:
    # dp4 over two pods of 2: groups 0, 1 on pod 0, groups 2, 3 on pod 1.
    front = settings({"dp": 4}, 2, 0, "10.0.0.0")
    assert front.dp_urls == (
        "http://127.0.0.1:29504",
        "http://10.0.0.1:29505",
        "http://10.0.0.1:29506",
    )
    assert [front.group_store_host(d) for d in range(4)] == ["10.0.0.0"] * 2 + ["10.0.0.1"] * 2
    assert front.dp_http_host(1) == "127.0.0.1"


def test_a_pod_serves_its_dp_leaders_on_its_own_address() -> None:
    pod1 = settings({"dp": 4}, 2, 1, "10.0.0.1")
    assert pod1.dp_http_host(2) == pod1.dp_http_host(3) == "10.0.0.1"
    assert pod1.group_store_host(2) == "10.0.0.1"


def test_a_group_spanning_pods_dials_its_leaders_pod() -> None:
    # dp2 tp2 one rank a pod: pod 3 runs group 1's follower, led by pod 2.
    pod3 = settings({"dp": 2, "tp": 2}, 1, 3, "10.0.0.3")
    assert pod3.group_store_host(1) == "10.0.0.2"
    pod1 = settings({"dp": 2, "tp": 2}, 1, 1, "10.0.0.1")
    assert pod1.group_store_host(0) == "10.0.0.0"


def test_one_pod_dp_keeps_every_group_on_loopback() -> None:
    one = settings({"dp": 2}, None, 0, "10.0.0.0")
    assert one.dp_urls == ("http://127.0.0.1:29502",)
    assert one.group_store_host(1) == "127.0.0.1"


def test_a_loopback_pod_address_is_kept_so_pods_sharing_a_network_do_not_collide() -> None:
    one = settings({"dp": 2}, None, 0, "127.0.3.4")
    assert one.dp_urls == ("http://127.0.3.4:29502",)
    assert one.dp_http_host(1) == one.group_store_host(1) == "127.0.3.4"
