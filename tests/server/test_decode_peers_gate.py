"""A decode worker is not ready, and serves nothing, before it knows its prefill peers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pdcluster.runtime.pd.known_peers import KnownPeers
from pdcluster.runtime.pd_worker.backends import DecodeBackend
from pdcluster.runtime.serving.request import BadRequest, BootstrapFields, PreparedRequest


def backend() -> DecodeBackend:
    service: Any = SimpleNamespace(is_alive=True, is_stalled=False)
    return DecodeBackend(service, None, None, {"dp_size": 1, "dp_rank": 0, "token": "t"})


def request(host: str, port: int) -> PreparedRequest:
    b = BootstrapFields(bootstrap_host=host, bootstrap_port=port, bootstrap_room=5)
    return PreparedRequest("rid", [1, 2], {}, [], b)


def test_unpublished_decode_is_not_ready_and_refuses_with_503() -> None:
    d = backend()
    assert not d.is_healthy()
    with pytest.raises(BadRequest) as err:
        d.check(request("127.0.0.1", 8998))
    assert err.value.status == 503


def test_an_unknown_bootstrap_server_is_refused_before_anything_else() -> None:
    d = backend()
    d.known = KnownPeers(frozenset({"10.0.0.5:8998"}))
    assert d.is_healthy()
    with pytest.raises(BadRequest) as err:
        d.check(request("10.0.0.6", 8998))
    assert err.value.status == 400 and "10.0.0.6:8998 is not a known prefill" in str(err.value)
