"""What the room machines ask their I/O loop to do.

Every event method of `PrefillRoomTable` / `DecodeRoomTable` returns a list
of these, in the order they must be performed. The tables never perform I/O
themselves and never read a clock.

Common:
- `Send(endpoint, message)` — encode with `messages.encode` and send on the
  control socket to that endpoint (a prefill rank's or decode rank's ZMQ
  address). Best effort: a peer that cannot be reached is the heartbeat's
  and timeouts' business, not a reason to retry here.
- `RoomFailed(room, rid, reason)` — the request bound to the room failed;
  emitted once per room. Tell the client (HTTP error / SSE error event),
  count `reason` in metrics, log with rid/room/rank.
- `Dropped(room, what, reason)` — an input was ignored (stale generation,
  unknown room, unauthenticated peer, ...). Count and log at debug; never
  an error for the process.

Prefill only:
- `StartCompute(room, rid)` — hand the request to the engine now (the
  prefill leg arrived; under either policy decode's metadata may still be
  on its way).
- `SendHeldKV(room)` — every destination is known now: push the KV computed
  before that (`prefill_complete`: all of it; `early`: the chunks done so
  far, the rest streams as it is computed).
- `CancelWrites(room)` — a failed room's writes did not drain within the
  release timeout: abandon them, then report them done (`writes_done`).
- `ReleaseSource(room, rid)` — the room is over and its writes drained: the
  engine may free the request's prefill pages (`engine.release(rid)`).
  Emitted exactly once, and only if `StartCompute` was.
- `RoomSucceeded(room, rid, sent_tokens)` — every destination got its KV and Success.

Decode only:
- `PrefillReady(room)` — `prefill_complete`: every source reported Ready;
  the room may now queue for pages.
- `TransferComplete(room, rid, pages, first_token, checksums)` — every
  source reported Success; the pages now belong to the request (the room
  left the table). Verify checksums, then start decoding.
- `ReleasePages(room, rid, pages, reason)` — a failed room's pages are safe
  to reuse: every notified source acked, the release timeout passed (not
  for one-sided writes), or the peer was declared dead. Exactly once.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.messages import FirstLogprobs, Message


@dataclass(frozen=True, slots=True)
class Send:
    endpoint: str
    message: Message


@dataclass(frozen=True, slots=True)
class RoomFailed:
    room: int
    rid: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class Dropped:
    room: int | None
    what: str
    reason: str


@dataclass(frozen=True, slots=True)
class RoomAction:
    """An action about one room, and nothing more to say."""

    room: int


@dataclass(frozen=True, slots=True)
class RequestAction(RoomAction):
    """An action about one room and the request bound to it."""

    rid: str


@dataclass(frozen=True, slots=True)
class StartCompute(RequestAction):
    """Prefill: hand the request to the engine now."""


@dataclass(frozen=True, slots=True)
class SendHeldKV(RoomAction):
    """Prefill: every destination is known; push the KV computed before it was."""


@dataclass(frozen=True, slots=True)
class CancelWrites(RoomAction):
    """Prefill: abandon a failed room's writes that did not drain in time."""


@dataclass(frozen=True, slots=True)
class CloseDestination:
    """Prefill: close the connection to a decode rank reported lost. Frames queued to
    it would never be read; closing releases them, so the rooms writing to it drain."""

    endpoint: str


@dataclass(frozen=True, slots=True)
class ReleaseSource(RequestAction):
    """Prefill: the engine may free the request's prefill pages."""


@dataclass(frozen=True, slots=True)
class RoomSucceeded(RequestAction):
    """Prefill: every destination got its KV and Success.

    `sent_tokens`: prompt tokens whose KV travelled (the rest decode reused;
    None: the prompt's length was never known)."""

    sent_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class PrefillReady(RoomAction):
    """Decode, `prefill_complete`: every source is Ready; queue for pages."""


@dataclass(frozen=True, slots=True)
class TransferComplete(RequestAction):
    """Decode: every source reported Success; the pages belong to the request."""

    pages: tuple[int, ...]
    first_token: int | None
    checksums: tuple[tuple[RankCoord, int], ...]
    first_logprobs: FirstLogprobs | None = None


@dataclass(frozen=True, slots=True)
class ReleasePages(RequestAction):
    """Decode: a failed room's pages are safe to reuse."""

    pages: tuple[int, ...]
    reason: str


Action = (
    Send
    | RoomFailed
    | Dropped
    | StartCompute
    | SendHeldKV
    | CancelWrites
    | CloseDestination
    | ReleaseSource
    | RoomSucceeded
    | PrefillReady
    | TransferComplete
    | ReleasePages
)
