"""python -m e2e.nodeagent --kubeconfig K --state-dir D --nodes a,b --control-port P"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from e2e.nodeagent.agent import NodeAgent, reserve_address_block
from e2e.nodeagent.backoff import BackoffPolicy
from e2e.nodeagent.control import serve_control
from e2e.nodeagent.kubeapi import KubeApi
from e2e.nodeagent.settings import AgentSettings, NodeCapacity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.nodeagent", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--nodes", required=True, help="comma-separated node names")
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument(
        "--address-block", type=int, default=None, help="B in 127.B.x.y (default: any free)"
    )
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--backoff-base", type=float, default=1.0, help="first restart delay, s")
    parser.add_argument("--backoff-max", type=float, default=30.0, help="longest restart delay, s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise

    block, block_lock = reserve_address_block(args.address_block)
    settings = AgentSettings(
        state_dir=args.state_dir.resolve(),
        node_names=tuple(n for n in args.nodes.split(",") if n),
        address_block=block,
        capacity=NodeCapacity(gpus=args.gpus_per_node),
        backoff=BackoffPolicy(base_s=args.backoff_base, max_s=args.backoff_max),
    )
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    agent = NodeAgent(settings, KubeApi.from_kubeconfig(args.kubeconfig))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: agent.stop_event.set())
    server = serve_control(agent, args.control_port)
    logging.getLogger("nodeagent").info(
        "pod addresses 127.%d.x.y, control on port %d", block, args.control_port
    )
    try:
        agent.run()
    finally:
        server.shutdown()
        block_lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
