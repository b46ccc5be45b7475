"""Small shared pieces: settings, peer matching, compatibility messages."""

from __future__ import annotations

import pytest

from pdcluster.runtime.pd.compat import CompatError, check_compat
from pdcluster.runtime.pd.failure_labels import reason_label
from pdcluster.runtime.pd.room_common import host_of, peer_matches
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd_worker.agent import model_fingerprint
from pdcluster.runtime.spec import TransferSpec

from .sim import compat


def test_settings_from_the_manifest() -> None:
    spec = TransferSpec(
        bootstrap_timeout_seconds=7, waiting_timeout_seconds=9, abort_release_timeout_seconds=2
    )
    s = RoomSettings.from_spec(spec)
    assert (s.bootstrap_s, s.waiting_s, s.prefill_wait_s, s.release_s) == (7, 9, 9, 2)
    assert s.tombstone_ttl == 16
    assert RoomSettings.from_spec(spec, prefill_wait_s=3).prefill_wait_s == 3


@pytest.mark.parametrize(
    "kwargs",
    [{"bootstrap_s": 0}, {"waiting_s": -1}, {"release_s": 0}, {"tombstone_s": 0}, {"max_rooms": 0}],
)
def test_bad_settings_name_the_field(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RoomSettings(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("tcp://10.0.0.5:7000", "10.0.0.5"),
        ("10.0.0.5:8998", "10.0.0.5"),
        ("10.0.0.5", "10.0.0.5"),
        ("[::1]:80", "::1"),
        ("tcp://[fe80::1]:5", "fe80::1"),
    ],
)
def test_host_of(address: str, host: str) -> None:
    assert host_of(address) == host


@pytest.mark.parametrize(
    ("peer", "address", "expected"),
    [
        ("10.0.0.5", "tcp://10.0.0.5:7000", True),  # operator: a pod IP names all its endpoints
        ("10.0.0.5:8998", "10.0.0.5:8998", True),  # heartbeat: the bootstrap address
        ("10.0.0.5:8998", "tcp://10.0.0.5:7000", False),  # another port is another peer
        ("10.0.0.50", "tcp://10.0.0.5:7000", False),
        ("tcp://10.0.0.5:7000", "tcp://10.0.0.5:7000", True),
        ("", "tcp://10.0.0.5:7000", False),
    ],
)
def test_peer_matching(peer: str, address: str, expected: bool) -> None:
    assert peer_matches(peer, address) is expected


def test_compat_error_names_every_field_and_both_values() -> None:
    with pytest.raises(CompatError) as err:
        check_compat(compat(), compat(page_size=8, kv_layout="HND"))
    assert str(err.value) == (
        "page_size mismatch: prefill=4, decode=8; kv_layout mismatch: prefill=NHD, decode=HND"
    )
    assert err.value.field == "page_size" and len(err.value.mismatches) == 2
    check_compat(compat(), compat())


@pytest.mark.parametrize(
    ("field", "theirs", "text"),
    [
        ("num_layers", 3, "num_layers mismatch: prefill=2, decode=3"),
        ("num_kv_heads", 4, "num_kv_heads mismatch: prefill=2, decode=4"),
        ("head_dim", 128, "head_dim mismatch: prefill=64, decode=128"),
        ("kv_layout", "LPHKN", "kv_layout mismatch: prefill=NHD, decode=LPHKN"),
    ],
)
def test_a_kv_geometry_mismatch_names_its_field(field: str, theirs: object, text: str) -> None:
    geometry = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64}
    with pytest.raises(CompatError, match=text) as err:
        check_compat(compat(**geometry), compat(**(geometry | {field: theirs})))
    assert err.value.field == field


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("bootstrap_timeout", "bootstrap_timeout"),
        (
            "page_size mismatch: prefill=16, decode=32; kv_dtype mismatch: a, b",
            "page_size_mismatch",
        ),
        (
            "allocation_policy mismatch: prefill=early, decode=prefill_complete",
            "allocation_policy_mismatch",
        ),
        ("prefill dp0/cp0/tp1/pp0 failed: transfer_error", "prefill_failed"),
        ("aborted by decode: client_disconnected", "aborted_by_decode"),
        ("room_closed: bootstrap_timeout", "room_closed"),
        ("Ünïcode & spaces!", "other"),
        ("x" * 200, "other"),
        ("", "unknown"),
        (None, "unknown"),
    ],
)
def test_reason_labels_are_bounded_codes(reason: str | None, label: str) -> None:
    assert reason_label(reason) == label


def test_a_model_fingerprint_mismatch_names_the_part_that_differs() -> None:
    ours = model_fingerprint("tiny", 0, "cfg", "tok-a", "chat-a")
    theirs = model_fingerprint("tiny", 0, "cfg", "tok-b", "chat-a")
    assert ours == model_fingerprint("tiny", 0, "cfg", "tok-a", "chat-a")
    with pytest.raises(CompatError) as err:
        check_compat(compat(model_fingerprint=ours), compat(model_fingerprint=theirs))
    assert str(err.value).endswith("(differs in: tokenizer)")
    assert "tokenizer=tok-a" in str(err.value) and "tokenizer=tok-b" in str(err.value)
    other_weights = model_fingerprint("tiny", 1, "cfg", "tok-a", "chat-b")
    with pytest.raises(CompatError, match=r"\(differs in: weights, chat_template\)$"):
        check_compat(compat(model_fingerprint=ours), compat(model_fingerprint=other_weights))
    # A fingerprint in another form still fails, naming both values.
    with pytest.raises(CompatError, match="prefill=opaque-1, decode=opaque-2$"):
        check_compat(compat(model_fingerprint="opaque-1"), compat(model_fingerprint="opaque-2"))
