"""Our KV connector inside vLLM against vLLM's own NixlConnector, side by side in one run.

    .venv/bin/python bench/vllm_connectors.py [--repeats 5] [--json out.json] [--chart out.png]
        [--fault-wait 600] [--configs pdcluster-tcp,...]   # shorter: --repeats 3 --fault-wait 120

Same box, same vLLM (e2e/vllmenv: vLLM 0.32 CPU, NIXL 1.5.1), same random
Llama, same router (ours, `pdcluster router`), one configuration after the
other, each a prefill and a decode `vllm serve` as `pdcluster up` starts
them from the manifest (`runtime/local/plan.py`: argv, ports, side ports,
the decode's prefill peers, the router's flags; vLLM's environment for this
CPU box as in the tests, `tests/vllm/harness.py`), without local mode's
supervisor, since the bench kills and restarts the prefill itself:

- `pdcluster-tcp`, `pdcluster-nixl`: `kvConnector: PDClusterConnector`,
  `transfer.backend` tcp or nixl; the router sends both legs at once;
- `NixlConnector`: vLLM's connector over NIXL; the router sends the prefill
  leg, then the decode leg with the prefill's `kv_transfer_params`.

For each:
1. equality: PD through the router == the decode engine serving the same
   prompt alone, greedy, for prompts of 16, 300 and 2,000 tokens;
2. TTFT (streamed, median of `--repeats`) through the router in PD, and on
   the decode engine alone (colocated), at 16 and 2,000 tokens: PD ÷ colocated,
   and PD − colocated (the time PD adds, which does not depend on how fast
   each connector's engine computes);
3. transfer rate for a 2,000-token prompt the prefill has cached, two ways:
   - moving: KV bytes ÷ the time the KV was in flight. NixlConnector: vLLM's
     `vllm:nixl_bytes_transferred` ÷ `vllm:nixl_xfer_time_seconds` (the
     decode's READs, posted → done). Ours: the prefill's sender, bytes of
     completed jobs ÷ the time any job was moving (`kv:sent_bytes`,
     `kv:busy_us`: first frame handed over → last frame done; over nixl a
     WRITE is done once NIXL reports it written into the decode's memory,
     the same event as a READ's completion; over tcp once the kernel took
     the bytes, before the decode copied them into its pages);
   - load (ours only): KV bytes ÷ the decode's wait, its pages sent → every
     source done, which includes the prefill's scheduling and its step
     (NixlConnector's decode starts reading only after the prefill answered,
     so it has no such span);
   - moving and load with the legs in turn (ours only, `legs_in_turn`): the
     same prompt, its decode leg sent only once the prefill leg answered, as
     NixlConnector's run, so the KV moves while the prefill engine is idle:
     our engine's rate under NixlConnector's conditions, where the router's
     both-legs-at-once has the push compete with the prefill's own step;
4. faults: the prefill gets kill -9 while the decode still needs a
   2,000-token prompt's KV from it (ours: the decode waits in its room and
   the bench sends `fail_peer` at once, as the operator or local supervisor
   does; NixlConnector: killed between the two legs, nothing vLLM could be
   told; `fault()` says what is timed) → time until the decode ends the
   request, the decode's blocks in use after it (vLLM's
   `kv_cache_usage_perc`), whether its next request succeeds; then the
   prefill restarted → time until the first PD request through the router
   succeeds;
5. decode_fault: the decode gets kill -9 while the prefill holds a
   2,000-token prompt's blocks for it (`decode_fault()` says how each is
   staged) → time until the prefill's blocks are free again.

Targets (issue 34): failure ended ≤ 1 s with no block held where
NixlConnector waits for its timeout; TTFT overhead ≤ NixlConnector's;
transfer ≥ 0.9× NixlConnector's on the same UCX lanes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e.vllmenv.build import checkout_pythonpath, ensure_vllm_env  # noqa: E402
from pdcluster.runtime.local.parent_watch import PARENT_PID_ENV  # noqa: E402
from pdcluster.runtime.local.plan import build_local_plan, count_ports  # noqa: E402
from pdcluster.runtime.ports import free_ports  # noqa: E402
from pdcluster.runtime.spec import parse_manifest  # noqa: E402
from tests.engine.testing import write_random_hf_dir  # noqa: E402
from tests.vllm.harness import CPU_ENV  # noqa: E402

TOKEN = "bench-token"
MODEL = "bench-llama"
VOCAB = (3, 290)
START_TIMEOUT_S = 900.0
# How long the fault scenario waits for the decode to end the request (--fault-wait).
FAULT_WAIT_S = 600.0
HEADERS = {"authorization": f"Bearer {TOKEN}"}


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # A session of its own: a kill reaches vLLM's engine core too, which
        # holds the connector's side port (a restart binds it again).
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=out, start_new_session=True
            )

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        if self.proc is not None:
            self._signal(signal.SIGKILL)  # the whole group, even once the leader is gone
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


@dataclass
class Cluster:
    label: str
    prefill: Proc
    decode: Proc
    router: Proc
    ports: dict[str, int]
    procs: list[Proc] = field(default_factory=list)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"


def manifest(model: Path, connector: str, backend: str) -> dict[str, Any]:
    return {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": "bench"},
        "spec": {
            "engine": {
                "kind": "vllm",
                "vllm": {
                    "kvConnector": connector,
                    "extraArgs": ["--enforce-eager", "--max-model-len", "2048"],
                    # As in the tests (tests/vllm/harness.py): without
                    # VLLM_CPU_OMP_THREADS_BIND=nobind vLLM pins its worker's
                    # main thread to one core, and every thread started from it
                    # afterwards (our connector's agent, its sockets' threads)
                    # inherits that core.
                    "env": dict(CPU_ENV),
                },
            },
            "model": {"name": MODEL, "path": str(model)},
            "kvCache": {"pageSize": 32},
            "transfer": {"backend": backend},
            "prefill": {},
            "decode": {},
            "router": {"healthCheckIntervalSeconds": 0.5},
        },
    }


def launch(label: str, doc: dict[str, Any], root: Path) -> Cluster:
    """The processes `pdcluster up` would start for `doc` (runtime/local/plan.py:
    argv, ports, side ports, the decode's prefill peers, the router's flags),
    with the environment its launcher gives them, but no supervisor: the bench
    kills and restarts the prefill itself."""
    path = root / f"{label}.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = parse_manifest(doc)
    vllm = str(ensure_vllm_env(log=False).python)
    plan = build_local_plan(
        spec, str(path), free_ports(count_ports(spec)), python=sys.executable, vllm=vllm
    )
    base = dict(
        os.environ,
        PDCLUSTER_TOKEN=TOKEN,
        PYTHONUNBUFFERED="1",
        # vLLM stops with the bench (runtime/local/child_guard.py).
        **{PARENT_PID_ENV: str(os.getpid())},
    )
    base.pop("PDCLUSTER_TOKEN_FILE", None)
    procs: dict[str, Proc] = {}
    ports: dict[str, int] = {"router": plan.router.port}
    for w in plan.workers:
        role = str(w.role)
        env = base | w.env
        if w.api_key_env is not None:
            env[w.api_key_env] = TOKEN
        # vLLM's interpreter imports our connector from this checkout.
        env["PYTHONPATH"] = str(checkout_pythonpath())
        procs[role] = Proc(f"{label}-{role}", list(w.argv), env, root / f"{label}-{role}.log")
        ports[role] = w.port
        if w.side_port is not None:
            ports[f"{role}_side"] = w.side_port
    router = Proc(f"{label}-router", list(plan.router.argv), base, root / f"{label}-router.log")
    cluster = Cluster(label, procs["prefill"], procs["decode"], router, ports)
    for proc in (cluster.prefill, cluster.decode, cluster.router):
        proc.start()
    return cluster


def wait_ready(cluster: Cluster, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5, trust_env=False, headers=HEADERS) as http:
        for name in ("prefill", "decode"):
            while True:
                for proc in (cluster.prefill, cluster.decode, cluster.router):
                    if proc.proc is not None and proc.proc.poll() is not None:
                        raise RuntimeError(f"{proc.name} exited: see {proc.log}")
                try:
                    if http.get(cluster.url(name) + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cluster.label} {name} did not start")
                time.sleep(1)
        while True:  # the router admits both workers: a request goes through
            try:
                if completion(http, cluster.url("router"), [5, 6, 7], 1)["tokens"]:
                    return
            except (httpx.HTTPError, RuntimeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cluster.label} router did not admit its workers")
            time.sleep(1)


def completion(
    http: httpx.Client, base: str, prompt: list[int], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = http.post(base + "/v1/completions", json=body | extra, timeout=300)
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
    choice = resp.json()["choices"][0]
    return {"text": choice["text"], "tokens": choice.get("token_ids") or choice["text"]}


def ttft(http: httpx.Client, base: str, prompt: list[int]) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with http.stream("POST", base + "/v1/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}")
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


def prompts(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(length)]


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kv_usage(http: httpx.Client, cluster: Cluster) -> float:
    text = http.get(cluster.url("decode") + "/metrics").text
    return metric(text, "vllm:kv_cache_usage_perc")


PARTS = ("equal", "ttft", "transfer", "fault", "decode_fault")


def measure(
    cluster: Cluster,
    ours: bool,
    repeats: int,
    root: Path,
    fault_wait: float = FAULT_WAIT_S,
    parts: tuple[str, ...] = PARTS,
) -> dict[str, Any]:
    rng = random.Random(34)
    out: dict[str, Any] = {"config": cluster.label}
    router, decode = cluster.url("router"), cluster.url("decode")
    with httpx.Client(timeout=300, trust_env=False, headers=HEADERS) as http:
        if "equal" in parts:
            out["equal"] = equality(http, router, decode, rng)
        if "ttft" in parts:
            out.update(ttfts(http, router, decode, rng, repeats))
        if "transfer" in parts:
            out.update(transfer(http, cluster, ours, rng, repeats))
        if "fault" in parts:
            out.update(fault(http, cluster, ours, rng, root, fault_wait))
        if "decode_fault" in parts:
            out.update(decode_fault(http, cluster, ours, rng, fault_wait))
    return out


def equality(http: httpx.Client, router: str, decode: str, rng: random.Random) -> bool:
    """PD through the router == the decode engine alone, greedy."""
    equal = []
    for n in (16, 300, 2000):
        p = prompts(rng, n)
        want = completion(http, decode, p, 16)["text"]
        got = completion(http, router, p, 16)["text"]
        equal.append(got == want)
    return all(equal)


def ttfts(
    http: httpx.Client, router: str, decode: str, rng: random.Random, repeats: int
) -> dict[str, float]:
    """TTFT through the router (PD) and on the decode alone (colocated)."""
    out: dict[str, float] = {}
    for n in (16, 2000):
        colo = [ttft(http, decode, prompts(rng, n)) for _ in range(repeats)]
        pd = [ttft(http, router, prompts(rng, n)) for _ in range(repeats)]
        out[f"ttft_colocated_{n}_ms"] = statistics.median(colo) * 1e3
        out[f"ttft_pd_{n}_ms"] = statistics.median(pd) * 1e3
        out[f"ttft_ratio_{n}"] = statistics.median(pd) / statistics.median(colo)
        # The ratio's denominator is the engine's own speed, which differs per
        # connector (NixlConnector's agents spin a core); the added time does not.
        out[f"ttft_added_{n}_ms"] = (statistics.median(pd) - statistics.median(colo)) * 1e3
    return out


def transfer(
    http: httpx.Client, cluster: Cluster, ours: bool, rng: random.Random, repeats: int
) -> dict[str, float | None]:
    """Transfer rates of a cached 2,000-token prompt (see the module doc)."""
    out: dict[str, float | None] = {}
    router = cluster.url("router")
    rates: dict[str, list[float]] = {"moving": [], "load": [], "moving_in_turn": []}
    for _ in range(repeats):
        for in_turn in (False, True) if ours else (False,):
            p = prompts(rng, 2000)
            completion(http, cluster.url("prefill"), p, 1)  # now in the prefill's cache
            before = transfer_counters(http, cluster, ours)
            if in_turn:
                legs_in_turn(http, cluster, p, room=rng.randrange(1, 1 << 62))
            else:
                completion(http, router, p, 1)
            # A rank's counters reach the side port after a vLLM step: one more
            # short request on each engine runs one there once the move is done.
            time.sleep(0.2)
            for role in ("prefill", "decode"):
                completion(http, cluster.url(role), [5, 6, 7], 1)
            after = transfer_counters(http, cluster, ours)
            for kind, (moved, seconds) in after.items():
                moved -= before[kind][0]
                seconds -= before[kind][1]
                if moved > 0 and seconds > 0:
                    rates.setdefault(f"{kind}_in_turn" if in_turn else kind, []).append(
                        moved / seconds
                    )
    for kind, values in rates.items():
        out[f"transfer_{kind}_MiB_s"] = statistics.median(values) / 2**20 if values else None
    return out


def legs_in_turn(http: httpx.Client, cluster: Cluster, prompt: list[int], room: int) -> None:
    """Our two legs one after the other, as NixlConnector's run: the decode's leg
    only once the prefill answered, so the KV moves while the prefill engine is
    idle (our router sends both at once, and the push leaves as the forward ends)."""
    params = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.ports["prefill_side"],
        "bootstrap_room": room,
    }
    completion(http, cluster.url("prefill"), prompt, 1, kv_transfer_params=params)
    completion(http, cluster.url("decode"), prompt, 1, kv_transfer_params=params)


def transfer_counters(
    http: httpx.Client, cluster: Cluster, ours: bool
) -> dict[str, tuple[float, float]]:
    """(KV bytes so far, seconds they took), as "moving" and, for ours, "load"."""
    if ours:

        def stats(role: str) -> dict[str, Any]:
            side = f"http://127.0.0.1:{cluster.ports[f'{role}_side']}"
            return dict(http.get(side + "/admin/failures").json()["stats"])

        sent, got = stats("prefill"), stats("decode")
        return {
            "moving": (float(sent.get("kv:sent_bytes", 0)), sent.get("kv:busy_us", 0) / 1e6),
            "load": (float(got.get("kv_received_bytes", 0)), got.get("kv_received_us", 0) / 1e6),
        }
    text = http.get(cluster.url("decode") + "/metrics").text
    return {
        "moving": (
            metric(text, "vllm:nixl_bytes_transferred_sum"),
            metric(text, "vllm:nixl_xfer_time_seconds_sum"),
        )
    }


def nixl_prefill_leg(http: httpx.Client, cluster: Cluster, prompt: list[int]) -> dict[str, Any]:
    """NixlConnector's prefill leg, as our router sends it: the prefill computes the
    prompt and keeps its blocks for a decode's READ; its answer names them."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    resp = http.post(cluster.url("prefill") + "/v1/completions", json=body, timeout=300)
    answer: dict[str, Any] = resp.json()
    return answer


