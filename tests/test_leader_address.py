"""Where a pod k > 0 reads its leader's address (runtime/leader_address.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.runtime.leader_address import wait_leader_address
from pdcluster.runtime.pod_rendezvous import RendezvousError


def test_the_argument_wins_then_the_variable_then_the_file(tmp_path: Path) -> None:
    path = tmp_path / "leader"
    path.write_text("10.0.0.3\n")
    env = {"PDCLUSTER_LEADER_ADDRESS": "10.0.0.2", "PDCLUSTER_LEADER_ADDRESS_FILE": str(path)}
    assert wait_leader_address("10.0.0.1", env) == "10.0.0.1"
    assert wait_leader_address(None, env) == "10.0.0.2"
    del env["PDCLUSTER_LEADER_ADDRESS"]
    assert wait_leader_address(None, env) == "10.0.0.3"


def test_an_empty_or_absent_file_is_waited_for_until_the_deadline(tmp_path: Path) -> None:
    for path in (tmp_path / "absent", tmp_path / "empty"):
        if path.name == "empty":
            path.write_text("")
        env = {"PDCLUSTER_LEADER_ADDRESS_FILE": str(path)}
        with pytest.raises(RendezvousError, match=f"no leader address in {path} after 0s"):
            wait_leader_address(None, env, wait_s=0.0)


def test_a_bad_address_in_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "leader"
    path.write_text("tcp://10.0.0.3:1234")
    with pytest.raises(RendezvousError, match="not a URL"):
        wait_leader_address(None, {"PDCLUSTER_LEADER_ADDRESS_FILE": str(path)})


def test_no_source_at_all_says_which_ones_exist() -> None:
    with pytest.raises(RendezvousError, match="--leader-address, .PDCLUSTER_LEADER_ADDRESS"):
        wait_leader_address(None, {})
    with pytest.raises(RendezvousError, match="must be a number"):
        wait_leader_address(
            None,
            {"PDCLUSTER_LEADER_ADDRESS_FILE": "/x", "PDCLUSTER_LEADER_WAIT_SECONDS": "soon"},
        )
