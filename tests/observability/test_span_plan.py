"""Which spans a worker's part of a request makes from its stage stamps (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.telemetry.span_plan import (
    FAILURE_REASON,
    KV_BACKEND,
    KV_BYTES,
    RID,
    ROOM,
    RequestOutcome,
    RequestStamps,
    Stage,
    plan_worker_spans,
)


def stamps(received: int, **stages: int) -> RequestStamps:
    s = RequestStamps(received_ns=received)
    for stage, t in stages.items():
        s.mark(stage, t)
    return s


def outcome(end: int, failure: str | None = None) -> RequestOutcome:
    return RequestOutcome(
        end, room=42, rid="req-1", prompt_tokens=12, output_tokens=6, failure=failure
    )


def test_a_served_prefill_leg_is_its_request_its_compute_and_its_transfer() -> None:
    s = stamps(100, compute_start=110, first_token=150, paired=120, kv_sent=160)
    s.note(KV_BYTES, 4096)
    s.note(KV_BACKEND, "tcp")
    records = plan_worker_spans("prefill", s, outcome(170))
    assert [(r.name, r.start_ns, r.end_ns) for r in records] == [
        ("prefill.request", 100, 170),
        ("prefill.compute", 110, 150),
        ("kv.transfer", 120, 160),
    ]
    assert all(r.attributes[ROOM] == 42 and r.attributes[RID] == "req-1" for r in records)
    assert records[2].attributes[KV_BYTES] == 4096 and records[2].attributes[KV_BACKEND] == "tcp"
    assert KV_BYTES not in records[0].attributes  # the bytes belong to the transfer
    assert all(r.error is None for r in records)


def test_a_served_decode_leg_waits_for_kv_sends_its_first_token_then_streams() -> None:
    s = stamps(100, pages_reserved=105, kv_received=140, first_token=145)
    records = plan_worker_spans("decode", s, outcome(300))
    assert [(r.name, r.start_ns, r.end_ns) for r in records] == [
        ("decode.request", 100, 300),
        ("decode.wait_kv", 105, 140),
        ("decode.first_token", 140, 145),
        ("decode.stream", 145, 300),
    ]


def test_a_room_that_failed_waiting_for_kv_says_why_there_and_on_the_request() -> None:
    s = stamps(100, pages_reserved=105)
    records = plan_worker_spans("decode", s, outcome(3100, "kv transfer failed: waiting_timeout"))
    by_name = {r.name: r for r in records}
    assert by_name.keys() == {"decode.request", "decode.wait_kv"}  # later stages never started
    for name in by_name:
        assert by_name[name].error == "kv transfer failed: waiting_timeout"
        assert by_name[name].attributes[FAILURE_REASON] == by_name[name].error
    assert by_name["decode.wait_kv"].end_ns == 3100


def test_a_failure_after_a_stage_ended_marks_only_the_request() -> None:
    s = stamps(100, compute_start=110, first_token=150, paired=120)
    records = plan_worker_spans("prefill", s, outcome(900, "aborted"))
    by_name = {r.name: r for r in records}
    assert by_name["prefill.compute"].error is None
    assert by_name["kv.transfer"].error == "aborted" and by_name["kv.transfer"].end_ns == 900
    assert by_name["prefill.request"].error == "aborted"


def test_the_first_stamp_of_a_stage_wins() -> None:
    s = stamps(0, first_token=10)
    s.mark(Stage.first_token, 99)
    assert s.stages[Stage.first_token] == 10


def test_an_unknown_role_is_refused_naming_the_roles() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        plan_worker_spans("router", stamps(0), outcome(1))


@given(
    st.sampled_from(["prefill", "decode", "colocated"]),
    st.dictionaries(
        st.sampled_from([v for k, v in vars(Stage).items() if not k.startswith("_")]),
        st.integers(0, 10_000),
    ),
    st.integers(0, 10_000),
    st.integers(0, 20_000),
    st.one_of(st.none(), st.text(min_size=1, max_size=20)),
)
def test_every_span_is_a_child_of_the_request_and_never_ends_before_it_starts(
    role: str, stages: dict[str, int], received: int, end: int, failure: str | None
) -> None:
    s = RequestStamps(received_ns=received, stages=dict(stages))
    records = plan_worker_spans(role, s, outcome(end, failure))
    head = records[0]
    assert head.name == f"{role}.request" and head.end_ns >= head.start_ns
    for record in records:
        assert record.end_ns >= record.start_ns
        assert record.attributes[RID] == "req-1"
    if failure is None:
        assert all(r.error is None for r in records)
    else:
        assert head.error == failure
