"""The engine thread wakes the event loop once per step, not once per token.

Eight requests decode together on a real tiny engine; every token still
reaches its own request, in order, while the event loop is woken (a
`call_soon_threadsafe`) far fewer times than there are token events.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.serving.engine_service import EngineService, TokenEvent

TOK = ByteTokenizer()
CFG = EngineConfig(num_pages=128, page_size=4, max_running_requests=8, max_batch_tokens=256)
NUM_REQUESTS, NUM_TOKENS = 8, 12


async def test_one_wakeup_per_step_carries_every_requests_tokens_in_order() -> None:
    loop = asyncio.get_running_loop()
    wakeups = 0
    original = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any, **kw: Any) -> Any:
        nonlocal wakeups
        wakeups += 1
        return original(callback, *args, **kw)

    service = EngineService(LLMEngine(CFG), TOK)
    service.start()
    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:

        async def one(i: int) -> list[TokenEvent]:
            params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
            req = EngineRequest(f"r{i}", TOK.encode(f"prompt {i}"), params)
            return [e async for e in service.generate(req, [])]

        # Added while the engine is busy, so the requests decode as one batch.
        runs = await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]
        service.stop()
    events = sum(len(r) for r in runs)
    for r in runs:
        assert sum(len(e.token_ids) for e in r) == NUM_TOKENS
        assert r[-1].finished and not any(e.finished for e in r[:-1])
    # Each request's `call` result is one wake-up; its token events share the step's.
    assert events >= NUM_REQUESTS * NUM_TOKENS / 2
    assert wakeups <= NUM_REQUESTS + 2 * NUM_TOKENS + 4, (wakeups, events)
