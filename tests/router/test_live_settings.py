"""A running router takes new policies and a new health interval without a restart."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.router.live_settings import (
    LiveSettingsRefused,
    RouterLiveSettings,
    apply_live_settings,
)
from pdcluster.runtime.spec import RouterPolicySpec, RouterSpec, SelectionPolicy

from .harness import LoopThread, start_cluster, wait_until
from .test_app_pool import healthy_urls

TOKEN = "router-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PD = RouterConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",))
COLOCATED = RouterConfig(colocated_urls=("http://c:1",))
POLICIES = list(SelectionPolicy)


def live(prefill: str = "round_robin", decode: str = "round_robin", **rest: Any) -> dict[str, Any]:
    return {"policy": {"prefill": prefill, "decode": decode, **rest}}


def test_the_interval_has_the_bounds_of_the_manifest_field() -> None:
    ours = RouterLiveSettings.model_fields["health_check_interval_seconds"]
    theirs = RouterSpec.model_fields["health_check_interval_seconds"]
    assert (ours.default, ours.metadata) == (theirs.default, theirs.metadata)


@pytest.mark.parametrize("base", [PD, COLOCATED], ids=["pd", "colocated"])
@pytest.mark.parametrize("prefill", POLICIES)
@pytest.mark.parametrize("decode", POLICIES)
def test_every_policy_pair_applies_unless_it_changes_the_cache_aware_roles(
    base: RouterConfig, prefill: SelectionPolicy, decode: SelectionPolicy
) -> None:
    settings = RouterLiveSettings(
        policy=RouterPolicySpec(prefill=prefill, decode=decode, max_load_gap=9),
        health_check_interval_seconds=0.5,
    )
    aware = SelectionPolicy.cache_aware
    changes_aware = decode is aware or (base.is_disaggregated and prefill is aware)
    if changes_aware:
        with pytest.raises(LiveSettingsRefused, match="cache_aware"):
            apply_live_settings(base, settings)
        return
    applied = apply_live_settings(base, settings)
    assert applied.max_load_gap == 9 and applied.health_check_interval_s == 0.5
    assert RouterLiveSettings.from_config(applied).policy.decode is decode
    if base.is_disaggregated:
        assert RouterLiveSettings.from_config(applied) == settings
    # Everything else is the config it was.
    assert applied.prefill_urls == base.prefill_urls and applied.engine is base.engine


def test_a_cache_aware_router_keeps_its_roles_and_takes_a_new_load_gap() -> None:
    aware = RouterConfig(
        prefill_urls=("http://p:1",),
        decode_urls=("http://d:1",),
        prefill_policy="cache_aware",
    )
    gap = RouterLiveSettings.model_validate(live("cache_aware", "random", maxLoadGap=0))
    assert apply_live_settings(aware, gap).max_load_gap == 0
    with pytest.raises(LiveSettingsRefused, match=r"prefill -> none"):
        apply_live_settings(aware, RouterLiveSettings.model_validate(live()))


def test_new_settings_are_in_force_at_once_and_bad_ones_change_nothing(
    loop: LoopThread,
) -> None:
    settings: dict[str, Any] = {"worker_token": TOKEN, "policy_seed": 5}
    with start_cluster(loop, prefill=1, decode=2, **settings) as cluster, cluster.client() as http:
        start = http.get("/admin/settings", headers=AUTH)
        assert start.status_code == 200
        assert start.json() == {
            "policy": {"prefill": "round_robin", "decode": "round_robin", "maxLoadGap": 4},
            "healthCheckIntervalSeconds": 60.0,
        }
        assert http.get("/admin/settings").status_code == 401
        bad_calls = [
            (live(decode="fastest"), 400, "policy.decode"),
            (live(maxLoadGap=-1), 400, "policy.maxLoadGap"),
            ({**live(), "healthCheckIntervalSeconds": 0}, 400, "healthCheckIntervalSeconds"),
            ({**live(), "requestTimeoutSeconds": 5}, 400, "requestTimeoutSeconds"),
            (live(decode="cache_aware"), 409, "cache_aware"),
        ]
        for body, status, named in bad_calls:
            resp = http.put("/admin/settings", json=body, headers=AUTH)
            assert resp.status_code == status, (body, resp.text)
            assert named in resp.text
        assert http.put("/admin/settings", json=live(), headers={}).status_code == 401
        assert http.put("/admin/settings", content=b"[", headers=AUTH).status_code == 400
        assert http.get("/admin/settings", headers=AUTH).json() == start.json()

        # Round robin alternates the decodes; the seeded random policy does not.
        def decode_sequence(n: int) -> list[int]:
            order = []
            for _ in range(n):
                before = [len(d.bodies("/generate")) for d in cluster.decode]
                assert http.post("/generate", json={"text": "a"}).status_code == 200
                after = [len(d.bodies("/generate")) for d in cluster.decode]
                order.append(next(i for i in (0, 1) if after[i] > before[i]))
            return order

        alternating = decode_sequence(6)
        assert alternating in ([0, 1] * 3, [1, 0] * 3)
        new = {**live(decode="random"), "healthCheckIntervalSeconds": 0.05}
        resp = http.put("/admin/settings", json=new, headers=AUTH)
        assert resp.status_code == 200, resp.text
        assert resp.json()["policy"]["decode"] == "random"
        assert http.get("/admin/settings", headers=AUTH).json() == resp.json()
        picks = decode_sequence(16)
        assert picks not in ([0, 1] * 8, [1, 0] * 8)

        # The 60 s sleep under way ended: a worker that fails its probes leaves within a second.
        gone = cluster.decode[1]
        gone.behaviour.healthy = False
        wait_until(lambda: gone.url not in healthy_urls(cluster), timeout=5)
