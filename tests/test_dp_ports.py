"""The ports of an instance's dp groups (runtime/dp_ports.py)."""

import pytest

from pdcluster.runtime.dp_ports import (
    DpPortsError,
    derived_dp_ports,
    parse_port_list,
    resolve_dp_ports,
)


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_derived_ports_are_the_distinct_block_above_the_store(dp: int) -> None:
    ports = resolve_dp_ports(dp, 29500, None, None)
    assert ports == derived_dp_ports(dp, 29500)
    assert ports.dp == dp and len(ports.http_ports) == dp - 1
    assert ports.dist_ports == tuple(range(29500, 29500 + dp))
    assert sorted(ports.all_ports) == list(range(29500, 29500 + 2 * dp - 1))
    for d in range(1, dp):
        assert ports.http_port(d) == 29500 + dp + d - 1


def test_given_ports_are_used_as_given() -> None:
    ports = resolve_dp_ports(3, 20000, (21000, 21001), (22000, 22001))
    assert ports.dist_ports == (20000, 22000, 22001)
    assert ports.http_ports == (21000, 21001)
    assert ports.dist_port(2) == 22001 and ports.http_port(1) == 21000


def test_group_zero_has_no_internal_port() -> None:
    with pytest.raises(DpPortsError, match="group 0"):
        resolve_dp_ports(2, 20000, None, None).http_port(0)


@pytest.mark.parametrize(
    ("dp", "http", "dist", "match"),
    [
        (2, (21000,), None, "go together"),
        (2, None, (21000,), "go together"),
        (3, (21000,), (22000, 22001), "--dp-ports needs one port per dp group after the first"),
        (2, (21000,), (22000, 22001), r"--dp-dist-ports needs .*\(1 for dp=2\), got 2"),
        (2, (20000,), (22000,), "distinct"),
        (3, (21000, 21001), (21000, 22000), "distinct"),
        (2, (0,), (22000,), "outside 1-65535"),
        (0, None, None, "at least 1"),
    ],
)
def test_ports_that_do_not_fit_are_refused(dp, http, dist, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DpPortsError, match=match):
        resolve_dp_ports(dp, 20000, http, dist)


def test_a_derived_block_past_the_last_port_is_refused() -> None:
    with pytest.raises(DpPortsError, match="outside"):
        resolve_dp_ports(4, 65530, None, None)


def test_port_lists_parse_and_bad_items_are_named() -> None:
    assert parse_port_list("20001, 20002", "--dp-ports") == (20001, 20002)
    assert parse_port_list("", "--dp-ports") == ()
    with pytest.raises(DpPortsError, match="--dp-ports: 'x' is not a port number"):
        parse_port_list("20001,x", "--dp-ports")
    with pytest.raises(DpPortsError, match="--dp-ports: port 70000"):
        parse_port_list("70000", "--dp-ports")
