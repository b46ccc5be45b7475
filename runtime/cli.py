"""`pdcluster` command line: local mode (up/ps/down) and the pod entry points.

pdcluster up -f examples/pd-1p1d.yaml [--demo] [--port 8000]
pdcluster ps | down
pdcluster worker -f M --role prefill|decode|colocated --instance N --port P ...
pdcluster router -f M --port P --prefill URL --decode URL | --colocated URL
pdcluster render -f M [--namespace NS]   (with the operator package installed)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from pdcluster.runtime.spec import (
    PDCluster,
    RestartPolicySpec,
    Role,
    SpecError,
    load_manifest_text,
)

if TYPE_CHECKING:
    from pdcluster.runtime.local.autoscaling import LocalAutoscaler
    from pdcluster.runtime.local.launcher import LocalCluster

DEFAULT_STATE_DIR = ".pdcluster"
DEMO_PROMPT = "The capital of France is"


def load_manifest(path: str) -> PDCluster:
    """Read a manifest from a file, or from an environment variable with `env:NAME`.

    Pods get the manifest through an env var filled from the cluster's
    ConfigMap, so no volume is needed.
    """
    if path.startswith("env:"):
        text = os.environ.get(path[4:], "")
        if not text:
            raise SystemExit(f"pdcluster: environment variable {path[4:]} holds no manifest")
    else:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise SystemExit(f"pdcluster: cannot read manifest {path}: {err.strerror}") from None
    try:
        return load_manifest_text(text)
    except SpecError as err:
        raise SystemExit(f"pdcluster: {path}: {err}") from None


def check_backend(manifest: PDCluster, path: str) -> None:
    """Refuse a manifest whose transfer backend cannot run here (`nixl` not installed)."""
    from pdcluster.runtime.transfer.nixl_support import check_backend_available

    try:
        check_backend_available(manifest.spec)
    except SpecError as err:
        raise SystemExit(f"pdcluster: {path}: {err}") from None


# ---------------------------------------------------------------- local mode
def cmd_up(args: argparse.Namespace) -> int:
    from pdcluster.runtime.local.launcher import LocalCluster, format_state, read_state
    from pdcluster.runtime.local.plan import build_local_plan, count_ports
    from pdcluster.runtime.ports import free_ports

    manifest = load_manifest(args.file)
    vllm = _vllm_program(manifest, args)
    if vllm is None:
        check_backend(manifest, args.file)
    state_dir = Path(args.state_dir) / manifest.metadata.name
    existing = read_state(state_dir)
    if existing and any(p["alive"] for p in existing["processes"]):
        raise SystemExit(
            f"pdcluster: cluster {manifest.metadata.name!r} is already running "
            f"(pdcluster down -f {args.file} to stop it)"
        )
    router_port = None if args.port == 0 else args.port
    if router_port is not None and not _port_free(router_port):
        raise SystemExit(f"pdcluster: port {router_port} is in use; pick another with --port")
    plan = build_local_plan(
        manifest,
        str(Path(args.file).resolve()),
        free_ports(count_ports(manifest)),
        python=sys.executable,
        vllm=vllm,
        router_port=router_port,
    )
    cluster = LocalCluster(plan, state_dir)
    autoscaler = None
    stop_requested = False

    def on_signal(signum: int, _: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # Ctrl-C stops the cluster even when `up` was started in the background of
    # a non-interactive shell, which starts it with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        print(
            f"starting {len(plan.processes)} processes for {manifest.metadata.name} ...", flush=True
        )
        cluster.start()
        cluster.wait_ready(args.ready_timeout)
        cluster.wait_admitted(args.ready_timeout)
        state = read_state(state_dir)
        assert state is not None
        print(format_state(state), flush=True)
        if args.demo or args.demo_only:
            _demo(plan.endpoint, manifest.spec.model.name)
        if args.demo_only:
            return 0
        autoscaler = _start_autoscaler(cluster, manifest, args.file, vllm)
        print(f"\nserving on {plan.endpoint}/v1 — press Ctrl-C to stop", flush=True)
        # A lost instance is restarted (spec.<role>.restart); only a spent
        # budget or the router's exit ends here.
        reason = cluster.supervise(
            restart_policies(manifest),
            bootstrap_timeout_s=manifest.spec.transfer.bootstrap_timeout_seconds,
            on_action=lambda line: print(line, flush=True),
        )
        print(
            f"pdcluster: stopping {manifest.metadata.name}: {reason}", file=sys.stderr, flush=True
        )
        raise SystemExit(1)
    except KeyboardInterrupt:
        if not stop_requested:
            print("\nstopping ...", flush=True)
        return 0
    finally:
        if autoscaler is not None:
            autoscaler.stop()
        cluster.stop()


def _vllm_program(manifest: PDCluster, args: argparse.Namespace) -> str | None:
    """How to run vLLM for a `kind: vllm` manifest (None for builtin); exits if none works."""
    from pdcluster.runtime.local.vllm_program import VllmNotFound, resolve_vllm

    if not manifest.spec.engine.is_vllm:
        return None
    try:
        return resolve_vllm(args.vllm)
    except VllmNotFound as err:
        raise SystemExit(f"pdcluster: {args.file}: {err}") from None


def _start_autoscaler(
    cluster: LocalCluster, manifest: PDCluster, path: str, vllm: str | None
) -> LocalAutoscaler | None:
    """The planner's loop when a role has `autoscaling`; its decisions go to stderr."""
    from pdcluster.runtime.local.autoscaling import LocalAutoscaler, scaling_config
    from pdcluster.runtime.local.launcher import print_err

    if not scaling_config(manifest).is_enabled:
        return None
    autoscaler = LocalAutoscaler(
        cluster, manifest, path, sys.executable, on_line=print_err, vllm=vllm
    )
    autoscaler.start()
    return autoscaler


