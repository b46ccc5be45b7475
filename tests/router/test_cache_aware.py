"""cache_aware: the worker with the longest cached prefix, unless its load is
more than ``max_load_gap`` above the least loaded candidate's; otherwise (and
with nothing cached, or no prompt ids) exactly what least_outstanding picks.
Also its settings: selectable for prefill, decode and colocated, refused for
a role whose prefix cache is off; and a PD plan ranks decodes by their own
cached pages (decode-side reuse), prefill and decode each by its own index rows.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.prefix_events import KeyEventLog
from pdcluster.runtime.prefix_keys import chain_page_keys, root_key
from pdcluster.runtime.router.bodies import ClientRequest, Endpoint
from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.router.errors import NoHealthyWorkerError
from pdcluster.runtime.router.leg_plan import LegPlanner
from pdcluster.runtime.router.policies import (
    CacheAware,
    LeastOutstanding,
    Policy,
    choose_by_cache,
    make_policy,
)
from pdcluster.runtime.router.prefix_index import PrefixIndex, PromptTokens
from pdcluster.runtime.router.rooms import RidMinter
from pdcluster.runtime.router.workers import ServerInfo, Worker, WorkerPool, WorkerTarget
from pdcluster.runtime.spec import PDClusterSpec, Role

PAGE = 4
SALT = b"salt"


def workers(loads: list[int], healthy: list[bool] | None = None) -> list[Worker]:
    ok = healthy or [True] * len(loads)
    return [
        Worker(url=f"http://127.0.0.1:{9000 + i}", role=Role.prefill, healthy=h, outstanding=o)
        for i, (o, h) in enumerate(zip(loads, ok, strict=True))
    ]


@pytest.mark.parametrize(
    ("loads", "cached", "gap", "expected"),
    [
        ([0, 0], [0, 0], 4, None),  # nothing cached: by load
        ([0, 0], [0, 3], 4, 1),
        ([4, 0], [3, 0], 4, 0),  # exactly at the gap: still the cache
        ([5, 0], [3, 0], 4, None),  # over the gap: by load
        ([2, 1, 0], [3, 3, 1], 4, 1),  # a tie on pages: the less loaded holder
        ([1, 1], [2, 2], 0, 0),  # a full tie: pool order
        ([0, 3], [1, 2], 3, 1),  # more pages win over lower load within the gap
        ([0, 3], [1, 2], 2, None),
    ],
)
def test_choose_by_cache(
    loads: list[int], cached: list[int], gap: int, expected: int | None
) -> None:
    pool = workers(loads)
    pages = {w.url: n for w, n in zip(pool, cached, strict=True)}
    got = choose_by_cache(pool, pages, gap)
    assert got is (None if expected is None else pool[expected])


@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), min_size=1, max_size=8),
    st.integers(0, 10),
)
def test_choose_by_cache_properties(rows: list[tuple[int, int]], gap: int) -> None:
    pool = workers([load for load, _ in rows])
    pages = {w.url: n for w, (_, n) in zip(pool, rows, strict=True)}
    got = choose_by_cache(pool, pages, gap)
    best = max(pages.values())
    low = min(w.outstanding for w in pool)
    holders = [w for w in pool if pages[w.url] == best]
    least_loaded_holder = min(w.outstanding for w in holders)
    if best == 0 or least_loaded_holder - low > gap:
        assert got is None
    else:
        assert got is not None and pages[got.url] == best
        assert got.outstanding == least_loaded_holder
        assert got.outstanding - low <= gap


def indexed(pool: list[Worker], cached_prompts: dict[int, list[int]]) -> PrefixIndex:
    """An index where worker i holds the full pages of cached_prompts[i]."""
    index = PrefixIndex()
    for i, w in enumerate(pool):
        log = KeyEventLog("e", salt=SALT, page_size=PAGE)
        if i in cached_prompts:
            log.record(True, chain_page_keys(cached_prompts[i], PAGE, root_key(SALT)))
        index.reset(w.url, log.snapshot())
    return index


SYSTEM = list(range(1, 13))  # three full pages


def test_cache_aware_sends_a_shared_prefix_to_the_worker_holding_it() -> None:
    pool = workers([1, 0, 0])
    policy = CacheAware(indexed(pool, {0: SYSTEM}), max_load_gap=4)
    prompt = PromptTokens((*SYSTEM, 50, 51))
    assert [policy.select(pool, "prefill", prompt) for _ in range(3)] == [pool[0]] * 3
    assert policy.num_by_cache == 3


def test_cache_aware_goes_by_load_past_the_gap_without_prompt_or_hit() -> None:
    pool = workers([6, 0, 2])
    policy = CacheAware(indexed(pool, {0: SYSTEM}), max_load_gap=4)
    by_load = LeastOutstanding()
    prompts = [PromptTokens((*SYSTEM, 9)), None, PromptTokens((90, 91, 92, 93, 94, 95))]
    for prompt in prompts:
        assert policy.select(pool, "prefill", prompt) is by_load.select(pool, "prefill")
    assert policy.num_by_cache == 0


def test_cache_aware_skips_unhealthy_holders_and_refuses_an_empty_pool() -> None:
    pool = workers([0, 0], healthy=[False, True])
    policy = CacheAware(indexed(pool, {0: SYSTEM}), max_load_gap=4)
    assert policy.select(pool, "prefill", PromptTokens((*SYSTEM, 1))) is pool[1]
    with pytest.raises(NoHealthyWorkerError):
        policy.select(workers([0], healthy=[False]), "prefill", PromptTokens((1,)))


@pytest.mark.parametrize("gap", [-1, True, 1.5])
def test_a_bad_gap_is_refused(gap: object) -> None:
    with pytest.raises(ValueError, match="max_load_gap"):
        CacheAware(PrefixIndex(), gap)  # type: ignore[arg-type]


def test_make_policy_builds_cache_aware_on_the_index_it_is_given() -> None:
    index = PrefixIndex()
    policy = make_policy("cache_aware", index=index, max_load_gap=7)
    assert isinstance(policy, CacheAware)
    assert policy.index is index and policy.max_load_gap == 7


def test_router_config_selects_cache_aware_for_any_role() -> None:
    def pd(**policies: str) -> RouterConfig:
        return RouterConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",), **policies)

    assert pd(prefill_policy="cache_aware").cache_aware_roles == (Role.prefill,)
    assert pd(decode_policy="cache_aware").cache_aware_roles == (Role.decode,)
    both = pd(prefill_policy="cache_aware", decode_policy="cache_aware")
    assert both.cache_aware_roles == (Role.prefill, Role.decode)
    assert pd().cache_aware_roles == ()
    colocated = RouterConfig(colocated_urls=("http://c:1",), colocated_policy="cache_aware")
    assert colocated.cache_aware_roles == (Role.colocated,)
    assert RouterConfig(colocated_urls=("http://c:1",)).cache_aware_roles == ()
    with pytest.raises(ValueError, match="max_load_gap"):
        RouterConfig(colocated_urls=("http://c:1",), max_load_gap=-1)


def test_the_manifest_selects_cache_aware_and_its_gap() -> None:
    spec = PDClusterSpec.model_validate(
        {
            "prefill": {},
            "decode": {},
            "router": {"policy": {"prefill": "cache_aware", "maxLoadGap": 2}},
        }
    )
    config = RouterConfig.from_spec(spec, prefill_urls=["http://p:1"], decode_urls=["http://d:1"])
    assert (config.prefill_policy, config.max_load_gap, config.tokenizer) == (
        "cache_aware",
        2,
        "tiny",
    )
    spec = PDClusterSpec.model_validate(
        {"prefill": {}, "decode": {}, "router": {"policy": {"decode": "cache_aware"}}}
    )
    config = RouterConfig.from_spec(spec, prefill_urls=["http://p:1"], decode_urls=["http://d:1"])
    assert config.cache_aware_roles == (Role.decode,)
    with pytest.raises(ValueError, match="max_load_gap|maxLoadGap"):
        PDClusterSpec.model_validate(
            {"prefill": {}, "decode": {}, "router": {"policy": {"maxLoadGap": -1}}}
        )


@pytest.mark.parametrize(
    ("roles", "policy", "message"),
    [
        (
            {"prefill": {"engine": {"prefixCache": False}}, "decode": {}},
            {"prefill": "cache_aware"},
            "router.policy.prefill: cache_aware needs prefill.engine.prefixCache",
        ),
        (
            {"prefill": {}, "decode": {"engine": {"prefixCache": False}}},
            {"decode": "cache_aware"},
            "router.policy.decode: cache_aware needs decode.engine.prefixCache",
        ),
        (
            {"colocated": {"engine": {"prefixCache": False}}},
            {"decode": "cache_aware"},
            "router.policy.decode: cache_aware needs colocated.engine.prefixCache",
        ),
    ],
)
def test_the_manifest_refuses_cache_aware_for_a_role_without_the_cache(
    roles: dict[str, object], policy: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        PDClusterSpec.model_validate({**roles, "router": {"policy": policy}})
    # The cache off with another policy is fine.
    PDClusterSpec.model_validate(roles)


def _pd_planner(decode_policy: Policy) -> tuple[LegPlanner, list[Worker], list[Worker]]:
    pool = WorkerPool()
    targets = [WorkerTarget(f"http://10.0.0.{i + 1}:8000", Role.prefill) for i in range(2)]
    targets += [WorkerTarget(f"http://10.0.1.{i + 1}:8000", Role.decode) for i in range(3)]
    pool.sync(targets)
    for worker in pool.all():
        port = 8998 if worker.role is Role.prefill else None
        pool.record_probe_success(worker, ServerInfo(bootstrap_port=port, dp_size=1))
    rng = random.Random(0)
    planner = LegPlanner(
        pool=pool,
        disaggregated=True,
        prefill_policy=make_policy("round_robin"),
        decode_policy=decode_policy,
        colocated_policy=make_policy("round_robin"),
        rids=RidMinter(rng),
        rooms_source=rng,
        prompt_tokens=lambda r: PromptTokens(tuple(r.body["input_ids"])),  # type: ignore[arg-type]
    )
    return planner, pool.of_role(Role.prefill), pool.of_role(Role.decode)


def _ids_request(ids: list[int]) -> ClientRequest:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    return ClientRequest(endpoint=Endpoint.generate, body=body, stream=False, model=None)


def test_a_pd_plan_sends_the_decode_leg_to_the_decode_holding_the_prompt() -> None:
    index = PrefixIndex()
    planner, prefills, decodes = _pd_planner(make_policy("cache_aware", index=index))
    other = [70, 71, 72, 73, 74, 75, 76, 77]
    held = {decodes[1].url: SYSTEM, decodes[2].url: other}
    for w in prefills + decodes:
        log = KeyEventLog("e", salt=SALT, page_size=PAGE)
        if w.url in held:
            log.record(True, chain_page_keys(held[w.url], PAGE, root_key(SALT)))
        index.reset(w.url, log.snapshot())
    plans = [planner.plan(_ids_request([*SYSTEM, 9, i]), set()) for i in range(4)]
    # Every decode leg goes to the decode holding the system prompt, while
    # prefill keeps its own turns.
    assert [p.main for p in plans] == [decodes[1]] * 4
    assert [p.prefill for p in plans] == [prefills[0], prefills[1]] * 2
    assert planner.plan(_ids_request([*other, 1]), set()).main is decodes[2]
    # Busy past the gap: by load.
    decodes[1].outstanding = 5
    assert planner.plan(_ids_request([*SYSTEM, 1]), set()).main is decodes[0]


def test_a_pd_plan_ranks_decodes_only_by_what_decodes_hold() -> None:
    """A prefill that cached the prompt says nothing about the decodes."""
    index = PrefixIndex()
    planner, prefills, decodes = _pd_planner(make_policy("cache_aware", index=index))
    for w in prefills + decodes:
        log = KeyEventLog("e", salt=SALT, page_size=PAGE)
        if w is prefills[0]:
            log.record(True, chain_page_keys(SYSTEM, PAGE, root_key(SALT)))
        index.reset(w.url, log.snapshot())
    by_load = LeastOutstanding()
    for i in range(3):
        want = by_load.select(decodes, "decode")
        assert planner.plan(_ids_request([*SYSTEM, i]), set()).main is want
