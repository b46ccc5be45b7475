"""Sender proofs and the identity rules (pure)."""

from __future__ import annotations

import pytest

from pdcluster.runtime.transfer.identity import (
    PROOF_BYTES,
    check_proof,
    claim_mismatch,
    group_must_be_local,
    group_route,
    identity_key,
    is_loopback,
    kv_source_ok,
    new_routing_id,
    prove,
)

KEY = identity_key("token-a")
RID = b"\x01" + b"r" * 15
ME = b"tcp://10.0.0.1:5000"


def test_a_proof_binds_the_sender_to_its_routing_id() -> None:
    proof = prove(KEY, RID, ME)
    assert len(proof) == PROOF_BYTES
    assert check_proof(KEY, RID, ME, proof) is None


@pytest.mark.parametrize(
    ("key", "rid", "sender", "proof", "why"),
    [
        (identity_key("token-b"), RID, ME, prove(KEY, RID, ME), "bad_proof"),  # other cluster
        (KEY, b"\x01other", ME, prove(KEY, RID, ME), "bad_proof"),  # copied to another connection
        (KEY, RID, b"tcp://10.0.0.2:5000", prove(KEY, RID, ME), "bad_proof"),  # another's address
        (KEY, RID, ME, prove(KEY, RID, ME)[:-1], "bad_proof"),  # truncated
        (KEY, RID, ME, b"", "bad_proof"),
        (KEY, b"", ME, prove(KEY, b"", ME), "bad_identity"),
        (KEY, b"\x01" * 256, ME, prove(KEY, b"\x01" * 256, ME), "bad_identity"),
    ],
)
def test_a_proof_that_does_not_match_is_refused(key, rid, sender, proof, why) -> None:
    assert check_proof(key, rid, sender, proof) == why


def test_the_routing_id_length_is_part_of_the_proof() -> None:
    # (rid, sender) pairs that concatenate to the same bytes still differ.
    assert prove(KEY, b"\x01ab", b"c") != prove(KEY, b"\x01a", b"bc")


def test_routing_ids_are_random_and_never_start_with_a_zero_byte() -> None:
    ids = {new_routing_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i[0] != 0 and len(i) == 16 for i in ids)


@pytest.mark.parametrize(
    ("claimed", "mismatch"),
    [(None, False), ("tcp://a:1", False), ("tcp://b:1", True), ("", True)],
)
def test_claim_mismatch(claimed, mismatch) -> None:
    assert claim_mismatch("tcp://a:1", claimed) is mismatch


@pytest.mark.parametrize(
    ("sources", "ok"),
    [
        (None, True),  # not receiving: the receiver's own rules drop it
        (frozenset({"tcp://p:1"}), True),
        (frozenset({"tcp://p:1", "tcp://p:2"}), True),
        (frozenset({"tcp://p:2"}), False),
        (frozenset(), False),
    ],
)
def test_kv_source_ok(sources, ok) -> None:
    assert kv_source_ok("tcp://p:1", sources) is ok


@pytest.mark.parametrize(
    ("ip", "local"),
    [
        ("127.0.0.1", True),
        ("127.8.9.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.5", False),
        ("::ffff:10.0.0.5", False),
        ("1127.0.0.1", False),
        ("", False),
        (None, False),
    ],
)
def test_is_loopback(ip, local) -> None:
    assert is_loopback(ip) is local


@pytest.mark.parametrize(
    ("bind", "peer", "route"),
    [
        ("0.0.0.0", "tcp://10.1.2.3:7000", "tcp://127.0.0.1:7000"),
        ("::", "tcp://10.1.2.3:7000", "tcp://127.0.0.1:7000"),
        ("127.0.0.1", "tcp://10.1.2.3:7000", "tcp://127.0.0.1:7000"),
        ("10.1.2.3", "tcp://10.1.2.3:7000", "tcp://10.1.2.3:7000"),  # one interface only
        ("0.0.0.0", "tcp://10.9.9.9:7000", "tcp://10.9.9.9:7000"),  # another pod
    ],
)
def test_group_route(bind, peer, route) -> None:
    assert group_route(peer, bind, "tcp://10.1.2.3:6000") == route


@pytest.mark.parametrize(
    ("bind", "peers", "local"),
    [
        ("0.0.0.0", ["tcp://10.1.2.3:7000", "tcp://10.1.2.3:7001"], True),
        ("0.0.0.0", [], True),
        ("0.0.0.0", ["tcp://10.1.2.3:7000", "tcp://10.9.9.9:7001"], False),
        ("10.1.2.3", ["tcp://10.1.2.3:7000"], False),
    ],
)
def test_group_must_be_local(bind, peers, local) -> None:
    assert group_must_be_local(bind, "tcp://10.1.2.3:6000", peers) is local


def test_identity_refusals_are_protocol_rejects_and_socket_upkeep_is_not() -> None:
    # What `pdcluster_protocol_rejects_total` counts, by the worker's own rule.
    from pdcluster.runtime.pd_worker.coordinator import NOT_REJECTS, REJECT_PREFIXES

    def counted(key: str) -> bool:
        return key.startswith(REJECT_PREFIXES) and key not in NOT_REJECTS

    for key in (
        "endpoint:bad_proof",
        "endpoint:bad_identity",
        "endpoint:kv_wrong_source",
        "endpoint:not_loopback",
        "reject:sender_mismatch",
    ):
        assert counted(key), key
    for key in ("endpoint:peer_evicted", "endpoint:peer_idle_closed", "endpoint:peers_over_cap"):
        assert not counted(key), key