def restart_policies(manifest: PDCluster) -> dict[Role, RestartPolicySpec]:
    """Each worker role's restart policy (back-off and budget), as the operator reads it."""
    spec = manifest.spec
    roles = {Role.prefill: spec.prefill, Role.decode: spec.decode, Role.colocated: spec.colocated}
    return {role: rs.restart for role, rs in roles.items() if rs is not None}


def _demo(endpoint: str, model: str) -> None:
    import httpx

    body = {"model": model, "prompt": DEMO_PROMPT, "max_tokens": 24, "temperature": 0}
    resp = httpx.post(f"{endpoint}/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    text = resp.json()["choices"][0]["text"]
    print(f"\nPOST {endpoint}/v1/completions {json.dumps(body)}")
    print(f"→ {DEMO_PROMPT!r} + {text!r}", flush=True)
    print(
        "\ntry it:  curl -s "
        f"{endpoint}/v1/completions -H 'content-type: application/json' "
        f"-d '{json.dumps(body)}'",
        flush=True,
    )


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cmd_ps(args: argparse.Namespace) -> int:
    from pdcluster.runtime.local.launcher import format_state, read_state

    base = Path(args.state_dir)
    dirs = [base / load_manifest(args.file).metadata.name] if args.file else sorted(base.glob("*"))
    found = False
    for d in dirs:
        state = read_state(d)
        if state is not None:
            found = True
            print(format_state(state))
    if not found:
        print("no local cluster is running")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from pdcluster.runtime.local.launcher import STATE_FILE, read_state, stop_pids

    base = Path(args.state_dir)
    dirs = [base / load_manifest(args.file).metadata.name] if args.file else sorted(base.glob("*"))
    for d in dirs:
        state = read_state(d)
        if state is None:
            continue
        pids = [p["pid"] for p in state["processes"]]
        launcher = state.get("launcher_pid")
        if launcher and launcher != os.getpid():
            try:
                os.kill(launcher, signal.SIGTERM)
            except ProcessLookupError:
                pass
        stop_pids(pids)
        (d / STATE_FILE).unlink(missing_ok=True)
        print(f"stopped {state['cluster']}")
    return 0


# ---------------------------------------------------------------- pod entry points
def _watch_launcher() -> None:
    """Stop with `pdcluster up` if it started this process (`local/parent_watch.py`)."""
    from pdcluster.runtime.local.parent_watch import watch_parent

    try:
        watch_parent(os.environ)
    except ValueError as err:
        raise SystemExit(f"pdcluster: {err}") from None


def cmd_worker(args: argparse.Namespace) -> int:
    from pdcluster.runtime.worker_main import run_worker

    _watch_launcher()
    manifest = load_manifest(args.file)
    if manifest.spec.engine.is_vllm:
        raise SystemExit(
            f"pdcluster: {args.file}: engine.kind is vllm: its workers run `vllm serve` "
            "(pdcluster up starts them; pods run them), not `pdcluster worker`"
        )
    check_backend(manifest, args.file)
    return run_worker(manifest, args)


def cmd_router(args: argparse.Namespace) -> int:
    from pdcluster.runtime.router_main import run_router_from_cli

    _watch_launcher()
    manifest = load_manifest(args.file) if args.file else None
    return run_router_from_cli(manifest, args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster", description=__doc__.split("\n")[0])
    p.add_argument("--log-level", default=os.environ.get("PDCLUSTER_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a PDCluster manifest locally on 127.0.0.1")
    up.add_argument("-f", "--file", required=True)
    up.add_argument("--port", type=int, default=8000, help="router port (0: any free port)")
    up.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    up.add_argument("--ready-timeout", type=float, default=300.0)
    up.add_argument("--demo", action="store_true", help="send a sample request once ready")
    up.add_argument("--demo-only", action="store_true", help="send a sample request, then stop")
    up.add_argument(
        "--vllm",
        help="engine.kind vllm: a `vllm` executable or a Python interpreter with vLLM "
        "(default: $PDCLUSTER_VLLM, then vllm on PATH)",
    )
    up.set_defaults(fn=cmd_up)

    for name, fn, help_ in (("ps", cmd_ps, "list local clusters"), ("down", cmd_down, "stop")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("-f", "--file")
        sp.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
        sp.set_defaults(fn=fn)

    w = sub.add_parser("worker", help="run one instance of a role (all its ranks)")
    w.add_argument("-f", "--file", required=True)
    w.add_argument("--role", required=True, choices=[r.value for r in Role])
    w.add_argument("--instance", type=int, default=0)
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--dist-port", type=int, required=True)
    w.add_argument("--bootstrap-port", type=int)
    w.add_argument(
        "--dp-ports",
        help="dp > 1: comma-separated internal HTTP ports of the leaders of dp groups 1..dp-1 "
        "(with --dp-dist-ports; both left out: the block after the stores, "
        "--dist-port + dp ...)",
    )
    w.add_argument(
        "--dp-dist-ports",
        help="dp > 1: comma-separated torch store ports of dp groups 1..dp-1 "
        "(left out: --dist-port + 1 ...)",
    )
    w.add_argument(
        "--tokenizer",
        help="directory with tokenizer.json to use instead of the model's own "
        "(part of the model fingerprint: prefill and decode must agree)",
    )
    w.add_argument(
        "--pod-index",
        type=int,
        default=0,
        help="pod of a multi-pod instance (0 runs the leader ranks and the HTTP server)",
    )
    w.add_argument(
        "--leader-address",
        help="pods k > 0: the leader pod's IP (else $PDCLUSTER_LEADER_ADDRESS, else the file "
        "$PDCLUSTER_LEADER_ADDRESS_FILE names, waited for until it holds one)",
    )
    w.add_argument(
        "--prefill-peers",
        help="decode: comma-separated host:port of the prefill bootstrap servers it may "
        "contact (without it, it waits for PUT /admin/prefill_peers)",
    )
    w.set_defaults(fn=cmd_worker)

    r = sub.add_parser("router", help="run the OpenAI-compatible router")
    r.add_argument("-f", "--file")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--prefill", action="append", default=[])
    r.add_argument("--decode", action="append", default=[])
    r.add_argument("--colocated", action="append", default=[])
    r.add_argument("--kv-events", action="append", default=[], metavar="URL=PUB,REPLAY")
    r.add_argument(
        "--side-port",
        action="append",
        default=[],
        metavar="URL=PORT",
        help="vLLM with our connector: a worker's side port (bootstrap server, admin API)",
    )
    r.add_argument("--kubernetes", action="store_true", help="discover worker pods by label")
    r.add_argument("--namespace", default="")
    r.add_argument("--cluster", default="", help="PDCluster name (label pdcluster.io/cluster)")
    r.add_argument("--api-key-file", help="API keys the router requires (one a line, or commas)")
    r.set_defaults(fn=cmd_router)
    from pdcluster.runtime.engine.model_fetch import add_parser as add_fetch_model

    add_fetch_model(sub)
    _register_plugins(sub)
    return p


PLUGIN_GROUP = "pdcluster.commands"


def _register_plugins(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Commands other installed packages add (`render`, from the operator package):
    each entry point of PLUGIN_GROUP is a function that adds its subparser."""
    from importlib.metadata import entry_points

    for entry in entry_points(group=PLUGIN_GROUP):
        entry.load()(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result: int = args.fn(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
