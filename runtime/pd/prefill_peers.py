"""The decode ranks a prefill rank accepts control messages from.

A decode rank registers its KV layout once (`KVLayoutRegister`) before any
room traffic. Registration is the authentication step of the ZMQ control
plane: only an endpoint registered with the cluster token and with
compatible fields (page size, KV dtype, KV layout, allocation policy, model
fingerprint) may send metadata, BOOTSTRAP or ABORT. The token itself is not
kept.

Pure module.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from pdcluster.runtime.pd.compat import CompatInfo, describe, find_mismatches
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.incarnations import Incarnations
from pdcluster.runtime.pd.messages import KVLayoutRegister
from pdcluster.runtime.pd.peer_address import PeerRef, ZmqEndpoint
from pdcluster.runtime.pd.room_common import peer_matches

# Bounds the table against registrations from many endpoints.
MAX_PEERS = 4096


@dataclass(frozen=True, slots=True)
class Registration:
    accepted: bool
    reason: str | None  # why not, naming the field and both values
    code: str  # metric label: ok | unauthorized | incompatible | too_many_peers
    replaced: bool = False  # the endpoint had a different layout before (restarted peer)


class PeerLayouts:
    def __init__(self, compat: CompatInfo, token: str | None, max_peers: int = MAX_PEERS) -> None:
        self.compat = compat
        self._token = token
        self.max_peers = max_peers
        self._layouts: dict[str, KVLayoutRegister] = {}
        # Which start of each decode rank registered (its layout's incarnation).
        self.incarnations = Incarnations()

    def register(self, msg: KVLayoutRegister) -> Registration:
        if self._token is not None and not hmac.compare_digest(
            msg.token.encode(), self._token.encode()
        ):
            return Registration(
                False, "unauthorized: missing or wrong cluster token", "unauthorized"
            )
        mismatches = find_mismatches(self.compat, msg.compat)
        if mismatches:
            return Registration(False, describe(mismatches, "prefill", "decode"), "incompatible")
        stored = msgspec.structs.replace(msg, token="")
        old = self._layouts.get(msg.decode_endpoint)
        if old is None and len(self._layouts) >= self.max_peers:
            reason = f"too many registered decode peers (limit {self.max_peers})"
            return Registration(False, reason, "too_many_peers")
        self._layouts[msg.decode_endpoint] = stored
        self.incarnations.saw(msg.decode_endpoint, msg.incarnation)
        return Registration(True, None, "ok", replaced=old is not None and old != stored)

    def is_authenticated(self, endpoint: str, decode_rank: RankCoord) -> bool:
        layout = self._layouts.get(endpoint)
        return layout is not None and layout.decode_rank == decode_rank

    def get(self, endpoint: str) -> KVLayoutRegister | None:
        return self._layouts.get(endpoint)

    def forget_matching(self, peer: PeerRef) -> list[ZmqEndpoint]:
        """Drop every registration `peer` names; returns their endpoints."""
        gone = [ZmqEndpoint(e) for e in self._layouts if peer_matches(peer, e)]
        for endpoint in gone:
            del self._layouts[endpoint]
        return gone

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)
