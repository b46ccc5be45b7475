"""Reading the UCX transports NIXL selected from UCX's log lines."""
# ruff: noqa: E501  (UCX log lines, verbatim)

from pdcluster.runtime.transfer.ucx_report import is_tcp_fallback, parse_ucx_lanes, transports_of

CPU_LOG = """\
[1.0] [vm:1:0]  ucp_context.c:2753 UCX  INFO  Version 1.23.0
[1.1] [vm:1:0]  ucp_worker.c:1997 UCX  INFO    agent-a self cfg#0 rma_am(tcp/lo)  am(tcp/lo cma/memory)
[1.2] [vm:1:1]  ucp_worker.c:1997 UCX  INFO    agent-a intra-node cfg#1 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
"""
RDMA_LOG = """\
[2.0] [gpu:7:1] ucp_worker.c:1997 UCX  INFO    agent-b inter-node cfg#2 rma_bw(rc_mlx5/mlx5_0:1 cuda_ipc/cuda) am(rc_mlx5/mlx5_0:1)
"""


def test_lanes_of_peer_configs_are_read_and_the_self_loop_ignored() -> None:
    lanes = parse_ucx_lanes(CPU_LOG)
    assert lanes == {
        "am": ["cma/memory", "tcp/lo"],
        "amo_am": ["tcp/lo"],
        "ka": ["tcp/lo"],
        "rma_am": ["tcp/lo"],
    }
    assert transports_of(lanes) == ["cma", "tcp"]


def test_a_cpu_box_is_a_tcp_fallback_an_rdma_link_is_not() -> None:
    assert is_tcp_fallback(parse_ucx_lanes(CPU_LOG))
    lanes = parse_ucx_lanes(RDMA_LOG)
    assert transports_of(lanes) == ["cuda_ipc", "rc_mlx5"]
    assert not is_tcp_fallback(lanes)


def test_no_peer_yet_is_no_verdict() -> None:
    assert parse_ucx_lanes("") == {}
    assert not is_tcp_fallback({})
    # Only the self loop-back configuration: no peer reached yet.
    assert not is_tcp_fallback(parse_ucx_lanes(CPU_LOG.splitlines()[1]))
