"""The registry behind one prefill instance's bootstrap server.

Every prefill rank registers once at start (and again after a restart):
its coordinates, the instance sizes it was started with, its control
endpoint and the compatibility fields. Decode asks for the instance as a
whole (ready only when every *distinct* rank registered: a rank registering
twice counts once) and for single ranks' endpoints.

Rules:
- sizes must equal the instance's expected topology; coordinates must lie
  inside it — else 400 naming the field;
- compatibility fields must equal those of earlier registrations (the first
  registration sets them) — else 400 naming the field and both values;
- a re-registration of the same rank replaces its endpoint (a restarted rank
  comes back on a new port);
- a rank may say which incarnation it is (its pod's uid on Kubernetes):
  decode keeps it with the rank's endpoint, and the instance's is its rank
  0's (the leader pod's), so an operator report about a pod that is gone
  is told from one about its successor at the same address;
- room → dp-rank entries (for routing that is not `room % dp`) expire after
  `dp_entry_ttl_s` and are bounded in number.

Errors carry the HTTP status the server answers with. Pure module: the
caller passes `now`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated

import msgspec

from pdcluster.runtime.pd.compat import CompatInfo, describe, find_mismatches
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord

Endpoint = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# What makes one start of a rank's process another's: its pod's uid, which the
# operator gives every worker pod in this variable (downward API).
Incarnation = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
INCARNATION_ENV = "PDCLUSTER_INCARNATION"

MAX_DP_ENTRIES = 1 << 16


class RankRegistration(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Body of `PUT /route`."""

    rank: RankCoord
    shape: InstanceShape
    endpoint: Endpoint  # the rank's ZMQ control endpoint, e.g. tcp://10.0.0.5:7100
    compat: CompatInfo
    incarnation: Incarnation | None = None  # its pod's uid (None: not on Kubernetes)


class RankAddress(msgspec.Struct, frozen=True, omit_defaults=True):
    rank: RankCoord
    endpoint: str
    incarnation: str | None = None


class InstanceInfo(msgspec.Struct, frozen=True):
    """Answer of `GET /route` with all coordinates -1."""

    shape: InstanceShape
    compat: CompatInfo
    ranks: list[RankAddress]

    @property
    def incarnation(self) -> str | None:
        """The instance's incarnation: its leader's, the pod of rank 0 (None: unknown)."""
        first = RankCoord()
        return next((r.incarnation for r in self.ranks if r.rank == first), None)


class RegistryError(ValueError):
    status = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnknownRank(RegistryError):
    status = 404


class NotReady(RegistryError):
    status = 503

    def __init__(self, registered: int, expected: int) -> None:
        super().__init__(f"prefill instance not fully registered: {registered}/{expected} ranks")
        self.registered = registered
        self.expected = expected


class BootstrapRegistry:
    def __init__(self, expected: InstanceShape, dp_entry_ttl_s: float = 300.0) -> None:
        if not dp_entry_ttl_s > 0:
            raise ValueError(f"dp_entry_ttl_s must be > 0, got {dp_entry_ttl_s}")
        self.expected = expected
        self.dp_entry_ttl_s = dp_entry_ttl_s
        self._ranks: dict[RankCoord, RankRegistration] = {}
        self._compat: CompatInfo | None = None
        self._dp_entries: OrderedDict[int, tuple[float, int]] = OrderedDict()

    @property
    def num_registered(self) -> int:
        return len(self._ranks)

    @property
    def num_expected(self) -> int:
        return self.expected.num_ranks

    @property
    def is_ready(self) -> bool:
        return self.num_registered == self.num_expected

    def register(self, reg: RankRegistration) -> bool:
        """Record a rank; True if it is new. Raises RegistryError naming the field."""
        for dim in ("dp", "cp", "tp", "pp"):
            want, got = getattr(self.expected, dim), getattr(reg.shape, dim)
            if want != got:
                raise RegistryError(
                    f"shape.{dim}: this instance has {dim}={want}, the rank says {got}",
                    f"shape.{dim}",
                )
            if getattr(reg.rank, dim) >= want:
                raise RegistryError(
                    f"rank.{dim}: {getattr(reg.rank, dim)} is outside {dim}={want}", f"rank.{dim}"
                )
        if self._compat is not None:
            mismatches = find_mismatches(self._compat, reg.compat)
            if mismatches:
                raise RegistryError(
                    describe(mismatches, "registered", "this rank"), mismatches[0].field
                )
        is_new = reg.rank not in self._ranks
        self._ranks[reg.rank] = reg
        if self._compat is None:
            self._compat = reg.compat
        return is_new

    def instance_info(self) -> InstanceInfo:
        if not self.is_ready or self._compat is None:
            raise NotReady(self.num_registered, self.num_expected)
        ranks = [
            RankAddress(r.rank, r.endpoint, r.incarnation) for _, r in sorted(self._ranks.items())
        ]
        return InstanceInfo(shape=self.expected, compat=self._compat, ranks=ranks)

    def rank_address(self, rank: RankCoord) -> RankAddress:
        reg = self._ranks.get(rank)
        if reg is None:
            raise UnknownRank(f"rank {rank} is not registered")
        return RankAddress(reg.rank, reg.endpoint, reg.incarnation)

    def register_dp_rank(self, room: int, dp_rank: int, now: float) -> None:
        if not 0 <= dp_rank < self.expected.dp:
            raise RegistryError(f"dp_rank: {dp_rank} is outside dp={self.expected.dp}", "dp_rank")
        self.prune(now)
        self._dp_entries.pop(room, None)
        self._dp_entries[room] = (now + self.dp_entry_ttl_s, dp_rank)
        while len(self._dp_entries) > MAX_DP_ENTRIES:
            self._dp_entries.popitem(last=False)

    def query_dp_ranks(self, rooms: list[int], now: float) -> dict[int, int]:
        """Known, unexpired rooms → their dp rank (unknown rooms are left out)."""
        self.prune(now)
        out = {}
        for room in rooms:
            entry = self._dp_entries.get(room)
            if entry is not None:
                out[room] = entry[1]
        return out

    def prune(self, now: float) -> None:
        # Constant ttl and re-insertion on update keep the dict in expiry order.
        while self._dp_entries:
            room, (expires, _) = next(iter(self._dp_entries.items()))
            if expires > now:
                break
            del self._dp_entries[room]
