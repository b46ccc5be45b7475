"""Both legs of a request to a vLLM prefill and a vLLM decode with our connector, at once."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

from tests.faults.harness import wait_until
from tests.vllm_connector.engines import Engine

_rooms = itertools.count(random.Random().randrange(1 << 40))
_rids = itertools.count()
VOCAB = (3, 290)  # token ids of the tiny test model, specials left out


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCAB) for _ in range(n)] for n in lengths]


@dataclass
class PDPair:
    prefill: Engine
    decode: Engine

    def new_room(self) -> int:
        return next(_rooms)

    def params(self, room: int, port: int | None = None) -> dict[str, Any]:
        """The pairing fields our router puts in both legs' `kv_transfer_params`."""
        return {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port or self.prefill.side_port,
            "bootstrap_room": room,
            "rid": f"req-{next(_rids):032x}",
        }

    def pd(self, prompt: list[int], max_tokens: int, timeout: float = 120.0) -> dict[str, Any]:
        """Both legs at once (prefill computes one token); the decode leg's end."""
        room = self.new_room()
        params = self.params(room)
        rid = params["rid"]
        self.prefill.add(rid + "-p", prompt, 1, params)
        self.decode.add(rid + "-d", prompt, max_tokens, params)
        done = self.decode.wait("done", timeout, rid=rid + "-d")
        prefill_done = self.prefill.wait("done", timeout, rid=rid + "-p")
        assert not prefill_done["error"], prefill_done
        return done

    def decode_alone(
        self, prompt: list[int], max_tokens: int, params: dict[str, Any]
    ) -> dict[str, Any]:
        rid = f"alone-{next(_rids)}"
        self.decode.add(rid, prompt, max_tokens, params)
        return self.decode.wait("done", 60, rid=rid)

    def colocated(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The prefill engine serving the prompt alone: the reference output."""
        done = self.prefill.generate(f"colo-{next(_rids)}", prompt, max_tokens)
        assert not done["error"], done
        return list(done["tokens"])

    # ------------------------------------------------------------ side ports
    def decode_rooms(self) -> list[dict[str, Any]]:
        rooms: list[dict[str, Any]] = self.decode.side.get("/admin/rooms").json()["rooms"]
        return rooms

    def decode_failures(self) -> dict[str, int]:
        failures: dict[str, int] = self.decode.side.get("/admin/failures").json()["failures"]
        return failures

    def prefill_stats(self) -> dict[str, int]:
        stats: dict[str, int] = self.prefill.side.get("/admin/failures").json()["stats"]
        return stats

    def counters(self) -> dict[str, int]:
        """Decode's reuse and load counters and prefill's bytes sent, after a step of each."""
        # Rank counters ride on each step's output: one short request steps both.
        self.prefill.generate(f"tick-{next(_rids)}", [3, 4], 1)
        info = self.decode.side.get("/get_server_info").json()
        stats = self.prefill_stats()
        return {
            "reused_tokens": info["pd_stats"]["reused_tokens"],
            "loaded_tokens": info["pd_stats"]["loaded_tokens"],
            "kv_sent_bytes": stats.get("kv_sent_bytes", 0),
        }

    # ------------------------------------------------------------ invariants
    def assert_decode_clean(self) -> None:
        _assert_clean(self.decode)

    def assert_clean(self) -> None:
        """No room left on either side's scheduler, every block back."""
        _assert_clean(self.prefill)
        _assert_clean(self.decode)


def _assert_clean(engine: Engine) -> None:
    def clean() -> dict[str, Any] | None:
        stats = engine.stats()
        rooms = engine.side.get("/admin/rooms").json()["rooms"]
        idle = stats["requests"] == 0 and stats["free_blocks"] == engine.free_blocks
        return stats if idle and not rooms else None

    # A request just sent may not have reached the engine yet: wait for all three.
    wait_until(clean, 30, 0.1, f"{engine.name} to run no request, hold no room and no block")
