"""The front of a dp > 1 instance relays another dp group's requests over one
kept-alive connection pool, with the cluster token, and passes the stream on."""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace
from typing import Any

import uvicorn

from pdcluster.runtime.pd_worker.backends import DecodeBackend
from pdcluster.runtime.server.api_models import BootstrapFields
from pdcluster.runtime.server.worker_app import PreparedRequest

SAMPLING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_tokens": 2,
    "seed": None,
    "ignore_eos": True,
    "stop_token_ids": [],
}


class GroupLeader:
    """Stands in for dp group 1's leader: records who called, streams two tokens."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any], str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/generate":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode()
            self.calls.append((tuple(scope["client"]), json.loads(body), auth))
        events = [
            {"text": "a", "output_ids": [7], "meta_info": {"finish_reason": None}},
            {
                "text": "ab",
                "output_ids": [7, 8],
                "meta_info": {"finish_reason": {"type": "length"}},
            },
        ]
        payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload.encode()})


async def test_relayed_requests_share_one_connection_and_carry_the_token() -> None:
    leader = GroupLeader()
    sock = socket.socket(proto=socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(leader, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    service: Any = SimpleNamespace(is_alive=True, is_stalled=False)
    info = {"dp_size": 2, "dp_rank": 0, "dp_urls": (f"http://127.0.0.1:{port}",), "token": "t"}
    front = DecodeBackend(service, None, None, info)
    try:
        for i in range(3):
            b = BootstrapFields(bootstrap_host="127.0.0.1", bootstrap_port=9, bootstrap_room=3)
            req = PreparedRequest(f"rid-{i}", [1, 2, 3], dict(SAMPLING), [], b)
            events = [e async for e in front.events(req)]
            assert [e.token_ids for e in events] == [[7], [8]]
            assert events[-1].finished and events[-1].finish_reason == "length"
        clients = {client for client, _, _ in leader.calls}
        assert len(leader.calls) == 3 and len(clients) == 1, leader.calls
        assert {auth for _, _, auth in leader.calls} == {"Bearer t"}
        assert [body["rid"] for _, body, _ in leader.calls] == ["rid-0", "rid-1", "rid-2"]
        assert leader.calls[0][1]["bootstrap_room"] == 3
    finally:
        if front._relay_client is not None:
            await front._relay_client.aclose()
        server.should_exit = True
        await serving


async def test_a_relayed_request_keeps_its_penalties_and_logprobs() -> None:
    leader = GroupLeader()
    sock = socket.socket(proto=socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(leader, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    service: Any = SimpleNamespace(is_alive=True, is_stalled=False)
    info = {"dp_size": 2, "dp_rank": 0, "dp_urls": (f"http://127.0.0.1:{port}",), "token": "t"}
    front = DecodeBackend(service, None, None, info)
    sampling = {**SAMPLING, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "logprobs": 2}
    try:
        b = BootstrapFields(bootstrap_host="127.0.0.1", bootstrap_port=9, bootstrap_room=3)
        req = PreparedRequest("rid-lp", [1, 2, 3], sampling, [], b)
        _ = [e async for e in front.events(req)]
        (_, body, _) = leader.calls[0]
        sent = body["sampling_params"]
        assert (sent["frequency_penalty"], sent["repetition_penalty"]) == (0.5, 1.2)
        assert (body["return_logprob"], body["top_logprobs_num"]) == (True, 2)
    finally:
        if front._relay_client is not None:
            await front._relay_client.aclose()
        server.should_exit = True
        await serving


def test_relayed_logprobs_read_back_what_the_worker_wrote() -> None:
    from pdcluster.runtime.engine.sampling import TokenLogprobs
    from pdcluster.runtime.pd_worker.backends import relayed_logprobs
    from pdcluster.runtime.server.responses import generate_logprobs

    ids = [7, 8, 9]
    lps = [
        TokenLogprobs(-0.5, ((7, -0.5), (3, -1.0))),
        None,
        TokenLogprobs(-2.0, ((1, -0.1), (9, -2.0))),
    ]
    meta = json.loads(json.dumps(generate_logprobs(ids, lps, 2, None)))
    assert relayed_logprobs(meta, 0, 3) == lps
    assert relayed_logprobs(meta, 1, 3) == lps[1:]
    assert relayed_logprobs({}, 0, 3) == []
