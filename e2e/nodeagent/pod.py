"""One pod's lifecycle as local processes (I/O): a thread per pod.

The worker owns its containers' processes; nothing else starts or reaps
them. Other threads talk to it only through `update`, `mark_gone` and the
signal hooks, under `_lock`. Its loop: reap exits, start what is due (init
containers one by one first), probe, stop what failed a liveness probe, and
write the pod's status whenever it changed. Processes are spawned from this
thread with a parent-death signal, so the thread outlives every process it
starts (it stops them before it returns) and the agent's death kills them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import processes
from e2e.nodeagent import podspec
from e2e.nodeagent.backoff import (
    compute_restart_delay,
    count_consecutive_crashes,
    should_restart,
)
from e2e.nodeagent.container import ContainerRun, has_succeeded
from e2e.nodeagent.kubeapi import ApiError, KubeApi
from e2e.nodeagent.podapi import (
    delete_pod_object,
    issue_service_account_env,
    read_object_data,
    service_host_env,
)
from e2e.nodeagent.prober import run_probe
from e2e.nodeagent.probes import ProbeError, ProbeTracker, parse_probe
from e2e.nodeagent.settings import AgentSettings
from e2e.nodeagent.status import (
    PodView,
    Running,
    Terminated,
    Waiting,
    build_pod_status,
    terminated_reason,
)

log = logging.getLogger("nodeagent.pod")


# What the kubelet keeps of a failed container's log as its termination message
# (FallbackToLogsOnError): the last 80 lines, at most 2048 bytes.
TERMINATION_LOG_LINES = 80
TERMINATION_LOG_BYTES = 2048


def log_tail(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - TERMINATION_LOG_BYTES))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-TERMINATION_LOG_LINES:])


@dataclass(frozen=True)
class PodEnvironment:
    """What every pod on a node shares: the API, settings, addresses."""

    api: KubeApi
    settings: AgentSettings
    node_name: str
    host_ip: str
    allocate_ip: Callable[[], str]
    release_ip: Callable[[str], None]
    base_env: Mapping[str, str]


def pod_key(pod: Mapping[str, Any]) -> str:
    metadata = pod["metadata"]
    return f"{metadata['namespace']}/{metadata['name']}"


class PodWorker(threading.Thread):
    def __init__(self, pod: dict[str, Any], env: PodEnvironment) -> None:
        super().__init__(name=f"pod {pod_key(pod)}", daemon=True)
        self.key = pod_key(pod)
        self.uid = str(pod["metadata"]["uid"])
        self.env = env
        self._pod = pod
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._gone = False  # the API object no longer exists
        self._stopping_agent = False
        namespace, name = self.key.split("/")
        self.directory = env.settings.state_dir / "pods" / f"{namespace}_{name}_{self.uid}"
        spec = pod["spec"]
        self.init_containers = [
            ContainerRun(c, True, self.directory / c["name"])
            for c in spec.get("initContainers") or []
        ]
        self.containers = [
            ContainerRun(c, False, self.directory / c["name"]) for c in spec.get("containers") or []
        ]
        self.restart_policy = str(spec.get("restartPolicy") or "Always")
        self.pod_ip: str | None = None
        self.start_time: float | None = None
        self._conditions: dict[str, tuple[str, float]] = {}
        self._last_status: dict[str, Any] | None = None
        self._terminating_since: float | None = None
        self._service_env: dict[str, str] = {}

    # ------------------------------------------------------------ other threads

    def update(self, pod: dict[str, Any]) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def mark_gone(self) -> None:
        with self._lock:
            self._gone = True
        self._wake.set()

    def stop_for_agent_shutdown(self) -> None:
        with self._lock:
            self._stopping_agent = True
        self._wake.set()

    def signal_containers(self, container: str | None, signum: int) -> list[str]:
        """Signal the process group of one container (or all); names of those signalled."""
        signalled = []
        with self._lock:
            for run in self.init_containers + self.containers:
                if container not in (None, run.name) or run.record is None or run.proc is None:
                    continue
                if processes.signal_group(run.record, signum):
                    signalled.append(run.name)
                    if signum == signal.SIGSTOP:
                        run.frozen = True
                    elif signum in (signal.SIGCONT, signal.SIGKILL):
                        run.frozen = False
        if container is not None and not signalled:
            names = [r.name for r in self.init_containers + self.containers]
            if container not in names:
                raise KeyError(f"pod {self.key} has no container {container!r} (has {names})")
        self._wake.set()
        return signalled

    def log_file(self, container: str | None, previous: bool) -> tuple[Path, Callable[[], bool]]:
        """The log of a container's current (or previous) run, and whether that run still
        runs (a follower stops reading once it does not)."""
        runs = self.init_containers + self.containers
        if container is None:
            if len(self.containers) != 1:
                names = [r.name for r in self.containers]
                raise KeyError(f"pod {self.key} has several containers {names}: name one")
            run = self.containers[0]
        else:
            matching = [r for r in runs if r.name == container]
            if not matching:
                raise KeyError(f"pod {self.key} has no container {container!r}")
            run = matching[0]
        index = run.num_runs - (2 if previous else 1)
        if index < 0:
            which = "previous run" if previous else "run yet"
            raise KeyError(f"container {run.name!r} of {self.key} has no {which}")

        def is_live() -> bool:
            return not previous and run.num_runs == index + 1 and run.is_running

        return run.log_path(index), is_live

    def log_text(self, container: str | None, previous: bool) -> str:
        path, _ = self.log_file(container, previous)
        return path.read_text(errors="replace")

    # ------------------------------------------------------------ the worker thread

    def run(self) -> None:
        try:
            self._setup()
            while not self._step():
                self._wake.wait(self.env.settings.tick_s)
                self._wake.clear()
        except Exception:
            log.exception("pod %s: worker failed", self.key)
        finally:
            for run in self.init_containers + self.containers:
                self._kill_now(run)
            if self.pod_ip and self.pod_ip != self.env.host_ip:
                self.env.release_ip(self.pod_ip)

    def _setup(self) -> None:
        spec = self._pod["spec"]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.start_time = time.time()
        self.pod_ip = self.env.host_ip if spec.get("hostNetwork") else self.env.allocate_ip()
        self._sync_status(time.time())

    def _step(self) -> bool:
        """One pass of the loop; True when the worker is done."""
        now = time.time()
        with self._lock:
            pod, gone, stopping_agent = self._pod, self._gone, self._stopping_agent
        runs = self.init_containers + self.containers
        if gone:
            return True
        deleting = pod["metadata"].get("deletionTimestamp") is not None or stopping_agent
        for run in runs:
            self._reap(run, now, restart_allowed=not deleting)
        if deleting:
            if self._terminate(pod, now, stopping_agent):
                if not stopping_agent:
                    self._sync_status(now)
                    self._delete_object()
                return True
        else:
            self._start_due(now)
            for run in runs:
                if run.is_running:
                    self._probe(run, now)
                    if run.kill_at is not None and now >= run.kill_at:
                        # Grace ran out after a failed probe: still restarted per policy.
                        self._kill_now(run, restart_allowed=True)
        if not stopping_agent:
            self._sync_status(now)
        return False

    def _start_due(self, now: float) -> None:
        pending_init = [r for r in self.init_containers if not has_succeeded(r)]
        if pending_init:
            first = pending_init[0]
            if not first.is_running and not first.finished and now >= first.not_before:
                self._start(first, now)
            return
        for run in self.containers:
            if not run.is_running and not run.finished and now >= run.not_before:
                self._start(run, now)

    def _reap(self, run: ContainerRun, now: float, restart_allowed: bool) -> None:
        if run.proc is None or run.proc.poll() is None:
            return
        processes.reap(run.proc.pid)  # drop it from the registry of live children
        code = run.proc.returncode
        exit_code, signum = (128 - code, -code) if code < 0 else (code, None)
        message = ""
        if exit_code != 0 and run.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = log_tail(run.log_path(run.num_runs - 1))
        self._finish_run(
            run,
            Terminated(
                exit_code, terminated_reason(exit_code), run.run_started, now, signum, message
            ),
            now,
            restart_allowed,
        )

    def _finish_run(
        self, run: ContainerRun, result: Terminated, now: float, restart_allowed: bool
    ) -> None:
        run.proc = None
        run.kill_at = None
        run.ready = run.started = run.frozen = False
        run.startup = run.liveness = run.readiness = None
        (run.directory / "pid.json").unlink(missing_ok=True)
        # Init containers run to success: they restart on failure unless the policy is Never.
        policy = (
            ("OnFailure" if self.restart_policy == "Always" else self.restart_policy)
            if run.is_init
            else self.restart_policy
        )
        if restart_allowed and should_restart(policy, result.exit_code):
            backoff = self.env.settings.backoff
            run.num_consecutive_crashes = count_consecutive_crashes(
                backoff, run.num_consecutive_crashes, now - run.run_started
            )
            delay = compute_restart_delay(backoff, run.num_consecutive_crashes)
            run.last_state = result
            run.state = Waiting(
                "CrashLoopBackOff",
                f"back-off {delay:g}s restarting failed container={run.name} pod={self.key}",
            )
            run.not_before = now + delay
        else:
            run.state = result
            run.finished = True

    def _start(self, run: ContainerRun, now: float) -> None:
        pod = self._pod
        try:
            podspec.check_volumes(pod, run.spec)
            podspec.prestop_sleep_s(run.spec)  # an unsupported hook is refused here
            mounts = self._mount_secret_volumes(pod, run)
            mounts.update(self._host_volumes(pod, run))
            env = self._container_environment(pod, run, mounts)
            argv = [
                podspec.translate_mount_paths(a, mounts)
                for a in podspec.resolve_argv(run.spec, env)
            ]
            trackers = {
                kind: parse_probe(run.spec[kind], run.spec, f"{run.name}.{kind}")
                for kind in ("startupProbe", "livenessProbe", "readinessProbe")
                if run.spec.get(kind) and not run.is_init
            }
            cwd = run.directory / "work"
            if run.spec.get("workingDir"):
                cwd = Path(run.spec["workingDir"])
                if not cwd.is_dir():
                    raise podspec.ContainerConfigError(
                        f"workingDir {str(cwd)!r} does not exist here"
                    )
        except podspec.VolumeMountError as exc:
            # The kubelet keeps such a pod in ContainerCreating until the mount works.
            run.state = Waiting("ContainerCreating", str(exc))
            run.not_before = now + self.env.settings.config_retry_s
            return
        except (podspec.ContainerConfigError, ProbeError, ApiError) as exc:
            run.state = Waiting("CreateContainerConfigError", str(exc))
            run.not_before = now + self.env.settings.config_retry_s
            return
        cwd.mkdir(parents=True, exist_ok=True)
        run.env = env
        log_path = run.log_path(run.num_runs)
        run.num_runs += 1
        run.run_started = now
        try:
            proc, record = processes.spawn(
                f"{self.key}/{run.name}", argv, log_path, env=env, cwd=cwd, die_with_parent=True
            )
        except OSError as exc:
            # Like the kubelet's StartError: counts as a failed run, restarted with back-off.
            with open(log_path, "a") as handle:
                handle.write(f"failed to start {argv[0]!r}: {exc}\n")
            result = Terminated(128, "StartError", now, now, message=f"{argv[0]!r}: {exc.strerror}")
            self._finish_run(run, result, now, restart_allowed=True)
            return
        run.proc, run.record = proc, record
        (run.directory / "pid.json").write_text(json.dumps(record.to_json()))
        run.state = Running(now)
        run.startup = (
            ProbeTracker(trackers["startupProbe"], now) if "startupProbe" in trackers else None
        )
        run.liveness = (
            ProbeTracker(trackers["livenessProbe"], now) if "livenessProbe" in trackers else None
        )
        run.readiness = (
            ProbeTracker(trackers["readinessProbe"], now) if "readinessProbe" in trackers else None
        )
        run.started = run.startup is None
        run.ready = run.started and run.readiness is None
        log.info("pod %s: started %s (pid %d): %s", self.key, run.name, record.pid, argv)

    def _mount_secret_volumes(self, pod: Mapping[str, Any], run: ContainerRun) -> dict[str, str]:
        """Write the files of the container's secret volumes (read now, so a rotated
        Secret reaches a restarted container); mountPath -> local folder."""
        namespace = pod["metadata"]["namespace"]
        objects: dict[podspec.ObjectKey, Mapping[str, str] | None] = {
            key: read_object_data(self.env.api, namespace, *key)
            for key in podspec.secret_volume_secrets(pod, run.spec)
        }
        dirs: dict[str, str] = {}
        for volume, files in podspec.secret_volume_files(pod, run.spec, objects).items():
            folder = self.directory / "volumes" / volume
            folder.mkdir(parents=True, exist_ok=True)
            for relative, content in files.items():
                target = folder / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                staged = target.with_name(f".{target.name}.new")
                staged.unlink(missing_ok=True)
                fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, podspec.SECRET_FILE_MODE)
                with os.fdopen(fd, "w") as handle:
                    handle.write(content)
                os.replace(staged, target)
            dirs[volume] = str(folder)
        return podspec.secret_mount_paths(pod, run.spec, dirs)

    def _host_volumes(self, pod: Mapping[str, Any], run: ContainerRun) -> dict[str, str]:
        """mountPath -> host folder of the container's hostPath and claim volumes (a
        claim read through the API, then the PersistentVolume it is bound to)."""
        namespace = pod["metadata"]["namespace"]
        bound: dict[str, Mapping[str, Any] | None] = {}
        for claim in podspec.claimed_volumes(pod, run.spec):
            pvc = self.env.api.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
            volume = (pvc or {}).get("spec", {}).get("volumeName")
            phase = (pvc or {}).get("status", {}).get("phase")
            bound[claim] = (
                self.env.api.get(f"/api/v1/persistentvolumes/{volume}")
                if volume and phase == "Bound"
                else None
            )
        return podspec.host_mount_paths(pod, run.spec, bound)

    def _container_environment(
        self, pod: Mapping[str, Any], run: ContainerRun, mounts: Mapping[str, str]
    ) -> dict[str, str]:
        namespace = pod["metadata"]["namespace"]
        objects: dict[podspec.ObjectKey, Mapping[str, str] | None] = {}
        for kind, name in podspec.referenced_objects(run.spec):
            objects[(kind, name)] = read_object_data(self.env.api, namespace, kind, name)
        assert self.pod_ip is not None
        own = podspec.resolve_environment(
            pod, run.spec, pod_ip=self.pod_ip, host_ip=self.env.host_ip, objects=objects
        )
        env = dict(self.env.base_env)
        env["HOSTNAME"] = pod["metadata"]["name"]
        if podspec.wants_service_account_token(pod):
            if not self._service_env:
                self._service_env = issue_service_account_env(
                    self.env.api, pod, self.directory, self.env.settings.token_expiration_s
                )
            env.update(self._service_env)
        else:
            env.update(service_host_env(self.env.api))
        env.update({k: podspec.translate_mount_paths(v, mounts) for k, v in own.items()})
        return env

    def _probe(self, run: ContainerRun, now: float) -> None:
        assert self.pod_ip is not None
        cwd = run.directory / "work"
        if run.startup is not None and not run.started:
            if run.startup.is_due(now):
                ok, message = run_probe(run.startup.spec, self.pod_ip, run.env, cwd)
                verdict = run.startup.record(ok, time.time(), message)
                if verdict is True:
                    run.started = True
                    run.ready = run.readiness is None
                elif verdict is False:
                    self._begin_kill(run, now, f"startup probe failed: {message}")
            return
        if run.liveness is not None and run.kill_at is None and run.liveness.is_due(now):
            ok, message = run_probe(run.liveness.spec, self.pod_ip, run.env, cwd)
            if run.liveness.record(ok, time.time(), message) is False:
                self._begin_kill(run, now, f"liveness probe failed: {message}")
        if run.readiness is not None and run.kill_at is None and run.readiness.is_due(now):
            ok, message = run_probe(run.readiness.spec, self.pod_ip, run.env, cwd)
            run.ready = run.readiness.record(ok, time.time(), message) is True

    def _grace_s(self, pod: Mapping[str, Any]) -> float:
        metadata, spec = pod["metadata"], pod["spec"]
        grace = metadata.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds")
        return float(30 if grace is None else grace)

    def _begin_kill(self, run: ContainerRun, now: float, reason: str) -> None:
        log.info("pod %s: stopping %s: %s", self.key, run.name, reason)
        run.ready = False
        run.liveness = run.readiness = run.startup = None
        if run.record is not None:
            processes.signal_group(run.record, signal.SIGTERM)
            if run.frozen:
                processes.signal_group(run.record, signal.SIGCONT)
        run.kill_at = now + self._grace_s(self._pod)

    def _kill_now(self, run: ContainerRun, restart_allowed: bool = False) -> None:
        if run.record is not None and run.proc is not None:
            processes.signal_group(run.record, signal.SIGKILL)
            run.proc.wait()
            self._reap(run, time.time(), restart_allowed=restart_allowed)

    def _terminate(self, pod: Mapping[str, Any], now: float, stopping_agent: bool) -> bool:
        """Graceful stop of every container; True once none is running. A container
        with a preStop sleep gets SIGTERM when it ends, within the same grace period."""
        running = [r for r in self.init_containers + self.containers if r.is_running]
        if self._terminating_since is None:
            self._terminating_since = now
            grace = self._grace_s(pod)
            if stopping_agent:
                grace = min(grace, self.env.settings.shutdown_grace_s)
            for run in running:
                sleep_s = 0.0 if stopping_agent else podspec.prestop_sleep_s(run.spec)
                if sleep_s > 0:
                    log.info("pod %s: %s: preStop sleep %.0f s", self.key, run.name, sleep_s)
                    run.term_at = now + sleep_s
                else:
                    self._begin_kill(run, now, "pod is terminating")
                run.kill_at = now + grace
        for run in running:
            if run.term_at is not None and now >= run.term_at:
                run.term_at = None
                deadline = run.kill_at
                self._begin_kill(run, now, "pod is terminating (after its preStop sleep)")
                run.kill_at = deadline
            if run.kill_at is not None and now >= run.kill_at:
                self._kill_now(run)
        for run in self.init_containers + self.containers:
            if not run.is_running and not isinstance(run.state, Terminated):
                # Waiting to restart: its last exit is its final state. One that never
                # ran stays waiting, as the kubelet leaves it.
                if run.last_state is not None:
                    run.state = run.last_state
                run.finished = True
        return not any(r.is_running for r in self.init_containers + self.containers)

    def _view(self) -> PodView:
        return PodView(
            restart_policy=self.restart_policy,
            host_ip=self.env.host_ip,
            pod_ip=self.pod_ip,
            start_time=self.start_time,
            init_containers=tuple(r.view() for r in self.init_containers),
            containers=tuple(r.view() for r in self.containers),
        )

    def _sync_status(self, now: float) -> None:
        status, memory = build_pod_status(self._view(), self._conditions, now)
        if status == self._last_status:
            return
        namespace, name = self.key.split("/")
        try:
            self.env.api.patch(
                f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": status}
            )
        except ApiError as exc:
            if exc.status == 404:
                self.mark_gone()
                return
            log.warning("pod %s: status update failed: %s", self.key, exc)
            return
        self._conditions = memory
        self._last_status = status

    def _delete_object(self) -> None:
        namespace, name = self.key.split("/")
        try:
            delete_pod_object(self.env.api, namespace, name, self.uid)
        except ApiError as exc:
            log.warning("pod %s: final delete failed: %s", self.key, exc)
