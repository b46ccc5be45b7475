"""Stateful property test: heartbeat false alarms against live one-sided writers.

The room-table machine of `tests/pd/test_rooms_stateful.py` (both tables
wired together, random interleavings, docs/design.md §14 invariants after every
step) gains one rule: a decode rank's heartbeat declares a prefill instance
unreachable while it is in fact alive — hung for a while, or just slow — so
its ranks keep their writes in flight and resume them. With shm those
writes land in decode's memory; the machine's invariant that no page is
released while a live prefill rank may still write it must hold anyway, and
every room must still settle (the ABORTs reach the live ranks, which drain
and acknowledge).
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis.stateful import precondition, rule

from pdcluster.runtime.pd.coords import InstanceShape
from tests.pd.sim import BOOTSTRAP, d_endpoint
from tests.pd.test_rooms_stateful import PDMachine


class HungPrefillOneSided(PDMachine):
    one_sided = True
    prefill_shape = InstanceShape(tp=2)

    @rule()
    def heartbeat_false_alarm(self) -> None:
        event("heartbeat verdict against a live prefill")
        self._verdict()

    @precondition(lambda self: any(self.inflight.values()))
    @rule()
    def heartbeat_false_alarm_mid_transfer(self) -> None:
        """The verdict lands while a live prefill rank still has writes in flight."""
        event("heartbeat verdict with writes in flight")
        self._verdict()

    def _verdict(self) -> None:
        for rank, table in self.net.decode.items():
            self.react(
                d_endpoint(rank),
                table.fail_peer(BOOTSTRAP, "prefill_unreachable", self.now, definitive=False),
            )


TestHungPrefillOneSided = settings(max_examples=60, stateful_step_count=50, deadline=None)(
    HungPrefillOneSided
).TestCase
