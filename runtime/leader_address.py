"""Where a pod k > 0 of an instance learns its leader's address (no cluster DNS).

In order: `--leader-address`; `$PDCLUSTER_LEADER_ADDRESS`; the file that
`$PDCLUSTER_LEADER_ADDRESS_FILE` names, polled until it holds an address.
The file is meant for a downward-API volume projecting an annotation the
operator sets on the pod once the leader pod has an IP: the kubelet writes
an empty file until the annotation exists, then its value. Local mode
passes the environment variable (every pod is on 127.0.0.1).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from pdcluster.runtime.pod_rendezvous import (
    LEADER_ADDRESS_ENV,
    LEADER_ADDRESS_FILE_ENV,
    RendezvousError,
    parse_leader_address,
)

log = logging.getLogger("pdcluster.worker")

WAIT_ENV = "PDCLUSTER_LEADER_WAIT_SECONDS"
DEFAULT_WAIT_S = 600.0
POLL_S = 0.5


def wait_leader_address(
    arg: str | None, env: Mapping[str, str], wait_s: float | None = None
) -> str:
    """The leader pod's host; RendezvousError when none is given or it never comes."""
    if arg:
        return parse_leader_address(arg)
    if env.get(LEADER_ADDRESS_ENV):
        return parse_leader_address(env[LEADER_ADDRESS_ENV])
    path = env.get(LEADER_ADDRESS_FILE_ENV)
    if not path:
        raise RendezvousError(
            f"a pod k > 0 needs its leader's address: --leader-address, ${LEADER_ADDRESS_ENV} "
            f"or ${LEADER_ADDRESS_FILE_ENV}"
        )
    if wait_s is None:
        try:
            wait_s = float(env.get(WAIT_ENV, DEFAULT_WAIT_S))
        except ValueError:
            raise RendezvousError(f"${WAIT_ENV} must be a number of seconds") from None
    deadline = time.monotonic() + wait_s
    logged = False
    while True:
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            text = ""
        except OSError as err:
            raise RendezvousError(f"cannot read the leader address from {path}: {err}") from None
        if text.strip():
            return parse_leader_address(text)
        if time.monotonic() > deadline:
            raise RendezvousError(f"no leader address in {path} after {wait_s:.0f}s")
        if not logged:
            log.info("waiting for the leader's address in %s", path)
            logged = True
        time.sleep(POLL_S)
