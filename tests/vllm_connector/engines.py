"""Real vLLM engines with our connector, for the tests: processes of vLLM's own interpreter.

`start_engines` starts several `engine_host.py` processes at once (a cold
vLLM start takes a minute or more on a loaded box, so a test module starts
its engines once and shares them) and waits until each is ready. Each
`Engine` sends requests, waits for their ends and reads its scheduler's
block count; its `side` client talks to the connector's side port with the
cluster token.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.vllmenv.build import VllmEnvError, checkout_pythonpath, ensure_vllm_env

HOST_SCRIPT = Path(__file__).with_name("engine_host.py")
EVENT_MARK = "@@pdcluster "
TOKEN = "vllm-connector-test-token"
START_TIMEOUT_S = 1200.0


@dataclass
class Engine:
    name: str
    config: dict[str, Any]
    proc: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    log_path: Path | None = None
    free_blocks: int = 0  # when it came up: the count every test must return to
    _side: httpx.Client | None = None

    @property
    def side_port(self) -> int:
        return int(self.config["extra"]["sidePort"])

    @property
    def side_url(self) -> str:
        return f"http://127.0.0.1:{self.side_port}"

    @property
    def side(self) -> httpx.Client:
        """A client of the connector's side port, with the cluster token."""
        if self._side is None:
            self._side = httpx.Client(
                base_url=self.side_url,
                headers={"authorization": f"Bearer {TOKEN}"},
                timeout=10.0,
                trust_env=False,
            )
        return self._side

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def add(
        self, rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None
    ) -> None:
        self.send(op="add", id=rid, prompt=prompt, max_tokens=max_tokens, params=params)

    def wait(self, kind: str, timeout: float = 120.0, rid: str | None = None) -> dict[str, Any]:
        """The next event of `kind` (of request `rid`); events of other kinds are kept."""
        deadline = time.monotonic() + timeout
        skipped: list[dict[str, Any]] = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{self.name}: no {kind} event ({rid}) in {timeout}s")
                try:
                    event = self.events.get(timeout=left)
                except queue.Empty:
                    continue
                if event["event"] == kind and (rid is None or event.get("id") == rid):
                    return event
                skipped.append(event)
        finally:
            for event in skipped:
                self.events.put(event)

    def generate(
        self, rid: str, prompt: list[int], max_tokens: int, timeout: float = 120.0
    ) -> dict[str, Any]:
        self.add(rid, prompt, max_tokens)
        return self.wait("done", timeout, rid)

    def stats(self) -> dict[str, Any]:
        self.send(op="stats")
        return self.wait("stats")

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Stats once every block is back and no request is left (or the last ones seen)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["free_blocks"] == self.free_blocks and stats["requests"] == 0:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _close_side(self) -> None:
        if self._side is not None:
            self._side.close()
            self._side = None

    def stop(self) -> None:
        self._close_side()
        if self.alive:
            try:
                self._close_stdin()
                self.proc.wait(20)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait(10)
        self._close_stdin()

    def kill(self) -> None:
        """kill -9, as a crash."""
        self._close_side()
        self.proc.kill()
        self.proc.wait(10)
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass  # the process is gone: nothing left to flush to


def vllm_python() -> str:
    try:
        return str(ensure_vllm_env(log=False).python)
    except VllmEnvError as err:
        pytest.fail(f"vLLM's environment could not be built: {err}")


def _spawn(name: str, config: dict[str, Any], log_dir: Path) -> Engine:
    env = dict(
        os.environ,
        PYTHONPATH=str(checkout_pythonpath()),
        PDCLUSTER_TOKEN=TOKEN,
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    env.pop("PDCLUSTER_TOKEN_FILE", None)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [vllm_python(), str(HOST_SCRIPT), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
        )
    engine = Engine(name, config, proc, log_path=log_path)

    def read() -> None:
        assert proc.stdout is not None
        with proc.stdout:  # closed at the process's end
            for line in proc.stdout:
                if line.startswith(EVENT_MARK):
                    engine.events.put(json.loads(line[len(EVENT_MARK) :]))

    threading.Thread(target=read, name=f"{name}-events", daemon=True).start()
    return engine


def start_engines(configs: dict[str, dict[str, Any]], log_dir: Path) -> dict[str, Engine]:
    """Start every engine at once; return them once all are ready (or fail naming the one)."""
    engines = {name: _spawn(name, cfg, log_dir) for name, cfg in configs.items()}
    try:
        for engine in engines.values():
            ready = engine.wait("ready", START_TIMEOUT_S)
            engine.free_blocks = int(ready["free_blocks"])
    except AssertionError:
        for engine in engines.values():
            engine.stop()
        tails = {e.name: _tail(e.log_path) for e in engines.values()}
        pytest.fail(f"a vLLM engine did not start: {tails}")
    return engines


def restart(engine: Engine, log_dir: Path) -> Engine:
    """The same engine again (after a crash): a new process, same config."""
    engine.stop()
    (fresh,) = start_engines({engine.name: engine.config}, log_dir).values()
    return fresh


def stop_all(engines: Iterable[Engine]) -> None:
    for engine in engines:
        engine.stop()


def _tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def connector(role: str, side_port: int, transfer: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """`kv_connector_extra_config` of one engine."""
    return {
        "sidePort": side_port,
        "host": "127.0.0.1",
        "advertiseHost": "127.0.0.1",
        "transfer": transfer,
    } | extra
