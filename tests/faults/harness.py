"""Real-process fault harness: a local-mode cluster the test can kill, hang and restart.

`FaultCluster` runs a manifest's processes with the local-mode launcher
(`LocalCluster`, the same code `pdcluster up` uses) but without its
supervisor loop, so killing one worker does not take the cluster down: the
test decides what dies, what hangs (SIGSTOP) and what comes back (a restart
reuses the worker's ports, as a restarted pod keeps its Service address).

`PDClient` plays a PD router by hand — it mints rid and room and sends both
legs at once — for scenarios that need to name rooms, reuse them or aim a
leg at a fake peer. Observation helpers read what a user or operator can:
`/get_server_info` (pages, rooms, counters), `/metrics` and the admin API.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from pdcluster.runtime.cli import load_manifest
from pdcluster.runtime.local.launcher import LocalCluster
from pdcluster.runtime.local.plan import ProcessSpec, build_local_plan, count_ports
from pdcluster.runtime.ports import free_ports
from pdcluster.runtime.spec import PDCluster
from tests.faults.rogue import PREFILL_LISTENERS, Background
from tests.local.cluster import write_manifest
from tests.pd_integration.reference import colocated_outputs

TOKEN = "fault-suite-" + secrets.token_hex(8)
# Workers' data plane and info need the cluster token, as a PD router sends it.
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VOCAB = 256
PAGE = 16  # tokens per KV page in every base_spec cluster
# What a loaded CI box (load 12+ on 2 cores) may add to any "at once" in a
# test: a wake-up of each process on the path (client, worker HTTP loop,
# engine thread, ZMQ loop) queued behind other runnable processes. Timing
# bounds are a configured duration (heartbeat, probe, timeout) plus this
# slack; each test checks the bound stays below the mechanism it must tell
# apart (the request or room timeout), so "failed fast" still means fast.
LOAD_SLACK_S = 3.0
T = TypeVar("T")

# One client for every leg the suite sends. An `httpx.Client` costs ~0.1 s of
# CPU to build (its TLS context loads the CA bundle, ~0.5 s the first time in
# a process) while holding the GIL: built per leg, as `httpx.post` does, it
# delayed a request's second leg by seconds on a loaded box (past the 6 s
# bootstrap timeout for a burst's first requests) and counted in the leg's
# `elapsed`. No keep-alive: a pooled connection the worker closes as idle
# could fail the next request sent on it.
LEGS_HTTP = httpx.Client(
    timeout=30.0, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0)
)


def fast_bound(configured: float, beats: float, what: str) -> float:
    """`configured` seconds plus `LOAD_SLACK_S`: how long a fast failure may take.

    Checked to stay below `beats`, what a request that missed the fast path
    would take instead (a room timeout, the request timeout), so a test using
    the bound still fails when the fast path does not work.
    """
    bound = configured + LOAD_SLACK_S
    assert bound < beats, f"{what}: a bound of {bound:.2f}s cannot tell it from {beats:.2f}s"
    return bound


def wait_until(
    check: Callable[[], T | None], timeout: float, interval: float = 0.02, what: str = ""
) -> T:
    """Poll `check` until it returns something truthy; raise AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what or check}")
        time.sleep(interval)


def base_spec(**transfer: Any) -> dict[str, Any]:
    """A small 1p1d manifest spec with short timeouts, a fast heartbeat and the
    prefix cache on."""
    return {
        "model": {"name": "tiny"},
        "kvCache": {"pageSize": PAGE, "dtype": "float32", "layout": "NHD", "numPages": 1024},
        "transfer": {
            "backend": "tcp",
            "allocationPolicy": "early",
            "bootstrapTimeoutSeconds": 6.0,
            "waitingTimeoutSeconds": 10.0,
            "abortReleaseTimeoutSeconds": 3.0,
            "heartbeat": {"intervalSeconds": 0.5, "failureThreshold": 2},
            **transfer,
        },
        # The fault suite runs with the prefix cache on in both roles: decode
        # then references cached pages for rooms whose prompts share them.
        "prefill": {
            "replicas": 1,
            "topology": {"dp": 1, "tp": 1, "cp": 1, "pp": 1},
            "engine": {"prefixCache": True},
        },
        "decode": {
            "replicas": 1,
            "topology": {"dp": 1, "tp": 1, "cp": 1, "pp": 1},
            "engine": {"prefixCache": True},
        },
        "router": {"healthCheckIntervalSeconds": 0.5, "requestTimeoutSeconds": 30.0},
    }


