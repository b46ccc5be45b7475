"""The pod entry points read their secrets from mounted files: the worker's
cluster token (`PDCLUSTER_TOKEN_FILE`) and the router's API keys
(`pdcluster router --api-key-file`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdcluster.runtime.cli import build_parser, load_manifest
from pdcluster.runtime.cluster_token import read_cluster_token
from pdcluster.runtime.router.cli import parse_invocation
from pdcluster.runtime.router_main import router_invocation


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


def test_pdcluster_router_passes_the_api_key_file_on(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1\nk2\n")
    workers = ["--colocated", "http://127.0.0.1:1"]
    args = build_parser().parse_args(["router", *workers, "--api-key-file", str(keys)])
    assert router_invocation(None, args, env={}).config.api_keys == ("k1", "k2")
    plain = build_parser().parse_args(["router", *workers])
    assert router_invocation(None, plain, env={}).config.api_keys == ()


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("example", ["pd-1p1d.yaml", "colocated.yaml"])
def test_pdcluster_router_builds_what_the_router_command_line_builds(example: str) -> None:
    # `pdcluster router` hands its loaded manifest over as it is; the settings
    # equal those of `python -m pdcluster.runtime.router` with the same file.
    path = str(EXAMPLES / example)
    flags = ["--port", "8001", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    args = build_parser().parse_args(["router", "-f", path, *flags])
    got = router_invocation(load_manifest(path), args, env={})
    want = parse_invocation(["--manifest", path, "--log-level", "warning", *flags], env={})
    assert got == want
    assert got.config.model_name == load_manifest(path).spec.model.name


def test_a_manifest_from_the_environment_leaves_no_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDC_MANIFEST", (EXAMPLES / "pd-1p1d.yaml").read_text())
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # honour TMPDIR from here on
    args = build_parser().parse_args(
        ["router", "-f", "env:PDC_MANIFEST", "--prefill", "http://a:1", "--decode", "http://b:2"]
    )
    inv = router_invocation(load_manifest("env:PDC_MANIFEST"), args, env={})
    assert inv.config.model_name == load_manifest("env:PDC_MANIFEST").spec.model.name
    assert list(tmp_path.iterdir()) == []


def test_kubernetes_discovery_needs_namespace_and_cluster() -> None:
    args = build_parser().parse_args(["router", "--kubernetes", "--namespace", "ns"])
    with pytest.raises(SystemExit, match="needs --namespace and --cluster"):
        router_invocation(None, args, env={})
    args = build_parser().parse_args(
        ["router", "--kubernetes", "--namespace", "ns", "--cluster", "c1"]
    )
    kube = router_invocation(None, args, env={}).config.kubernetes
    assert kube is not None
    assert (kube.namespace, kube.label_selector) == ("ns", "pdcluster.io/cluster=c1")
