"""One container of a pod as the worker tracks it: process, history, probes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from subprocess import Popen
from typing import Any

from e2e.nodeagent import podspec
from e2e.nodeagent.probes import ProbeTracker
from e2e.nodeagent.status import ContainerState, ContainerView, Terminated, Waiting
from e2e.processes import ProcessRecord


class ContainerRun:
    """One container of a pod: its current process and its history."""

    def __init__(self, spec: Mapping[str, Any], is_init: bool, directory: Path) -> None:
        self.spec = spec
        self.name = str(spec["name"])
        self.is_init = is_init
        self.directory = directory
        self.proc: Popen[bytes] | None = None
        self.record: ProcessRecord | None = None
        self.env: dict[str, str] = {}
        self.state: ContainerState = Waiting("ContainerCreating")
        self.last_state: Terminated | None = None
        self.num_runs = 0
        self.num_consecutive_crashes = 0
        self.run_started = 0.0
        self.not_before = 0.0
        self.finished = False  # exited and will not run again
        self.started = False
        self.ready = False
        self.startup: ProbeTracker | None = None
        self.liveness: ProbeTracker | None = None
        self.readiness: ProbeTracker | None = None
        self.kill_at: float | None = None  # SIGKILL if still alive then
        self.term_at: float | None = None  # SIGTERM then: the pod's preStop sleep ends
        self.frozen = False

    @property
    def is_running(self) -> bool:
        return self.proc is not None

    def log_path(self, run: int) -> Path:
        return self.directory / f"{run}.log"

    def view(self) -> ContainerView:
        return ContainerView(
            name=self.name,
            image=str(self.spec.get("image") or ""),
            state=self.state,
            last_state=self.last_state,
            restart_count=max(self.num_runs - 1, 0),
            ready=self.ready and self.is_running,
            started=self.started and self.is_running,
            container_id=f"pdcluster://{self.record.pid}" if self.record else "",
        )


def has_succeeded(run: ContainerRun) -> bool:
    return isinstance(run.state, Terminated) and run.state.exit_code == 0 and run.finished


def environ_for_pods(venv_bin: Path) -> dict[str, str]:
    """The inherited environment of every pod: the venv's commands first on PATH."""
    env = podspec.build_base_environment(os.environ, [str(venv_bin)])
    env["VIRTUAL_ENV"] = str(venv_bin.parent)
    return env
