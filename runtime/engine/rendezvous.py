"""The token gate in front of torch.distributed (see runtime/pod_rendezvous.py).

Every rank of a torch world writes its proof into the world's TCP store;
rank 0 (which hosts the store) waits for all of them, checks them and
writes the verdict; every rank joins the process group only on "ok".

A multi-pod instance with dp > 1 also keeps its address directory in dp
group 0's store on the leader pod: a pod hosting another dp group's leader
publishes its address there, with a proof binding it to the pod.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.pod_rendezvous import (
    VERDICT_KEY,
    VERDICT_OK,
    RankIdentity,
    RendezvousError,
    address_entry,
    address_key,
    compute_verdict,
    missing_ranks,
    proof_key,
    rank_proof,
    read_address_entry,
)

log = logging.getLogger("pdcluster.rendezvous")

POLL_S = 0.1
LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class RankGate:
    """What the ranks of one torch world prove (`offset`: global rank of its rank 0)."""

    token: str
    identity: RankIdentity
    offset: int = 0
    # Called by rank 0 with the (world-local) ranks not arrived yet, at every poll.
    on_waiting: Callable[[list[int]], None] | None = None


def pass_gate(store: Any, gate: RankGate, rank: int, world_size: int, timeout_s: float) -> None:
    """Prove this rank, and (rank 0) admit the world or refuse it; raise RendezvousError."""
    store.set(proof_key(rank), rank_proof(gate.token, gate.identity, gate.offset + rank))
    if rank != 0:
        store.wait([VERDICT_KEY], datetime.timedelta(seconds=timeout_s))
        verdict = store.get(VERDICT_KEY).decode()
        if verdict != VERDICT_OK:
            raise RendezvousError(f"the instance's leader refused this rank: {verdict}")
        return
    deadline = time.monotonic() + timeout_s
    next_log = time.monotonic() + LOG_EVERY_S
    while True:
        present = [r for r in range(world_size) if store.check([proof_key(r)])]
        missing = missing_ranks(world_size, present)
        if gate.on_waiting is not None:
            gate.on_waiting(missing)
        if not missing:
            break
        now = time.monotonic()
        if now > deadline:
            store.set(VERDICT_KEY, "refused: not every rank joined in time")
            raise RendezvousError(
                f"ranks {[gate.offset + r for r in missing]} did not join within {timeout_s:.0f}s"
            )
        if now > next_log:
            log.info("waiting for ranks %s to join", [gate.offset + r for r in missing])
            next_log = now + LOG_EVERY_S
        time.sleep(POLL_S)
    # Proofs are checked against global ranks: the store's keys are world-local.
    ranks = [gate.offset + r for r in range(world_size)]
    proofs = {gate.offset + r: store.get(proof_key(r)).decode() for r in range(world_size)}
    verdict = compute_verdict(gate.token, gate.identity, ranks, proofs)
    store.set(VERDICT_KEY, verdict)
    if verdict != VERDICT_OK:
        raise RendezvousError(verdict)


def publish_address(store: Any, token: str, who: RankIdentity, pod_index: int, host: str) -> None:
    """Pod `pod_index` writes its address, with its proof, to the instance's directory."""
    store.set(address_key(pod_index), address_entry(token, who, pod_index, host))


def wait_addresses(
    store: Any, token: str, who: RankIdentity, pods: tuple[int, ...], timeout_s: float
) -> dict[int, str]:
    """The checked addresses of `pods` from the directory, waiting until each published;
    RendezvousError when one is late or was not written with this cluster's token."""
    deadline = time.monotonic() + timeout_s
    next_log = time.monotonic() + LOG_EVERY_S
    while True:
        missing = [k for k in pods if not store.check([address_key(k)])]
        if not missing:
            break
        now = time.monotonic()
        if now > deadline:
            raise RendezvousError(
                f"pods {missing} did not publish their address within {timeout_s:.0f}s"
            )
        if now > next_log:
            log.info("waiting for pods %s to publish their address", missing)
            next_log = now + LOG_EVERY_S
        time.sleep(POLL_S)
    return {k: read_address_entry(token, who, k, store.get(address_key(k)).decode()) for k in pods}
