"""The cluster token, read at a process's start (worker and router alike).

Pods get it as a mounted Secret file that `PDCLUSTER_TOKEN_FILE` names; a
local cluster's launcher passes it as `PDCLUSTER_TOKEN`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

TOKEN_ENV = "PDCLUSTER_TOKEN"
TOKEN_FILE_ENV = "PDCLUSTER_TOKEN_FILE"


def read_cluster_token(env: Mapping[str, str], who: str = "pdcluster worker") -> str:
    """The cluster token: from the file `PDCLUSTER_TOKEN_FILE` names (pods: a
    mounted Secret), else from `PDCLUSTER_TOKEN` (local mode), else none.

    A named file that cannot be read, or holds no token, stops the process:
    it must not come up unauthenticated because a mount went wrong.
    """
    path = env.get(TOKEN_FILE_ENV)
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as err:
            raise SystemExit(
                f"{who}: cannot read the cluster token from {path} "
                f"({TOKEN_FILE_ENV}): {err.strerror}"
            ) from None
        if not token:
            raise SystemExit(f"{who}: the token file {path} ({TOKEN_FILE_ENV}) is empty")
        return token
    return env.get(TOKEN_ENV, "")
