"""The pod entry points read their secrets from mounted files: the worker's
cluster token (`PDCLUSTER_TOKEN_FILE`) and the router's API keys
(`pdcluster router --api-key-file`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdcluster.runtime.cli import build_parser
from pdcluster.runtime.cluster_token import read_cluster_token
from pdcluster.runtime.router_main import router_argv


def test_the_token_file_wins_and_is_stripped(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-the-file\n")
    env = {"PDCLUSTER_TOKEN_FILE": str(path), "PDCLUSTER_TOKEN": "from-the-env"}
    assert read_cluster_token(env) == "from-the-file"


def test_local_mode_still_hands_the_token_by_variable() -> None:
    assert read_cluster_token({"PDCLUSTER_TOKEN": "local"}) == "local"
    assert read_cluster_token({}) == ""


def test_an_unreadable_or_empty_token_file_stops_the_worker(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="cannot read the cluster token from .*absent"):
        read_cluster_token({"PDCLUSTER_TOKEN_FILE": str(tmp_path / "absent")})
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(SystemExit, match="is empty"):
        # An empty file must not fall back to an unauthenticated worker.
        read_cluster_token({"PDCLUSTER_TOKEN_FILE": str(empty), "PDCLUSTER_TOKEN": ""})
    locked = tmp_path / "locked"
    locked.write_text("t")
    locked.chmod(0)
    if os.geteuid() != 0:  # root reads any file
        with pytest.raises(SystemExit, match="cannot read"):
            read_cluster_token({"PDCLUSTER_TOKEN_FILE": str(locked)})


def test_pdcluster_router_passes_the_api_key_file_on() -> None:
    args = build_parser().parse_args(
        ["router", "--port", "8001", "--api-key-file", "/var/run/keys/keys"]
    )
    argv = router_argv(None, args)
    assert argv[argv.index("--api-key-file") + 1] == "/var/run/keys/keys"
    plain = build_parser().parse_args(["router", "--port", "8001"])
    assert "--api-key-file" not in router_argv(None, plain)
