"""The worker's prefix-cache feed over HTTP: a snapshot, then events after it
(a long poll answered as soon as the engine thread records one), 410 when
the asker must start over, 400 on bad parameters, and the cluster token on
every call. A router replica built from the wire equals the worker's keys.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
from fastapi import FastAPI

from pdcluster.runtime.http.auth import is_guarded
from pdcluster.runtime.prefix_events import Apply, KeyReplica, parse_batch, parse_snapshot
from pdcluster.runtime.server.prefix_feed import PrefixFeed, add_prefix_feed_routes
from tests.router.test_prefix_events import key, new_log


def feed_app(max_keys: int = 100) -> tuple[PrefixFeed, httpx.AsyncClient]:
    feed = PrefixFeed(new_log(max_keys, epoch="ep"))
    app = FastAPI()
    add_prefix_feed_routes(app, feed)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w")
    return feed, client


async def test_a_replica_from_snapshot_and_events_equals_the_worker_keys() -> None:
    feed, client = feed_app()
    async with client:
        feed.record(True, [key(1), key(2)])
        replica = KeyReplica(parse_snapshot((await client.get("/prefix_cache/snapshot")).json()))
        feed.record(False, [key(1)])
        feed.record(True, [key(3)])
        resp = await client.get(
            "/prefix_cache/events", params={"epoch": "ep", "after": replica.seq, "wait": 0}
        )
        assert resp.status_code == 200
        assert replica.apply(parse_batch(resp.json())) is Apply.applied
        assert replica.keys == {key(2), key(3)}


async def test_a_long_poll_returns_when_the_engine_thread_records() -> None:
    feed, client = feed_app()
    async with client:
        poll = asyncio.create_task(
            client.get("/prefix_cache/events", params={"epoch": "ep", "after": 0, "wait": 30})
        )
        # Wait until the request is parked on the feed, then record from another thread.
        while feed._changed is None:
            await asyncio.sleep(0.01)
        thread = threading.Thread(target=feed.record, args=(True, [key(7)]))
        thread.start()
        resp = await asyncio.wait_for(poll, 60)  # far below the 30 s wait when woken
        thread.join()
        batch = parse_batch(resp.json())
        assert [(e.seq, e.keys) for e in batch.events] == [(1, (key(7),))]


async def test_410_asks_for_a_snapshot_and_bad_parameters_get_400() -> None:
    feed, client = feed_app(max_keys=1)
    async with client:
        for i in range(3):
            feed.record(True, [key(i)])
        for params in ({"epoch": "other", "after": 3}, {"epoch": "ep", "after": 0}):
            resp = await client.get("/prefix_cache/events", params=params)
            assert resp.status_code == 410 and resp.json()["reason"] == "snapshot_needed"
        for params in (
            {"epoch": "ep", "after": "x"},
            {"epoch": "ep"},
            {"epoch": "ep", "after": 3, "wait": 31},
            {"epoch": "ep", "after": 3, "wait": "soon"},
        ):
            resp = await client.get("/prefix_cache/events", params=params)
            assert resp.status_code == 400, params
        assert feed.snapshot_wire()["seq"] == 3  # nothing changed


async def test_a_change_the_cache_never_reports_stops_the_feed_not_the_engine() -> None:
    feed, client = feed_app()
    async with client:
        feed.record(True, [key(1)])
        feed.record(True, [key(1)])  # drift: must not raise into the engine thread
        assert "already cached" in feed.broken
        for path in ("/prefix_cache/snapshot", "/prefix_cache/events?epoch=ep&after=0"):
            resp = await client.get(path)
            assert resp.status_code == 503 and resp.json()["reason"] == "feed_stopped"


def test_the_feed_needs_the_cluster_token_even_with_an_open_data_plane() -> None:
    for path in ("/prefix_cache/snapshot", "/prefix_cache/events"):
        assert is_guarded(path, data_plane_open=False)
        assert is_guarded(path, data_plane_open=True)
