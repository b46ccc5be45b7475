"""How the PD control plane names another worker: three forms, three names.

- `BootstrapAddress` — `host:port` of a prefill instance's bootstrap server
  (the `bootstrap_host`/`bootstrap_port` of a request). Decode's known peers,
  its heartbeats and its rooms name a prefill instance by it; the operator
  and the launcher publish a set of them (`PUT /admin/prefill_peers`).
  `known_peers.normalize_address` makes the canonical form (host
  lower-cased, IPv6 in brackets).
- `ZmqEndpoint` — `tcp://host:port` of one rank's ZMQ socket: where control
  messages and KV frames go (the `Endpoint` fields of `messages.py`).
- `PeerRef` — whatever `fail_peer` is told names a lost peer: a
  `BootstrapAddress` (a lost prefill instance), a `ZmqEndpoint`, or a bare
  host (a lost decode pod's IP, matching every endpoint on it);
  `room_common.peer_matches` compares it with the other forms.

The first two are `NewType`s over `str`: values are plain strings at run time
(wire and JSON forms unchanged), but the type checker keeps one form from
being passed where the other is meant. `PeerRef` is any `str`, since every
form may name a peer.

Pure module.
"""

from __future__ import annotations

from typing import NewType, TypeAlias

BootstrapAddress = NewType("BootstrapAddress", str)
ZmqEndpoint = NewType("ZmqEndpoint", str)
PeerRef: TypeAlias = str
