"""cache_aware's parts in one router: the prefix index, the prompt reader
that turns a request into page keys off the event loop (`off_loop.py`), and
the follower that keeps the index current.

The index and the policy are the same whatever the workers run; what fills
the index differs:
- our workers publish page keys over HTTP (`prefix_feed.PrefixFollower`);
- vLLM workers publish their prefix-cache events over ZMQ
  (`vllm_prefix_feed.VllmPrefixFollower`), which the router turns into the
  same keys; a prompt is read the way vLLM reads it (`prompt_ids.py`).

Nothing here runs when no role is routed by cache_aware.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import httpx

from pdcluster.runtime.router.bodies import ClientRequest
from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.router.metrics import RouterMetrics
from pdcluster.runtime.router.off_loop import PromptReader
from pdcluster.runtime.router.prefix_feed import PrefixFollower
from pdcluster.runtime.router.prefix_index import PrefixIndex, PromptTokens
from pdcluster.runtime.router.prompt_ids import RouterTokenizer
from pdcluster.runtime.router.vllm_prefix_feed import VllmPrefixFollower
from pdcluster.runtime.router.workers import Worker
from pdcluster.runtime.spec import EngineKind

log = logging.getLogger(__name__)


class PrefixRouting:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        # Page keys each worker has cached (`prefix_index.py`).
        self.index = PrefixIndex()
        self.roles = config.cache_aware_roles
        self.tokenizer = _load_tokenizer(config.tokenizer) if self.roles else None
        self.prompts = (
            PromptReader(self.index, self.tokenizer, config.engine) if self.roles else None
        )
        self.follower: PrefixFollower | VllmPrefixFollower | None = None

    async def read_prompt(self, request: ClientRequest) -> PromptTokens | None:
        """The request's prompt keyed for the followed workers (None: go by load)."""
        return None if self.prompts is None else await self.prompts.read(request)

    def indexed_pages(self, url: str) -> int | None:
        replica = self.index.replica(url)
        return None if replica is None else len(replica.keys)

    def start(
        self,
        workers: Callable[[], Iterable[Worker]],
        control: httpx.AsyncClient,
        metrics: RouterMetrics,
    ) -> None:
        """Follow the cache_aware roles' workers (inside the app's event loop)."""
        if not self.roles:
            return
        roles = self.roles

        def followed() -> list[Worker]:
            return [w for w in workers() if w.role in roles]

        cfg = self.config
        if cfg.engine is EngineKind.vllm:
            self.follower = VllmPrefixFollower(
                self.index,
                followed,
                page_size=cfg.vllm_block_size,
                tokenizer=self.tokenizer.fingerprint if self.tokenizer is not None else "",
                metrics=metrics,
            )
        else:
            self.follower = PrefixFollower(
                self.index, control, followed, timeout_s=cfg.health_check_timeout_s
            )
        self.sync()

    def sync(self) -> None:
        """The pool changed: follow exactly the eligible workers."""
        if self.follower is not None:
            self.follower.sync()

    async def close(self) -> None:
        if self.follower is not None:
            await self.follower.close()


def _load_tokenizer(source: str | None) -> RouterTokenizer | None:
    """The model's tokenizer, for cache_aware's text prompts (None: ids only)."""
    if source is None:
        return None
    # The one engine module the router reads: plain Python, no torch.
    from pdcluster.runtime.engine.tokenizer import load_tokenizer

    try:
        return load_tokenizer(source)
    except Exception as err:  # a missing or unreadable tokenizer must not stop the router
        log.warning("cache_aware: no tokenizer from %s (%s); text prompts go by load", source, err)
        return None
