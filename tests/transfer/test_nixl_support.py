"""`transfer.backend: nixl`: parsed, UCX settings applied, refused when NIXL is missing."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.runtime.spec import SpecError, TransferBackend, parse_spec
from pdcluster.runtime.transfer import nixl_support
from pdcluster.runtime.transfer.nixl_support import (
    INSTALL_HINT,
    apply_ucx_env,
    check_backend_available,
)

PD = {"prefill": {}, "decode": {}}


def nixl_spec(**ucx: object) -> dict:
    return {**PD, "transfer": {"backend": "nixl", "ucx": ucx}}


def test_nixl_is_a_one_sided_backend() -> None:
    spec = parse_spec(nixl_spec())
    assert spec.transfer.backend is TransferBackend.nixl
    assert spec.transfer.backend.is_one_sided
    assert TransferBackend.shm.is_one_sided and not TransferBackend.tcp.is_one_sided


def test_ucx_fields_reach_the_environment() -> None:
    spec = parse_spec(nixl_spec(tls="tcp,cma", netDevices="lo", requireRdma=True))
    env: dict[str, str] = {"UCX_TLS": "old"}
    apply_ucx_env(spec.transfer.ucx, env, log_dir="/logs")
    assert env == {
        "UCX_TLS": "tcp,cma",
        "UCX_NET_DEVICES": "lo",
        # UCX names the transports it selected in its info log.
        "UCX_LOG_LEVEL": "info",
        "UCX_LOG_FILE": "/logs/ucx-%p.log",
    }
    assert spec.transfer.ucx.require_rdma


def test_unset_ucx_fields_leave_the_environment_alone() -> None:
    env = {"UCX_TLS": "rc", "UCX_LOG_LEVEL": "warn"}
    apply_ucx_env(parse_spec(nixl_spec()).transfer.ucx, env)
    assert env == {"UCX_TLS": "rc", "UCX_LOG_LEVEL": "warn"}  # the box's own log level wins


@pytest.mark.parametrize("tls", ["tcp;rm -rf", "a b", ""])
def test_ucx_tls_rejects_what_is_not_a_transport_list(tls: str) -> None:
    with pytest.raises(SpecError, match="ucx.tls"):
        parse_spec(nixl_spec(tls=tls))


def test_missing_nixl_fails_validation_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.import_module

    def no_nixl(name: str, *a: object) -> object:
        if name.startswith("nixl"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *a)

    monkeypatch.setattr(nixl_support.importlib, "import_module", no_nixl)
    with pytest.raises(SpecError) as err:
        check_backend_available(parse_spec(nixl_spec()))
    assert INSTALL_HINT in str(err.value) and "spec.transfer.backend" in str(err.value)
    # Other backends never need it.
    check_backend_available(parse_spec({**PD, "transfer": {"backend": "tcp"}}))


def test_pdcluster_up_refuses_a_nixl_manifest_without_nixl(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "apiVersion: pdcluster.io/v1alpha1\nkind: PDCluster\nmetadata: {name: n}\n"
        "spec: {prefill: {}, decode: {}, transfer: {backend: nixl}}\n"
    )
    # A `nixl` module that fails to import stands in for the missing package.
    fake = tmp_path / "fake"
    (fake / "nixl").mkdir(parents=True)
    (fake / "nixl" / "__init__.py").write_text("raise ImportError('no NIXL backend found')\n")
    out = subprocess.run(
        [sys.executable, "-m", "pdcluster.runtime.cli", "up", "-f", str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(fake), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert out.returncode != 0
    assert INSTALL_HINT in out.stderr, out.stderr


def test_nixl_is_installed_with_the_dev_setup() -> None:
    """`make setup` installs the extra; the nixl tests below rely on it."""
    from tests.transfer.nixl_helpers import need_nixl

    need_nixl()
    assert nixl_support.nixl_import_error() is None
