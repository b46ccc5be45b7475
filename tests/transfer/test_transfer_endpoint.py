"""The ZMQ endpoint: real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from pdcluster.runtime.ports import free_port
from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig, check_address
from pdcluster.runtime.transfer.identity import identity_key, prove
from tests.transfer.transfer_helpers import Inbox, wait_until

RAW_ID = b"\x01raw-dealer"
RAW_SENDER = b"tcp://127.0.0.1:1"
RAW_PROOF = prove(identity_key(""), RAW_ID, RAW_SENDER)


@pytest.fixture
def pair() -> Iterator[tuple[Endpoint, Endpoint, Inbox]]:
    inbox = Inbox()
    server = Endpoint(EndpointConfig(max_control_bytes=1024, max_kv_bytes=4096), on_control=inbox)
    client = Endpoint()
    server.start()
    client.start()
    yield server, client, inbox
    client.close()
    server.close()


@pytest.fixture
def raw_dealer(pair: tuple[Endpoint, Endpoint, Inbox]) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, RAW_ID)
    sock.connect(pair[0].address)
    yield sock
    sock.close(0)
    ctx.term()


def dead_address() -> str:
    """An address where nothing listens."""
    return f"tcp://127.0.0.1:{free_port()}"


def test_control_messages_arrive_in_order_with_their_sender(pair):
    server, client, inbox = pair
    for i in range(200):
        client.send_control(server.address, b"msg-%d" % i)
    inbox.wait_for(b"msg-199")
    assert [d for _, d in inbox.messages] == [b"msg-%d" % i for i in range(200)]
    assert {s for s, _ in inbox.messages} == {client.address}


def test_a_reply_to_the_sender_address_comes_back(pair):
    server, client, inbox = pair
    back = Inbox()
    client.on_control = back
    server.on_control = lambda sender, data: server.send_control(sender, b"re:" + data)
    client.send_control(server.address, b"ping")
    assert back.wait_for(b"re:ping") == server.address


def test_kv_payload_is_received_intact_and_on_sent_fires(pair):
    server, client, _ = pair
    got: list[tuple[bytes, bytes]] = []
    server.on_kv = lambda header, payload: got.append((header, bytes(payload)))
    payload = np.arange(1024, dtype=np.uint8) % 251
    sent = threading.Event()
    errors: list[str | None] = []
    client.send_kv(server.address, b"hdr", payload, lambda err: (errors.append(err), sent.set()))
    assert sent.wait(5)
    wait_until(lambda: bool(got), what="kv frame")
    assert got == [(b"hdr", payload.tobytes())]
    assert errors == [None]


@pytest.mark.parametrize("size", [1024, 64 * 1024])
def test_a_small_payload_is_copied_its_buffer_free_once_on_sent_fired(size):
    server = Endpoint()
    client = Endpoint(EndpointConfig(copy_below=128 * 1024))
    got: list[bytes] = []
    server.on_kv = lambda header, payload: got.append(bytes(payload))
    server.start()
    client.start()
    try:
        payload = np.arange(size, dtype=np.uint8) % 251
        want = payload.tobytes()
        sent = threading.Event()
        # Overwrite the buffer inside on_sent: the copy libzmq holds must not change.
        client.send_kv(server.address, b"hdr", payload, lambda err: (payload.fill(7), sent.set()))
        assert sent.wait(5)
        wait_until(lambda: bool(got), what="kv frame")
        assert got == [want]
        assert client.stats.get("kv_copied") == 1
    finally:
        client.close()
        server.close()


def test_a_payload_at_or_over_the_copy_size_is_tracked_not_copied():
    server = Endpoint()
    client = Endpoint(EndpointConfig(copy_below=4096))
    got: list[bytes] = []
    server.on_kv = lambda header, payload: got.append(bytes(payload))
    server.start()
    client.start()
    try:
        sent = threading.Event()
        payload = np.ones(4096, dtype=np.uint8)
        client.send_kv(server.address, b"hdr", payload, lambda err: sent.set())
        assert sent.wait(5)
        wait_until(lambda: bool(got), what="kv frame")
        assert got == [payload.tobytes()]
        assert "kv_copied" not in client.stats
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ([b"C"], "bad_frame_count"),
        ([b"K", RAW_SENDER, RAW_PROOF, b"hdr"], "bad_frame_count"),
        ([b"C", RAW_SENDER, RAW_PROOF, b"x", b"extra"], "bad_frame_count"),
        ([b"Z", RAW_SENDER, RAW_PROOF, b"a", b"b"], "unknown_kind"),
        ([b"C", RAW_SENDER, RAW_PROOF, b"x" * 2048], "oversized"),
        ([b"K", RAW_SENDER, RAW_PROOF, b"hdr", b"x" * 5000], "oversized"),
        ([b"C", b"not-an-address", RAW_PROOF, b"x"], "bad_sender"),
        ([b"C", b"\xff\xfe", RAW_PROOF, b"x"], "bad_sender"),
        ([b"C", b"tcp://" + b"h" * 300 + b":1", RAW_PROOF, b"x"], "bad_sender"),
        ([b"C", RAW_SENDER, b"\0" * 16, b"x"], "bad_proof"),
        ([b"C", RAW_SENDER, RAW_PROOF[:8], b"x"], "bad_proof"),
        ([b"C", b"tcp://127.0.0.1:2", RAW_PROOF, b"x"], "bad_proof"),  # another's address
    ],
)
def test_malformed_messages_are_dropped_counted_and_serving_continues(
    pair, raw_dealer, parts, reason
):
    server, client, inbox = pair
    raw_dealer.send_multipart(parts)
    wait_until(lambda: server.stats.get(reason) == 1, what=f"{reason} counted")
    client.send_control(server.address, b"still-alive")
    inbox.wait_for(b"still-alive")
    assert inbox.messages == [(client.address, b"still-alive")]


def test_a_frame_over_the_socket_cap_disconnects_only_that_peer(pair, raw_dealer):
    server, client, inbox = pair
    frames: list[bytes] = []
    server.on_kv = lambda header, payload: frames.append(header)
    raw_dealer.send_multipart([b"K", RAW_SENDER, RAW_PROOF, b"hdr", b"x" * (200 * 1024)])
    client.send_control(server.address, b"after")
    inbox.wait_for(b"after")
    time.sleep(0.05)
    assert frames == []  # dropped by libzmq before it was allocated, never delivered


def test_garbage_bytes_on_the_tcp_port_do_not_stop_the_endpoint(pair):
    server, client, inbox = pair
    host, port = server.address.removeprefix("tcp://").rsplit(":", 1)
    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 40):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(junk)
    client.send_control(server.address, b"ok")
    inbox.wait_for(b"ok")


def test_callback_errors_are_counted_and_do_not_kill_the_thread(pair):
    server, client, inbox = pair

    def boom(sender: str, data: bytes) -> None:
        if data == b"bad":
            raise RuntimeError("handler bug")
        inbox(sender, data)

    server.on_control = boom
    client.send_control(server.address, b"bad")
    client.send_control(server.address, b"good")
    inbox.wait_for(b"good")
    assert server.stats["callback_error"] == 1


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:5", "tcp://127.0.0.1", "tcp://:5", "tcp://h:0", "tcp://h:99999", "tcp://h:x", 5],
)
def test_bad_peer_addresses_are_refused(pair, address):
    _, client, _ = pair
    with pytest.raises(ValueError, match="peer"):
        check_address(address)
    with pytest.raises(ValueError):
        client.send_control(address, b"x")


def test_oversized_sends_are_refused_before_queueing(pair):
    server, client, inbox = pair
    with pytest.raises(ValueError, match="control message"):
        client.send_control(server.address, b"x" * (client.config.max_control_bytes + 1))
    with pytest.raises(ValueError, match="KV payload"):
        client.send_kv(server.address, b"h", bytes(client.config.max_kv_bytes + 1))
    client.send_control(server.address, b"fine")
    inbox.wait_for(b"fine")


def test_dropping_a_dead_peer_fails_its_pending_sends():
    client = Endpoint()
    client.start()
    dead = dead_address()
    results: list[str | None] = []
    done = threading.Event()

    def on_sent(err: str | None) -> None:
        results.append(err)
        if len(results) == 3:
            done.set()

    for _ in range(3):
        client.send_kv(dead, b"h", np.zeros(100_000, dtype=np.uint8), on_sent)
    time.sleep(0.05)
    assert results == []  # nobody listens: libzmq still holds them
    client.drop_peer(dead)
    assert done.wait(5)
    assert results == ["peer_dropped"] * 3
    client.close()


def test_close_with_sends_queued_to_a_dead_peer_returns_promptly():
    client = Endpoint()
    client.start()
    results: list[str | None] = []
    for _ in range(20):
        client.send_kv(dead_address(), b"h", np.zeros(200_000, dtype=np.uint8), results.append)
    started = time.monotonic()
    client.close(timeout=5)
    assert time.monotonic() - started < 3
    assert results == ["endpoint_closed"] * 20
    with pytest.raises(RuntimeError, match="clos"):
        client.send_control(dead_address(), b"x")


def test_close_is_idempotent_and_safe_before_start():
    never_started = Endpoint()
    never_started.close()
    never_started.close()
    with pytest.raises(RuntimeError):
        never_started.start()
    ep = Endpoint()
    ep.start()
    ep.close()
    ep.close()
    assert not ep.is_running


def test_close_while_a_peer_floods_us_returns_promptly():
    server = Endpoint()
    server.start()
    client = Endpoint()
    client.start()
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                client.send_control(server.address, b"x" * 1000)
            except RuntimeError:
                return
            time.sleep(0)

    thread = threading.Thread(target=flood)
    thread.start()
    time.sleep(0.2)
    started = time.monotonic()
    server.close(timeout=5)
    assert time.monotonic() - started < 3
    stop.set()
    thread.join(5)
    client.close(timeout=5)


def test_a_blocking_callback_makes_close_raise_instead_of_hanging(pair):
    server, client, inbox = pair
    release = threading.Event()
    server.on_control = lambda sender, data: release.wait(10)
    client.send_control(server.address, b"x")
    time.sleep(0.1)
    with pytest.raises(TimeoutError, match="callback"):
        server.close(timeout=0.2)
    release.set()
    server.close(timeout=5)


def test_port_in_use_is_a_clear_error(pair):
    server, _, _ = pair
    port = int(server.address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match="cannot bind"):
        Endpoint(EndpointConfig(port=port)).start()


def test_wildcard_bind_needs_an_advertised_host():
    with pytest.raises(ValueError, match="advertise_host"):
        Endpoint(EndpointConfig(host="0.0.0.0"))


def test_a_message_whose_peer_never_shows_up_times_out():
    client = Endpoint(EndpointConfig(send_timeout=0.2))
    client.start()
    results: list[str | None] = []
    started = time.monotonic()
    client.send_kv(dead_address(), b"h", np.zeros(100_000, dtype=np.uint8), results.append)
    wait_until(lambda: results == ["send_timeout"], timeout=5, what="send_timeout")
    assert time.monotonic() - started >= 0.2
    assert client.stats["send_timeout"] == 1
    client.close()


def test_discard_withdraws_only_the_tagged_messages_still_waiting():
    client = Endpoint()
    client.start()
    peer = dead_address()
    results: dict[int, list[str | None]] = {1: [], 2: []}
    for tag in (1, 2, 1):
        client.send_kv(peer, b"h", np.zeros(100_000, dtype=np.uint8), results[tag].append, tag)
    client.discard(1)
    wait_until(lambda: results[1] == ["discarded", "discarded"], what="discarded")
    time.sleep(0.05)
    assert results[2] == []  # still waiting for its peer
    client.close()
    assert results[2] == ["endpoint_closed"]


def test_an_address_libzmq_refuses_drops_that_send_not_the_endpoint(pair):
    # Passes the shape check but not libzmq (a fuzzed frame named it as its sender).
    server, client, inbox = pair
    errors: list[str | None] = []
    client.send_kv('tcp://"27.0.0.1:9', b"h", b"p", on_sent=errors.append)
    client.send_control('tcp://"27.0.0.1:9', b"lost")
    wait_until(lambda: errors, 5)
    assert errors[0] is not None and "cannot connect" in errors[0]
    client.send_control(server.address, b"still-serving")
    inbox.wait_for(b"still-serving")


def refused_then_genuine(
    sock: zmq.Socket,
    claimed: Endpoint,
    target: Endpoint,
    inbox: Inbox,
    proof: bytes,
    forged: bytes,
    genuine: bytes,
) -> None:
    """`sock` sends `target` the control frame `forged` in `claimed`'s name with `proof`:
    refused as bad_proof on `sock`'s own connection; `claimed`'s own `genuine` frame is
    then the only one `target` handed on."""
    sock.send_multipart([b"C", claimed.address.encode(), proof, forged])
    assert sock.poll(5000)
    assert sock.recv_multipart() == [b"R", b"bad_proof"]
    claimed.send_control(target.address, genuine)
    inbox.wait_for(genuine)
    assert inbox.messages == [(claimed.address, genuine)]


def test_a_frame_speaking_for_another_endpoint_is_refused_on_its_own_connection(pair, raw_dealer):
    # A peer without the key claims to be `client`: the frame never reaches the
    # handler, and the refusal goes back on the forger's connection only.
    server, client, inbox = pair
    forged = prove(identity_key(""), b"\x01someone-else", client.address.encode())
    refused_then_genuine(raw_dealer, client, server, inbox, forged, b"forged", b"genuine")
    assert server.stats.get("bad_proof") == 1


def test_a_frame_keyed_by_another_token_is_refused():
    inbox = Inbox()
    server = Endpoint(EndpointConfig(token="cluster-a"), on_control=inbox)
    stranger = Endpoint(EndpointConfig(token="cluster-b"))
    friend = Endpoint(EndpointConfig(token="cluster-a"))
    for e in (server, stranger, friend):
        e.start()
    try:
        stranger.send_control(server.address, b"from b")
        friend.send_control(server.address, b"from a")
        inbox.wait_for(b"from a")
        wait_until(lambda: server.stats.get("bad_proof") == 1, what="stranger refused")
        assert inbox.messages == [(friend.address, b"from a")]
    finally:
        for e in (friend, stranger, server):
            e.close()


def test_kv_frames_a_filter_refuses_are_dropped_and_counted(pair):
    server, client, _ = pair
    got: list[bytes] = []
    server.on_kv = lambda header, payload: got.append(header)
    server.accept_kv = lambda sender, header: header == b"ok"
    done = threading.Event()
    client.send_kv(server.address, b"no", b"x" * 8)
    client.send_kv(server.address, b"ok", b"x" * 8, lambda err: done.set())
    assert done.wait(5)
    wait_until(lambda: got == [b"ok"], what="accepted frame")
    assert server.stats.get("kv_wrong_source") == 1


def test_frames_marked_local_only_are_taken_only_over_loopback(pair, monkeypatch):
    import pdcluster.runtime.transfer.endpoint as endpoint_mod

    server, client, inbox = pair
    server.local_only = lambda data: data.startswith(b"group")
    client.send_control(server.address, b"group over loopback")
    inbox.wait_for(b"group over loopback")
    monkeypatch.setattr(endpoint_mod, "_peer_ip", lambda frame: "10.0.0.5")
    client.send_control(server.address, b"group from the pod network")
    client.send_control(server.address, b"other traffic")
    inbox.wait_for(b"other traffic")
    assert [m for _, m in inbox.messages] == [b"group over loopback", b"other traffic"]
    assert server.stats.get("not_loopback") == 1


def test_a_forged_group_frame_claiming_the_leader_is_refused():
    # A follower trusts group commands from its leader's address: a peer
    # without the token that names that address is refused before the agent.
    inbox = Inbox()
    follower = Endpoint(EndpointConfig(token="t"), on_control=inbox)
    leader = Endpoint(EndpointConfig(token="t"))
    follower.start()
    leader.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(follower.address)
    try:
        unkeyed = prove(identity_key(""), b"\x01x", leader.address.encode())
        sock.setsockopt(zmq.ROUTING_ID, b"\x01x")
        refused_then_genuine(
            sock, leader, follower, inbox, unkeyed, b"PDG\x01fail", b"PDG\x01genuine"
        )
    finally:
        sock.close(0)
        ctx.term()
        leader.close()
        follower.close()


def test_outbound_dealers_are_capped_lru_and_idle_ones_close():
    servers = [Endpoint() for _ in range(3)]
    for s in servers:
        s.start()
    inboxes = [Inbox() for _ in servers]
    for s, box in zip(servers, inboxes, strict=True):
        s.on_control = box
    client = Endpoint(EndpointConfig(max_peers=2, peer_idle_timeout=0.5))
    client.start()
    try:
        for s, box in zip(servers, inboxes, strict=True):
            client.send_control(s.address, b"hi")
            box.wait_for(b"hi")
        # The third peer closed the least recently used DEALER (the first one).
        wait_until(lambda: client.stats.get("peer_evicted") == 1, what="one evicted")
        # Unused ones close on their own; a later send reconnects.
        wait_until(lambda: client.stats.get("peer_idle_closed") == 2, what="idle ones closed")
        client.send_control(servers[0].address, b"again")
        inboxes[0].wait_for(b"again")
        assert client.stats.get("send_dropped", 0) == 0
    finally:
        client.close()
        for s in servers:
            s.close()


def test_outbound_settings_are_checked():
    for bad in ({"max_peers": 0}, {"peer_idle_timeout": 0.0}):
        with pytest.raises(ValueError, match="max_peers"):
            Endpoint(EndpointConfig(**bad))