def fault(
    http: httpx.Client,
    cluster: Cluster,
    ours: bool,
    rng: random.Random,
    root: Path,
    wait_s: float = FAULT_WAIT_S,
) -> dict[str, Any]:
    """The prefill lost while the decode still needs a long prompt's KV from it.

    Ours: the decode waits in its room (the prefill leg never comes), the
    prefill gets kill -9, and the bench sends `fail_peer` at once, as the
    operator or local supervisor does; timed from the kill. NixlConnector
    reads the KV itself as soon as its request arrives, so the prefill is
    killed between its leg and the decode's (the KV is not read yet: the
    decode must still fetch it); timed from the decode request, the prefill
    already gone, and nothing vLLM could be told."""
    p = prompts(rng, 2000)
    decode = cluster.url("decode")
    if ours:
        room = rng.randrange(1, 1 << 62)
        params = {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": cluster.ports["prefill_side"],
            "bootstrap_room": room,
        }
        decode_extra = {"kv_transfer_params": params}
    else:
        answer = nixl_prefill_leg(http, cluster, p)
        decode_extra = {"kv_transfer_params": answer["kv_transfer_params"]}
        cluster.prefill.kill()
    result: dict[str, Any] = {}

    def run_decode() -> None:
        try:
            completion(http, decode, p, 4, **decode_extra)
            result["decode_outcome"] = "served"
        except (httpx.HTTPError, RuntimeError) as err:
            result["decode_outcome"] = f"error: {str(err)[:120]}"
        result["decode_end"] = time.perf_counter()

    lost = time.perf_counter()
    waiter = threading.Thread(target=run_decode)
    waiter.start()
    if ours:
        time.sleep(1.0)  # the decode is waiting for KV that will never come
        lost = time.perf_counter()
        cluster.prefill.kill()
        side = f"http://127.0.0.1:{cluster.ports['decode_side']}"
        http.post(
            side + "/admin/fail_peer",
            json={
                "peer": f"127.0.0.1:{cluster.ports['prefill_side']}",
                "reason": "prefill_pod_lost",
                "gone": True,
            },
        )
    waiter.join(wait_s)
    out: dict[str, Any] = {
        "fault_decode_outcome": result.get("decode_outcome", f"still waiting after {wait_s:.0f} s"),
        "fault_time_to_end_s": (result["decode_end"] - lost) if "decode_end" in result else None,
    }
    time.sleep(0.5)
    out["fault_kv_usage_after"] = kv_usage(http, cluster)
    try:
        completion(http, decode, prompts(rng, 50), 4)
        out["fault_next_request"] = "served"
    except (httpx.HTTPError, RuntimeError) as err:
        out["fault_next_request"] = f"error: {str(err)[:120]}"
    restarted = time.perf_counter()
    cluster.prefill.start()
    deadline = restarted + START_TIMEOUT_S
    while time.perf_counter() < deadline:
        try:
            completion(http, cluster.url("router"), prompts(rng, 100), 4)
            out["restart_to_first_pd_s"] = time.perf_counter() - restarted
            break
        except (httpx.HTTPError, RuntimeError):
            time.sleep(0.5)
    return out


