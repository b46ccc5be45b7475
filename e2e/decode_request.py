"""A request to a decode pod whose KV must come from one named prefill pod.

The operator journeys and `bench/operator_timings.py` freeze or kill that prefill
while decode waits for it: `DecodeRequest` sends the request on a thread,
keeps the answer with the time it came, and tells whether decode has opened
the request's room on that prefill yet.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import httpx

# The worker's bootstrap server port on a prefill pod (the chart's default).
BOOTSTRAP_PORT = 8998


def generate_body(prefill_ip: str) -> dict[str, Any]:
    """A decode leg with a fresh room whose KV comes from the prefill at `prefill_ip`."""
    return {
        "text": "hello",
        "sampling_params": {"max_new_tokens": 4},
        "bootstrap_host": prefill_ip,
        "bootstrap_port": BOOTSTRAP_PORT,
        "bootstrap_room": secrets.randbits(62),
    }


class DecodeRequest:
    """POST /generate to `decode_url` on a thread; `answer` holds status, text and `at`."""

    def __init__(
        self, decode_url: str, prefill_ip: str, headers: dict[str, str], timeout_s: float
    ) -> None:
        self.decode_url = decode_url
        self.prefill_ip = prefill_ip
        self.headers = headers
        self.answer: dict[str, Any] = {}
        # What the last `room_open` saw, for a failure message.
        self.rooms: list[dict[str, Any]] = []
        body = generate_body(prefill_ip)
        self.room: int = body["bootstrap_room"]

        def ask() -> None:
            resp = httpx.post(
                f"{decode_url}/generate", json=body, headers=headers, timeout=timeout_s
            )
            self.answer.update(status=resp.status_code, text=resp.text, at=time.monotonic())

        self._thread = threading.Thread(target=ask, daemon=True)
        self._thread.start()

    def room_open(self) -> bool:
        """Whether decode lists a room tied to the prefill (it is waiting for its KV)."""
        resp = httpx.get(f"{self.decode_url}/admin/rooms", headers=self.headers, timeout=5)
        self.rooms = resp.json()["rooms"]
        return any(f"{self.prefill_ip}:{BOOTSTRAP_PORT}" in r["peers"] for r in self.rooms)

    def join(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the answer (at most `timeout_s`); what came, empty if nothing did."""
        self._thread.join(timeout_s)
        return self.answer
