"""Failure reasons are counted under a fixed, documented set of labels."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd.compat import COMPAT_FIELDS, Mismatch, describe
from pdcluster.runtime.pd.failure_labels import FAILURE_LABELS, OTHER, UNKNOWN, reason_label
from pdcluster.runtime.pd.instance_counts import RoomFailureTally, failure_key

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
LABEL_SHAPE = re.compile(r"[a-z][a-z0-9_]{0,47}")
# Names in the table's label column that are not failure reasons: keys of
# other counters (`dropped:…`, `reject:*`, `metric{label}`) and a stats map.
NOT_A_REASON = re.compile(r"[:*{]|^kv_receive_stats$")


def test_every_label_is_label_shaped() -> None:
    assert OTHER in FAILURE_LABELS and UNKNOWN in FAILURE_LABELS
    for label in FAILURE_LABELS:
        assert LABEL_SHAPE.fullmatch(label), label


@pytest.mark.parametrize(
    "reason",
    [
        "chosen_by_peer: anything",
        "chosen_by_peer",
        "room_failed_2",
        "page_size mismatchx: a",
        "bootstrap_timeout_but_longer",
    ],
)
def test_a_reason_with_an_unknown_head_is_other(reason: str) -> None:
    assert reason_label(reason) == OTHER


def test_every_label_in_the_set_labels_itself_with_or_without_details() -> None:
    for label in FAILURE_LABELS - {UNKNOWN}:
        assert reason_label(label) == label
        assert reason_label(f"{label}: details from a peer") == label


@given(st.text(max_size=300))
def test_arbitrary_text_never_yields_a_label_outside_the_set(reason: str) -> None:
    assert reason_label(reason) in FAILURE_LABELS


@given(st.from_regex(LABEL_SHAPE, fullmatch=True), st.text(max_size=50))
def test_a_label_shaped_head_is_itself_only_if_in_the_set(head: str, tail: str) -> None:
    label = reason_label(f"{head}: {tail}")
    assert label == (head if head in FAILURE_LABELS else OTHER)


@given(st.text(max_size=100))
def test_stats_keys_made_from_a_reason_stay_in_the_set(reason: str) -> None:
    key = failure_key(reason)
    assert key.startswith("room_failed:")
    assert key.removeprefix("room_failed:") in FAILURE_LABELS


def test_a_tally_counts_a_peer_chosen_reason_as_other() -> None:
    tally = RoomFailureTally(ttl_s=10.0)
    tally.record(1, "made_up_by_peer: x", 0.0)
    tally.record(2, "transfer_timeout", 0.0)
    assert tally.counts() == {"room_failed:other": 1, "room_failed:transfer_timeout": 1}


@pytest.mark.parametrize("field", COMPAT_FIELDS)
def test_every_compatibility_mismatch_has_its_own_label(field: str) -> None:
    text = describe([Mismatch(field, "a", "b")], "prefill", "decode")
    assert reason_label(text) not in (OTHER, UNKNOWN)


def _failure_table_labels() -> set[str]:
    lines = OPERATIONS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| what happens |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    column = header.index("failure reason (label)")
    labels: set[str] = set()
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        labels.update(
            n for n in re.findall(r"`([^`]+)`", cells[column]) if not NOT_A_REASON.search(n)
        )
    return labels


def test_every_label_in_the_failure_table_is_in_the_set() -> None:
    documented = _failure_table_labels()
    assert len(documented) > 20  # the table was found and read
    assert documented <= FAILURE_LABELS, sorted(documented - FAILURE_LABELS)


def test_the_docs_list_exactly_the_set() -> None:
    entries = [
        line for line in OPERATIONS.read_text().splitlines() if line.startswith("Failure labels:")
    ]
    assert len(entries) == 1
    assert set(re.findall(r"`([^`]+)`", entries[0])) == FAILURE_LABELS
