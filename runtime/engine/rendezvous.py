"""The token gate in front of torch.distributed (see runtime/pod_rendezvous.py).

Every rank of a torch world answers rank 0's fresh nonce in the world's TCP
store with its own challenge and proof; rank 0 (which hosts the store)
waits for all of them, checks them and writes the verdict, signed over the
nonce and every challenge; every rank checks that signature and joins the
process group only on a signed "ok".

A multi-pod instance with dp > 1 also keeps its address directory in dp
group 0's store on the leader pod: pod 0 opens it with a nonce of its own,
and a pod hosting another dp group's leader publishes its address there,
with a proof binding it to the pod and that nonce.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.pod_rendezvous import (
    DIRECTORY_NONCE_KEY,
    NONCE_KEY,
    VERDICT_KEY,
    RankIdentity,
    RendezvousError,
    address_entry,
    address_key,
    check_fresh,
    check_verdict,
    compute_verdict,
    is_admitted,
    missing_ranks,
    proof_entry,
    proof_key,
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


def fresh() -> str:
    """A nonce or challenge: 128 random bits as 32 hex digits."""
    return secrets.token_hex(16)


def _read(store: Any, key: str, timeout_s: float) -> str:
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return str(store.get(key).decode(errors="replace"))


def pass_gate(store: Any, gate: RankGate, rank: int, world_size: int, timeout_s: float) -> None:
    """Prove this rank, and (rank 0) admit the world or refuse it; raise RendezvousError."""
    if rank == 0:
        nonce = fresh()
        store.set(NONCE_KEY, nonce)
    else:
        nonce = check_fresh("nonce", _read(store, NONCE_KEY, timeout_s))
    ranks = [gate.offset + r for r in range(world_size)]
    store.set(proof_key(rank), proof_entry(gate.token, gate.identity, ranks[rank], nonce, fresh()))
    if rank != 0:
        verdict = _read(store, VERDICT_KEY, timeout_s)
        # Every entry is in by now if the leader wrote the verdict; a missing one
        # leaves the signature unchecked, and the verdict refused.
        entries = {
            gate.offset + r: store.get(proof_key(r)).decode(errors="replace")
            for r in range(world_size)
            if store.check([proof_key(r)])
        }
        check_verdict(gate.token, gate.identity, ranks, entries, nonce, verdict)
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
    entries = {
        gate.offset + r: store.get(proof_key(r)).decode(errors="replace") for r in range(world_size)
    }
    verdict = compute_verdict(gate.token, gate.identity, ranks, entries, nonce)
    store.set(VERDICT_KEY, verdict)
    if not is_admitted(verdict):
        raise RendezvousError(verdict)


def open_directory(store: Any) -> str:
    """Pod 0: a fresh nonce for the instance's address directory (before any pod publishes)."""
    nonce = fresh()
    store.set(DIRECTORY_NONCE_KEY, nonce)
    return nonce


def publish_address(
    store: Any, token: str, who: RankIdentity, pod_index: int, host: str, timeout_s: float
) -> None:
    """Pod `pod_index` writes its address, with its proof, to the instance's directory."""
    nonce = check_fresh("directory nonce", _read(store, DIRECTORY_NONCE_KEY, timeout_s))
    store.set(address_key(pod_index), address_entry(token, who, pod_index, host, nonce))


def wait_addresses(
    store: Any,
    token: str,
    who: RankIdentity,
    pods: tuple[int, ...],
    timeout_s: float,
    nonce: str | None = None,
) -> dict[int, str]:
    """The checked addresses of `pods` from the directory, waiting until each published;
    RendezvousError when one is late or was not written with this cluster's token in
    this rendezvous. `nonce`: the directory's, when this pod opened it (else read)."""
    if nonce is None:
        nonce = check_fresh("directory nonce", _read(store, DIRECTORY_NONCE_KEY, timeout_s))
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
    return {
        k: read_address_entry(token, who, k, store.get(address_key(k)).decode(), nonce)
        for k in pods
    }
