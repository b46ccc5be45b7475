"""Starting and stopping the harness's own processes, and waiting on loopback ports.

Every process is started in its own session (so its process group holds
whatever it forks) and recorded by pid together with its start time; a stop
signals the group only if that pid still names the process we started, so a
recycled pid is never hit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1

# Children started by this Python process, kept so they can be reaped (and so that
# a Popen is never garbage-collected while its process still runs).
_children: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class ProcessRecord:
    """What is needed to stop a process later, from another Python process too."""

    name: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22; tells a recycled pid apart

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "pid": self.pid, "start_ticks": self.start_ticks}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ProcessRecord:
        return cls(str(data["name"]), int(str(data["pid"])), int(str(data["start_ticks"])))


def process_start_ticks(pid: int) -> int | None:
    """Start time of pid in clock ticks since boot, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def is_alive(record: ProcessRecord) -> bool:
    return process_start_ticks(record.pid) == record.start_ticks


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    die_with_parent: bool = False,
) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Start argv in a new session, stdout and stderr appended to log_path.

    die_with_parent: the kernel kills the child if the *thread* that spawned
    it exits, so only use it from a thread that lives as long as the child.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    ticks = process_start_ticks(proc.pid)
    _children[proc.pid] = proc
    return proc, ProcessRecord(name, proc.pid, ticks if ticks is not None else -1)


def signal_group(record: ProcessRecord, signum: int) -> bool:
    """Send signum to the process group of record; False if it is already gone."""
    if not is_alive(record):
        return False
    try:
        os.killpg(record.pid, signum)
    except ProcessLookupError:
        return False
    return True


def stop(record: ProcessRecord, grace_s: float = 5.0) -> None:
    """SIGTERM the group, then SIGKILL it if still alive after grace_s."""
    if not signal_group(record, signal.SIGTERM):
        _kill_leftover_group(record.pid)
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        reap(record.pid)
        if not is_alive(record):
            break
        time.sleep(0.05)
    # Children in the group may outlive the leader; the group id stays the leader's pid.
    _kill_leftover_group(record.pid)
    child = _children.pop(record.pid, None)
    if child is not None:
        child.wait(timeout=10)
    else:
        reap(record.pid)


def _kill_leftover_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def reap(pid: int) -> None:
    """Collect the exit status of pid if it is our child and has exited."""
    child = _children.get(pid)
    if child is not None:
        if child.poll() is not None:
            del _children[pid]
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_until(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.1,
    alive: Callable[[], str | None] | None = None,
) -> None:
    """Poll condition until true; raise TimeoutError naming what, or early if alive() says why."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return
        if alive is not None and (reason := alive()) is not None:
            raise RuntimeError(f"{what}: {reason}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def https_get_ok(
    url: str, ca_file: Path | None, token: str | None = None, timeout_s: float = 2.0
) -> bool:
    """True when GET url answers 200 over TLS, verified against ca_file unless it is None
    (the controllers serve health checks on self-signed certificates)."""
    if ca_file is None:
        context = ssl._create_unverified_context()
    else:
        context = ssl.create_default_context(cafile=str(ca_file))
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def http_get_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def tail(path: Path, num_lines: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-num_lines:])