class FaultCluster:
    """Processes of one manifest on 127.0.0.1, individually killable and restartable."""

    def __init__(self, tmp: Path, name: str, spec: dict[str, Any], token: str = TOKEN) -> None:
        self.manifest_path = write_manifest(tmp, name, spec)
        self.manifest: PDCluster = load_manifest(str(self.manifest_path))
        ports = free_ports(count_ports(self.manifest))
        self.plan = build_local_plan(
            self.manifest, str(self.manifest_path), ports, python=sys.executable
        )
        self.state_dir = tmp / "state" / name
        self.token = token
        self.launcher = LocalCluster(self.plan, self.state_dir, token=token)
        self.http = httpx.Client(timeout=10.0, headers={"Authorization": f"Bearer {token}"})
        self._stopped: set[str] = set()
        self._extra_prefills: set[str] = set()

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 240.0) -> FaultCluster:
        self.launcher.start()
        self.launcher.wait_ready(timeout)
        for name in self.workers("prefill"):
            self.wait_healthy(name, timeout)
        # The router answers /health once one worker per role is in: a test
        # sending through it must find every worker admitted.
        self.launcher.wait_admitted(timeout)
        PREFILL_LISTENERS.append(self._on_extra_prefill)
        return self

    # ------------------------------------------------------------ prefill peers
    def prefill_peers(self) -> list[str]:
        """What decode may contact: the plan's prefills plus the running rogue ones."""
        return sorted({self.peer(p) for p in self.workers("prefill")} | self._extra_prefills)

    def publish_prefill_peers(self, peers: Iterable[str] | None = None) -> None:
        """`PUT /admin/prefill_peers` to every live decode worker (the operator's call)."""
        body = {"peers": sorted(self.prefill_peers() if peers is None else peers)}
        for name in self.workers("decode"):
            if self.launcher.procs[name].poll() is None and name not in self._stopped:
                self.admin(name, "PUT", "/admin/prefill_peers", json=body).raise_for_status()

    def _on_extra_prefill(self, address: str, running: bool) -> None:
        if running:
            self._extra_prefills.add(address)
        else:
            self._extra_prefills.discard(address)
        self.publish_prefill_peers()

    def close(self) -> None:
        if self._on_extra_prefill in PREFILL_LISTENERS:
            PREFILL_LISTENERS.remove(self._on_extra_prefill)
        for name in list(self._stopped):
            self.cont(name)
        self.launcher.stop(grace=5.0)
        self.http.close()

    def __enter__(self) -> FaultCluster:
        try:
            return self.start()
        except BaseException:
            # __exit__ does not run when __enter__ raises: stop what did start.
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ addresses
    def spec(self, name: str) -> ProcessSpec:
        return next(p for p in self.plan.processes if p.name == name)

    def url(self, name: str) -> str:
        return self.spec(name).url

    @property
    def endpoint(self) -> str:
        return self.plan.endpoint

    def bootstrap(self, name: str) -> tuple[str, int]:
        port = self.spec(name).bootstrap_port
        assert port is not None, f"{name} hosts no bootstrap server"
        return "127.0.0.1", port

    def peer(self, name: str) -> str:
        """The string decode's room tables use for a prefill instance: `host:port`."""
        host, port = self.bootstrap(name)
        return f"{host}:{port}"

    def workers(self, role: str | None = None) -> list[str]:
        return [w.name for w in self.plan.workers if role is None or w.role == role]

    def pid(self, name: str) -> int:
        return self.launcher.procs[name].pid

    # ------------------------------------------------------------ faults
    def signal(self, name: str, sig: signal.Signals) -> None:
        # Each worker leads its own process group: its rank children share the fate.
        os.killpg(self.pid(name), sig)

    def kill(self, name: str) -> None:
        """kill -9 the worker (and its ranks); returns once the process is gone."""
        self._stopped.discard(name)
        self.signal(name, signal.SIGKILL)
        self.launcher.procs[name].wait(10)

    def hang(self, name: str) -> None:
        """SIGSTOP: the process stays, answers nothing (a hung pod)."""
        self.signal(name, signal.SIGSTOP)
        self._stopped.add(name)

    def cont(self, name: str) -> None:
        if name in self._stopped:
            self._stopped.discard(name)
            self.signal(name, signal.SIGCONT)

    def restart(self, name: str, wait: bool = True, timeout: float = 180.0) -> None:
        """Start the worker again on the same ports (a pod restart behind its Service)."""
        spec = self.spec(name)
        old = self.launcher.procs[name]
        if old.poll() is None:
            self.kill(name)
        self.launcher.spawn(spec)
        if wait:
            self.wait_healthy(name, timeout)
            if self.spec(name).bootstrap_port is not None:
                self.wait_seen_answering([name])
            elif self._extra_prefills:  # a restarted decode knows only the plan's prefills
                self.publish_prefill_peers()

    def wait_seen_answering(self, prefills: Iterable[str], timeout: float = 30.0) -> None:
        """Until no live decode refuses new rooms on these prefills any more.

        A decode that declared a prefill dead fails new rooms on it at once
        until its heartbeat finds it answering again (`peers_down`).
        """
        peers = {self.peer(p) for p in prefills}
        for name in self.workers("decode"):
            if self.launcher.procs[name].poll() is not None or name in self._stopped:
                continue
            wait_until(
                lambda n=name: not peers & set(self.info(n).get("peers_down", {})),
                timeout,
                0.05,
                f"{name} to see {sorted(peers)} answering",
            )

    def wait_healthy(self, name: str, timeout: float = 180.0) -> None:
        proc = self.launcher.procs[name]

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.launcher.log_tail(name)}")
            try:
                return self.http.get(self.url(name) + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout, 0.2, f"{name} healthy")
        if self.spec(name).bootstrap_port is not None:
            # Serving HTTP is not enough for a prefill: its ranks must have
            # registered with its bootstrap server before decode can use it.
            host, port = self.bootstrap(name)

            def registered() -> bool:
                try:
                    resp = self.http.get(
                        f"http://{host}:{port}/route",
                        params={"dp": -1, "cp": -1, "tp": -1, "pp": -1},
                        headers={"Authorization": f"Bearer {self.token}"},
                        timeout=2,
                    )
                except httpx.HTTPError:
                    return False
                return resp.status_code == 200

            wait_until(registered, timeout, 0.1, f"{name} registered")

    def log(self, name: str, lines: int = 200) -> str:
        return self.launcher.log_tail(name, lines)

    # ------------------------------------------------------------ observation
    def info(self, name: str) -> dict[str, Any]:
        resp = self.http.get(self.url(name) + "/get_server_info")
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data

    def stats(self, name: str) -> dict[str, int]:
        stats: dict[str, int] = self.info(name)["pd_stats"]
        return stats

    def failures(self, name: str) -> dict[str, float]:
        """`pdcluster_failures_total` by reason label, from /metrics."""
        text = self.http.get(self.url(name) + "/metrics").text
        return parse_counter(text, "pdcluster_failures_total", "reason")

    def admin(self, name: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}", **kwargs.pop("headers", {})}
        return self.http.request(method, self.url(name) + path, headers=headers, **kwargs)

    def rooms(self, name: str) -> list[dict[str, Any]]:
        resp = self.admin(name, "GET", "/admin/rooms")
        resp.raise_for_status()
        rooms: list[dict[str, Any]] = resp.json()["rooms"]
        return rooms

    def room_state(self, name: str, room: int) -> str | None:
        """The KVPoll state of `room` on worker `name`; None once it is gone."""
        for r in self.rooms(name):
            if r["room"] == room:
                state: str = r["state"]
                return state
        return None

    def abort(self, name: str, rid: str) -> dict[str, Any]:
        """POST /abort_request for `rid` on worker `name`; it must answer 200."""
        resp = self.admin(name, "POST", "/abort_request", json={"rid": rid}, timeout=5)
        assert resp.status_code == 200, resp.text
        data: dict[str, Any] = resp.json()
        return data

    def fail_peer(
        self, name: str, peer: str, reason: str = "peer_lost", gone: bool | None = None
    ) -> httpx.Response:
        """The operator's fast path; `gone=None` sends no flag (the worker's default)."""
        body: dict[str, Any] = {"peer": peer, "reason": reason}
        if gone is not None:
            body["gone"] = gone
        return self.admin(name, "POST", "/admin/fail_peer", json=body)

    def is_clean(self, name: str) -> bool:
        info = self.info(name)
        return (
            info["num_free_pages"] == info["num_total_pages"]
            and info["num_rooms"] == 0
            and not self.rooms(name)
        )

    def assert_clean(self, names: Iterable[str] | None = None, timeout: float = 15.0) -> None:
        """No page leak and no leftover room on each named worker (docs/design.md §14)."""
        for name in self.workers() if names is None else names:
            try:
                wait_until(lambda n=name: self.is_clean(n), timeout, 0.1, f"{name} clean")
            except AssertionError:
                raise AssertionError(
                    f"{name} did not return to its initial state: {self.info(name)} "
                    f"rooms={self.rooms(name)}"
                ) from None


