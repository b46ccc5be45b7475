"""Turns a validated client request into the legs to send.

Picks the workers (prefill and decode, or one colocated worker) and mints the
rid. How the legs of a disaggregated request meet depends on the engine the
workers run (`LegFlow`, the per-engine seam):

- `bootstrap` (our workers; SGLang-compatible ones): a room aimed at one dp
  group of the chosen prefill instance; both legs get the identical body
  with the rid and `bootstrap_host/port/room`, and go out at once (relay.py);
- `kv_params` (vLLM with a pull connector, e.g. NixlConnector): no room; the
  body stays the client's, the prefill leg goes first and its answer's
  `kv_transfer_params` go into the decode leg (vllm_legs.py,
  vllm_relay.py). The rid names the request in logs (`X-Request-Id`);
- `room_params` (vLLM with our connector): a room as in `bootstrap`, aimed at
  the prefill's side port, carried in both legs' `kv_transfer_params`; the
  prefill leg computes one token; both go out at once (relay.py).

Pure module: workers, policies and minters are plain objects.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Container
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.router.bodies import Bootstrap, ClientRequest, build_leg_body
from pdcluster.runtime.router.errors import NoHealthyWorkerError, RouterError
from pdcluster.runtime.router.leg_bytes import encode_leg_body, leg_body_bytes
from pdcluster.runtime.router.policies import Policy
from pdcluster.runtime.router.prefix_index import PromptTokens
from pdcluster.runtime.router.rooms import RandomSource, RidMinter, mint_room
from pdcluster.runtime.router.vllm_legs import build_room_legs
from pdcluster.runtime.router.workers import Worker, WorkerPool
from pdcluster.runtime.spec import EngineKind, Role, VllmKVConnector


class LegFlow(enum.StrEnum):
    """How the two legs of a disaggregated request reach their workers."""

    # Both legs at once; the room in the bootstrap fields pairs them.
    bootstrap = "bootstrap"
    # Prefill first; its kv_transfer_params go into the decode leg.
    kv_params = "kv_params"
    # Both legs at once; the room rides in their kv_transfer_params.
    room_params = "room_params"


def leg_flow_of(engine: EngineKind, connector: VllmKVConnector = VllmKVConnector.nixl) -> LegFlow:
    """The flow a cluster's workers speak (vLLM's NixlConnector pulls: `kv_params`;
    our connector inside vLLM pairs by a room: `room_params`)."""
    if engine is not EngineKind.vllm:
        return LegFlow.bootstrap
    return LegFlow.room_params if connector is VllmKVConnector.pdcluster else LegFlow.kv_params


@dataclass(frozen=True)
class LegPlan:
    path: str
    body: dict[str, Any]
    rid: str
    stream: bool
    # The worker whose response the client sees: decode, or colocated.
    main: Worker
    prefill: Worker | None = None
    room: int | None = None
    # `body` as the client's own bytes with the router's fields spliced in,
    # when that is exact (`leg_bytes.py`); None: encode `body`.
    body_bytes: bytes | None = None
    flow: LegFlow = LegFlow.bootstrap
    # The client's request (the `kv_params` flow builds each leg's body from it).
    request: ClientRequest | None = None
    # The prefill leg's own body when it differs from `body` (`room_params`).
    prefill_body: dict[str, Any] | None = None

    @property
    def content(self) -> bytes:
        """What both legs are sent (raises ValueError for a NaN, as encoding always did)."""
        return self.body_bytes if self.body_bytes is not None else encode_leg_body(self.body)

    @property
    def prefill_content(self) -> bytes:
        """What the prefill leg is sent."""
        if self.prefill_body is None:
            return self.content
        return encode_leg_body(self.prefill_body)


def pairable(prefills: list[Worker], decodes: list[Worker]) -> tuple[list[Worker], list[Worker]]:
    """Workers of the revisions that have both roles healthy.

    During a rollout old and new pods coexist; a prefill may only pair with a
    decode of the same revision (the operator's `pdcluster.io/revision`
    label; empty for static workers, so they all pair). Raises when no
    revision has both roles.
    """
    both = {p.revision for p in prefills} & {d.revision for d in decodes}
    if not both:
        raise NoHealthyWorkerError("prefill+decode of one revision")
    return (
        [p for p in prefills if p.revision in both],
        [d for d in decodes if d.revision in both],
    )


@dataclass
class LegPlanner:
    pool: WorkerPool
    disaggregated: bool
    prefill_policy: Policy
    decode_policy: Policy
    colocated_policy: Policy
    rids: RidMinter
    rooms_source: RandomSource
    # The prompt's token ids for cache_aware (None: no policy reads them).
    prompt_tokens: Callable[[ClientRequest], PromptTokens | None] | None = None
    # The engine the workers run: how legs meet, what their bodies carry.
    engine: EngineKind = EngineKind.builtin
    connector: VllmKVConnector = VllmKVConnector.nixl

    @property
    def flow(self) -> LegFlow:
        return leg_flow_of(self.engine, self.connector)

    def plan(
        self,
        request: ClientRequest,
        rooms_in_use: Container[int],
        prompt: PromptTokens | None = None,
    ) -> LegPlan:
        """`prompt`: the request's prompt as cache_aware reads it, when the caller
        read it already (the router does, off its loop); else `prompt_tokens`."""
        prefill: Worker | None = None
        bootstrap: Bootstrap | None = None
        if prompt is None and self.prompt_tokens is not None:
            prompt = self.prompt_tokens(request)
        if self.disaggregated:
            prefill, main, bootstrap = self._pick_pair(rooms_in_use, prompt)
        else:
            main = self.colocated_policy.select(
                self.pool.of_role(Role.colocated), Role.colocated.value, prompt
            )
        rid = self.rids.mint()
        if self.flow is LegFlow.room_params and bootstrap is not None:
            prefill_body, decode_body = build_room_legs(
                request.body, request.endpoint, bootstrap, rid
            )
            return LegPlan(
                path=request.endpoint.value,
                body=decode_body,
                rid=rid,
                stream=request.stream,
                main=main,
                prefill=prefill,
                room=bootstrap.room,
                flow=self.flow,
                request=request,
                prefill_body=prefill_body,
            )
        if self.engine is EngineKind.vllm:
            # vLLM takes no rid field: the rid rides in X-Request-Id.
            body = build_leg_body(request.body, None, None)
            return LegPlan(
                path=request.endpoint.value,
                body=body,
                rid=rid,
                stream=request.stream,
                main=main,
                prefill=prefill,
                flow=self.flow,
                request=request,
            )
        body = build_leg_body(request.body, rid, bootstrap)
        return LegPlan(
            path=request.endpoint.value,
            body=body,
            rid=rid,
            stream=request.stream,
            main=main,
            prefill=prefill,
            room=None if bootstrap is None else bootstrap.room,
            body_bytes=leg_body_bytes(request.raw, request.body, body),
        )

    def _pick_pair(
        self, rooms_in_use: Container[int], prompt: PromptTokens | None = None
    ) -> tuple[Worker, Worker, Bootstrap | None]:
        """The prefill and decode workers, and the room the decode leg names (None: the
        `kv_params` flow, which has no room)."""
        # Check both roles before either policy moves its state, so a refused
        # request leaves round-robin positions and dp ranks where they were.
        for role in (Role.prefill, Role.decode):
            if not self.pool.healthy(role):
                raise NoHealthyWorkerError(role.value)
        prefills, decodes = pairable(
            self.pool.healthy(Role.prefill), self.pool.healthy(Role.decode)
        )
        prefill = self.prefill_policy.select(prefills, Role.prefill.value, prompt)
        decode = self.decode_policy.select(
            [d for d in decodes if d.revision == prefill.revision], Role.decode.value, prompt
        )
        if self.flow is LegFlow.kv_params:
            return prefill, decode, None
        if prefill.bootstrap_port is None:
            # The pool only marks a prefill worker healthy once it reported a
            # port, so this is a broken invariant rather than a user error.
            raise RouterError(
                503, "prefill worker has no bootstrap port yet", reason="prefill_not_ready"
            )
        room = mint_room(
            self.rooms_source,
            dp_size=prefill.dp_size,
            dp_rank=prefill.take_dp_rank(),
            in_use=rooms_in_use,
        )
        return prefill, decode, Bootstrap(host=prefill.host, port=prefill.bootstrap_port, room=room)

    def repick_prefill(self, decode: Worker, tried: Collection[Worker]) -> Worker | None:
        """Another healthy prefill for `decode` (of its revision), none of `tried`; None
        when there is none. The `kv_params` flow retries a request whose prefill was
        lost before anything reached the client."""
        candidates = [
            p
            for p in self.pool.healthy(Role.prefill)
            if p.revision == decode.revision and p not in tried
        ]
        if not candidates:
            return None
        chosen: Worker = self.prefill_policy.select(candidates, Role.prefill.value, None)
        return chosen
