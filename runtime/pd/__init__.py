"""The PD control plane: which request's KV goes where, and when.

Pure modules (no sockets, HTTP, ZMQ or torch; `mypy --strict`):

- `kvpoll`       — the `KVPoll` states and the one transition rule both sides share;
- `messages`     — versioned msgspec wire messages, `encode` / `decode`;
- `coords`       — rank coordinates shared by messages, topology and registry;
- `compat`       — the compatibility fields both sides must agree on;
- `topology`     — which prefill rank sends which layers/heads/tokens to which decode rank;
- `tombstones`   — bounded memory of concluded rooms;
- `actions`      — what the room machines ask their I/O loop to do;
- `settings`     — timeouts and limits of the room machines;
- `prefill_rooms` / `decode_rooms` — the per-rank room tables (sans-IO);
- `decode_admission` — FIFO page/slot admission on the decode side;
- `heartbeat`    — consecutive-failure tracking of prefill peers;
- `bootstrap_registry` — the registry behind a prefill instance's bootstrap server.

I/O edges: `bootstrap_server` (FastAPI app factory) and `bootstrap_client`
(httpx, async).
"""
