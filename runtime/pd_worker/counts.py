"""Counters of a whole PD instance for `/admin/failures` and `pd_stats` (I/O side).

A dp group's leader knows its own counters, its followers' last pushed
counters (`GroupStats`, see agent.py) and the rooms its group failed (the
coordinator's tally). The front of the instance (dp group 0) adds the other
dp groups' views, read from their leaders' `/admin/failures?scope=group`
concurrently, each within `DP_TIMEOUT_S`: a group that does not answer in
time is listed as missing and its last answer stands in for it, so the
endpoint never waits longer than that and the totals never go down.
The arithmetic lives in `pdcluster.runtime.pd.instance_counts`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from pdcluster.runtime.pd.instance_counts import CountsView, build_group_view, merge_views

log = logging.getLogger("pdcluster.pd")

DP_TIMEOUT_S = 0.5


class InstanceCounts:
    def __init__(self, agent: Any, coordinator: Any, token: str, dp_urls: tuple[str, ...]):
        self.agent = agent
        self.coordinator = coordinator
        self.dp_urls = dp_urls  # other dp groups' leaders, http://host:port (front only)
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._last: dict[int, CountsView] = {}  # dp group -> its last good answer

    def group_view(self) -> CountsView:
        """This dp group: every rank's counters, rooms counted once."""
        by_rank, missing = self.agent.group_counts(time.monotonic())
        return build_group_view(
            str(self.agent.ctx.coord),
            self.agent.counts(),
            by_rank,
            missing,
            self.coordinator.rooms_failed(),
        )

    def _url(self, base: str) -> str:
        return f"{base}/admin/failures?scope=group"

    def _combine(self, answers: list[CountsView | None]) -> CountsView:
        views, missing = [self.group_view()], []
        for group, answer in enumerate(answers, start=1):
            if answer is not None:
                self._last[group] = answer
            else:
                missing.append(f"dp{group}")
                answer = self._last.get(group)
            if answer is not None:
                views.append(answer)
        return merge_views(views, missing)

    def _parse(self, group: int, resp: httpx.Response) -> CountsView | None:
        try:
            resp.raise_for_status()
            return CountsView.from_json(resp.json())
        except (httpx.HTTPError, ValueError) as err:
            log.warning("counters of dp group %s unusable: %s", group, err)
            return None

    async def instance_view(self) -> CountsView:
        """The whole instance (async: the admin endpoint)."""
        if not self.dp_urls:
            return self.group_view()

        async def one(client: httpx.AsyncClient, group: int, base: str) -> CountsView | None:
            try:
                resp = await client.get(self._url(base), headers=self._headers)
            except httpx.HTTPError as err:
                log.warning("counters of dp group %s: %s", group, err)
                return None
            return self._parse(group, resp)

        async with httpx.AsyncClient(timeout=DP_TIMEOUT_S) as client:
            jobs = [one(client, g, p) for g, p in enumerate(self.dp_urls, start=1)]
            # The client timeout bounds each phase; this bounds the whole read.
            try:
                answers = await asyncio.wait_for(asyncio.gather(*jobs), 2 * DP_TIMEOUT_S)
            except TimeoutError:
                answers = [None] * len(self.dp_urls)
        return self._combine(list(answers))

    def instance_view_blocking(self) -> CountsView:
        """The whole instance, from a worker thread (`/get_server_info` is synchronous)."""
        if not self.dp_urls:
            return self.group_view()
        answers: list[CountsView | None] = []
        with httpx.Client(timeout=DP_TIMEOUT_S) as client:
            for group, base in enumerate(self.dp_urls, start=1):
                try:
                    answers.append(
                        self._parse(group, client.get(self._url(base), headers=self._headers))
                    )
                except httpx.HTTPError as err:
                    log.warning("counters of dp group %s: %s", group, err)
                    answers.append(None)
        return self._combine(answers)
