"""Fuzzing the control messages and the worker HTTP API (hypothesis).

Every ZMQ control message type, as random bytes and as mutated valid
frames, is decoded (pure: only `ProtocolError` may come out) and then sent
to a live prefill and decode rank; random and mutated JSON bodies go to
every worker HTTP endpoint with the token (past auth, into validation).
Meanwhile one request is in flight: afterwards every process still serves,
that request's output equals its colocated output, and no room is left
behind.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from tests.faults.harness import FaultCluster, PDClient, make_prompts, wait_until
from tests.pd_integration.reference import colocated_outputs

EP = "tcp://127.0.0.1:9"


def valid_messages(compat: CompatInfo) -> list[pdmsg.Message]:
    r = RankCoord()
    return [
        pdmsg.KVLayoutRegister("t", r, EP, compat, 8, 0, 1, 0, 1),
        pdmsg.LayoutAck(r, EP, False, "no"),
        pdmsg.TransferMeta(7, 1, "rid-x", r, EP, [1, 2], 1),
        pdmsg.Bootstrap(7, 1, "rid-x", r, EP, 1),
        pdmsg.Abort(7, 1, "rid-x", "fuzz", r, EP),
        pdmsg.Ready(7, 1, r),
        pdmsg.Status(7, 1, r, KVPoll.Failed, "fuzz"),
        pdmsg.AbortAck(7, r, 1),
    ]


def mutate(frame: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    data = bytearray(frame)
    for pos, byte in edits:
        data[pos % len(data)] = byte
    return bytes(data[:cut] if cut is not None else data)


EDITS = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4)
CUTS = st.none() | st.integers(0, 256)
FRAMES = st.binary(max_size=256) | st.builds(lambda b: pdmsg.HEADER + b, st.binary(max_size=128))

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=8,
)
FIELDS = [
    "input_ids", "text", "rid", "stream", "sampling_params", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "prompt", "messages", "max_tokens", "abort_all",
    "stop_token_ids", "stop", "temperature",
]  # fmt: skip
BODIES = JSON | st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6)
POSTS = ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]
GETS = ["/health", "/get_server_info", "/server_info", "/model_info", "/v1/models", "/metrics"]


def test_fuzzed_frames_and_bodies_change_nothing(
    pd: FaultCluster, client: PDClient, compat: CompatInfo
) -> None:
    base = [pdmsg.encode(m) for m in valid_messages(compat)]
    ctx: zmq.Context[Any] = zmq.Context()
    socks = []
    for name in ("prefill-0", "decode-0"):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.connect(pd.info(name)["endpoint"])
        socks.append(s)
    auth = {"Authorization": f"Bearer {pd.token}"}
    http = httpx.Client(timeout=10, headers=auth)
    prompt = make_prompts(1, seed=4242, lo=40, hi=40)[0]
    expected = colocated_outputs(pd.manifest, [prompt], 48)[0]
    rooms = {n: pd.info(n)["num_rooms"] for n in pd.workers()}
    live = client.pool.submit(
        client.generate,
        pd.url("prefill-0"),
        pd.url("decode-0"),
        pd.bootstrap("prefill-0"),
        prompt,
        48,
    )
    sent = {"frames": 0, "bodies": 0}
    statuses: set[int] = set()

    @settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
    @given(which=st.integers(0, len(base) - 1), edits=EDITS, cut=CUTS, raw=FRAMES)
    def frames(which: int, edits: list[tuple[int, int]], cut: int | None, raw: bytes) -> None:
        for data in (mutate(base[which], edits, cut), raw):
            try:
                pdmsg.decode(data)
            except pdmsg.ProtocolError:
                pass
            for s in socks:
                s.send_multipart([b"C", EP.encode(), data])
                sent["frames"] += 1

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        worker=st.sampled_from(["prefill-0", "decode-0"]),
        path=st.sampled_from(POSTS),
        body=BODIES,
        mangle=st.booleans(),
    )
    def bodies(worker: str, path: str, body: Any, mangle: bool) -> None:
        if isinstance(body, dict) and path == "/abort_request":
            body.pop("abort_all", None)  # aborting everything is allowed with the token
        raw = json.dumps(body).encode()
        if mangle:
            raw = raw[: len(raw) // 2]
        resp = http.post(pd.url(worker) + path, content=raw, timeout=10)
        statuses.add(resp.status_code)
        assert resp.status_code < 500 or resp.status_code in (502, 503), resp.text
        sent["bodies"] += 1

    try:
        frames()
        bodies()
        for worker in ("prefill-0", "decode-0"):
            for path in GETS:
                assert http.get(pd.url(worker) + path).status_code == 200
    finally:
        http.close()
        for s in socks:
            s.close(0)
        ctx.term()
    res = live.result(60)
    assert res.decode.ok and res.decode.output_ids == expected
    for name in pd.workers():
        assert pd.launcher.procs[name].poll() is None, f"{name} died"
    wait_until(
        lambda: all(pd.info(n)["num_rooms"] <= rooms[n] for n in pd.workers()), 15, 0.1, "rooms"
    )
    again = client.pair(pd, "prefill-0", "decode-0", prompt, 48)
    assert again.decode.ok and again.decode.output_ids == expected
    assert sent["frames"] >= 4000 and sent["bodies"] >= 300, sent
