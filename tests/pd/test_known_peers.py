"""Which bootstrap servers a decode worker may contact (pure)."""

from __future__ import annotations

import pytest

from pdcluster.runtime.pd.known_peers import (
    MAX_PEERS,
    KnownPeers,
    PeerSetError,
    normalize_address,
    parse_peers_body,
    parse_peers_env,
)


@pytest.mark.parametrize(
    ("host", "port", "canonical"),
    [
        ("10.0.0.5", 8998, "10.0.0.5:8998"),
        ("Prefill-0.NS.svc", "8998", "prefill-0.ns.svc:8998"),
        ("::1", 80, "[::1]:80"),
        ("[fd00::2]", 9000, "[fd00::2]:9000"),
    ],
)
def test_addresses_are_normalized(host, port, canonical) -> None:
    assert normalize_address(host, port) == canonical


@pytest.mark.parametrize(
    ("host", "port"),
    [("", 80), ("a b", 80), ("evil/x", 80), ("h", 0), ("h", 70000), ("h", "x"), ("h", True)],
)
def test_bad_addresses_are_refused(host, port) -> None:
    with pytest.raises(PeerSetError):
        normalize_address(host, port)


def test_nothing_is_known_before_a_publication() -> None:
    known = KnownPeers()
    assert not known.is_published
    with pytest.raises(PeerSetError, match="not been told its prefill peers"):
        known.check("10.0.0.5", 8998)


def test_only_published_addresses_pass_and_a_publication_replaces_the_set() -> None:
    known = KnownPeers().replaced(parse_peers_body({"peers": ["10.0.0.5:8998", "10.0.0.6:8998"]}))
    assert known.check("10.0.0.5", 8998) == "10.0.0.5:8998"
    with pytest.raises(PeerSetError, match=r"127\.0\.0\.1:9 is not a known prefill"):
        known.check("127.0.0.1", 9)
    with pytest.raises(PeerSetError):  # same host, another port
        known.check("10.0.0.5", 8999)
    known = known.replaced(parse_peers_body({"peers": ["10.0.0.6:8998"]}))
    with pytest.raises(PeerSetError):
        known.check("10.0.0.5", 8998)
    assert known.replaced(frozenset()).is_published


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {},
        {"peers": "10.0.0.5:8998"},
        {"peers": ["10.0.0.5"]},
        {"peers": [5]},
        {"peers": [], "extra": 1},
        {"peers": [f"10.0.{i // 250}.{i % 250}:1" for i in range(MAX_PEERS + 1)]},
    ],
)
def test_bad_publications_are_refused(body) -> None:
    with pytest.raises(PeerSetError):
        parse_peers_body(body)


def test_the_launcher_list_parses() -> None:
    assert parse_peers_env("127.0.0.1:1, 127.0.0.1:2,") == {"127.0.0.1:1", "127.0.0.1:2"}
