"""A local-mode process stops when the `pdcluster up` that started it is gone.

`pdcluster up` starts every worker and the router in a session of its own,
so a Ctrl-C at the terminal reaches only the launcher, which then stops
them in order. A launcher killed outright (kill -9, the OOM killer) stops
nothing: its processes would serve on, holding their ports, until someone
ran `pdcluster down`. So the launcher names itself in `PDCLUSTER_PARENT_PID`,
and each process it starts checks once a second that it is still its
parent; once it is not (the process was re-parented), the process sends
itself SIGTERM and drains as it would for `pdcluster down`.

The variable is removed from the environment when read: whatever the
process starts in turn has another parent and must not take it for a
lost launcher. Pods never set it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, MutableMapping

PARENT_PID_ENV = "PDCLUSTER_PARENT_PID"

log = logging.getLogger(__name__)


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class ParentWatch:
    """The watch's thread; `stop` ends it (the processes themselves never do)."""

    def __init__(
        self,
        parent: int,
        interval_s: float,
        getppid: Callable[[], int],
        on_gone: Callable[[], None],
    ) -> None:
        self.parent = parent
        self._stopped = threading.Event()
        self._interval_s = interval_s
        self._getppid = getppid
        self._on_gone = on_gone
        self.thread = threading.Thread(target=self._watch, name="parent-watch", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(self._interval_s):
            if self._getppid() != self.parent:
                log.warning("the launcher (pid %d) is gone; stopping", self.parent)
                self._on_gone()
                return

    def stop(self) -> None:
        self._stopped.set()
        self.thread.join()


def watch_parent(
    environ: MutableMapping[str, str],
    *,
    interval_s: float = 1.0,
    getppid: Callable[[], int] = os.getppid,
    on_gone: Callable[[], None] = _terminate_self,
) -> ParentWatch | None:
    """Start the watch if `environ` names a parent (None: nothing to watch).

    A value that is not a pid is refused at once: a launcher that sets it
    wrongly must not leave processes that cannot notice its death.
    """
    value = environ.pop(PARENT_PID_ENV, None)
    if value is None:
        return None
    try:
        parent = int(value)
    except ValueError:
        raise ValueError(f"{PARENT_PID_ENV}={value!r}: expected a process id") from None
    if parent <= 1:
        raise ValueError(f"{PARENT_PID_ENV}={value!r}: expected a process id above 1")
    return ParentWatch(parent, interval_s, getppid, on_gone)
