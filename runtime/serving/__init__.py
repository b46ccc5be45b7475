"""What every worker role serves through: the engine thread and the request a backend gets.

Two independent siblings sit on this package: `server` (the worker HTTP API,
which validates a body into a `PreparedRequest` and hands it to a `Backend`)
and `pd_worker` (the prefill and decode backends, rank agents and
coordinator). Neither imports the other; `worker_main.py` composes them.

- `engine_service` — the engine on its own thread, served to asyncio callers;
- `request`        — `PreparedRequest`, its `BootstrapFields`, and `BadRequest`;
- `backend`        — the `Backend` interface and the engine calls every backend shares.
"""
