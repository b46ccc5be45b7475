"""Timeouts and limits of the room machines, in seconds of monotonic time.

Loaded once at the edge (`RoomSettings.from_spec(manifest.spec.transfer)`),
passed explicitly to the room tables.

- `bootstrap_s`: prefill waits this long for every decode destination's
  metadata (from room creation, re-armed when the KV is computed under
  `prefill_complete`); decode waits this long for its route and its pages.
- `waiting_s`: decode waits this long from sending metadata to Success from
  every source; prefill bounds its own transfer phase by it too.
- `prefill_wait_s`: decode under `prefill_complete`, from BOOTSTRAP sent to
  Ready from every source.
- `waiting_per_token_s`: added per prompt token to `waiting_s` and
  `prefill_wait_s` (`waiting_budget_s`, `prefill_wait_budget_s`): a fixed
  timeout that suits a short prompt fails a long one that is merely slow to
  compute and move. The timeouts are the floor (an empty prompt's budget).
- `release_s`: a failed decode room keeps its pages at most this long
  waiting for ABORT_ACKs (never for one-sided `shm` writes); a failed
  prefill room waits this long for its writes to drain before asking the
  transfer engine to cancel them.
- `abort_resend_s`: a failed room on a one-sided transport (shm), which
  keeps its pages until every source acked, sends its ABORT again this
  often to each source that has neither acked nor been declared gone: a
  lost ABORT (or a lost ack) would otherwise hold the pages forever.
  Default `release_s / 4`.
- `tombstone_s`: how long a concluded room is remembered (default
  bootstrap + waiting, so a message delayed by a full timeout still finds it).
- `max_rooms`: live rooms per rank (bounds memory against a flood of
  metadata for rooms that never open).

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.runtime.spec import TransferSpec


@dataclass(frozen=True)
class RoomSettings:
    bootstrap_s: float = 30.0
    waiting_s: float = 60.0
    prefill_wait_s: float = 60.0
    release_s: float = 10.0
    waiting_per_token_s: float = 0.001
    tombstone_s: float | None = None
    abort_resend_s: float | None = None
    max_rooms: int = 4096
    max_tombstones: int = 1 << 16

    def __post_init__(self) -> None:
        for name in ("bootstrap_s", "waiting_s", "prefill_wait_s", "release_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"RoomSettings.{name} must be > 0 seconds, got {value}")
        if not 0 <= self.waiting_per_token_s <= 1:
            raise ValueError(
                "RoomSettings.waiting_per_token_s must be in [0, 1] seconds, "
                f"got {self.waiting_per_token_s}"
            )
        if self.abort_resend_s is not None and not self.abort_resend_s > 0:
            raise ValueError(
                f"RoomSettings.abort_resend_s must be > 0 seconds, got {self.abort_resend_s}"
            )
        if self.tombstone_s is not None and not self.tombstone_s > 0:
            raise ValueError(
                f"RoomSettings.tombstone_s must be > 0 seconds, got {self.tombstone_s}"
            )
        if self.max_rooms < 1 or self.max_tombstones < 1:
            raise ValueError("RoomSettings.max_rooms and max_tombstones must be >= 1")

    def waiting_budget_s(self, num_tokens: int) -> float:
        """How long a room of a `num_tokens`-token prompt may wait for its KV (seconds)."""
        return self.waiting_s + max(0, num_tokens) * self.waiting_per_token_s

    def prefill_wait_budget_s(self, num_tokens: int) -> float:
        """`prefill_complete`: how long decode waits for the prompt's KV to be computed."""
        return self.prefill_wait_s + max(0, num_tokens) * self.waiting_per_token_s

    @property
    def abort_resend_interval_s(self) -> float:
        return self.abort_resend_s if self.abort_resend_s is not None else self.release_s / 4

    @property
    def tombstone_ttl(self) -> float:
        if self.tombstone_s is not None:
            return self.tombstone_s
        return self.bootstrap_s + self.waiting_s

    @classmethod
    def from_spec(
        cls,
        transfer: TransferSpec,
        *,
        prefill_wait_s: float | None = None,
        max_rooms: int = 4096,
    ) -> RoomSettings:
        """From the manifest's `spec.transfer`; `prefill_wait_s` defaults to its waiting timeout."""
        return cls(
            bootstrap_s=transfer.bootstrap_timeout_seconds,
            waiting_s=transfer.waiting_timeout_seconds,
            prefill_wait_s=(
                transfer.waiting_timeout_seconds if prefill_wait_s is None else prefill_wait_s
            ),
            release_s=transfer.abort_release_timeout_seconds,
            waiting_per_token_s=transfer.waiting_per_token_milliseconds / 1000.0,
            max_rooms=max_rooms,
        )
