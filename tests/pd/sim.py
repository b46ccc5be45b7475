"""In-memory wiring of decode and prefill room tables, for tests.

Every control message goes through `encode` / `decode` (so the wire format
is exercised too) and waits in a per-(sender, receiver) FIFO, like one ZMQ
connection: order holds per channel, not across channels. Tests pick which
channel delivers next, drop a dead peer's traffic, and read what each table
asked its I/O loop to do.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import TypeVar

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.decode_rooms import DecodeRankInfo, DecodeRoomTable
from pdcluster.runtime.pd.decode_sources import Source
from pdcluster.runtime.pd.messages import TransferMeta, decode, encode
from pdcluster.runtime.pd.prefill_rooms import PrefillRankInfo, PrefillRoomTable
from pdcluster.runtime.pd.prompt_digest import PromptId
from pdcluster.runtime.pd.room_common import RoomLeg
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd.topology import ModelShape, PDTopology

TOKEN = "s3cret-token"
PAGE_SIZE = 4
NUM_PAGES = 64


def compat(policy: str = "early", **overrides: object) -> CompatInfo:
    values: dict[str, object] = {
        "page_size": PAGE_SIZE,
        "kv_dtype": "float32",
        "kv_layout": "NHD",
        "allocation_policy": policy,
        "model_fingerprint": "tiny-0",
    }
    values.update(overrides)
    return CompatInfo(**values)  # type: ignore[arg-type]


def p_endpoint(rank: RankCoord) -> str:
    return f"tcp://127.0.0.1:{7000 + rank.dp * 100 + rank.cp * 30 + rank.tp * 5 + rank.pp}"


def d_endpoint(rank: RankCoord) -> str:
    return f"tcp://127.0.0.2:{8000 + rank.dp * 100 + rank.tp * 5 + rank.pp}"


BOOTSTRAP = "127.0.0.1:8998"
M = TypeVar("M")


def from_decode(
    kind: type[M],
    room: int,
    generation: int,
    rid: str | None,
    endpoint: str,
    rank: RankCoord | None = None,
    **fields: object,
) -> M:
    """A message of `kind` a decode rank sends about a room (Bootstrap, Abort, ...)."""
    return kind(
        room=room,
        generation=generation,
        rid=rid,
        decode_rank=RankCoord() if rank is None else rank,
        decode_endpoint=endpoint,
        **fields,
    )


def transfer_meta(
    room: int,
    rid: str | None,
    endpoint: str,
    pages: list[int],
    rank: RankCoord | None = None,
    prompt: PromptId | None = None,
) -> TransferMeta:
    """A decode rank's first-generation claim on `pages`, one destination per room."""
    return from_decode(
        TransferMeta,
        room,
        1,
        rid,
        endpoint,
        rank,
        dst_pages=pages,
        num_destinations=1,
        prompt=prompt,
    )


