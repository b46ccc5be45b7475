"""Whether a PD worker may take requests, and why not (the `/health` verdict).

A worker that answers `/health` 200 is put in the router's pool and, on
Kubernetes, marked Ready. So it answers 200 only when a request sent to it
now can be served: its engine thread runs and makes progress, every dp
group of the instance serves, and — prefill — every rank of the instance is
registered with its bootstrap server (decode cannot learn the topology
before that, and every request would fail later as `prefill_not_ready`).

`compute_not_ready` takes the facts and returns the first reason that keeps
the worker out, or None. Reasons (also in docs/operations.md):
- `engine_stopped`: the engine thread is gone;
- `engine_stalled`: work is queued and no step finished for the stall
  bound (see `stall.py`);
- `bootstrap_rejected: <detail>`: the bootstrap server refused this rank's
  registration (a 4xx: wrong token, inconsistent compatibility fields);
- `unregistered: <n>/<m> ranks registered`: registration still pending;
- `dp_groups_starting`: another dp group of the instance does not serve yet.

Registration retries use `RegistrationBackoff`: exponential, capped, never
giving up (the bootstrap server of rank 0 starts listening only once the
instance is built; a follower may be up long before it).

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.runtime.backoff import ExponentialBackoff


@dataclass(frozen=True)
class RegistrationBackoff(ExponentialBackoff):
    """Seconds to sleep between registration attempts; `delays()` never ends (no giving up)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base_s <= 0:  # a zero delay would retry in a busy loop
            raise ValueError(f"RegistrationBackoff needs base_s > 0, got {self}")


@dataclass(frozen=True)
class ReadinessFacts:
    engine_alive: bool
    engine_stalled: bool
    groups_ready: bool
    # Prefill only (None on decode): this rank's registration state.
    registered: bool | None = None
    registration_error: str | None = None
    # The front of a prefill instance (hosts the bootstrap server): ranks registered / expected.
    num_registered: int | None = None
    num_expected: int | None = None


def compute_not_ready(facts: ReadinessFacts) -> str | None:
    """The reason this worker must not take requests now, or None when it may."""
    if not facts.engine_alive:
        return "engine_stopped"
    if facts.engine_stalled:
        return "engine_stalled"
    if facts.registration_error is not None:
        return f"bootstrap_rejected: {facts.registration_error}"
    if facts.num_registered is not None and facts.num_expected is not None:
        if facts.num_registered < facts.num_expected:
            return f"unregistered: {facts.num_registered}/{facts.num_expected} ranks registered"
    if facts.registered is False:
        return "unregistered: this rank is not registered yet"
    if not facts.groups_ready:
        return "dp_groups_starting"
    return None
