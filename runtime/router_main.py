"""`pdcluster router`: the router process, configured from the manifest + flags."""

from __future__ import annotations

import argparse
import os

from pdcluster.runtime.spec import PDCluster, PDClusterSpec


def run_router_from_cli(manifest: PDCluster | None, args: argparse.Namespace) -> int:
    from pdcluster.runtime.router.config import RouterConfig
    from pdcluster.runtime.router.server import run_router

    spec = manifest.spec if manifest is not None else None
    keys = [k for k in os.environ.get("PDCLUSTER_ROUTER_API_KEYS", "").split(",") if k]
    if spec is None:
        spec = PDClusterSpec.model_validate(
            {"prefill": {}, "decode": {}} if args.prefill or args.decode else {"colocated": {}}
        )
    config = RouterConfig.from_spec(
        spec,
        prefill_urls=args.prefill,
        decode_urls=args.decode,
        colocated_urls=args.colocated,
        api_keys=keys,
    )
    run_router(config, host=args.host, port=args.port, log_level="warning")
    return 0