_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\}\s+([0-9.eE+-]+)$")


def parse_counter(text: str, metric: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != metric + "_total" and m.group(1) != metric:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + float(m.group(3))
    return out


# ---------------------------------------------------------------- PD client


def mint_rid() -> str:
    return "req-" + secrets.token_hex(16)


def mint_room() -> int:
    return secrets.randbits(63) or 1


def gen_body(
    prompt: list[int],
    max_tokens: int,
    *,
    bootstrap: tuple[str, int],
    rid: str | None = None,
    room: int | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """A worker leg's body; a fresh rid and room unless given."""
    return {
        "input_ids": prompt,
        "rid": mint_rid() if rid is None else rid,
        "stream": stream,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True},
        "bootstrap_host": bootstrap[0],
        "bootstrap_port": bootstrap[1],
        "bootstrap_room": mint_room() if room is None else room,
    }


@dataclass
class LegResult:
    status: int
    body: dict[str, Any]
    elapsed: float
    ended_at: float = 0.0  # time.monotonic() when the answer was complete

    @property
    def ok(self) -> bool:
        return self.status == 200 and "error" not in self.body

    @property
    def output_ids(self) -> list[int]:
        ids: list[int] = self.body["output_ids"]
        return ids

    @property
    def error(self) -> str:
        err = self.body.get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        return str(err)


@dataclass
class PDResult:
    rid: str
    room: int
    prefill: LegResult | None
    decode: LegResult


def post_leg(url: str, body: dict[str, Any], timeout: float) -> LegResult:
    t0 = time.monotonic()
    try:
        resp = LEGS_HTTP.post(url + "/generate", json=body, headers=AUTH, timeout=timeout)
    except httpx.HTTPError as err:
        end = time.monotonic()
        return LegResult(599, {"error": f"transport: {err!r}"}, end - t0, end)
    end = time.monotonic()
    try:
        data = resp.json()
    except ValueError:
        data = {"error": resp.text[:500]}
    if not isinstance(data, dict):
        data = {"error": str(data)[:500]}
    return LegResult(resp.status_code, data, end - t0, end)


def abort_leg(url: str, rid: str) -> None:
    try:
        LEGS_HTTP.post(url + "/abort_request", json={"rid": rid}, headers=AUTH, timeout=5)
    except httpx.HTTPError:
        pass  # the worker is gone: nothing of the request is left there


class PDClient:
    """Sends both legs of a request at once, like a PD router (SGLang worker API)."""

    def __init__(self, max_workers: int = 32) -> None:
        # Separate pools: a job blocked on its prefill leg must not starve that leg.
        self.pool = ThreadPoolExecutor(max_workers)
        self.legs = ThreadPoolExecutor(max_workers)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.legs.shutdown(wait=True, cancel_futures=True)

    def generate(
        self,
        prefill_url: str | None,
        decode_url: str,
        bootstrap: tuple[str, int],
        prompt: list[int],
        max_tokens: int = 4,
        *,
        rid: str | None = None,
        room: int | None = None,
        timeout: float = 30.0,
        propagate: bool = True,
    ) -> PDResult:
        """Both legs at once; like a PD router, a failed leg gets the other aborted."""
        rid = rid or mint_rid()
        room = room or mint_room()
        body = gen_body(prompt, max_tokens, rid=rid, room=room, bootstrap=bootstrap)
        dec = self.legs.submit(post_leg, decode_url, body, timeout)
        if prefill_url is None:
            return PDResult(rid, room, None, dec.result())
        pre = self.legs.submit(post_leg, prefill_url, body, timeout)
        legs = {pre: prefill_url, dec: decode_url}
        done, _ = wait(legs, return_when=FIRST_COMPLETED)
        if propagate:
            for fut in done:
                other = dec if fut is pre else pre
                if not fut.result().ok and not other.done():
                    abort_leg(legs[other], rid)
        return PDResult(rid, room, pre.result(), dec.result())

    def pair(
        self,
        cluster: FaultCluster,
        prefill: str,
        decode: str,
        prompt: list[int],
        max_tokens: int = 4,
        *,
        timeout: float = 30.0,
        propagate: bool = True,
    ) -> PDResult:
        """`generate` through the named workers of `cluster` (prefill's own bootstrap server)."""
        return self.generate(
            cluster.url(prefill),
            cluster.url(decode),
            cluster.bootstrap(prefill),
            prompt,
            max_tokens,
            timeout=timeout,
            propagate=propagate,
        )

    def many(self, jobs: list[Callable[[], T]]) -> list[T]:
        futures = [self.pool.submit(job) for job in jobs]
        return [f.result() for f in futures]


# ---------------------------------------------------------------- traffic under faults


def tied_rooms(cluster: FaultCluster, decode: str, prefill: str) -> list[dict[str, Any]]:
    peer = cluster.peer(prefill)
    return [r for r in cluster.rooms(decode) if peer in r["peers"]]


def live(rooms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rooms if r["state"] != "Failed"]


def start_traffic(
    cluster: FaultCluster,
    client: PDClient,
    victims: list[tuple[str, str, list[int]]],
    survivors: list[tuple[str, str, list[int]]],
    *,
    propagate: bool = True,
    max_tokens: int = 4,
) -> Background:
    """Victims and survivors at once. `propagate=False`: a failed leg does not get the
    other aborted, so only the workers' own detection (heartbeat, timeouts) ends it."""

    def job(prefill: str, decode: str, prompt: list[int], propagate: bool) -> PDResult:
        return client.pair(
            cluster, prefill, decode, prompt, max_tokens, timeout=40, propagate=propagate
        )

    jobs = [lambda a=a: job(*a, propagate) for a in victims] + [
        lambda a=a: job(*a, True) for a in survivors
    ]
    return Background(client.many, jobs)


def run_all(
    cluster: FaultCluster,
    client: PDClient,
    prompts: list[list[int]],
    max_tokens: int = 4,
    *,
    timeout: float = 40,
    propagate: bool = True,
) -> list[PDResult]:
    """Every prompt through prefill-0 and decode-0 at once; the results in prompt order."""
    return client.many(
        [
            lambda p=p: client.pair(
                cluster,
                "prefill-0",
                "decode-0",
                p,
                max_tokens,
                timeout=timeout,
                propagate=propagate,
            )
            for p in prompts
        ]
    )


def run_all_equal_colocated(
    cluster: FaultCluster, client: PDClient, prompts: list[list[int]], max_tokens: int = 4
) -> list[PDResult]:
    """`run_all`, checked: every prompt's PD output equals the colocated engine's."""
    expected = colocated_outputs(cluster.manifest, prompts, max_tokens)
    results = run_all(cluster, client, prompts, max_tokens)
    assert [r.decode.output_ids for r in results] == expected
    return results


def check_survivors(results: list[PDResult], expected: list[list[int]]) -> None:
    for i, (res, want) in enumerate(zip(results, expected, strict=True)):
        assert res.decode.ok, f"survivor {i} failed: {res.decode.status} {res.decode.error}"
        assert res.decode.output_ids == want, f"survivor {i}: PD output != colocated output"


def wait_mid_transfer(cluster: FaultCluster, decode: str, prefill: str) -> None:
    """Until one room from `prefill` is receiving KV on `decode` and another still waits."""
    seen: list[Any] = []

    def ready() -> bool:
        rooms = live(tied_rooms(cluster, decode, prefill))
        seen[:] = [(r["state"], r["detail"], r["reason"]) for r in rooms]
        return len(rooms) >= 2 and any(r["state"] == "Transferring" for r in rooms)

    try:
        wait_until(ready, 30, 0.01, f"a room on {decode} Transferring from {prefill}")
    except AssertionError as err:
        raise AssertionError(f"{err}; last seen {seen}; {cluster.stats(decode)}") from None


def abort_decode_leg(cluster: FaultCluster, rid: str, leg: Background, state: str) -> PDResult:
    """Abort `rid` on decode-0 while its room is in `state`; the client's leg ends
    at once: its tokens end with "abort" if decoding had begun (`Success`),
    otherwise it gets a 502 saying the request was aborted."""
    # At once: well before the room's own timeouts could have ended the leg.
    spec = cluster.manifest.spec.transfer
    bound = fast_bound(
        0.0,
        min(spec.bootstrap_timeout_seconds, spec.waiting_timeout_seconds),
        "an abort ending the decode leg",
    )
    aborted_at = time.monotonic()
    assert cluster.abort("decode-0", rid)["found"] is True
    result: PDResult = leg.result(bound + 10)
    took = result.decode.ended_at - aborted_at
    assert took < bound, f"the decode leg ended {took:.2f}s after the abort"
    if state == "Success":
        assert result.decode.status == 200
        assert result.decode.body["meta_info"]["finish_reason"]["type"] == "abort"
    else:
        assert result.decode.status == 502 and "aborted" in result.decode.error
    return result


def probe_timeout_s(cluster: FaultCluster) -> float:
    """The decode heartbeat's probe timeout: min(interval / 2, 1 s) (peer_liveness.py)."""
    return min(cluster.manifest.spec.transfer.heartbeat.interval_seconds / 2, 1.0)


def heartbeat_bound(cluster: FaultCluster) -> float:
    """Seconds within which decode fails the rooms of a prefill that stopped answering.

    The verdict comes after `failureThreshold` missed probes, `intervalSeconds`
    apart, the last one timing out; plus the load slack. A room the heartbeat
    missed would hang until its bootstrap or waiting timeout instead.
    """
    transfer = cluster.manifest.spec.transfer
    hb = transfer.heartbeat
    return fast_bound(
        hb.failure_threshold * hb.interval_seconds + probe_timeout_s(cluster),
        min(transfer.bootstrap_timeout_seconds, transfer.waiting_timeout_seconds),
        "a heartbeat verdict",
    )


def router_generate(endpoint: str, prompt: list[int], max_tokens: int, timeout: float) -> LegResult:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True},
    }
    return post_leg(endpoint, body, timeout)


