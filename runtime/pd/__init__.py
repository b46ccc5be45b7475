"""The PD control plane: which request's KV goes where, and when.

Pure modules (no sockets, HTTP, ZMQ or torch; `mypy --strict`):

- `kvpoll`       — the `KVPoll` states and the one transition rule both sides share;
- `messages`     — versioned msgspec wire messages, `encode` / `decode`, `ProtocolStats`;
- `coords`       — rank coordinates and instance shapes;
- `compat`       — the compatibility fields both sides must agree on;
- `prompt_digest` — the prompt's `PromptId` both legs compare before a byte moves;
- `topology`     — which prefill rank sends which layers/heads/tokens to which decode rank;
- `tombstones`   — bounded memory of concluded rooms;
- `actions`      — what the room machines ask their I/O loop to do;
- `settings`     — timeouts and limits of the room machines (`RoomSettings.from_spec`);
- `room_common`  — errors of local calls, the admin `RoomView`, peer matching;
- `prefill_rooms` (+ `prefill_claims`, `prefill_peers`) — a prefill rank's room table;
- `decode_rooms` (+ `decode_sources`) — a decode rank's room table;
- `decode_admission` — FIFO page/slot admission of a decode dp group;
- `heartbeat`    — consecutive-failure tracking of prefill peers;
- `bootstrap_registry` — the registry behind a prefill instance's bootstrap server.

The whole package is pure (import-linter enforces it); the HTTP edges of
the registry live in `pd_worker`: `bootstrap_server` (FastAPI app factory +
uvicorn thread) and `bootstrap_client` (httpx, async).

Wiring, in one paragraph: each rank owns one room table and feeds it from
one thread (tables are not thread-safe): local events from its worker and
engine, decoded control frames from its ZMQ socket, and `tick(now)` with a
monotonic clock. It performs the returned actions in order — `Send` frames
via the transfer engine's control channel, the rest on its engine and HTTP
request state. A decode dp group's leader owns `DecodeAdmission` and the
page allocator; its ranks take the same pages. The decode worker keeps a
`PeerLiveness` (heartbeat, verdicts, quarantine of the prefill instances it
uses) and a `BootstrapPool`.
"""
