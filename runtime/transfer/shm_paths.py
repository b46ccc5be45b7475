"""Where shared-memory KV pools may live, and which stale ones may be swept.

A decode rank's pool is the file `<base>/pdcluster-<cluster>-<pid>-<random>/
dp<d>/kv-rank<r>.bin` (`<base>`: /dev/shm, else the temp dir; `<pid>`: the
worker that owns the directory). A prefill rank maps and writes the file a
decode rank names in its registration, so it accepts only a path that
resolves (symlinks followed) to such a file of its own cluster: a
registration naming any other file is refused, and nothing is mapped.

A directory whose owner process is gone (killed before it could clean up)
is stale; a starting worker sweeps those of its cluster.

Pure module.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

_POOL_FILE = re.compile(r"kv-rank\d+\.bin")
_DP_DIR = re.compile(r"dp\d+")


def pool_dir_prefix(cluster: str, pid: int) -> str:
    return f"pdcluster-{cluster}-{pid}-"


def owner_of(dirname: str, cluster: str) -> int | None:
    """The owner pid a pool directory's name records, or None if it is not one of ours."""
    m = re.fullmatch(rf"pdcluster-{re.escape(cluster)}-(\d+)-[A-Za-z0-9_]+", dirname)
    return int(m.group(1)) if m else None


def check_pool_path(resolved: str, base: str, cluster: str, own_dir: str | None = None) -> None:
    """Raise ValueError unless `resolved` (a realpath) is a pool file of `cluster`.

    `own_dir`: an explicitly configured pool directory (PDCLUSTER_SHM_DIR)
    also accepted as the cluster's directory.
    """
    path = PurePosixPath(resolved)
    parts = path.parts
    ok = (
        len(parts) >= 3
        and _POOL_FILE.fullmatch(parts[-1]) is not None
        and _DP_DIR.fullmatch(parts[-2]) is not None
    )
    if ok:
        cluster_dir = path.parent.parent
        in_base = cluster_dir.parent == PurePosixPath(base) and cluster_dir.name.startswith(
            f"pdcluster-{cluster}-"
        )
        ok = in_base or (own_dir is not None and cluster_dir == PurePosixPath(own_dir))
    if not ok:
        raise ValueError(
            f"shared-memory pool {resolved!r} is not a pool file of cluster {cluster!r} "
            f"under {base}"
        )