def make_prompts(n: int, seed: int, lo: int = 1, hi: int = 64) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---------------------------------------------------------------- one-sided writers


def held_pages(cluster: FaultCluster, name: str) -> int:
    """Pages of worker `name` reserved now."""
    info = cluster.info(name)
    held: int = info["num_total_pages"] - info["num_free_pages"]
    return held


def one_sided_victims(cluster: FaultCluster, client: PDClient, seed: int) -> Background:
    """Two long prompts prefill-1 -> decode-0 (left to the workers' own detection);
    returns once prefill-1 writes into decode-0. A prefill-1 an earlier scenario
    killed is restarted first. A one-sided write can finish between two polls:
    victims that all finished unseen are replaced by new ones, up to three rounds."""
    if cluster.launcher.procs["prefill-1"].poll() is not None:
        cluster.restart("prefill-1")
    peer = cluster.peer("prefill-1")

    def writing() -> bool:
        return any(
            r["state"] == "Transferring" and peer in r["peers"] for r in cluster.rooms("decode-0")
        )

    for attempt in range(3):
        victims = make_prompts(2, seed=seed + 1000 * attempt, lo=1200, hi=1500)
        jobs = [
            lambda p=p: client.pair(cluster, "prefill-1", "decode-0", p, 4, propagate=False)
            for p in victims
        ]
        traffic = Background(client.many, jobs)

        def seen(traffic: Background = traffic) -> str | None:
            return "writing" if writing() else "done" if traffic.done() else None

        if wait_until(seen, 30, 0.005, "prefill-1 writing into decode-0") == "writing":
            return traffic
        traffic.result()  # finished unseen: raise what broke it, else try again
    raise AssertionError("prefill-1 never seen writing into decode-0 in 3 rounds of victims")


def survivors_served(cluster: FaultCluster, client: PDClient, seed: int) -> None:
    """Four prompts prefill-0 -> decode-0, each equal to its colocated output: pages
    reused after a writer's failure hold none of its late bytes."""
    prompts = make_prompts(4, seed=seed, lo=200, hi=900)
    expected = colocated_outputs(cluster.manifest, prompts, 32)
    results = client.many(
        [lambda p=p: client.pair(cluster, "prefill-0", "decode-0", p, 32) for p in prompts]
    )
    for res, want in zip(results, expected, strict=True):
        assert res.decode.ok, res.decode.error
        assert res.decode.output_ids == want, "a page was reused while a writer could reach it"
