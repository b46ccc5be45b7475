"""`pdcluster router`: the router process, configured from the manifest + flags.

Maps `pdcluster router`'s flags onto the router's own settings
(`router.cli.invocation_from`, the same code as `python -m
pdcluster.runtime.router`), with the manifest `pdcluster` already loaded:
static worker URLs in local mode, or Kubernetes discovery of the cluster's
pods (`--kubernetes --namespace NS --cluster NAME`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from pdcluster.runtime.router.cli import Invocation, build_parser, invocation_from
from pdcluster.runtime.spec import PDCluster, Role


def router_invocation(
    manifest: PDCluster | None, args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> Invocation:
    """`pdcluster router` flags → the router's settings; ValueError on bad input."""
    router_args = build_parser().parse_args([])  # the router's defaults
    router_args.host = args.host
    router_args.port = args.port
    router_args.log_level = "warning"
    if getattr(args, "api_key_file", None):
        router_args.api_key_file = Path(args.api_key_file)
    for role in Role:
        setattr(router_args, role.value, list(getattr(args, role.value)))
    router_args.kv_events = list(getattr(args, "kv_events", ()))
    router_args.side_port = list(getattr(args, "side_port", None) or [])
    if args.kubernetes:
        if not args.namespace or not args.cluster:
            raise SystemExit("pdcluster router: --kubernetes needs --namespace and --cluster")
        disaggregated = manifest is None or manifest.spec.is_disaggregated
        router_args.k8s_namespace = args.namespace
        router_args.k8s_selector = f"pdcluster.io/cluster={args.cluster}"
        router_args.k8s_mode = "pd" if disaggregated else "colocated"
    return invocation_from(router_args, manifest, env)


def run_router_from_cli(manifest: PDCluster | None, args: argparse.Namespace) -> int:
    from pdcluster.runtime.router.cli import run_invocation

    try:
        inv = router_invocation(manifest, args)
    except ValueError as err:
        build_parser().error(str(err))
    run_invocation(inv)
    return 0
