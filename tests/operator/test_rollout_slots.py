"""The rollout's per-slot decision, case by case (rollout.decide_slot).

Each row is one slot: its instances (template, health, revision), the
restart ledger's answers for it, and what the slot must do and report.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdcluster.operator.builders.meta import ObjectKey
from pdcluster.operator.builders.workers import InstanceKey
from pdcluster.operator.names import LABEL_REVISION, Role
from pdcluster.operator.reconcile.instances import Health, ObservedInstance
from pdcluster.operator.reconcile.observed import ObservedObject, ObservedPod
from pdcluster.operator.reconcile.rollout import SlotStep, decide_slot

NEW, OLD = "tnew", "told"
REV, OTHER_REV = "r2", "r1"
NOW = 1000.0


def inst(template: str, health: Health, revision: str = REV) -> ObservedInstance:
    name = f"decode-0-{template}"
    pod = ObservedPod(
        obj=ObservedObject(
            key=ObjectKey("Pod", name),
            uid=f"uid-{name}",
            controller_uid="owner",
            labels={LABEL_REVISION: revision},
            annotations={},
            terminating=health == Health.terminating,
        ),
        role=Role.decode,
        instance=0,
        pod_index=0,
        template_hash=template,
        instance_size=1,
        phase="Running",
        ready=health == Health.ready,
    )
    return ObservedInstance(
        key=InstanceKey(Role.decode, 0, template),
        size=1,
        pods={0: pod},
        health=health,
        reason=str(health),
    )


@dataclass(frozen=True)
class Row:
    slot: tuple[ObservedInstance, ...]
    step: SlotStep
    is_ready: bool = False
    is_existing: bool = False
    holds_surge: bool = False
    num_dropped: int = 0
    num_retired: int = 0
    num_held: int = 0
    recreate_at: float | None = None
    can_restart: bool = True
    retire_other_revisions: bool = True


ROWS = {
    "empty slot is created": Row((), SlotStep.create),
    "empty slot in back-off waits": Row((), SlotStep.backoff, recreate_at=NOW + 5),
    "back-off over: created": Row((), SlotStep.create, recreate_at=NOW - 1),
    "outdated serving: surge candidate": Row(
        (inst(OLD, Health.ready),), SlotStep.surge, is_ready=True, is_existing=True
    ),
    "outdated serving, back-off running: holds the surge": Row(
        (inst(OLD, Health.ready),),
        SlotStep.backoff,
        is_ready=True,
        is_existing=True,
        holds_surge=True,
        recreate_at=NOW + 5,
    ),
    "outdated broken: dropped, slot created": Row(
        (inst(OLD, Health.broken),), SlotStep.create, num_dropped=1
    ),
    "outdated incomplete: dropped, slot created": Row(
        (inst(OLD, Health.incomplete),), SlotStep.create, num_dropped=1
    ),
    "current Ready retires the outdated one": Row(
        (inst(NEW, Health.ready), inst(OLD, Health.ready)),
        SlotStep.complete,
        is_ready=True,
        is_existing=True,
        num_retired=1,
    ),
    "current Ready keeps another revision's pair until told": Row(
        (inst(NEW, Health.ready), inst(OLD, Health.ready, OTHER_REV)),
        SlotStep.complete,
        is_ready=True,
        is_existing=True,
        num_held=1,
        retire_other_revisions=False,
    ),
    "current Ready retires an outdated one of its own revision anyway": Row(
        (inst(NEW, Health.ready), inst(OLD, Health.ready, REV)),
        SlotStep.complete,
        is_ready=True,
        is_existing=True,
        num_retired=1,
        retire_other_revisions=False,
    ),
    "current starting beside a serving outdated one holds the surge": Row(
        (inst(NEW, Health.starting), inst(OLD, Health.ready)),
        SlotStep.start,
        is_ready=True,
        is_existing=True,
        holds_surge=True,
    ),
    "current starting alone waits": Row(
        (inst(NEW, Health.starting),), SlotStep.start, is_existing=True
    ),
    "current incomplete is filled": Row(
        (inst(NEW, Health.incomplete),), SlotStep.fill, is_existing=True
    ),
    "current terminating waits": Row(
        (inst(NEW, Health.terminating),), SlotStep.terminating, is_existing=True
    ),
    "current broken restarts": Row((inst(NEW, Health.broken),), SlotStep.restart, is_existing=True),
    "current broken, budget spent: kept": Row(
        (inst(NEW, Health.broken),), SlotStep.budget_spent, is_existing=True, can_restart=False
    ),
    "current broken beside a serving outdated one holds the surge": Row(
        (inst(NEW, Health.broken), inst(OLD, Health.ready)),
        SlotStep.restart,
        is_ready=True,
        is_existing=True,
        holds_surge=True,
    ),
}


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_slot_decision(row: Row) -> None:
    decided = decide_slot(
        row.slot,
        target=NEW,
        now=NOW,
        recreate_at=row.recreate_at,
        can_restart=row.can_restart,
        revision=REV,
        retire_other_revisions=row.retire_other_revisions,
    )
    assert decided.step == row.step
    assert decided.current is next((i for i in row.slot if i.key.template_hash == NEW), None)
    assert (decided.is_ready, decided.is_existing, decided.holds_surge) == (
        row.is_ready,
        row.is_existing,
        row.holds_surge,
    )
    assert (len(decided.drop), len(decided.retire), decided.num_held) == (
        row.num_dropped,
        row.num_retired,
        row.num_held,
    )
    assert decided.not_before == (row.recreate_at if row.step == SlotStep.backoff else None)
    assert all(i.key.template_hash == OLD for i in (*decided.drop, *decided.retire))
