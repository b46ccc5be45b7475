"""Garbage and oversized input on every socket (scenario 12).

Every listening socket of a PD cluster gets malformed, hostile and oversized
input: the ZMQ endpoints of a prefill and a decode rank (wrong part counts,
unknown kinds, forged senders, bad magic, unknown versions, invalid fields,
frames over the limits, group commands from outside the group, KV frames
with bad headers), the workers' HTTP API, the admin API, the bootstrap
server and the router. Each is refused with a clear status or dropped and
counted; no process dies, no state changes, and a normal request afterwards
still equals its colocated output.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import msgspec
import zmq

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd_worker.group import GroupFailPeer, encode_group
from pdcluster.runtime.transfer.frames import encode_header
from pdcluster.runtime.transfer.identity import identity_key, prove
from tests.faults.harness import (
    TOKEN,
    FaultCluster,
    PDClient,
    make_prompts,
    parse_counter,
    wait_until,
)
from tests.faults.rogue import fetch_instance
from tests.pd_integration.reference import colocated_outputs
from tests.transfer.transfer_helpers import frame_header

FAKE_SENDER = b"tcp://127.0.0.1:9"
ROUTING_ID = b"\x01garbage"
# An insider's proof (it holds the token): what it sends gets past the
# endpoint, so the rank's own checks are what these frames probe.
PROOF = prove(identity_key(TOKEN), ROUTING_ID, FAKE_SENDER)
MiB = 1 << 20


def control(data: bytes, sender: bytes = FAKE_SENDER) -> list[bytes]:
    return [b"C", sender, PROOF, data]


def kv(header: bytes, payload: bytes) -> list[bytes]:
    return [b"K", FAKE_SENDER, PROOF, header, payload]


def hostile_frames(room: int) -> list[tuple[str, list[bytes]]]:
    """(expected counter, multipart message) pairs for one rank's endpoint."""
    status = msgspec.msgpack.encode(
        {"type": "status", "room": -1, "generation": 1, "rank": {}, "state": 4}
    )
    header = frame_header(room, 1, layers=(0,), tokens=(0, 1), heads=(0, 1), head_dim=32)
    forged = pdmsg.Status(
        room=room, generation=1, rank=RankCoord(), state=KVPoll.Success, first_token=3
    )
    return [
        ("endpoint:bad_frame_count", [b"C"]),
        ("endpoint:bad_frame_count", [b"C", b"a", b"b"]),
        ("endpoint:bad_frame_count", [b"C", FAKE_SENDER, PROOF, b"b", b"c"]),
        ("endpoint:unknown_kind", [b"X", b"a", b"b"]),
        ("endpoint:bad_sender", [b"C", b"not an address", PROOF, pdmsg.HEADER + b"x"]),
        ("endpoint:bad_sender", [b"C", b"tcp://" + b"9" * 300, PROOF, pdmsg.HEADER + b"x"]),
        ("endpoint:bad_proof", [b"C", FAKE_SENDER, bytes(16), pdmsg.HEADER + b"x"]),
        ("endpoint:bad_proof", control(pdmsg.HEADER + b"x", sender=b"tcp://127.0.0.1:8")),
        ("endpoint:oversized", control(pdmsg.HEADER + os.urandom(MiB + 1))),
        ("reject:bad_magic", control(os.urandom(64))),
        ("reject:truncated", control(b"PDC")),
        ("reject:unsupported_version", control(b"PDC\x09" + b"\x80")),
        ("reject:malformed", control(pdmsg.HEADER + b"\xc1\xc1")),
        ("reject:unknown_type", control(pdmsg.HEADER + msgspec.msgpack.encode({"type": "x"}))),
        ("reject:invalid_field", control(pdmsg.HEADER + status)),
        ("group_reject:not_in_group", control(encode_group(GroupFailPeer("127.0.0.1", "x")))),
        ("group_reject:not_in_group", control(b"PDG\x01" + os.urandom(32))),
        ("dropped:", control(pdmsg.encode(forged))),
        ("kv:", kv(os.urandom(40), b"payload")),
        ("kv:", kv(encode_header(header), bytes(1 * 2 * 1 * 1 * 32 * 4))),
    ]


def counters(cluster: FaultCluster, name: str) -> dict[str, int]:
    info = cluster.info(name)
    out = dict(info["pd_stats"])
    out.update({f"kv:{k}": v for k, v in info.get("kv_receive_stats", {}).items()})
    return out


def grew(before: dict[str, int], after: dict[str, int], prefix: str) -> bool:
    return sum(v for k, v in after.items() if k.startswith(prefix)) > sum(
        v for k, v in before.items() if k.startswith(prefix)
    )


