"""What one vLLM rank is to our control plane: its coordinates, its slice, its compatibility fields.

A vLLM engine of tensor-parallel size T is one instance of ours with
`dp = cp = pp = 1, tp = T`: rank t holds every layer and the KV heads
`[t·H/T, (t+1)·H/T)` of the model's H, exactly as our engine splits them,
so `PDTopology` pairs a vLLM prefill of one TP size with a vLLM decode of
another through the same head-splitting rules (prefill TP1 → decode TP2:
each decode rank reads its half of every head from the one prefill rank).

Refused here, with the setting named: pipeline, context or data parallel
vLLM engines (their layer or token split is vLLM's, not ours), fewer KV
heads than ranks (vLLM then replicates heads), and a cache whose geometry
disagrees with the model's.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.runtime.engine.kv_shape import KVPoolShape
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.messages import PROTOCOL_VERSION
from pdcluster.runtime.spec import AllocationPolicy, Role, TransferBackend
from pdcluster.runtime.spec.base import SpecError


@dataclass(frozen=True)
class EngineFacts:
    """The numbers the connector reads off vLLM's config for one rank."""

    role: Role
    tp_size: int
    tp_rank: int
    num_layers: int  # the model's attention layers
    num_kv_heads: int  # the model's KV heads (all ranks together)
    head_size: int
    block_size: int
    kv_dtype: str  # float32, float16, bfloat16
    model_fingerprint: str
    pp_size: int = 1
    dcp_size: int = 1
    pcp_size: int = 1
    dp_size: int = 1

    def check(self) -> None:
        """SpecError naming the first vLLM setting our protocol cannot pair."""
        for name, value in (
            ("pipeline_parallel_size", self.pp_size),
            ("decode_context_parallel_size", self.dcp_size),
            ("prefill_context_parallel_size", self.pcp_size),
            ("data_parallel_size", self.dp_size),
        ):
            if value != 1:
                raise SpecError(
                    f"{name}={value}: the PDCluster connector pairs tensor-parallel vLLM "
                    "engines only (run one engine per data-parallel replica)"
                )
        if self.num_kv_heads % self.tp_size:
            raise SpecError(
                f"tensor_parallel_size={self.tp_size} does not divide the model's "
                f"{self.num_kv_heads} KV heads (vLLM would replicate them)"
            )

    @property
    def shape(self) -> InstanceShape:
        return InstanceShape(dp=1, cp=1, tp=self.tp_size, pp=1)

    @property
    def coord(self) -> RankCoord:
        return RankCoord(dp=0, cp=0, tp=self.tp_rank, pp=0)

    @property
    def heads(self) -> tuple[int, int]:
        """This rank's KV heads, `[start, end)` of the model's."""
        per_rank = self.num_kv_heads // self.tp_size
        return self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank

    def check_cache(self, shape: KVPoolShape) -> None:
        """SpecError if the registered cache is not this rank's slice of the model."""
        want = (self.num_layers, self.block_size, self.heads[1] - self.heads[0], self.head_size)
        got = (shape.num_layers, shape.page_size, shape.num_kv_heads, shape.head_dim)
        if want != got or shape.dtype != self.kv_dtype:
            raise SpecError(
                "vLLM's KV cache (layers, block size, KV heads, head size, dtype) = "
                f"{(*got, shape.dtype)}, the model's slice for this rank is "
                f"{(*want, self.kv_dtype)}"
            )

    def compat(self, kv_layout: str, backend: TransferBackend) -> CompatInfo:
        """What this rank publishes and checks at every handshake (`kv_layout`: the
        pool's order, with the backend's page format when pages move whole)."""
        return CompatInfo(
            page_size=self.block_size,
            kv_dtype=self.kv_dtype,
            kv_layout=kv_layout,
            allocation_policy=str(AllocationPolicy.early),
            model_fingerprint=self.model_fingerprint,
            transfer_backend=str(backend),
            protocol_version=PROTOCOL_VERSION,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size,
        )
