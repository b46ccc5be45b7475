"""Every wait is bounded: the three room timeouts, on the side that waits.

All three run at once against the shared cluster (`bootstrapTimeoutSeconds`
6 s, `waitingTimeoutSeconds` 10 s):
- decode waits for its route (the prefill instance never completes its
  registration) → `prefill_not_ready`, within `bootstrapTimeoutSeconds`;
- decode reserved pages and sent them, but the prefill rank never writes →
  `waiting_timeout`, and ABORT goes to that rank (the pages wait for its ack);
- a prefill leg whose decode never sends metadata → `bootstrap_timeout`.
Each ends in a readable error at its deadline (not before, not much after),
a counted failure, a log line naming room and rid, and no page held.
"""

from __future__ import annotations

import time

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import InstanceShape
from tests.faults.harness import (
    FaultCluster,
    LegResult,
    PDClient,
    PDResult,
    gen_body,
    mint_rid,
    mint_room,
    post_leg,
)
from tests.faults.rogue import Background, RoguePrefill

SLACK_S = 2.0


def test_each_side_gives_up_at_its_deadline(
    pd: FaultCluster, client: PDClient, compat: CompatInfo
) -> None:
    spec = pd.manifest.spec.transfer
    silent = RoguePrefill(pd.token, compat)
    unready = RoguePrefill(pd.token, compat, shape=InstanceShape(tp=2))  # 1 of 2 ranks
    decode_before, prefill_before = pd.stats("decode-0"), pd.stats("prefill-0")
    try:
        t0 = time.monotonic()
        waiting = Background(client.generate, None, pd.url("decode-0"), silent.bootstrap, [3] * 30)
        routing = Background(client.generate, None, pd.url("decode-0"), unready.bootstrap, [4] * 30)
        rid, room = mint_rid(), mint_room()
        orphan = Background(
            post_leg,
            pd.url("prefill-0"),
            gen_body([5] * 30, 4, rid=rid, room=room, bootstrap=pd.bootstrap("prefill-0")),
            30.0,
        )
        _, meta = silent.expect(pdmsg.TransferMeta)

        res: PDResult = routing.result(spec.bootstrap_timeout_seconds + 10)
        # Its /route retries give up within the same budget, saying why.
        assert res.decode.status == 502, res.decode
        assert "prefill_not_ready" in res.decode.error and "1/2 ranks" in res.decode.error
        assert spec.bootstrap_timeout_seconds - 1.5 <= res.decode.ended_at - t0
        assert res.decode.ended_at - t0 <= spec.bootstrap_timeout_seconds + SLACK_S

        pre: LegResult = orphan.result(spec.bootstrap_timeout_seconds + 10)
        assert pre.status == 502 and "bootstrap_timeout" in pre.error
        assert pre.ended_at - t0 <= spec.bootstrap_timeout_seconds + SLACK_S

        res = waiting.result(spec.waiting_timeout_seconds + 10)
        assert res.decode.status == 502 and "waiting_timeout" in res.decode.error
        assert spec.waiting_timeout_seconds - 0.5 <= res.decode.ended_at - t0
        assert res.decode.ended_at - t0 <= spec.waiting_timeout_seconds + SLACK_S
        _, abort = silent.expect(pdmsg.Abort, meta.room)
        assert abort.reason == "waiting_timeout" and abort.generation == meta.generation
        silent.ack(meta.decode_endpoint, meta.room, meta.generation)
    finally:
        silent.close()
        unready.close()
    pd.assert_clean(["decode-0", "prefill-0"])

    def grew(before: dict[str, int], after: dict[str, int], key: str, n: int) -> bool:
        return after.get(key, 0) - before.get(key, 0) == n

    decode_after, prefill_after = pd.stats("decode-0"), pd.stats("prefill-0")
    assert grew(decode_before, decode_after, "room_failed:prefill_not_ready", 1)
    assert grew(decode_before, decode_after, "room_failed:waiting_timeout", 1)
    assert grew(prefill_before, prefill_after, "room_failed:bootstrap_timeout", 1)
    # The log names the room and the rid of each failure.
    assert f"room {meta.room} rid {meta.rid} failed: waiting_timeout" in pd.log("decode-0", 2000)
    assert f"room {room} rid {rid} failed: bootstrap_timeout" in pd.log("prefill-0", 2000)
