"""Whether a process id is still in use on this machine."""

from __future__ import annotations

import os


def is_pid_alive(pid: int) -> bool:
    """True while `pid` names a process (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
