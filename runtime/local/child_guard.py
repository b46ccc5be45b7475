"""Runs a program that is not ours (vLLM) the way `pdcluster up` runs its own.

    python -m pdcluster.runtime.local.child_guard -- vllm serve MODEL ...

Our workers stop by themselves once the launcher that started them is gone
(`parent_watch.py`); `vllm serve` does not know the launcher. This guard,
started by the launcher in the process group it gives each instance, starts
the program as its child in that same group and:
- watches the launcher like our processes do; once it is gone, sends the
  child SIGTERM and, after `GRACE_S`, SIGKILL to the whole group (vLLM's
  engine core runs in it too);
- passes SIGTERM and SIGINT on to the child (`pdcluster down` signals the
  whole group anyway; a signal sent to the guard alone reaches vLLM too);
- exits as the child did: its exit code, or killed by the same signal, so
  the supervisor reads the exit it would have read from the program itself.

I/O module: the edge between the launcher and a foreign process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType

from pdcluster.runtime.local.parent_watch import watch_parent

GRACE_S = 10.0


def _exit_like(returncode: int) -> None:
    """End this process the way the child ended."""
    if returncode >= 0:
        raise SystemExit(returncode)
    sig = -returncode
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    raise SystemExit(128 + sig)  # a signal that does not end a process by default


def run(argv: list[str]) -> int:
    if not argv:
        print("child_guard: give the program after `--`", file=sys.stderr)
        return 2
    started = threading.Event()
    child: subprocess.Popen[bytes] | None = None

    def launcher_gone() -> None:
        started.wait()
        assert child is not None
        if child.poll() is None:
            child.terminate()
        try:
            child.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            # The engine core and whatever else the program started share our group.
            os.killpg(os.getpgid(0), signal.SIGKILL)

    # Read (and removed from the environment) before the child starts: the
    # launcher is the guard's parent, not the program's.
    watch_parent(os.environ, on_gone=lambda: threading.Thread(target=launcher_gone).start())
    child = subprocess.Popen(argv)
    started.set()

    def forward(signum: int, _: FrameType | None) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return child.wait()


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    _exit_like(run(args))


if __name__ == "__main__":
    main()
