"""A prefill writes only into pool files of its own cluster; stale pool dirs are swept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.runtime.transfer.shm_dirs import make_pool_dir, sweep_stale_pool_dirs
from pdcluster.runtime.transfer.shm_paths import check_pool_path, owner_of

BASE = "/dev/shm"


@pytest.mark.parametrize(
    "path",
    [
        "/dev/shm/pdcluster-demo-12-abc/dp0/kv-rank0.bin",
        "/dev/shm/pdcluster-demo-x/dp3/kv-rank15.bin",
    ],
)
def test_pool_files_of_the_cluster_are_accepted(path: str) -> None:
    check_pool_path(path, BASE, "demo")


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "/dev/shm/pdcluster-other-1-a/dp0/kv-rank0.bin",  # another cluster
        "/dev/shm/pdcluster-demo-1-a/dp0/weights.bin",  # not a pool file
        "/dev/shm/pdcluster-demo-1-a/kv-rank0.bin",  # no dp directory
        "/dev/shm/x/pdcluster-demo-1-a/dp0/kv-rank0.bin",  # not directly under the base
        "/tmp/pdcluster-demo-1-a/dp0/kv-rank0.bin",  # another base
    ],
)
def test_anything_else_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="is not a pool file of cluster 'demo'"):
        check_pool_path(path, BASE, "demo")


def test_a_symlink_out_of_the_cluster_dir_is_refused(tmp_path: Path) -> None:
    pool = tmp_path / "pdcluster-demo-1-a" / "dp0"
    pool.mkdir(parents=True)
    target = tmp_path / "secret.bin"
    target.write_bytes(b"x")
    (pool / "kv-rank0.bin").symlink_to(target)
    with pytest.raises(ValueError):
        check_pool_path(os.path.realpath(pool / "kv-rank0.bin"), str(tmp_path), "demo")


def test_an_explicit_pool_dir_is_accepted() -> None:
    check_pool_path("/data/shm/dp0/kv-rank0.bin", BASE, "demo", own_dir="/data/shm")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_pool_dirs_of_dead_workers_are_swept(tmp_path: Path) -> None:
    base = str(tmp_path)
    stale = tmp_path / f"pdcluster-demo-{dead_pid()}-abc"
    (stale / "dp0").mkdir(parents=True)
    live = Path(make_pool_dir("demo", base))  # this process owns it
    parent = tmp_path / f"pdcluster-demo-{os.getppid()}-def"
    parent.mkdir()
    other = tmp_path / f"pdcluster-other-{dead_pid()}-ghi"
    other.mkdir()
    assert owner_of(live.name, "demo") == os.getpid()
    assert sweep_stale_pool_dirs("demo", base) == [str(stale)]
    assert not stale.exists()
    assert live.exists() and parent.exists() and other.exists()
