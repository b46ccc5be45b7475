"""The shared-memory pool directories on this host: where, and sweeping stale ones.

The naming and path rules are in shm_paths.py (pure); this module touches
the file system.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from pdcluster.runtime.pids import is_pid_alive
from pdcluster.runtime.transfer.shm_paths import owner_of, pool_dir_prefix

log = logging.getLogger("pdcluster.shm")


def shm_base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def sweep_stale_pool_dirs(cluster: str, base: str | None = None) -> list[str]:
    """Remove `cluster`'s pool directories whose owner process is gone; returns them."""
    base = base or shm_base()
    swept = []
    try:
        names = os.listdir(base)
    except OSError:
        return []
    for name in names:
        pid = owner_of(name, cluster)
        if pid is None or pid == os.getpid() or is_pid_alive(pid):
            continue
        path = os.path.join(base, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path)
            log.info("removed stale shared-memory pool directory %s (pid %d is gone)", path, pid)
    return swept


def make_pool_dir(cluster: str, base: str | None = None) -> str:
    return tempfile.mkdtemp(prefix=pool_dir_prefix(cluster, os.getpid()), dir=base or shm_base())
