"""Command line of the router: ``python -m pdcluster.runtime.router ...``.

Flags map onto `RouterConfig`; a PDCluster manifest (``--manifest``) supplies
the model name, policies and timeouts, and flags given explicitly win over
it. API keys never come from flags (they would show in ``ps``): they come
from ``PDCLUSTER_ROUTER_API_KEYS`` (comma-separated) or ``--api-key-file``
(one key per line, or comma-separated; what the operator mounts from the
`auth.routerApiKeySecretName` Secret).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcluster.runtime.cluster_token import read_cluster_token
from pdcluster.runtime.http.event_loop import DEFAULT_EVENT_LOOP, EventLoop, event_loop_from_env
from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.router.discovery import KubernetesDiscoverySettings, parse_kv_events
from pdcluster.runtime.spec import (
    FailurePolicy,
    PDCluster,
    SelectionPolicy,
    SpecError,
    load_manifest_text,
)

API_KEYS_ENV = "PDCLUSTER_ROUTER_API_KEYS"
_POLICIES = [p.value for p in SelectionPolicy]


@dataclass(frozen=True)
class Invocation:
    config: RouterConfig
    host: str
    port: int
    log_level: str
    event_loop: EventLoop = DEFAULT_EVENT_LOOP  # PDCLUSTER_EVENT_LOOP


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdcluster.runtime.router",
        description="OpenAI-compatible router in front of prefill/decode workers.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", default=[], metavar="URL")
    p.add_argument("--decode", action="append", default=[], metavar="URL")
    p.add_argument("--colocated", action="append", default=[], metavar="URL")
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=PUB,REPLAY",
        help="cache_aware over vLLM: the ports a listed worker publishes its cache events on",
    )
    p.add_argument(
        "--side-port",
        action="append",
        default=[],
        metavar="URL=PORT",
        help="vLLM with our connector: a worker's side port (bootstrap server, admin API)",
    )
    p.add_argument("--manifest", type=Path, help="PDCluster YAML for model, policies, timeouts")
    p.add_argument("--model-name")
    p.add_argument("--prefill-policy", choices=_POLICIES)
    p.add_argument("--decode-policy", choices=_POLICIES)
    p.add_argument("--colocated-policy", choices=_POLICIES)
    p.add_argument("--policy-seed", type=int)
    p.add_argument(
        "--max-load-gap",
        type=int,
        help="cache_aware: legs in flight the cached worker may exceed the least loaded by",
    )
    p.add_argument(
        "--tokenizer", help="cache_aware: 'tiny' or a model directory, to hash text prompts"
    )
    p.add_argument("--api-key-file", type=Path)
    p.add_argument("--request-timeout", type=float, dest="request_timeout_s")
    p.add_argument("--health-interval", type=float, dest="health_check_interval_s")
    p.add_argument("--health-threshold", type=int, dest="health_failure_threshold")
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument(
        "--failure-policy",
        choices=[f.value for f in FailurePolicy],
        help="the cluster's transfer.failurePolicy; recompute: a failed prefill leg "
        "leaves the request to decode",
    )
    k8s = p.add_argument_group("kubernetes discovery (instead of URL lists)")
    k8s.add_argument("--k8s-namespace")
    k8s.add_argument("--k8s-selector", default="")
    k8s.add_argument("--k8s-port", type=int, default=8000, help="port when a pod names none")
    k8s.add_argument("--k8s-mode", choices=["pd", "colocated"])
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _api_keys(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, ...]:
    keys = [k.strip() for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if args.api_key_file is not None:
        try:
            text = args.api_key_file.read_text()
        except OSError as err:
            raise ValueError(f"cannot read --api-key-file: {err}") from None
        # One key per line, or comma-separated like the variable.
        keys += [k.strip() for k in text.replace(",", "\n").splitlines() if k.strip()]
    return tuple(keys)


def _side_ports(entries: Sequence[str]) -> dict[str, int]:
    """`--side-port URL=PORT` entries → {URL: port}; ValueError naming a bad one."""
    ports: dict[str, int] = {}
    for entry in entries:
        url, sep, port = entry.rpartition("=")
        if not sep or not url or not port.isdigit():
            raise ValueError(f"--side-port {entry!r}: expected URL=PORT")
        ports[url] = int(port)
    return ports


def parse_invocation(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Invocation:
    """Flags → settings; raise ValueError (or exit via argparse) on bad input."""
    args = build_parser().parse_args(list(argv))
    manifest = None
    if args.manifest is not None:
        try:
            manifest = load_manifest_text(args.manifest.read_text())
        except (OSError, SpecError) as err:
            raise ValueError(f"--manifest: {err}") from None
    return invocation_from(args, manifest, env)


def invocation_from(
    args: argparse.Namespace, manifest: PDCluster | None, env: Mapping[str, str] | None = None
) -> Invocation:
    """Parsed flags (this parser's names) and an already loaded manifest → settings.

    Raises ValueError on bad input; `args.manifest` is not read here.
    """
    kube = None
    if args.k8s_namespace:
        if args.k8s_mode is None:
            raise ValueError("--k8s-namespace needs --k8s-mode pd|colocated")
        kube = KubernetesDiscoverySettings(
            namespace=args.k8s_namespace,
            label_selector=args.k8s_selector,
            default_port=args.k8s_port,
        )
    fields: dict[str, Any] = {
        "prefill_urls": tuple(args.prefill),
        "decode_urls": tuple(args.decode),
        "colocated_urls": tuple(args.colocated),
        "kubernetes": kube,
        "api_keys": _api_keys(args, os.environ if env is None else env),
        "side_ports": _side_ports(args.side_port),
    }
    if kube is not None:
        fields["disaggregated"] = args.k8s_mode == "pd"
    kv_events = tuple(parse_kv_events(text) for text in args.kv_events)
    if manifest is not None:
        base = RouterConfig.from_spec(
            manifest.spec,
            prefill_urls=fields["prefill_urls"],
            decode_urls=fields["decode_urls"],
            colocated_urls=fields["colocated_urls"],
            kubernetes=kube,
            api_keys=fields["api_keys"],
            side_ports=fields["side_ports"],
            cluster_name=manifest.metadata.name,
        )
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields["kv_events"] = kv_events
    for name in (
        "model_name",
        "prefill_policy",
        "decode_policy",
        "colocated_policy",
        "policy_seed",
        "max_load_gap",
        "tokenizer",
        "request_timeout_s",
        "health_check_interval_s",
        "health_failure_threshold",
        "max_body_bytes",
        "failure_policy",
    ):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    # The cluster token (local mode and the operator set it) guards the workers' API.
    fields["worker_token"] = read_cluster_token(
        os.environ if env is None else env, who="pdcluster router"
    )
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    return Invocation(
        config=RouterConfig(**fields),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        event_loop=event_loop_from_env(os.environ if env is None else env),
    )


def main(argv: Sequence[str] | None = None) -> None:
    try:
        inv = parse_invocation(sys.argv[1:] if argv is None else argv)
    except ValueError as err:
        build_parser().error(str(err))
    run_invocation(inv)


def run_invocation(inv: Invocation) -> None:
    """Serve until stopped."""
    from pdcluster.runtime.router.server import run_router
    from pdcluster.runtime.telemetry.request_log import configure_logging, log_format_of

    try:
        log_format = log_format_of(inv.config.log_format, os.environ)
    except ValueError as err:
        raise SystemExit(f"pdcluster router: {err}") from None
    configure_logging(log_format, inv.log_level, role="router", cluster=inv.config.cluster_name)
    run_router(
        inv.config, host=inv.host, port=inv.port, log_level=inv.log_level, loop=inv.event_loop
    )