@dataclass
class Net:
    """The tables of one prefill and one decode instance, and the wires between them."""

    prefill_shape: InstanceShape = field(default_factory=InstanceShape)
    decode_shape: InstanceShape = field(default_factory=InstanceShape)
    model: ModelShape = field(default_factory=lambda: ModelShape(num_layers=4, num_kv_heads=4))
    policy: str = "early"
    decode_policy: str | None = None
    one_sided: bool = False
    settings: RoomSettings = field(default_factory=RoomSettings)
    token: str = TOKEN
    decode_token: str | None = None

    def __post_init__(self) -> None:
        self.topology = PDTopology(self.prefill_shape, self.decode_shape, self.model)
        self.prefill: dict[RankCoord, PrefillRoomTable] = {}
        self.decode: dict[RankCoord, DecodeRoomTable] = {}
        self.by_endpoint: dict[str, PrefillRoomTable | DecodeRoomTable] = {}
        for rank in self.prefill_shape.ranks():
            info = PrefillRankInfo(rank, p_endpoint(rank), compat(self.policy), self.token)
            table = PrefillRoomTable(info, self.settings)
            self.prefill[rank] = table
            self.by_endpoint[info.endpoint] = table
        d_policy = self.decode_policy or self.policy
        for rank in self.decode_shape.ranks():
            layers = self.topology.sources(rank, 0)[0].decode_layers
            heads = self.topology.sources(rank, 0)[0].decode_heads
            info = DecodeRankInfo(
                rank=rank,
                endpoint=d_endpoint(rank),
                compat=compat(d_policy),
                token=self.decode_token or self.token,
                num_pages=NUM_PAGES,
                layers=layers,
                heads=heads,
                one_sided=self.one_sided,
            )
            table = DecodeRoomTable(info, self.settings)
            self.decode[rank] = table
            self.by_endpoint[info.endpoint] = table
        self.wires: dict[tuple[str, str], deque[bytes]] = defaultdict(deque)
        self.dead: set[str] = set()
        self.log: dict[str, list[A.Action]] = defaultdict(list)

    # -------------------------------------------------------------- plumbing

    def sources(self, decode_rank: RankCoord, room: int) -> list[Source]:
        dp = self.topology.prefill_dp_for_room(room)
        return [
            Source(
                s.prefill_rank,
                p_endpoint(s.prefill_rank),
                self.topology.num_destinations(s.prefill_rank),
            )
            for s in self.topology.sources(decode_rank, dp)
        ]

    def handle(self, origin: str, acts: list[A.Action]) -> list[A.Action]:
        """Queue the Sends, log and return the rest."""
        rest = []
        for act in acts:
            if isinstance(act, A.Send):
                if origin not in self.dead and act.endpoint not in self.dead:
                    self.wires[(origin, act.endpoint)].append(encode(act.message))
            else:
                rest.append(act)
        self.log[origin].extend(rest)
        return rest

    def channels(self) -> list[tuple[str, str]]:
        return sorted(k for k, q in self.wires.items() if q)

    def receive(self, channel: tuple[str, str], now: float) -> list[A.Action]:
        """Hand the channel's next frame to its target; the raw actions, unhandled."""
        origin, target = channel
        frame = self.wires[channel].popleft()
        if target in self.dead:
            return []
        # The channel is the connection: its origin is the sender it proves.
        return self.by_endpoint[target].on_message(decode(frame), now, origin)

    def deliver(self, channel: tuple[str, str], now: float) -> list[A.Action]:
        return self.handle(channel[1], self.receive(channel, now))

    def pump(self, now: float, limit: int = 10_000) -> None:
        """Deliver everything, in channel order, until the wires are quiet."""
        for _ in range(limit):
            live = self.channels()
            if not live:
                return
            for channel in live:
                self.deliver(channel, now)
        raise AssertionError("messages kept flowing")

    def kill(self, endpoint: str) -> None:
        self.dead.add(endpoint)
        for key in list(self.wires):
            if endpoint in key:
                self.wires[key].clear()

    def actions(self, endpoint: str, kind: type) -> list:
        return [a for a in self.log[endpoint] if isinstance(a, kind)]

    # -------------------------------------------------------- request helpers

    def open_decode(self, room: int, rid: str, now: float, prompt: PromptId | None = None) -> None:
        for rank, table in self.decode.items():
            table.add_room(RoomLeg(room, rid, prompt=prompt), BOOTSTRAP, now)
            self.handle(d_endpoint(rank), table.resolve(room, self.sources(rank, room), now))

    def open_prefill(
        self, room: int, rid: str, num_tokens: int, now: float, prompt: PromptId | None = None
    ) -> None:
        dp = self.topology.prefill_dp_for_room(room)
        for rank, table in self.prefill.items():
            if rank.dp == dp:
                self.handle(
                    p_endpoint(rank), table.open_room(RoomLeg(room, rid, num_tokens, prompt), now)
                )

    def assign(self, room: int, pages: list[int], now: float) -> None:
        for rank, table in self.decode.items():
            self.handle(d_endpoint(rank), table.assign_pages(room, pages, now))

    def prefill_group(self, room: int) -> dict[RankCoord, PrefillRoomTable]:
        dp = self.topology.prefill_dp_for_room(room)
        return {r: t for r, t in self.prefill.items() if r.dp == dp}

    def send_all(self, room: int, now: float, first_token: int = 7) -> None:
        """Every prefill rank of the room's group writes one chunk, drains, finishes."""
        for rank, table in self.prefill_group(room).items():
            origin = p_endpoint(rank)
            if table.can_send(room):
                self.handle(origin, table.writes_enqueued(room, 1, now))
                self.handle(origin, table.writes_done(room, 1, True, now))
                self.handle(origin, table.finish_sending(room, first_token, 1234, now))
