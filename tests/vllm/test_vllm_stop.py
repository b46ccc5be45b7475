"""A vLLM pod asked to stop finishes its requests: real vLLM, the pod's own flags.

The operator starts a vLLM worker with `--shutdown-timeout` (the role's
drain budget, operator/builders/vllm_pods.py): on SIGTERM vLLM finishes the
requests it has instead of aborting them, its default. This runs the
arguments the operator renders for a colocated vLLM pod (its address and
port swapped for loopback ones) as a process of the cached vLLM
environment, sends SIGTERM while a long greedy stream is in flight, and
checks that the stream still ends complete and the process then exits
cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdcluster.operator.builders import build_worker_pod
from pdcluster.runtime.ports import free_ports
from pdcluster.runtime.spec import Role
from pdcluster.runtime.vllm.serve_command import VllmServe, vllm_argv
from tests.operator.helpers import make_cluster
from tests.vllm.harness import CPU_ENV, MODEL_NAME, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

READY_TIMEOUT_S = 600
DRAIN_S = 60
MAX_TOKENS = 300


def pod_args(model: Path, port: int) -> list[str]:
    """`vllm serve`'s arguments in the operator's colocated vLLM pod, on loopback."""
    spec = {
        "engine": {
            "kind": "vllm",
            "vllm": {"extraArgs": ["--max-model-len", "1024", "--enforce-eager"]},
        },
        "model": {"name": MODEL_NAME, "path": str(model)},
        "kvCache": {"pageSize": 128},
        "colocated": {"drain": {"timeoutSeconds": DRAIN_S}},
    }
    pod = build_worker_pod(make_cluster(spec), Role.colocated, 0, 0)
    (container,) = pod["spec"]["containers"]
    args = [str(a) for a in container["args"]]
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    return args


@pytest.fixture(scope="module")
def engine(
    vllm_python: str, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    (port,) = free_ports(1)
    args = pod_args(vllm_model, port)
    argv = vllm_argv(vllm_python, VllmServe(model=args[0], flags=tuple(args[1:])))
    log = tmp_path_factory.mktemp("vllm-stop") / "vllm.log"
    env = {**os.environ, **CPU_ENV}
    env.pop("VLLM_API_KEY", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert proc.poll() is None, f"vLLM exited: {log.read_text()[-2000:]}"
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, READY_TIMEOUT_S, "vLLM ready")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_pods_flags_let_vllm_finish_a_stream_after_sigterm(
    engine: tuple[subprocess.Popen[bytes], str],
) -> None:
    proc, url = engine
    body = {
        "model": MODEL_NAME,
        "prompt": [5, 6, 7, 8],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    finish = None
    stopped = False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "choices" in event, f"the stream broke off: {event}"
            choice = event["choices"][0]
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            if len(tokens) >= 5 and not stopped:
                proc.send_signal(signal.SIGTERM)
                stopped = True
    assert stopped, "the stream ended before it could be stopped"
    # Every token of the request came, and it ended as a full answer, not an abort.
    assert finish == "length"
    assert len(tokens) == MAX_TOKENS
    # Then vLLM stops on its own, well inside its drain budget.
    assert proc.wait(timeout=DRAIN_S) == 0
