"""Loopback addresses for nodes and pods.

A cluster owns one block 127.B.0.0/16 (B chosen per cluster, so clusters of
concurrent sessions never hand out the same pod address). Node i (1-based)
has address 127.B.0.i and gives its pods 127.B.i.1 ... 127.B.i.254, handed
out round-robin so a released address is reused as late as possible: a late
connection to a dead pod's address then finds nothing rather than a new pod.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NUM_HOSTS_PER_NODE = 254
MIN_BLOCK = 1
MAX_BLOCK = 253  # 127.254/16 holds service ClusterIPs, 127.255 is left alone


class AddressesExhausted(RuntimeError):
    """Every pod address of a node is in use."""


def check_block(block: int) -> None:
    if not MIN_BLOCK <= block <= MAX_BLOCK:
        raise ValueError(f"address block must be in [{MIN_BLOCK}, {MAX_BLOCK}], got {block}")


def check_node_index(node_index: int) -> None:
    if not 1 <= node_index <= 250:
        raise ValueError(f"node index must be in [1, 250], got {node_index}")


def node_address(block: int, node_index: int) -> str:
    check_block(block)
    check_node_index(node_index)
    return f"127.{block}.0.{node_index}"


@dataclass
class PodAddressPool:
    """Pod addresses of one node: allocate, release, never the same address twice at once."""

    block: int
    node_index: int
    _in_use: set[int] = field(default_factory=set)
    _next: int = 1

    def __post_init__(self) -> None:
        check_block(self.block)
        check_node_index(self.node_index)

    def _address(self, host: int) -> str:
        return f"127.{self.block}.{self.node_index}.{host}"

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    def allocate(self) -> str:
        if len(self._in_use) >= NUM_HOSTS_PER_NODE:
            raise AddressesExhausted(
                f"all {NUM_HOSTS_PER_NODE} pod addresses of node {self.node_index} are in use"
            )
        host = self._next
        while host in self._in_use:
            host = host % NUM_HOSTS_PER_NODE + 1
        self._in_use.add(host)
        self._next = host % NUM_HOSTS_PER_NODE + 1
        return self._address(host)

    def release(self, address: str) -> None:
        prefix = f"127.{self.block}.{self.node_index}."
        if not address.startswith(prefix):
            raise ValueError(f"{address} is not a pod address of this node ({prefix}*)")
        host = int(address[len(prefix) :])
        if host not in self._in_use:
            raise ValueError(f"{address} is not allocated")
        self._in_use.remove(host)
