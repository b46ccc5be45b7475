"""The router's work that grows with a request's size runs off its event loop.

One event loop serves every client of a router replica: a call that holds it
for a second holds every stream and every probe for that second. Three
steps take time in proportion to a request's bytes, and run on a worker
thread (`asyncio.to_thread`) when the request is large:

- parsing and checking a body (`bodies.check_request`): inline under
  `OFF_LOOP_BODY_BYTES`, where a thread hop costs more than it saves;
- reading the prompt's token ids for `cache_aware` (tokenizing text,
  checking ids: `prompt_ids.prompt_tokens`);
- hashing them into page keys (`PrefixIndex.keyed`), never past the longest
  prefix a followed worker could hold (the plan is read on the loop first,
  so the thread touches no replica the loop updates).

With no worker followed (no replica yet) the prompt is not read at all: no
worker could hold any of it, and the request goes by load.
"""

from __future__ import annotations

import asyncio

from pdcluster.runtime.router.bodies import (
    ClientRequest,
    Endpoint,
    check_request,
    parse_json_object,
)
from pdcluster.runtime.router.prefix_index import KeyGroup, PrefixIndex, PromptTokens
from pdcluster.runtime.router.prompt_ids import RouterTokenizer, prompt_tokens

__all__ = ["OFF_LOOP_BODY_BYTES", "PromptReader", "read_request"]

OFF_LOOP_BODY_BYTES = 256 * 1024


def _read(endpoint: Endpoint, raw: bytes, disaggregated: bool) -> ClientRequest:
    return check_request(endpoint, parse_json_object(raw), disaggregated=disaggregated, raw=raw)


async def read_request(endpoint: Endpoint, raw: bytes, *, disaggregated: bool) -> ClientRequest:
    """The checked request (RouterError 400 naming the field), parsed off the loop if large."""
    if len(raw) <= OFF_LOOP_BODY_BYTES:
        return _read(endpoint, raw, disaggregated)
    return await asyncio.to_thread(_read, endpoint, raw, disaggregated)


class PromptReader:
    """A request's prompt, keyed for the index's workers, read off the loop."""

    def __init__(self, index: PrefixIndex, tokenizer: RouterTokenizer | None) -> None:
        self.index = index
        self.tokenizer = tokenizer

    async def read(self, request: ClientRequest) -> PromptTokens | None:
        plan = self.index.key_plan()
        if not plan:
            return None
        return await asyncio.to_thread(self._keyed, request, plan)

    def _keyed(self, request: ClientRequest, plan: dict[KeyGroup, int]) -> PromptTokens | None:
        prompt = prompt_tokens(request, self.tokenizer)
        return None if prompt is None else self.index.keyed(prompt, plan)
