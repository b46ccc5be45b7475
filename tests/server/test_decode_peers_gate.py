"""A decode worker is not ready, and serves nothing, before it knows its prefill peers;
and a PD worker refuses up front a prompt no room could move."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pdcluster.runtime.pd.known_peers import KnownPeers
from pdcluster.runtime.pd.messages import MAX_PAGES_PER_ROOM
from pdcluster.runtime.pd_worker.backends import DecodeBackend, PrefillBackend
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


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_prompt_longer_than_one_room_can_move_is_refused_with_a_400(
    role: str, page_size: int
) -> None:
    """More pages than a TransferMeta names: refused before any room exists,
    with the limit in tokens, never left to wait out a deadline."""
    checked: list[int] = []
    engine = SimpleNamespace(check_admissible=lambda n, m: checked.append(n))
    service: Any = SimpleNamespace(is_alive=True, is_stalled=False, engine=engine)
    agent: Any = SimpleNamespace(ctx=SimpleNamespace(page_size=page_size))
    info = {"dp_size": 1, "dp_rank": 0, "token": "t"}
    coordinator: Any = SimpleNamespace(is_full=lambda: False)
    kind = PrefillBackend if role == "prefill" else DecodeBackend
    backend = kind(service, agent, coordinator, info)
    backend.known = KnownPeers(frozenset({"127.0.0.1:8998"}))
    most = MAX_PAGES_PER_ROOM * page_size
    fields = BootstrapFields(bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=4)
    sampling = {"max_tokens": 1}
    with pytest.raises(BadRequest) as err:
        backend.check(PreparedRequest("rid", [1] * (most + 1), sampling, [], fields))
    assert err.value.status == 400
    assert f"at most {MAX_PAGES_PER_ROOM} pages ({most} tokens)" in str(err.value)
    assert checked == []  # refused before the engine was asked
    backend.check(PreparedRequest("rid", [1] * most, sampling, [], fields))
    assert checked == [most]
