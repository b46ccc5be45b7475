"""Local mode: run a LocalPlan as processes, record them, stop them cleanly.

Each process starts in its own session (process group) so stopping the
cluster reaches the ranks a worker spawned too: SIGTERM to every group, then
SIGKILL after a grace period. The state file lists what is running so
`pdcluster ps` / `pdcluster down` work from another shell.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from pdcluster.runtime.local.plan import LocalPlan, ProcessSpec
from pdcluster.runtime.pids import is_pid_alive

STATE_FILE = "state.json"
TOKEN_FILE = "token"


def free_ports(n: int) -> list[int]:
    """Ask the kernel for n distinct free loopback ports."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def state_dir_for(base: Path, cluster: str) -> Path:
    return base / cluster


class LocalCluster:
    def __init__(self, plan: LocalPlan, state_dir: Path, token: str | None = None) -> None:
        self.plan = plan
        self.state_dir = state_dir
        self.token = token or secrets.token_hex(16)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        # The cluster token, for a third-party PD router's worker API key (owner-only).
        token_file = self.state_dir / TOKEN_FILE
        token_file.touch(mode=0o600, exist_ok=True)
        token_file.chmod(0o600)
        token_file.write_text(self.token + "\n")
        try:
            for spec in self.plan.processes:
                self.spawn(spec)
        except BaseException:
            self.stop()
            raise
        self.write_state()

    def spawn(self, spec: ProcessSpec) -> subprocess.Popen[bytes]:
        """Start one process of the plan (again, after it died: same argv and ports);
        its output is appended to its log."""
        env = {**os.environ, "PDCLUSTER_TOKEN": self.token, "PYTHONUNBUFFERED": "1", **spec.env}
        with open(self.state_dir / "logs" / f"{spec.name}.log", "ab") as log:
            proc = subprocess.Popen(
                list(spec.argv),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs[spec.name] = proc
        return proc

    def write_state(self) -> None:
        state = {
            "cluster": self.plan.cluster,
            "endpoint": self.plan.endpoint,
            "launcher_pid": os.getpid(),
            "processes": [
                {**_public(spec), "pid": self.procs[spec.name].pid}
                for spec in self.plan.processes
                if spec.name in self.procs
            ],
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / STATE_FILE)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Wait for every process's /health; raise with the log tail of a dead one."""
        deadline = time.monotonic() + timeout
        pending = list(self.plan.processes)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for spec in list(pending):
                    proc = self.procs[spec.name]
                    if proc.poll() is not None:
                        tail = self.log_tail(spec.name)
                        raise RuntimeError(f"{spec.name} exited ({proc.returncode}):\n{tail}")
                    try:
                        if client.get(spec.url + "/health").status_code == 200:
                            pending.remove(spec)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(s.name for s in pending)
                    raise TimeoutError(f"not ready after {timeout:.0f}s: {names}")
                if pending:
                    time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.state_dir / "logs" / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        stop_pids([p.pid for p in self.procs.values()], grace)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        (self.state_dir / STATE_FILE).unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_pids(pids: list[int], grace: float = 10.0) -> None:
    """SIGTERM each process group, SIGKILL what is left after `grace` seconds."""
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_group_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still "exists"; reap it if it is our child.
    try:
        pid, _ = os.waitpid(pgid, os.WNOHANG)
        if pid == pgid:
            return _group_alive(pgid)
    except ChildProcessError:
        pass
    return True


def _public(spec: ProcessSpec) -> dict[str, Any]:
    d = asdict(spec)
    d.pop("env", None)
    d["argv"] = list(spec.argv)
    d["url"] = spec.url
    return d


def read_state(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    state: dict[str, Any] = json.loads(path.read_text())
    for p in state["processes"]:
        p["alive"] = is_pid_alive(p["pid"])
    return state


def format_state(state: dict[str, Any]) -> str:
    rows = [("NAME", "ROLE", "RANKS", "PID", "ALIVE", "URL", "BOOTSTRAP")]
    for p in state["processes"]:
        rows.append(
            (
                p["name"],
                p["role"],
                str(p["num_ranks"]),
                str(p["pid"]),
                "yes" if p["alive"] else "no",
                p["url"],
                str(p.get("bootstrap_port") or "-"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"cluster {state['cluster']}  endpoint {state['endpoint']}/v1"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def print_err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
