"""Attacks on a worker's HTTP API, on real processes: each is refused and changes nothing.

- Token theft: a `/generate` body naming any `bootstrap_host:port` used to
  make decode call `GET /route` there with the cluster token. Decode now
  contacts only the prefill bootstrap servers it was told about; any other
  address gets 400 naming it, and that address sees no connection at all.
- The data plane without the token: `abort_all`, `/generate` and the server
  info are refused (401) and no room changes.
- `/health` and `/metrics` stay open and name no peer address.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.harness import FaultCluster, PDClient, gen_body, make_prompts
from tests.pd_integration.reference import colocated_outputs


class Listener:
    """A loopback TCP listener that records every connection and the bytes sent on it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port: int = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(0.5)
            data = b""
            try:
                data = conn.recv(65536)
            except OSError:
                pass
            self.received.append(data)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    lis = Listener()
    yield lis
    lis.close()


def test_decode_never_contacts_an_unknown_bootstrap_server(
    pd: FaultCluster, client: PDClient, listener: Listener
) -> None:
    auth = {"Authorization": f"Bearer {pd.token}"}
    body = gen_body([1, 2, 3], 4, bootstrap=("127.0.0.1", listener.port))
    before = pd.info("decode-0")["num_rooms"]
    for stream in (False, True):
        resp = httpx.post(
            pd.url("decode-0") + "/generate", json={**body, "stream": stream}, headers=auth
        )
        assert resp.status_code == 400, resp.text
        assert f"127.0.0.1:{listener.port} is not a known prefill" in resp.text
    # A hostname spelling of the same listener is no more known.
    resp = httpx.post(
        pd.url("decode-0") + "/generate",
        json={**body, "bootstrap_host": "localhost"},
        headers=auth,
    )
    assert resp.status_code == 400
    time.sleep(1.0)  # what a fetch off the scheduler would have needed
    assert listener.received == [], "decode contacted an address taken from a request body"
    assert pd.info("decode-0")["num_rooms"] == before
    # A known prefill still works, output unchanged.
    prompt = make_prompts(1, seed=7, lo=20, hi=20)[0]
    res = client.pair(pd, "prefill-0", "decode-0", prompt)
    assert res.decode.ok, res.decode.body
    assert res.decode.output_ids == colocated_outputs(pd.manifest, [prompt], 4)[0]


def test_a_publication_replaces_the_prefills_decode_may_contact(
    pd: FaultCluster, client: PDClient
) -> None:
    url = pd.url("decode-0") + "/admin/prefill_peers"
    assert httpx.put(url, json={"peers": []}).status_code == 401
    assert (
        httpx.put(url, json={"peers": []}, headers={"Authorization": "Bearer x"}).status_code == 403
    )
    bad = pd.admin("decode-0", "PUT", "/admin/prefill_peers", json={"peers": ["nope"]})
    assert bad.status_code == 400 and "not host:port" in bad.text
    prompt = make_prompts(1, seed=8, lo=20, hi=20)[0]
    try:
        pd.publish_prefill_peers([pd.peer("prefill-0")])
        refused = client.pair(pd, "prefill-1", "decode-0", prompt)
        assert refused.decode.status == 400
        assert f"{pd.peer('prefill-1')} is not a known prefill" in refused.decode.error
    finally:
        pd.publish_prefill_peers()
    again = client.pair(pd, "prefill-1", "decode-0", prompt)
    assert again.decode.ok, again.decode.body


def test_the_data_plane_without_the_token_changes_nothing(
    pd: FaultCluster, client: PDClient
) -> None:
    prompt = make_prompts(1, seed=9, lo=20, hi=20)[0]
    body = gen_body(prompt, 4, bootstrap=pd.bootstrap("prefill-0"))
    for name in ("prefill-0", "decode-0"):
        url = pd.url(name)
        rooms = pd.info(name)["num_rooms"]
        assert httpx.post(url + "/generate", json=body).status_code == 401
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.post(url + "/abort_request", json={"abort_all": True}).status_code == 401
        assert httpx.get(url + "/get_server_info").status_code == 401
        assert httpx.get(url + "/server_info").status_code == 401
        assert pd.info(name)["num_rooms"] == rooms
    # A request in flight survives an unauthenticated abort_all on both legs.
    long = client.pool.submit(
        client.generate,
        pd.url("prefill-0"),
        pd.url("decode-0"),
        pd.bootstrap("prefill-0"),
        prompt,
        64,
    )
    time.sleep(0.2)
    for name in ("prefill-0", "decode-0"):
        httpx.post(pd.url(name) + "/abort_request", json={"abort_all": True})
    res = long.result(30)
    assert res.decode.ok and len(res.decode.output_ids) == 64


def test_health_and_metrics_name_no_peer(pd: FaultCluster) -> None:
    secrets = {pd.peer(p) for p in pd.workers("prefill")}
    for name in pd.workers():
        info = pd.info(name)
        if info.get("endpoint"):
            secrets.add(str(info["endpoint"]))
    assert secrets
    for name in pd.workers():
        for path in ("/health", "/metrics"):
            resp = httpx.get(pd.url(name) + path)
            assert resp.status_code == 200, (name, path)
            for secret in secrets:
                assert secret not in resp.text, f"{name}{path} names {secret}"
