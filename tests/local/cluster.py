"""Run `pdcluster up` as a real process tree for integration tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass
class RunningCluster:
    endpoint: str
    state: dict[str, Any]
    proc: subprocess.Popen[bytes]
    state_dir: Path

    def worker(self, name: str) -> dict[str, Any]:
        return next(p for p in self.state["processes"] if p["name"] == name)

    @property
    def auth(self) -> dict[str, str]:
        """The cluster token `pdcluster up` wrote to its state dir, as a Bearer header."""
        token = (self.state_dir / self.state["cluster"] / "token").read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def pids(self) -> list[int]:
        return [p["pid"] for p in self.state["processes"]]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ps_text(state_dir: Path) -> str:
    """What `pdcluster ps` prints for the clusters under `state_dir`."""
    return subprocess.run(
        [sys.executable, "-m", "pdcluster.runtime.cli", "ps", "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def ps_rows(state_dir: Path) -> dict[str, dict[str, str]]:
    """`pdcluster ps` as rows by name (columns are two or more spaces apart)."""
    header, *lines = (re.split(r"\s{2,}", line) for line in ps_text(state_dir).splitlines()[1:])
    return {cells[0]: dict(zip(header, cells, strict=True)) for cells in lines}


def write_manifest(tmp: Path, name: str, spec: dict[str, Any]) -> Path:
    path = tmp / f"{name}.yaml"
    doc = {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": name},
        "spec": spec,
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@contextmanager
def local_cluster(
    manifest: Path, state_dir: Path, timeout: float = 240, args: Sequence[str] = ()
) -> Iterator[RunningCluster]:
    """`pdcluster up -f manifest ...args` until it serves; stopped on exit."""
    cmd = [
        sys.executable,
        "-m",
        "pdcluster.runtime.cli",
        "up",
        "-f",
        str(manifest),
        "--port",
        "0",
        "--state-dir",
        str(state_dir),
        *args,
    ]
    log = open(state_dir.parent / f"up-{manifest.stem}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    name = yaml.safe_load(manifest.read_text())["metadata"]["name"]
    state_file = state_dir / name / "state.json"
    deadline = time.monotonic() + timeout
    state = None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"pdcluster up exited: {Path(log.name).read_text()[-3000:]}")
            text = Path(log.name).read_text(errors="replace")
            if state_file.exists() and "serving on" in text:
                state = json.loads(state_file.read_text())
                break
            time.sleep(0.2)
        if state is None:
            raise TimeoutError(
                f"cluster not ready: {Path(log.name).read_text()[-3000:]}"
                + process_log_tails(state_dir / name / "logs")
            )
        yield RunningCluster(state["endpoint"], state, proc, state_dir)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        if state is not None:
            for pid in (p["pid"] for p in state["processes"]):
                deadline = time.monotonic() + 15
                while pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)


def process_log_tails(logs: Path, lines: int = 25) -> str:
    """The last lines of every process log `pdcluster up` wrote, for a failure message."""
    parts = []
    for path in sorted(logs.glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"\n--- {path.name} ---\n" + "\n".join(tail))
    return "".join(parts)


def stop_process_groups(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process group still running, give each 30 s, then SIGKILL."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
