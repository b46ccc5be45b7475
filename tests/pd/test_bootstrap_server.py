"""Bootstrap HTTP server through FastAPI's TestClient: codes, auth, limits."""

from __future__ import annotations

import msgspec
import pytest
from fastapi.testclient import TestClient

from pdcluster.runtime.pd.coords import InstanceShape
from pdcluster.runtime.pd_worker.bootstrap_server import MAX_BODY_BYTES, create_bootstrap_app
from pdcluster.runtime.spec import Topology

from .test_bootstrap_registry import reg

TOKEN = "tok-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ALL = {"dp": -1, "cp": -1, "tp": -1, "pp": -1}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def client(clock: Clock) -> TestClient:
    app = create_bootstrap_app(Topology(tp=2, pp=2), TOKEN, dp_entry_ttl_s=5.0, clock=clock)
    return TestClient(app)


def put(client: TestClient, **kw: object) -> object:
    return client.put("/route", content=msgspec.json.encode(reg(**kw)), headers=AUTH)


def test_registration_then_topology_query(client: TestClient) -> None:
    r = put(client, tp=0, pp=0)
    assert r.status_code == 200 and r.json() == {"new": True, "registered": 1, "expected": 4}
    assert put(client, tp=0, pp=0).json()["registered"] == 1  # distinct ranks count once
    r = client.get("/route", params=ALL, headers=AUTH)
    assert r.status_code == 503 and r.json()["registered"] == 1 and r.json()["expected"] == 4
    for tp, pp in ((0, 1), (1, 0), (1, 1)):
        put(client, tp=tp, pp=pp, port=7000 + 10 * tp + pp)
    r = client.get("/route", params=ALL, headers=AUTH)
    assert r.status_code == 200
    body = r.json()
    assert body["shape"] == {"dp": 1, "cp": 1, "tp": 2, "pp": 2}
    assert body["compat"]["page_size"] == 4 and len(body["ranks"]) == 4
    r = client.get("/route", params={"dp": 0, "cp": 0, "tp": 1, "pp": 1}, headers=AUTH)
    assert r.json() == {
        "rank": {"dp": 0, "cp": 0, "tp": 1, "pp": 1},
        "endpoint": "tcp://127.0.0.1:7011",
    }


def test_inconsistent_field_is_400_naming_it(client: TestClient) -> None:
    put(client, tp=0)
    r = put(client, tp=1, kv_dtype="float16")
    assert r.status_code == 400
    assert r.json()["field"] == "kv_dtype"
    assert "kv_dtype mismatch: registered=float32, this rank=float16" in r.json()["error"]
    assert client.get("/health").json()["registered"] == 1


@pytest.mark.parametrize(
    ("params", "status", "field"),
    [
        ({"dp": 0, "cp": 0, "tp": 0}, 400, "pp"),
        ({"dp": 0, "cp": 0, "tp": "x", "pp": 0}, 400, "tp"),
        ({"dp": 0, "cp": 0, "tp": -2, "pp": 0}, 400, "tp"),
        ({"dp": -1, "cp": 0, "tp": 0, "pp": 0}, 400, None),
        ({"dp": 0, "cp": 0, "tp": 1, "pp": 0}, 404, None),
    ],
)
def test_bad_route_queries(
    client: TestClient, params: dict, status: int, field: str | None
) -> None:
    r = client.get("/route", params=params, headers=AUTH)
    assert r.status_code == status and r.json()["field"] == field and r.json()["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"", None),
        (b"{not json", None),
        (b'{"rank": {}, "shape": {}, "endpoint": "tcp://x:1"}', "compat"),
        (b'{"rank": {"tp": "a"}, "shape": {}, "endpoint": "e", "compat": {}}', "rank.tp"),
    ],
)
def test_bad_registration_bodies(client: TestClient, body: bytes, field: str | None) -> None:
    r = client.put("/route", content=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["field"] == field
    assert client.get("/health").json()["registered"] == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("put", "/route"),
        ("get", "/route"),
        ("post", "/register_dp_rank"),
        ("post", "/query_dp_ranks"),
    ],
)
def test_token_guards_everything_but_health(client: TestClient, method: str, path: str) -> None:
    body = msgspec.json.encode(reg()) if path == "/route" else b'{"room": 1, "dp_rank": 0}'
    kwargs = {"params": ALL} if method == "get" else {"content": body}
    missing = client.request(method, path, **kwargs)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    wrong = client.request(method, path, headers={"Authorization": "Bearer nope"}, **kwargs)
    assert wrong.status_code == 403
    basic = client.request(method, path, headers={"Authorization": f"Basic {TOKEN}"}, **kwargs)
    assert basic.status_code == 403
    health = client.get("/health").json()
    assert health == {"status": "ok", "registered": 0, "expected": 4, "start": health["start"]}


def test_health_names_the_start_a_new_app_draws_afresh() -> None:
    """Decode tells a restart at the same address from the old process by it."""
    starts = [
        TestClient(create_bootstrap_app(Topology(tp=2, pp=2), TOKEN)).get("/health").json()
        for _ in range(2)
    ]
    assert all(isinstance(h["start"], str) and h["start"] for h in starts)
    assert starts[0]["start"] != starts[1]["start"]
    app = create_bootstrap_app(Topology(tp=2, pp=2), TOKEN, start_id="s-1")
    assert TestClient(app).get("/health").json()["start"] == "s-1"


def test_oversized_bodies_are_refused(client: TestClient) -> None:
    big = b"{" + b" " * MAX_BODY_BYTES + b"}"
    r = client.put("/route", content=big, headers=AUTH)
    assert r.status_code == 413

    def chunks():  # no Content-Length: the limit holds while streaming
        for _ in range(MAX_BODY_BYTES // 1000 + 2):
            yield b" " * 1000

    r = client.put("/route", content=chunks(), headers=AUTH)
    assert r.status_code == 413


def test_dp_rank_mapping_with_expiry(client: TestClient, clock: Clock) -> None:
    app_dp = create_bootstrap_app(InstanceShape(dp=4), TOKEN, dp_entry_ttl_s=5.0, clock=clock)
    c = TestClient(app_dp)
    assert c.post("/register_dp_rank", json={"room": 42, "dp_rank": 3}, headers=AUTH).json() == {
        "ok": True
    }
    r = c.post("/query_dp_ranks", json={"rooms": [42, 43]}, headers=AUTH)
    assert r.json() == {"dp_ranks": {"42": 3}}
    clock.now += 5.0
    assert c.post("/query_dp_ranks", json={"rooms": [42]}, headers=AUTH).json() == {"dp_ranks": {}}
    bad = c.post("/register_dp_rank", json={"room": 1, "dp_rank": 4}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["field"] == "dp_rank"
    neg = c.post("/register_dp_rank", json={"room": -1, "dp_rank": 0}, headers=AUTH)
    assert neg.status_code == 400 and neg.json()["field"] == "room"


def test_no_token_configured_means_open(clock: Clock) -> None:
    c = TestClient(create_bootstrap_app(Topology(tp=2, pp=2), None, clock=clock))
    assert c.put("/route", content=msgspec.json.encode(reg())).status_code == 200
