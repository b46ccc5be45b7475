"""Local mode's autoscaling loop: the operator's planner under `pdcluster up`.

Every `intervalSeconds` of a role's `spec.<role>.autoscaling`, in its own
thread: scrape the ready instances' `/metrics`, decide (scaling.py, pure),
and act:

Start (a numbered recipe; the instance joins the router only once ready):
  1. build its process from the manifest on fresh ports, start it;
  2. wait for its `/health` (a process that exits or never answers is
     stopped and forgotten, with a log line);
  3. prefill: every decode learns the new bootstrap server
     (`PUT /admin/prefill_peers`) before any request can name it;
  4. `POST /admin/add_worker` at the router (it serves after its first good
     probe), then the supervisor takes it over (restarts, `ps`).

Drain (no request fails; `drain.py` decides each step, and says why a
step does not advance):
  1. the supervisor lets go of it (its exit is no loss);
  2. `POST /admin/hold_worker` at the router until it confirms: no new leg
     goes to it (an unconfirmed hold is asked again, never assumed);
  3. wait until the router has no leg in flight on it and the worker's own
     `pdcluster_requests_in_flight` is 0 — both read, neither guessed (a
     `/metrics` that times out is busy, not idle);
  4. the router removes it (`/admin/remove_worker`; a 409, legs still in
     flight, goes back to 3); prefill: the decodes forget its bootstrap
     server; its processes are stopped.

Step 1 of each happens in the loop, so the next interval already counts the
instance as starting (no scale-down meanwhile) or gone; the rest runs in a
task (thread) of its own, so a slow start does not stall the other role's
decisions.

Decisions go to `on_line` (stderr under `pdcluster up`) as the operator's
Events would: "Normal ScaledUp: prefill 1 -> 2: ttftP90Seconds ...".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from pdcluster.runtime.autoscale.samples import IN_FLIGHT, MetricsParseError, parse_worker_metrics
from pdcluster.runtime.http.auth import bearer_headers
from pdcluster.runtime.local.drain import Drain, DrainPhase, Load, Reply
from pdcluster.runtime.local.launcher import LocalCluster
from pdcluster.runtime.local.plan import (
    ProcessSpec,
    build_instance_specs,
    instance_ports,
    prefill_peers,
)
from pdcluster.runtime.local.scaling import (
    SCALED_ROLES,
    DrainInstance,
    RoleConfig,
    RoleInstances,
    ScaleAction,
    ScalingConfig,
    ScalingHistory,
    Scrape,
    compute_local_step,
    roles_due,
)
from pdcluster.runtime.local.supervision import InstanceKey
from pdcluster.runtime.ports import free_ports
from pdcluster.runtime.spec import EngineKind, PDCluster, Role

# The loop never sleeps longer than this (a stop is seen at once anyway).
MAX_WAIT_S = 5.0
POLL_S = 0.2


def scaling_config(manifest: PDCluster) -> ScalingConfig:
    """The autoscaling settings of a manifest's prefill and decode roles."""
    spec = manifest.spec
    roles = {}
    for role in SCALED_ROLES:
        rs = spec.role_spec(role)
        if rs is not None:
            roles[role] = RoleConfig(rs.autoscaling, rs.gpus_per_instance)
    return ScalingConfig(roles, spec.autoscaling.max_total_gpus)


