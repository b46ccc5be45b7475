"""The body of `POST /admin/fail_peer`, checked before anything is failed.

    {"peer": "host:port" | "host" | endpoint, "reason"?: str, "gone"?: bool,
     "incarnation"?: str}

`gone` (default true, what callers meant before it existed) says the peer's
processes can no longer run: the pod was deleted or exited. `gone: false`
says it stopped answering but may resume (NotReady past a grace, a hang).
Either way its rooms fail at once; the difference is when their pages may
be reused, which the decode rank decides by transport (decode_agent.py).

`incarnation` names which start of the peer is meant (the lost pod's uid,
or its instance leader's): a report about an incarnation the worker has not
seen, or one that an address now serves a successor of, fails nothing of
the successor's (decode_rooms.py, prefill_rooms.py). Without it a report
means whatever the address serves, as before it existed.

A body that is not an object with a usable `peer` is refused with 422, as
before `gone` existed; a `gone` that is not a JSON boolean, or an
`incarnation` that is not a short string, with 400 (a string "false" must
not silently mean true). Nothing is failed on refusal.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.pd.peer_address import PeerRef

MAX_FIELD_CHARS = 256
MAX_INCARNATION_CHARS = 128
DEFAULT_REASON = "peer_lost"


class FailPeerBodyError(ValueError):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class FailPeerRequest:
    peer: PeerRef
    reason: str = DEFAULT_REASON
    gone: bool = True
    incarnation: str | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"peer": self.peer, "reason": self.reason, "gone": self.gone}
        if self.incarnation is not None:
            body["incarnation"] = self.incarnation
        return body


def parse_fail_peer(body: Any) -> FailPeerRequest:
    """The checked request; raises FailPeerBodyError (with the HTTP status) otherwise."""
    if not isinstance(body, dict) or "peer" not in body:
        raise FailPeerBodyError("body must be {peer, reason?, gone?}", 422)
    peer, reason = str(body["peer"]), str(body.get("reason", DEFAULT_REASON))
    if not peer or len(peer) > MAX_FIELD_CHARS or len(reason) > MAX_FIELD_CHARS:
        raise FailPeerBodyError("peer/reason too long or empty", 422)
    gone = body.get("gone", True)
    # bool only: JSON true/false. 0/1 and "false" are refused, not guessed.
    if not isinstance(gone, bool):
        raise FailPeerBodyError(f"gone must be true or false, got {gone!r}", 400)
    incarnation = body.get("incarnation")
    if incarnation is not None and (
        not isinstance(incarnation, str) or not 0 < len(incarnation) <= MAX_INCARNATION_CHARS
    ):
        raise FailPeerBodyError(
            f"incarnation must be a string of 1..{MAX_INCARNATION_CHARS} characters, "
            f"got {incarnation!r:.80}",
            400,
        )
    return FailPeerRequest(peer, reason, gone, incarnation)