def prefill_usage(http: httpx.Client, cluster: Cluster) -> float:
    """The prefill's KV cache in use, fresh: vLLM updates the gauge when it steps,
    so a one-token request runs a step first (its own block is freed by then)."""
    completion(http, cluster.url("prefill"), [5, 6, 7], 1)
    text = http.get(cluster.url("prefill") + "/metrics").text
    return metric(text, "vllm:kv_cache_usage_perc")


def decode_fault(
    http: httpx.Client, cluster: Cluster, ours: bool, rng: random.Random, wait_s: float
) -> dict[str, Any]:
    """The decode lost while the prefill holds a 2,000-token prompt's blocks for it.

    NixlConnector: the prefill answered its leg (its blocks wait for the
    decode's READ), then the decode gets kill -9; nothing vLLM could be told.
    Ours: both legs through the router; the decode is stopped (SIGSTOP) once
    its room is open, so the prefill computes and holds the blocks for it,
    then it gets kill -9 and the bench reports the decode's host to the prefill's
    side port at once (`fail_peer`), as the operator does for a lost pod.
    Timed from the kill until the prefill's blocks in use are back to what
    they were before (within `wait_s`); then whether the prefill serves."""
    p = prompts(rng, 2000)
    base = prefill_usage(http, cluster)
    out: dict[str, Any] = {}
    waiter: threading.Thread | None = None
    if ours:
        waiter = threading.Thread(
            target=lambda: _ignore_errors(completion, http, cluster.url("router"), p, 4)
        )
        waiter.start()
        time.sleep(0.15)  # the decode opened its room and waits for the KV
        # Hung first, so the prefill's push cannot finish: it holds the blocks.
        cluster.decode._signal(signal.SIGSTOP)
    else:
        nixl_prefill_leg(http, cluster, p)
    held = prefill_usage(http, cluster)
    lost = time.perf_counter()
    cluster.decode.kill()
    if ours:
        side = f"http://127.0.0.1:{cluster.ports['prefill_side']}"
        http.post(
            side + "/admin/fail_peer",
            json={"peer": "127.0.0.1", "reason": "decode_pod_lost", "gone": True},
        )
    freed = None
    while time.perf_counter() - lost < wait_s:
        usage = prefill_usage(http, cluster)
        if usage <= base + 1e-4:
            freed = time.perf_counter() - lost
            break
        time.sleep(0.2)
    if waiter is not None:
        waiter.join(wait_s)
    out["decode_fault_held_before"] = held
    out["decode_fault_freed_s"] = freed
    out["decode_fault_outcome"] = (
        "freed" if freed is not None else f"still held after {wait_s:.0f} s"
    )
    cluster.decode.start()
    return out