class LocalAutoscaler:
    """Runs `compute_local_step` each interval and performs its actions on `cluster`.

    `ready_timeout_s`: the longest a new instance may take to answer /health;
    `drain_timeout_s`: the longest a drain waits for in-flight requests (then
    the instance is stopped anyway, with a Warning line).
    """

    def __init__(
        self,
        cluster: LocalCluster,
        manifest: PDCluster,
        manifest_path: str,
        python: str,
        *,
        on_line: Callable[[str], None],
        vllm: str | None = None,
        ready_timeout_s: float = 300.0,
        drain_timeout_s: float = 600.0,
    ) -> None:
        self.cluster = cluster
        self.manifest = manifest
        self.manifest_path = str(Path(manifest_path).resolve())
        self.python = python
        self.vllm = vllm
        self.config = scaling_config(manifest)
        self.on_line = on_line
        self.ready_timeout_s = ready_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.history = ScalingHistory()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # One thread per start or drain in progress: the loop keeps deciding meanwhile.
        self._tasks: list[threading.Thread] = []
        # The decodes' prefill set is computed and sent by one task at a time.
        self._peers_lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="autoscaler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        token = self.cluster.token
        with httpx.Client(timeout=2.0, trust_env=False, headers=bearer_headers(token)) as http:
            try:
                while not self._stop.is_set():
                    wait = self._interval(http)
                    self._stop.wait(wait)
            finally:
                for task in self._tasks:  # they see the stop within a poll
                    task.join(30)

    # ------------------------------------------------------------ one interval
    def _interval(self, http: httpx.Client) -> float:
        now = time.monotonic()
        due = roles_due(self.config, self.history, now)
        if not due:
            return self._wait_after(now)
        instances = self._instances()
        scrapes: dict[Role, dict[int, Scrape]] = {}
        for role in due:
            for spec in self._specs(role, instances[role].ready):
                try:
                    resp = http.get(spec.url + "/metrics")
                except httpx.HTTPError:
                    continue  # gone since: no sample from it
                if resp.status_code == 200:
                    scrapes.setdefault(role, {})[spec.instance] = Scrape(resp.text, now)
        step = compute_local_step(self.config, instances, scrapes, self.history, now)
        self.history = step.history
        for line in step.lines:
            self.on_line(line)
        self._tasks = [t for t in self._tasks if t.is_alive()]
        for action in step.actions:
            if self._stop.is_set():
                break
            self._perform(action, http)
        return self._wait_after(time.monotonic())

    def _wait_after(self, now: float) -> float:
        due = [
            self.history.decided_at[role] + cfg.interval_seconds
            for role, rc in self.config.roles.items()
            if (cfg := rc.autoscaling) is not None and role in self.history.decided_at
        ]
        if not due:
            return POLL_S
        return min(MAX_WAIT_S, max(0.0, min(due) - now))

    def _instances(self) -> dict[Role, RoleInstances]:
        phases = self.cluster.instance_phases()
        out = {}
        for role in SCALED_ROLES:
            mine = {k.index: p for k, p in phases.items() if k.role is role}
            out[role] = RoleInstances(
                ready=frozenset(i for i, p in mine.items() if p == "running"),
                starting=frozenset(i for i, p in mine.items() if p in ("starting", "backoff")),
                draining=frozenset(i for i, p in mine.items() if p == "draining"),
            )
        return out

    def _specs(self, role: Role, numbers: frozenset[int] | set[int]) -> list[ProcessSpec]:
        with self.cluster.lock:
            return [
                s for s in self.cluster.plan.workers if s.role is role and s.instance in numbers
            ]

    def _perform(self, action: ScaleAction, http: httpx.Client) -> None:
        """Change the membership now (the next interval sees the instance starting or
        draining), and wait for the rest in a task of its own."""
        key = InstanceKey(action.role, action.instance)
        if isinstance(action, DrainInstance):
            released = self.cluster.release(key)
            if released is None:
                self.on_line(f"Normal DrainSkipped: {key} is not running now; kept")
                return
            self._spawn_task(key, lambda: self._drain(key, released, http))
        else:
            specs = build_instance_specs(
                self.manifest,
                self.manifest_path,
                key.role,
                key.index,
                free_ports(instance_ports(self.manifest, key.role)),
                self._prefills(),
                self.python,
                self.vllm,
            )
            self.cluster.add_scaled(specs)
            self._spawn_task(key, lambda: self._join(key, specs, http))

    def _spawn_task(self, key: InstanceKey, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            except httpx.HTTPError as err:
                self.on_line(f"Warning ScalingFailed: {key}: {err}")

        task = threading.Thread(target=run, name=f"autoscaler-{key}", daemon=True)
        self._tasks.append(task)
        task.start()

    # ------------------------------------------------------------ start
    def _join(self, key: InstanceKey, specs: list[ProcessSpec], http: httpx.Client) -> None:
        """A started instance joins once ready (its leader answers for every pod):
        decodes, router, supervisor."""
        role, spec = key.role, specs[0]
        if not self._wait_healthy(spec, http):
            if self._stop.is_set():
                return  # the cluster is stopping: it stops this instance too
            tail = self.cluster.log_tail(spec.name, 10)
            self.on_line(f"Warning StartFailed: {key} did not become ready; stopped:\n{tail}")
            self.cluster.remove_scaled(specs)
            return
        if role is Role.prefill:
            self._publish_prefills(http)
        body: dict[str, object] = {"url": spec.url, "role": role.value}
        if spec.kv_events_ports:  # a vLLM instance whose cache the router follows
            publish, replay = spec.kv_events_ports
            body["kv_events"] = {"publish": publish, "replay": replay}
        resp = http.post(self.cluster.plan.endpoint + "/admin/add_worker", json=body)
        if resp.status_code != 200:
            self.on_line(f"Warning StartFailed: the router refused {key}: {resp.text[:200]}")
            self._forget(specs, http)
            return
        if not self.cluster.adopt(key, specs):
            self.on_line(f"Warning StartFailed: {key} could not be supervised; stopped")
            self._forget(specs, http)
            return
        self.on_line(f"Normal InstanceStarted: {key} is ready and serving")

    def _wait_healthy(self, spec: ProcessSpec, http: httpx.Client) -> bool:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            with self.cluster.lock:
                proc = self.cluster.procs.get(spec.name)
            if proc is None or proc.poll() is not None:
                return False
            try:
                if http.get(spec.url + "/health").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            self._stop.wait(POLL_S)
        return False

    def _prefills(self, without: str | None = None) -> list[ProcessSpec]:
        with self.cluster.lock:
            workers = list(self.cluster.plan.workers)
        return [s for s in workers if s.role is Role.prefill and s.name != without and s.is_leader]

    def _publish_prefills(self, http: httpx.Client, without: str | None = None) -> None:
        """Every decode's known prefill set becomes the cluster's prefills (less
        `without`, one being removed); one starting is already in it."""
        with self._peers_lock:
            with self.cluster.lock:
                decodes = [
                    s for s in self.cluster.plan.workers if s.role is Role.decode and s.is_leader
                ]
            self._send_peers(http, decodes, prefill_peers(self._prefills(without)))

    def _send_peers(self, http: httpx.Client, decodes: list[ProcessSpec], peers: list[str]) -> None:
        body = {"peers": peers}
        # vLLM decodes read their prefill from each request's kv_transfer_params.
        for decode in (d for d in decodes if d.engine is EngineKind.builtin):
            try:
                resp = http.put(decode.admin_url + "/admin/prefill_peers", json=body)
            except httpx.HTTPError as err:
                self.on_line(f"Warning PeersNotUpdated: {decode.name}: {err}")
                continue
            if resp.status_code != 200:
                self.on_line(f"Warning PeersNotUpdated: {decode.name}: {resp.text[:200]}")

    def _forget(self, specs: list[ProcessSpec], http: httpx.Client) -> None:
        """Undo a start that did not complete: the router and the decodes forget it."""
        spec, router = specs[0], self.cluster.plan.endpoint
        try:
            http.post(router + "/admin/remove_worker", json={"url": spec.url})
        except httpx.HTTPError:
            pass
        if spec.role is Role.prefill:
            self._publish_prefills(http, without=spec.name)
        self.cluster.remove_scaled(specs)

    # ------------------------------------------------------------ drain
    def _drain(self, key: InstanceKey, specs: list[ProcessSpec], http: httpx.Client) -> None:
        """A released instance: held out, waited on, forgotten, stopped (drain.py decides)."""
        started = time.monotonic()
        self.on_line(f"Normal Draining: {key}: held out at the router, waiting for its requests")
        for spec in [s for s in specs if s.is_leader]:  # a pod k > 0 serves no HTTP
            drain = Drain(str(key), started, self.drain_timeout_s)
            while drain.phase is not DrainPhase.STOPPED:
                before = drain.phase
                step = drain.observe(self._observe(drain.phase, spec, http), time.monotonic())
                if step.line is not None:
                    self.on_line(step.line)
                if step.phase is before and self._stop.wait(POLL_S):
                    return  # the cluster is stopping: it stops this instance too
            if spec.role is Role.prefill:
                self._publish_prefills(http, without=spec.name)
        self.cluster.remove_scaled(specs)
        took = time.monotonic() - started
        self.on_line(f"Normal InstanceStopped: {key} drained in {took:.1f}s and stopped")

    def _observe(self, phase: DrainPhase, spec: ProcessSpec, http: httpx.Client) -> Reply | Load:
        """The call a drain phase makes, and what came back."""
        router = self.cluster.plan.endpoint
        if phase is DrainPhase.HOLDING:
            held = {"url": spec.url, "reason": "scaling down (autoscaling)"}
            return _reply(lambda: http.post(router + "/admin/hold_worker", json=held))
        if phase is DrainPhase.REMOVING:
            gone = {"url": spec.url}
            return _reply(lambda: http.post(router + "/admin/remove_worker", json=gone))
        return self._load(spec, http)

    def _load(self, spec: ProcessSpec, http: httpx.Client) -> Load:
        """Legs the router has on the worker, and requests the worker has in flight."""
        legs: int | None = None
        in_flight: int | None = None
        why: list[str] = []
        try:
            resp = http.get(self.cluster.plan.endpoint + "/health")
            workers = resp.json().get("workers", []) if resp.status_code == 200 else None
            if workers is None:
                why.append(f"router /health: HTTP {resp.status_code}")
            else:
                # A worker the router does not list gets nothing from it.
                found = [w for w in workers if w.get("url") == spec.url]
                legs = int(found[0].get("outstanding", 0)) if found else 0
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as err:
            why.append(f"router /health: {_describe(err)}")
        try:
            resp = http.get(spec.url + "/metrics")
            if resp.status_code != 200:
                why.append(f"worker /metrics: HTTP {resp.status_code}")
            else:
                in_flight = int(parse_worker_metrics(resp.text).gauge(IN_FLIGHT) or 0)
        except (httpx.HTTPError, MetricsParseError) as err:
            why.append(f"worker /metrics: {_describe(err)}")
        return Load(legs, in_flight, "; ".join(why))


def _reply(call: Callable[[], httpx.Response]) -> Reply:
    try:
        return Reply(call().status_code)
    except httpx.HTTPError as err:
        return Reply(0, _describe(err))


def _describe(err: Exception) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