def test_garbage_on_the_zmq_endpoints_is_dropped_and_counted(
    pd: FaultCluster, client: PDClient
) -> None:
    prompt = make_prompts(1, seed=111, lo=50, hi=50)[0]
    expected = colocated_outputs(pd.manifest, [prompt], 4)[0]
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        for name in ("decode-0", "prefill-0"):
            endpoint = pd.info(name)["endpoint"]
            # One connection for every hostile frame: a fresh DEALER per frame
            # reusing ROUTING_ID races the ROUTER's disconnect of the previous
            # one, and libzmq silently ignores a newcomer with a routing id
            # still in use, so its frame never reaches the endpoint.
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, ROUTING_ID)
            sock.connect(endpoint)
            for expect, parts in hostile_frames(room=12345):
                if name == "prefill-0" and expect.startswith(("kv:", "dropped:")):
                    continue  # a prefill rank receives no KV and no Status
                before = counters(pd, name)
                sock.send_multipart(parts)
                wait_until(
                    lambda n=name, e=expect, b=before: grew(b, counters(pd, n), e),
                    5,
                    0.02,
                    f"{name} to count {expect}",
                )
            sock.close(0)
            # Over the socket's hard cap: libzmq drops the connection before reading it.
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send_multipart(kv(b"h", bytes(65 * MiB)))
            time.sleep(0.5)
            sock.close(0)
    finally:
        # destroy, not term: after a failed wait a socket is still open, and
        # term would block on it until the test's timeout.
        ctx.destroy(linger=0)
    for name in pd.workers():
        assert pd.launcher.procs[name].poll() is None, f"{name} died"
    # Counted for Prometheus too, by bounded reason.
    wanted = ("reject:bad_magic", "endpoint:bad_frame_count", "group_reject:not_in_group")
    for name in ("decode-0", "prefill-0"):

        def exported(n: str = name) -> dict[str, float] | None:
            text = pd.http.get(pd.url(n) + "/metrics").text
            counts = parse_counter(text, "pdcluster_protocol_rejects", "reason")
            return counts if all(counts.get(k, 0) >= 1 for k in wanted) else None

        wait_until(exported, 5, 0.1, f"{name} rejects in /metrics")
    pd.assert_clean()
    res = client.pair(pd, "prefill-0", "decode-0", prompt)
    assert res.decode.ok and res.decode.output_ids == expected


def test_garbage_on_the_http_apis_is_refused_and_changes_nothing(
    pd: FaultCluster, client: PDClient
) -> None:
    token = {"Authorization": f"Bearer {pd.token}"}
    big = b"x" * (9 * MiB)
    host, port = pd.bootstrap("prefill-0")
    boot = f"http://{host}:{port}"
    instance = fetch_instance((host, port), pd.token)
    h = httpx.Client(timeout=10)
    checks: list[tuple[str, httpx.Response, set[int]]] = []
    for name in ("prefill-0", "decode-0"):
        url = pd.url(name)
        checks += [
            (
                f"{name} /generate not json",
                h.post(url + "/generate", content=b"{nope", headers=token),
                {422},
            ),
            (
                f"{name} /generate list",
                h.post(url + "/generate", json=[1, 2], headers=token),
                {422},
            ),
            (
                f"{name} /generate huge",
                h.post(url + "/generate", content=big, headers=token),
                {413},
            ),
            (
                f"{name} /generate bad ids",
                h.post(
                    url + "/generate", json={"input_ids": [-1], "bootstrap_room": 1}, headers=token
                ),
                {400, 422},
            ),
            (
                f"{name} /generate no bootstrap",
                h.post(url + "/generate", json={"input_ids": [1, 2]}, headers=token),
                {400},
            ),
            (
                f"{name} /abort_request",
                h.post(url + "/abort_request", content=b"\x00", headers=token),
                {422},
            ),
            (f"{name} admin no token", h.get(url + "/admin/rooms"), {401}),
            (f"{name} /generate no token", h.post(url + "/generate", json=[1]), {401}),
            (f"{name} abort_all no token", h.post(url + "/abort_request", json={}), {401}),
            (f"{name} server_info no token", h.get(url + "/get_server_info"), {401}),
            (
                f"{name} admin wrong token",
                h.post(
                    url + "/admin/fail_peer",
                    json={"peer": "127.0.0.1", "reason": "x"},
                    headers={"Authorization": "Bearer wrong"},
                ),
                {403},
            ),
            (
                f"{name} admin bad body",
                h.post(url + "/admin/fail_peer", content=b"[]", headers=token),
                {422},
            ),
            (
                f"{name} admin huge peer",
                h.post(url + "/admin/fail_peer", json={"peer": "p" * 5000}, headers=token),
                {413, 422},
            ),
            (
                f"{name} admin huge body",
                h.post(url + "/admin/fail_peer", content=big, headers=token),
                {413},
            ),
        ]
    checks += [
        ("bootstrap no token", h.put(boot + "/route", json={}), {401}),
        ("bootstrap garbage", h.put(boot + "/route", content=b"{", headers=token), {400}),
        ("bootstrap huge", h.put(boot + "/route", content=big, headers=token), {413}),
        (
            "bootstrap bad params",
            h.get(boot + "/route", params={"dp": "x"}, headers=token),
            {400},
        ),
        (
            "bootstrap unknown rank",
            h.get(boot + "/route", params={"dp": 0, "cp": 0, "tp": 5, "pp": 0}, headers=token),
            {400, 404},
        ),
        (
            "bootstrap bad dp query",
            h.post(boot + "/query_dp_ranks", json={"rooms": "x"}, headers=token),
            {400},
        ),
        ("router not json", h.post(pd.endpoint + "/generate", content=b"{"), {400, 422}),
        ("router huge", h.post(pd.endpoint + "/v1/completions", content=big), {413}),
        ("router bad field", h.post(pd.endpoint + "/v1/completions", json={"prompt": 3}), {400}),
    ]
    for what, resp, allowed in checks:
        assert resp.status_code in allowed, f"{what}: {resp.status_code} {resp.text[:200]}"
        if resp.status_code >= 400:
            assert resp.text, f"{what}: empty error body"
    h.close()
    # Nothing changed: same registered ranks, no rooms, no pages taken, all alive.
    assert fetch_instance((host, port), pd.token) == instance
    for name in pd.workers():
        assert pd.launcher.procs[name].poll() is None, f"{name} died"
    pd.assert_clean()
    prompt = make_prompts(1, seed=112, lo=30, hi=30)[0]
    expected = colocated_outputs(pd.manifest, [prompt], 4)[0]
    res = client.pair(pd, "prefill-0", "decode-0", prompt)
    assert res.decode.ok and res.decode.output_ids == expected