def _ignore_errors(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except (httpx.HTTPError, RuntimeError):
        pass


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        ("PD == colocated (16, 300, 2,000 tokens)", "equal", "{}"),
        ("TTFT colocated, 16 tokens (ms)", "ttft_colocated_16_ms", "{:.0f}"),
        ("TTFT PD, 16 tokens (ms)", "ttft_pd_16_ms", "{:.0f}"),
        ("TTFT PD ÷ colocated, 16 tokens", "ttft_ratio_16", "{:.2f}"),
        ("TTFT PD − colocated, 16 tokens (ms)", "ttft_added_16_ms", "{:.0f}"),
        ("TTFT colocated, 2,000 tokens (ms)", "ttft_colocated_2000_ms", "{:.0f}"),
        ("TTFT PD, 2,000 tokens (ms)", "ttft_pd_2000_ms", "{:.0f}"),
        ("TTFT PD ÷ colocated, 2,000 tokens", "ttft_ratio_2000", "{:.2f}"),
        ("TTFT PD − colocated, 2,000 tokens (ms)", "ttft_added_2000_ms", "{:.0f}"),
        ("transfer while moving, cached 2,000 tokens (MiB/s)", "transfer_moving_MiB_s", "{:.0f}"),
        ("decode load, pages sent → landed (MiB/s)", "transfer_load_MiB_s", "{:.0f}"),
        (
            "… legs in turn, the prefill idle (MiB/s)",
            "transfer_moving_in_turn_MiB_s",
            "{:.0f}",
        ),
        ("prefill kill -9: decode ends the request after (s)", "fault_time_to_end_s", "{:.2f}"),
        ("… how it ends", "fault_decode_outcome", "{}"),
        ("… decode KV cache in use after (fraction)", "fault_kv_usage_after", "{:.3f}"),
        ("… decode's next request", "fault_next_request", "{}"),
        ("prefill restarted → first PD request (s)", "restart_to_first_pd_s", "{:.0f}"),
        ("decode kill -9: prefill KV in use then (fraction)", "decode_fault_held_before", "{:.3f}"),
        ("… prefill frees the blocks after (s)", "decode_fault_freed_s", "{:.2f}"),
    ]
    head = "| | " + " | ".join(r["config"] for r in results) + " |"
    lines = [head, "| --- |" + " --- |" * len(results)]
    for label, key, fmt in rows:
        cells = []
        for r in results:
            value = r.get(key)
            cells.append("—" if value is None else fmt.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in results]
    colors = ["#2c7a3f", "#6a9fd4", "#999"][: len(names)]
    panels = [
        ("ttft_ratio_16", "TTFT PD ÷ colocated, 16 tokens"),
        ("ttft_ratio_2000", "TTFT PD ÷ colocated, 2,000 tokens"),
        ("transfer_moving_MiB_s", "KV transfer while moving (MiB/s)"),
        ("fault_time_to_end_s", "prefill lost → decode ends (s)"),
        ("decode_fault_freed_s", "decode lost → prefill frees (s)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 3.4))
    for ax, (key, title) in zip(axes, panels, strict=True):
        values = [r.get(key) or 0.0 for r in results]
        ax.bar(names, values, color=colors)
        ax.set_title(title, fontsize=9)
        for label in ax.get_xticklabels():
            label.set_rotation(12)
            label.set_fontsize(8)
    fig.suptitle("PDClusterConnector vs vLLM's NixlConnector, 1P1D (vLLM CPU, tiny model)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--configs", default="pdcluster-tcp,pdcluster-nixl,NixlConnector")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--chart", type=Path, help="write a PNG chart here")
    ap.add_argument(
        "--fault-wait",
        type=float,
        default=FAULT_WAIT_S,
        help="seconds the fault scenario waits for the decode to end the request",
    )
    ap.add_argument(
        "--parts", default=",".join(PARTS), help=f"what to measure, of {', '.join(PARTS)}"
    )
    args = ap.parse_args()
    parts = tuple(args.parts.split(","))
    if unknown := set(parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
    # A terminated bench still stops the processes it started (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    root = Path(tempfile.mkdtemp(prefix="vllm-connectors-"))
    model = write_random_hf_dir(
        root / "model",
        num_layers=4,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1024,
    )
    configs = {
        "pdcluster-tcp": ("PDClusterConnector", "tcp", True),
        "pdcluster-nixl": ("PDClusterConnector", "nixl", True),
        "NixlConnector": ("NixlConnector", "nixl", False),
    }
    results = []
    for label in args.configs.split(","):
        connector, backend, ours = configs[label]
        print(f"== {label}: starting prefill, decode and router", flush=True)
        cluster = launch(label, manifest(model, connector, backend), root)
        try:
            wait_ready(cluster)
            results.append(measure(cluster, ours, args.repeats, root, args.fault_wait, parts))
            print(json.dumps(results[-1]), flush=True)
        finally:
            for proc in (cluster.router, cluster.decode, cluster.prefill):
                proc.stop()
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    if args.chart is not None:
        chart(results, args.chart)
    print(f"logs: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
