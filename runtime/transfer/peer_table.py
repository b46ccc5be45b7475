"""What a one-sided transport (`shm`, `nixl`) keeps per destination rank.

A one-sided transport writes into memory a peer registered: `shm` maps the
peer's pool file, `nixl` adds the peer's agent. Both look the registration
up by the peer's endpoint address from the sender thread while the control
plane adds and drops peers, so the table is guarded by its own lock.
A frame for a peer that is not (or no longer) registered must fail, never
write: `get` raises, `find` answers None.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class PeerTable(Generic[T]):
    """Registrations by peer endpoint address; `what` names them in errors."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._lock = threading.Lock()
        self._peers: dict[str, T] = {}

    def find(self, peer: str) -> T | None:
        with self._lock:
            return self._peers.get(peer)

    def get(self, peer: str) -> T:
        """The registration of `peer`; ValueError naming `what` if there is none."""
        found = self.find(peer)
        if found is None:
            raise ValueError(f"no {self.what} registered for peer {peer}")
        return found

    def put(self, peer: str, value: T) -> T | None:
        """Register `value` for `peer`; returns the registration it replaced."""
        with self._lock:
            old = self._peers.get(peer)
            self._peers[peer] = value
            return old

    def pop(self, peer: str) -> T | None:
        with self._lock:
            return self._peers.pop(peer, None)
