"""`pdcluster router`: the router process, configured from the manifest + flags.

A thin mapping onto the router's own command line (`python -m
pdcluster.runtime.router`): static worker URLs in local mode, or Kubernetes
discovery of the cluster's pods (`--kubernetes --namespace NS --cluster NAME`).
"""

from __future__ import annotations

import argparse
import tempfile

import yaml

from pdcluster.runtime.spec import PDCluster, Role


def router_argv(manifest: PDCluster | None, args: argparse.Namespace) -> list[str]:
    argv = ["--host", args.host, "--port", str(args.port), "--log-level", "warning"]
    if args.file and args.file.startswith("env:") and manifest is not None:
        # The router reads a file: hand it the manifest that came by env var.
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(yaml.safe_dump(manifest.model_dump(by_alias=True, mode="json")))
        argv += ["--manifest", f.name]
    elif args.file:
        argv += ["--manifest", args.file]
    if getattr(args, "api_key_file", None):
        argv += ["--api-key-file", args.api_key_file]
    for role in Role:
        for url in getattr(args, role.value):
            argv += [f"--{role}", url]
    if args.kubernetes:
        if not args.namespace or not args.cluster:
            raise SystemExit("pdcluster router: --kubernetes needs --namespace and --cluster")
        disaggregated = manifest is None or manifest.spec.is_disaggregated
        argv += [
            "--k8s-namespace",
            args.namespace,
            "--k8s-selector",
            f"pdcluster.io/cluster={args.cluster}",
            "--k8s-mode",
            "pd" if disaggregated else "colocated",
        ]
    return argv


def run_router_from_cli(manifest: PDCluster | None, args: argparse.Namespace) -> int:
    from pdcluster.runtime.router.cli import main

    main(router_argv(manifest, args))
    return 0
