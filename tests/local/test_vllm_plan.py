"""Local mode with `engine.kind: vllm`: the processes it plans, the vLLM it finds,
and the guard that ties a foreign process to the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdcluster.runtime.local.plan import (
    CHILD_GUARD,
    build_instance_specs,
    build_local_plan,
    count_ports,
)
from pdcluster.runtime.local.vllm_program import VLLM_ENV, VllmNotFound, resolve_vllm
from pdcluster.runtime.spec import EngineKind, Role, parse_manifest

SPEC: dict[str, Any] = {
    "engine": {"kind": "vllm"},
    "model": {"name": "m", "path": "/models/m"},
    "transfer": {"backend": "nixl"},
    "prefill": {"replicas": 2},
    "decode": {},
}


def manifest(spec: dict[str, Any]) -> Any:
    return parse_manifest(
        {
            "apiVersion": "pdcluster.io/v1alpha1",
            "kind": "PDCluster",
            "metadata": {"name": "v"},
            "spec": spec,
        }
    )


def test_each_vllm_instance_is_one_guarded_vllm_serve() -> None:
    m = manifest(SPEC)
    ports = list(range(41000, 41000 + count_ports(m)))
    plan = build_local_plan(m, "/m.yaml", ports, python="py", vllm="/env/bin/vllm")
    assert [w.name for w in plan.workers] == ["prefill-0", "prefill-1", "decode-0"]
    for w in plan.workers:
        assert w.engine is EngineKind.vllm and w.liveness_path == "/health"
        assert w.argv[:4] == ("py", "-m", CHILD_GUARD, "--")
        assert w.argv[4:7] == ("/env/bin/vllm", "serve", "/models/m")
        assert w.argv[w.argv.index("--port") + 1] == str(w.port)
        assert w.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert w.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(w.side_channel_ports[0])
        assert w.api_key_env == "VLLM_API_KEY"
    # The router is ours, told the vLLM workers' URLs.
    assert "--prefill" in plan.router.argv and plan.router.argv[0] == "py"


def test_our_connector_gets_a_side_port_the_router_and_the_decode_are_told() -> None:
    import json

    ours = {**SPEC, "engine": {"kind": "vllm", "vllm": {"kvConnector": "PDClusterConnector"}}}
    m = manifest(ours)
    ports = list(range(41000, 41000 + count_ports(m)))
    plan = build_local_plan(m, "/m.yaml", ports, python="py", vllm="/env/bin/vllm")
    prefills = [w for w in plan.workers if w.role.value == "prefill"]
    (decode,) = [w for w in plan.workers if w.role.value == "decode"]
    for w in plan.workers:
        assert w.side_port is not None and w.side_channel_ports == ()
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in w.env  # vLLM's side channel is unused
        assert w.admin_url == f"http://127.0.0.1:{w.side_port}"  # where fail_peer goes
        config = json.loads(w.argv[w.argv.index("--kv-transfer-config") + 1])
        assert config["kv_connector_extra_config"]["sidePort"] == w.side_port
        router = plan.router.argv
        assert router[router.index(w.url) + 1 : router.index(w.url) + 3] == (
            "--side-port",
            f"{w.url}={w.side_port}",
        )
    # A prefill's bootstrap server is its side port, and the decode may contact exactly those.
    assert [p.bootstrap_port for p in prefills] == [p.side_port for p in prefills]
    config = json.loads(decode.argv[decode.argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["prefillPeers"] == [
        f"127.0.0.1:{p.side_port}" for p in prefills
    ]
    assert decode.bootstrap_port is None


def test_an_open_worker_api_gets_no_key_and_a_colocated_one_no_side_channel() -> None:
    spec = {k: v for k, v in SPEC.items() if k not in ("prefill", "decode")}
    m = manifest({**spec, "colocated": {}, "auth": {"workerApi": "open"}})
    plan = build_local_plan(m, "/m.yaml", [41000, 41001], python="py", vllm="/v/python")
    (w,) = plan.workers
    assert w.api_key_env is None and w.side_channel_ports == ()
    assert w.argv[4:8] == ("/v/python", "-m", "vllm.entrypoints.openai.api_server", "--model")


def test_a_cache_aware_role_publishes_its_events_on_ports_the_router_is_told() -> None:
    m = manifest({**SPEC, "router": {"policy": {"decode": "cache_aware"}}})
    ports = list(range(41000, 41000 + count_ports(m)))
    plan = build_local_plan(m, "/m.yaml", ports, python="py", vllm="/env/bin/vllm")
    (decode,) = [w for w in plan.workers if w.role is Role.decode]
    assert all(w.kv_events_ports == () for w in plan.workers if w is not decode)
    publish, replay = decode.kv_events_ports
    # Every port is drawn once, and each instance's are its own.
    assert sorted(p for w in plan.processes for p in w.ports) == ports
    config = json.loads(decode.argv[decode.argv.index("--kv-events-config") + 1])
    assert config["endpoint"] == f"tcp://*:{publish}"
    assert config["replay_endpoint"] == f"tcp://127.0.0.1:{replay}"
    argv = plan.router.argv
    assert argv[argv.index("--kv-events") + 1] == f"{decode.url}={publish},{replay}"
    assert argv.count("--kv-events") == 1
    # An instance started later by autoscaling gets ports of its own the same way.
    (more,) = build_instance_specs(
        m, "/m.yaml", Role.decode, 1, list(range(42000, 42004)), [], "py", "/env/bin/vllm"
    )
    assert more.kv_events_ports == (42002, 42003)


@pytest.mark.parametrize(
    ("spec", "vllm", "message"),
    [
        (SPEC, None, "needs a vLLM installation"),
        ({**SPEC, "decode": {"topology": {"dp": 2}}}, "vllm", "decode.topology.dp is 2"),
    ],
)
def test_what_local_mode_cannot_run_is_a_clear_error(
    spec: dict[str, Any], vllm: str | None, message: str
) -> None:
    m = manifest(spec)
    with pytest.raises(ValueError, match=message):
        build_local_plan(m, "/m.yaml", list(range(41000, 41020)), python="py", vllm=vllm)


def test_the_vllm_program_is_found_or_refused_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert resolve_vllm(str(script), {}) == str(script)
    assert resolve_vllm(None, {VLLM_ENV: str(script)}) == str(script)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert resolve_vllm(None, {}) == str(script), "a vllm on PATH"
    # An interpreter is asked whether it imports vLLM (ours does not).
    with pytest.raises(VllmNotFound, match="cannot import vllm.*--vllm PATH"):
        resolve_vllm(sys.executable, {})
    with pytest.raises(VllmNotFound, match="does not exist"):
        resolve_vllm(str(tmp_path / "nope"), {})
    script.chmod(0o644)
    with pytest.raises(VllmNotFound, match="is not executable"):
        resolve_vllm(str(script), {})
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(VllmNotFound, match="no vllm is on PATH"):
        resolve_vllm(None, {})


def guard(tmp_path: Path, program: list[str], parent: int | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ}
    if parent is not None:
        env["PDCLUSTER_PARENT_PID"] = str(parent)
    return subprocess.Popen(
        [sys.executable, "-m", CHILD_GUARD, "--", *program], env=env, start_new_session=True
    )


def test_the_guard_exits_as_its_program_did(tmp_path: Path) -> None:
    assert guard(tmp_path, [sys.executable, "-c", "raise SystemExit(3)"]).wait(30) == 3
    killed = guard(tmp_path, [sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    assert killed.wait(30) == -signal.SIGKILL


def test_a_guarded_program_stops_once_the_launcher_is_gone(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    program = (
        f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    # A launcher that starts the guard and dies at once: the guard is re-parented.
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys; "
            f"env = dict(os.environ, PDCLUSTER_PARENT_PID=str(os.getpid())); "
            f"subprocess.Popen([sys.executable, '-m', {CHILD_GUARD!r}, '--', sys.executable, '-c', "
            f"{program!r}], env=env, start_new_session=True)",
        ],
    )
    assert launcher.wait(30) == 0
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(marker.read_text())
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the program outlived its launcher")


def test_vllm_with_our_connector_gets_a_path_to_our_runtime_package_alone(tmp_path):
    import pdcluster.runtime
    from pdcluster.runtime.local.launcher import our_package_path

    base = our_package_path(tmp_path)
    assert base == our_package_path(tmp_path)  # again: the same link, kept
    assert sorted(p.name for p in base.iterdir()) == ["pdcluster"]
    assert [p.name for p in (base / "pdcluster").iterdir()] == ["runtime"]
    link = base / "pdcluster" / "runtime"
    assert link.resolve() == Path(next(iter(pdcluster.runtime.__path__))).resolve()
    assert (link / "vllm_connector" / "connector.py").is_file()
