from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdcluster.runtime.ports import free_port
from pdcluster.runtime.router.cli import API_KEYS_ENV, parse_invocation
from pdcluster.runtime.router.workers import KVEventPorts

from .harness import LoopThread, start_cluster

P = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]

MANIFEST = """\
apiVersion: pdcluster.io/v1alpha1
kind: PDCluster
metadata: {name: demo}
spec:
  model: {name: tiny}
  prefill: {}
  decode: {}
  router:
    policy: {prefill: random, decode: least_outstanding}
    requestTimeoutSeconds: 42
"""


def test_flags_become_settings() -> None:
    inv = parse_invocation([*P, "--port", "9100", "--decode-policy", "random"], env={})
    assert inv.port == 9100 and inv.host == "127.0.0.1"
    assert inv.config.prefill_urls == ("http://127.0.0.1:1",)
    assert inv.config.decode_policy == "random"
    assert inv.config.is_disaggregated


def test_kv_events_name_the_ports_a_listed_vllm_worker_publishes_on() -> None:
    inv = parse_invocation([*P, "--kv-events", "http://127.0.0.1:2/=5557,5558"], env={})
    assert inv.config.kv_events == (("http://127.0.0.1:2", KVEventPorts(5557, 5558)),)


def test_manifest_settings_apply_and_flags_win(tmp_path: Path) -> None:
    manifest = tmp_path / "pd.yaml"
    manifest.write_text(MANIFEST)
    inv = parse_invocation(
        [*P, "--manifest", str(manifest), "--decode-policy", "round_robin"], env={}
    )
    assert inv.config.prefill_policy == "random"
    assert inv.config.decode_policy == "round_robin"
    assert inv.config.request_timeout_s == 42


def test_failure_policy_comes_from_the_manifest_or_the_flag(tmp_path: Path) -> None:
    manifest = tmp_path / "pd.yaml"
    manifest.write_text(
        MANIFEST.replace("  prefill: {}", "  transfer: {failurePolicy: recompute}\n  prefill: {}")
    )
    inv = parse_invocation([*P, "--manifest", str(manifest)], env={})
    assert inv.config.failure_policy == "recompute"
    inv = parse_invocation([*P, "--manifest", str(manifest), "--failure-policy", "fail"], env={})
    assert inv.config.failure_policy == "fail"
    assert parse_invocation(P, env={}).config.failure_policy == "fail"


def test_api_keys_come_from_env_and_file_not_flags(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("file-key-1\n\nfile-key-2\n")
    inv = parse_invocation(
        [*P, "--api-key-file", str(keys)], env={API_KEYS_ENV: "env-key, other-key"}
    )
    assert inv.config.api_keys == ("env-key", "other-key", "file-key-1", "file-key-2")


def test_an_api_key_file_may_hold_the_variables_comma_separated_form(tmp_path: Path) -> None:
    # The operator mounts the Secret key `keys` as this file; users wrote it for the variable.
    keys = tmp_path / "keys"
    keys.write_text("key-a, key-b\nkey-c\n")
    inv = parse_invocation([*P, "--api-key-file", str(keys)], env={})
    assert inv.config.api_keys == ("key-a", "key-b", "key-c")


def test_kubernetes_discovery_flags() -> None:
    inv = parse_invocation(
        ["--k8s-namespace", "ns", "--k8s-selector", "app=x", "--k8s-mode", "pd"], env={}
    )
    assert inv.config.kubernetes is not None
    assert inv.config.kubernetes.label_selector == "app=x"
    assert inv.config.is_disaggregated


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--prefill", "http://127.0.0.1:1"], "decode URL"),
        ([*P, "--port", "0"], "--port"),
        ([*P, "--manifest", "/nonexistent/pd.yaml"], "--manifest"),
        ([*P, "--api-key-file", "/nonexistent/keys"], "--api-key-file"),
        (["--k8s-namespace", "ns"], "--k8s-mode"),
        ([*P, "--max-body-bytes", "5"], "max_body_bytes"),
        ([*P, "--kv-events", "http://127.0.0.1:1"], "URL=PUB_PORT,REPLAY_PORT"),
        ([*P, "--kv-events", "http://127.0.0.1:1=5557"], "URL=PUB_PORT,REPLAY_PORT"),
        ([*P, "--kv-events", "http://127.0.0.1:1=5557,x"], "URL=PUB_PORT,REPLAY_PORT"),
        ([*P, "--kv-events", "http://127.0.0.1:1=5557,5557"], "both 5557"),
        ([*P, "--kv-events", "http://127.0.0.1:1=0,5558"], "1..65535"),
        ([*P, "--kv-events", "http://127.0.0.1:9=5557,5558"], "not a listed worker"),
        (
            [*P, "--kv-events", "http://127.0.0.1:1=1,2", "--kv-events", "http://127.0.0.1:1=3,4"],
            "twice",
        ),
    ],
)
def test_bad_flags_are_refused_with_a_reason(argv: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_invocation(argv, env={})


def test_module_entry_point_serves_requests(loop: LoopThread) -> None:
    """`python -m pdcluster.runtime.router` as a real process in front of a worker."""
    with start_cluster(loop, prefill=0, decode=0, colocated=1) as cluster:
        port = free_port()
        env = {**os.environ, API_KEYS_ENV: "cli-key"}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdcluster.runtime.router",
                "--port",
                str(port),
                "--colocated",
                cluster.colocated[0].url,
                "--log-level",
                "warning",
            ],
            env=env,
            cwd="/",  # the repository root would shadow the stdlib `operator`
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            with httpx.Client(base_url=url, trust_env=False, timeout=5) as http:
                while True:
                    try:
                        if http.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert proc.poll() is None, proc.communicate()[1]
                    assert time.monotonic() < deadline, "router process did not come up"
                    time.sleep(0.05)
                assert http.post("/generate", json={"text": "a"}).status_code == 401
                resp = http.post(
                    "/generate", json={"text": "a"}, headers={"authorization": "Bearer cli-key"}
                )
                assert resp.status_code == 200 and resp.json()["text"] == " w0 w1 w2 w3"
        finally:
            proc.terminate()
            _, stderr = proc.communicate(timeout=10)
        # uvicorn re-raises SIGTERM after its graceful shutdown.
        assert proc.returncode in (0, -15)
        assert b"Traceback" not in stderr
