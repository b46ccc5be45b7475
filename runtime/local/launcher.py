"""Local mode: run a LocalPlan as processes, record them, stop them cleanly.

Each process starts in its own session (process group) so stopping the
cluster reaches the ranks a worker spawned too: SIGTERM to every group, then
SIGKILL after a grace period. The state file lists what is running so
`pdcluster ps` / `pdcluster down` work from another shell.

Once ready, `supervise` keeps the cluster serving: it observes the
processes, feeds their exits to the pure `Supervisor` (supervision.py) and
performs what it decides — tear a lost instance down as a gang, tell its
peers (peers.py), start it again on the same ports, admit it at the router
once ready — until the supervisor gives up.

Autoscaling (autoscaling.py) changes the membership from its own thread:
`add_scaled` starts an instance outside supervision, `adopt` hands it to the
supervisor once it is ready, `release` takes a running one back before it is
drained (so its exit is no loss), `remove_scaled` forgets it once stopped.
The supervise loop applies adopt/release between two observations.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from pdcluster.runtime.local.liveness import LivenessLedger, LivenessPolicy
from pdcluster.runtime.local.parent_watch import PARENT_PID_ENV
from pdcluster.runtime.local.peers import PeerNotifier
from pdcluster.runtime.local.plan import LocalPlan, ProcessSpec
from pdcluster.runtime.local.prober import LivenessProber, ProbeTarget
from pdcluster.runtime.local.supervision import (
    Action,
    Admit,
    GiveUp,
    InstanceKey,
    ReportLost,
    Spawn,
    SupervisionError,
    Supervisor,
    TearDown,
    describe_exit,
)
from pdcluster.runtime.pids import is_pid_alive
from pdcluster.runtime.spec import EngineKind, RestartPolicySpec, Role

STATE_FILE = "state.json"
TOKEN_FILE = "token"


def state_dir_for(base: Path, cluster: str) -> Path:
    return base / cluster


def our_package_path(state_dir: Path) -> Path:
    """A folder that, on PYTHONPATH, imports this installation's `pdcluster.runtime`.

    vLLM with our connector imports it (`kv_connector_module_path`) in vLLM's
    own interpreter, which need not have PDCluster installed; the folder
    holds a link to our runtime package and nothing else of this environment
    (vLLM keeps its own torch).
    """
    import pdcluster.runtime

    base = state_dir / "pythonpath"
    package = base / "pdcluster"
    package.mkdir(parents=True, exist_ok=True)
    link, wanted = package / "runtime", Path(next(iter(pdcluster.runtime.__path__)))
    if not (link.is_symlink() and link.resolve() == wanted.resolve()):
        link.unlink(missing_ok=True)
        link.symlink_to(wanted)
    return base


@dataclass
class _Membership:
    """A change autoscaling asks of the supervise loop; `done` is set once applied."""

    adopt: bool  # True: supervise the instance; False: release it for a drain
    key: InstanceKey
    specs: list[ProcessSpec]
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


class LocalCluster:
    def __init__(self, plan: LocalPlan, state_dir: Path, token: str | None = None) -> None:
        self.plan = plan
        self.state_dir = state_dir
        self.token = token or secrets.token_hex(16)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # Per process: restarts, the last exit it made by itself, its instance's phase.
        self.restarts: dict[str, int] = {}
        self.last_exit: dict[str, str] = {}
        self.phase: dict[str, str] = {}
        # Guards plan, procs and phase against the autoscaling thread; state writes too.
        self.lock = threading.RLock()
        # Set by `stop`: the state file is removed, and no thread that still
        # sees a child exit (supervision, autoscaling) may write it back.
        self._stopped = False
        self._membership: queue.SimpleQueue[_Membership] = queue.SimpleQueue()

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
        env = {
            **os.environ,
            "PDCLUSTER_TOKEN": self.token,
            "PYTHONUNBUFFERED": "1",
            # The process stops once this launcher is gone (`parent_watch.py`).
            PARENT_PID_ENV: str(os.getpid()),
            **spec.env,
        }
        if spec.api_key_env is not None:
            env[spec.api_key_env] = self.token
        if spec.side_port is not None:  # vLLM with our connector
            ours = str(our_package_path(self.state_dir))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (ours, env.get("PYTHONPATH")) if p)
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
        with self.lock:
            self._write_state()

    def _write_state(self) -> None:
        if self._stopped:
            return
        state = {
            "cluster": self.plan.cluster,
            "endpoint": self.plan.endpoint,
            "launcher_pid": os.getpid(),
            "processes": [
                {
                    **_public(spec),
                    "pid": self.procs[spec.name].pid,
                    "state": self.phase.get(spec.name, "running"),
                    "restarts": self.restarts.get(spec.name, 0),
                    "last_exit": self.last_exit.get(spec.name),
                }
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

    def wait_admitted(self, timeout: float = 180.0) -> None:
        """Wait until the router counts every worker it lists as healthy.

        The router's /health answers 200 once one worker per role is in, so a
        request sent right after `wait_ready` may find an instance not yet
        admitted and go to the others; `up` says "serving on" only after this.
        """
        deadline = time.monotonic() + timeout
        url = self.plan.router.url + "/health"
        waiting: list[str] = ["the router"]
        with httpx.Client(timeout=2.0) as client:
            while True:
                try:
                    workers = client.get(url).json().get("workers", [])
                    waiting = [w["url"] for w in workers if not w.get("healthy")]
                    if workers and not waiting:
                        return
                except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the router has not admitted {', '.join(waiting)} after {timeout:.0f}s"
                    )
                time.sleep(0.1)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.state_dir / "logs" / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # ------------------------------------------------------------ supervision
    def instances(self) -> dict[InstanceKey, list[ProcessSpec]]:
        """The plan's processes by instance (a gang; the router is none)."""
        out: dict[InstanceKey, list[ProcessSpec]] = {}
        for spec in self.plan.workers:
            assert spec.role != "router"
            out.setdefault(InstanceKey(Role(spec.role), spec.instance), []).append(spec)
        return out

    def supervise(
        self,
        policies: dict[Role, RestartPolicySpec],
        *,
        bootstrap_timeout_s: float = 30.0,
        period_s: float = 0.1,
        on_action: Callable[[str], None] = print,
        stop: threading.Event | None = None,
        liveness: LivenessPolicy | None = None,
    ) -> str:
        """Keep the cluster serving until the supervisor gives up; returns why.

        `policies`: each role's restart policy; `bootstrap_timeout_s`: the
        longest a decode refuses rooms on a prefill it was told was lost (the
        restarted prefill is admitted at the router at the latest then);
        `stop`: set by another thread to end supervision (before `stop()`,
        so that nothing is restarted while the cluster is being stopped);
        `liveness`: how running instances' leaders are probed (`liveness.py`;
        default: as the operator's pods are).
        """
        instances = self.instances()
        sup = Supervisor(instances, policies)
        key_of = {s.name: k for k, specs in instances.items() for s in specs}
        generation = dict.fromkeys(self.procs, 0)
        seen: set[str] = set()  # processes whose exit was observed or caused
        started_at: dict[InstanceKey, float] = {}
        notifier = PeerNotifier(self.token, self.plan.endpoint)
        ledger = LivenessLedger(liveness or LivenessPolicy())
        prober = LivenessProber(ledger.policy)
        killed: dict[str, str] = {}  # processes killed for failed probes: why

        def running_decodes() -> list[ProcessSpec]:
            # A multi-pod instance talks to the rest of the cluster through its leader pod.
            decodes = [
                s
                for specs in instances.values()
                for s in specs
                if s.role is Role.decode and s.is_leader
            ]
            return [d for d in decodes if self.phase.get(d.name, "running") == "running"]

        def apply_membership() -> None:
            while True:
                try:
                    change = self._membership.get_nowait()
                except queue.Empty:
                    return
                names = [s.name for s in change.specs]
                if change.adopt:
                    sup.add_instance(change.key)
                    instances[change.key] = change.specs
                    for name in names:
                        key_of[name], generation[name] = change.key, 0
                    with self.lock:
                        self.phase.update(dict.fromkeys(names, "running"))
                    change.ok = True
                elif sup.is_supervised(change.key):
                    try:
                        sup.remove_instance(change.key)
                    except SupervisionError:
                        change.done.set()  # being restarted: not drained now
                        continue
                    del instances[change.key]
                    for name in names:
                        key_of.pop(name, None)
                    with self.lock:
                        self.phase.update(dict.fromkeys(names, "draining"))
                    change.ok = True
                self.write_state()
                change.done.set()

        def is_ready(key: InstanceKey) -> bool:
            specs = instances[key]
            if not all(notifier.is_healthy(s) for s in specs):
                return False
            if time.monotonic() - started_at[key] > bootstrap_timeout_s:
                return True  # every decode's verdict on it has expired by now
            return all(notifier.is_seen_answering(s, d) for s in specs for d in running_decodes())

        def perform(acts: list[Action]) -> None:
            said: list[str] = []  # printed once the state file shows it
            for act in acts:
                if isinstance(act, TearDown):
                    specs = instances[act.key]
                    seen.update(s.name for s in specs)
                    self._tear_down(specs)
                    for s in specs:
                        self.phase[s.name] = "backoff"
                elif isinstance(act, ReportLost):
                    specs = instances[act.key]
                    told = 0
                    for s in (s for s in specs if s.is_leader):
                        if s.role is Role.prefill:
                            told += notifier.fail_prefill(s, running_decodes())
                        notifier.hold(s, act.reason)
                    start_at = sup.view(act.key).start_at or time.monotonic()
                    delay = max(0.0, start_at - time.monotonic())
                    note = ""
                    if act.key.role is Role.prefill and specs[0].engine is EngineKind.vllm:
                        note = "; the router moved its requests still waiting for its KV"
                    elif act.key.role is Role.prefill:
                        note = (
                            f"; its rooms failed at {told}/{len(running_decodes())} decode workers"
                        )
                    said.append(f"{act.key} lost ({act.reason}){note}; restarting in {delay:.1f}s")
                elif isinstance(act, Spawn):
                    for s in instances[act.key]:
                        self.spawn(s)
                        generation[s.name] = act.generation
                        seen.discard(s.name)
                        self.restarts[s.name] = self.restarts.get(s.name, 0) + 1
                        self.phase[s.name] = "starting"
                    started_at[act.key] = time.monotonic()
                elif isinstance(act, Admit):
                    for s in instances[act.key]:
                        self.phase[s.name] = "running"
                        if s.is_leader:
                            notifier.admit(s)
                    said.append(f"{act.key} is back")
                else:
                    assert isinstance(act, GiveUp)  # the loop ends on `sup.given_up`
            if acts:
                self.write_state()
            for line in said:
                on_action(line)

        def probe_targets() -> list[ProbeTarget]:
            return [
                ProbeTarget(s.name, generation[s.name], s.url, s.liveness_path)
                for specs in instances.values()
                for s in specs
                if s.is_leader
                and s.name not in seen
                and self.phase.get(s.name, "running") == "running"
            ]

        def judge_probes() -> None:
            for result in prober.drain():
                name = result.process
                if name in seen or name not in key_of or generation[name] != result.generation:
                    continue  # ended, drained, or a probe of an older start
                if ledger.record(name, result.generation, result.ok):
                    killed[name] = ledger.policy.describe()
                    proc = self.procs[name]
                    if proc.poll() is None:
                        # Its whole group: a pod's rank processes go with it.
                        os.killpg(proc.pid, signal.SIGKILL)

        try:
            while sup.given_up is None:
                apply_membership()
                judge_probes()
                now = time.monotonic()
                for name, proc in list(self.procs.items()):
                    # A process autoscaling owns (starting, draining) is not supervised.
                    owned = name in key_of or name == self.plan.router.name
                    if name in seen or not owned or proc.poll() is None:
                        continue
                    seen.add(name)
                    ledger.forget(name)
                    how = killed.pop(name, None)
                    self.last_exit[name] = how or describe_exit(proc.returncode)
                    key = key_of.get(name)
                    perform(sup.on_exit(name, key, generation[name], proc.returncode, now, how))
                    if key is None or sup.given_up is not None:
                        tail = self.log_tail(name, 10)
                        on_action(f"{name} exited ({describe_exit(proc.returncode)}):\n{tail}")
                for key in sup.starting():
                    if is_ready(key):
                        perform(sup.on_ready(key, sup.generation(key)))
                perform(sup.tick(time.monotonic()))
                if sup.given_up is not None:
                    break
                prober.set_targets(probe_targets())
                if stop is None:
                    time.sleep(period_s)
                elif stop.wait(period_s):
                    return "supervision stopped"
        finally:
            prober.close()
            notifier.close()
            while not self._membership.empty():  # nobody applies them any more
                self._membership.get_nowait().done.set()
        reason: str = sup.given_up
        return reason

    # ------------------------------------------------------------ autoscaling hooks
    def add_scaled(self, specs: list[ProcessSpec]) -> None:
        """Start a new instance outside supervision (autoscaling waits for it)."""
        with self.lock:
            self.plan = replace(self.plan, workers=(*self.plan.workers, *specs))
            for spec in specs:
                self.spawn(spec)
                self.phase[spec.name] = "starting"
            self._write_state()

    def adopt(self, key: InstanceKey, specs: list[ProcessSpec], timeout: float = 30.0) -> bool:
        """Hand a ready instance to the supervise loop; False if it did not take it."""
        return self._ask(_Membership(True, key, specs), timeout)

    def release(self, key: InstanceKey, timeout: float = 30.0) -> list[ProcessSpec] | None:
        """Take a running instance back from supervision before draining it (None: it is
        not running now, e.g. being restarted; it is left alone)."""
        with self.lock:
            specs = [s for s in self.plan.workers if s.role == key.role and s.instance == key.index]
        if not specs:
            return None
        return specs if self._ask(_Membership(False, key, specs), timeout) else None

    def _ask(self, change: _Membership, timeout: float) -> bool:
        self._membership.put(change)
        return change.done.wait(timeout) and change.ok

    def remove_scaled(self, specs: list[ProcessSpec]) -> None:
        """Stop an unsupervised instance (a drained one, or one that failed to start)
        and forget it."""
        names = {s.name for s in specs}
        with self.lock:
            procs = [self.procs[n] for n in names if n in self.procs]
        stop_pids([p.pid for p in procs], grace=10.0)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with self.lock:
            for name in names:
                self.procs.pop(name, None)
                self.phase.pop(name, None)
            workers = tuple(s for s in self.plan.workers if s.name not in names)
            self.plan = replace(self.plan, workers=workers)
            self._write_state()

    def instance_phases(self) -> dict[InstanceKey, str]:
        """Each worker instance and its phase as `ps` shows it (a gang: its worst)."""
        order = ("running", "draining", "starting", "backoff")
        out: dict[InstanceKey, str] = {}
        with self.lock:
            for spec in self.plan.workers:
                key = InstanceKey(Role(spec.role), spec.instance)
                phase = self.phase.get(spec.name, "running")
                if key not in out or order.index(phase) > order.index(out[key]):
                    out[key] = phase
        return out

    def _tear_down(self, specs: list[ProcessSpec]) -> None:
        """Kill what is left of a lost instance (every process group of it) and reap it,
        so its ports are free for the next start."""
        procs = [self.procs[s.name] for s in specs if s.name in self.procs]
        stop_pids([p.pid for p in procs], grace=0.0)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_group_alive(p.pid) for p in procs):
            time.sleep(0.02)
        for proc in procs:
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, grace: float = 10.0) -> None:
        with self.lock:
            self._stopped = True
        stop_pids([p.pid for p in self.procs.values()], grace)
        # Every group got SIGKILL by now; a loaded box may take a while to
        # reap them, and a child left unreaped stays a zombie of ours.
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        with self.lock:
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
    rows = [
        (
            "NAME",
            "ROLE",
            "POD",
            "RANKS",
            "PID",
            "ALIVE",
            "STATE",
            "RESTARTS",
            "URL",
            "BOOTSTRAP",
            "LAST EXIT",
        )
    ]
    for p in state["processes"]:
        rows.append(
            (
                p["name"],
                p["role"],
                _pod_text(p),
                _ranks_text(p),
                str(p["pid"]),
                "yes" if p["alive"] else "no",
                p.get("state", "running"),
                str(p.get("restarts", 0)),
                p["url"],
                str(p.get("bootstrap_port") or "-"),
                p.get("last_exit") or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"cluster {state['cluster']}  endpoint {state['endpoint']}/v1"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _pod_text(p: dict[str, Any]) -> str:
    num_pods = p.get("num_pods", 1)
    return f"{p.get('pod', 0)}/{num_pods}" if num_pods > 1 else "-"


def _ranks_text(p: dict[str, Any]) -> str:
    """A pod's ranks: their count, or `2-3` (global ranks) for a pod of a multi-pod instance."""
    n: int = p["num_ranks"]
    if p.get("num_pods", 1) == 1:
        return str(n)
    first: int = p.get("first_rank", 0)
    return str(first) if n == 1 else f"{first}-{first + n - 1}"


def print_err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
