"""Settings of one engine instance, loaded at the edge and passed explicitly.

Pure module (no torch): the worker server and local mode build an
`EngineConfig` from the manifest with `engine_config_from_spec` and hand it
to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.runtime.engine.config import ModelConfig, tiny_config
from pdcluster.runtime.engine.scheduler import SchedulerConfig
from pdcluster.runtime.engine.topology import ParallelConfig
from pdcluster.runtime.spec import KVLayout, PDClusterSpec, RoleSpec

_DTYPES = ("float32", "float16", "bfloat16", "float64")


class EngineConfigError(ValueError):
    """An engine setting is invalid; the message names it."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # "tiny" or a local Hugging Face-style directory
    model_seed: int = 0  # weights seed of the tiny model
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    compute_dtype: str = "float32"  # float32 | float64 | bfloat16 | float16
    page_size: int = 16  # tokens per KV page
    # KV pages per rank; None: on CUDA, what fits `gpu_memory_utilization` of
    # the device (engine/pool_sizing.py), on the CPU the fixed default (512).
    num_pages: int | None = 512
    gpu_memory_utilization: float = 0.9  # share of the device a rank may use, weights included
    kv_dtype: str = "float32"
    kv_layout: KVLayout = KVLayout.NHD
    max_running_requests: int = 64
    max_batch_tokens: int = 2048  # tokens per forward step
    chunk_size: int = 512  # prefill tokens per sequence per step
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 1024  # largest max_tokens a request may ask for
    max_model_len: int | None = None  # prompt + output; None: the model's max positions
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Directory for shared-memory KV pools (one file per rank), for the shm transport.
    shm_dir: str | None = None
    # Reuse the KV of cached full prompt pages (spec.engine.prefixCache).
    prefix_cache: bool = False
    # Decode steps replayed from CUDA graphs where the device allows (engine/cuda_graphs.py).
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("compute_dtype", "kv_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise EngineConfigError(
                    f"{name} must be one of {_DTYPES}, got {getattr(self, name)!r}"
                )
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise EngineConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not isinstance(self.model, str) or not self.model:
            raise EngineConfigError("model must be 'tiny' or a model directory path")
        if self.num_pages is not None and self.num_pages < 2:
            raise EngineConfigError(f"num_pages must be >= 2 or None, got {self.num_pages}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_new_tokens < 1:
            raise EngineConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        try:
            self.scheduler_config(max_position_embeddings=1 << 30)
        except ValueError as err:
            raise EngineConfigError(str(err)) from None

    def model_config(self) -> ModelConfig:
        if self.model == "tiny":
            return tiny_config()
        from pdcluster.runtime.engine.weights import load_hf_config

        return load_hf_config(self.model)

    def scheduler_config(self, max_position_embeddings: int | None = None) -> SchedulerConfig:
        if max_position_embeddings is None:
            max_position_embeddings = self.model_config().max_position_embeddings
        max_len = self.max_model_len or max_position_embeddings
        if max_len > max_position_embeddings:
            raise EngineConfigError(
                f"max_model_len ({max_len}) exceeds the model's max positions "
                f"({max_position_embeddings})"
            )
        return SchedulerConfig(
            page_size=self.page_size,
            max_running_requests=self.max_running_requests,
            max_batch_tokens=self.max_batch_tokens,
            chunk_size=self.chunk_size,
            max_prompt_tokens=self.max_prompt_tokens,
            max_model_len=max_len,
        )

    def prefix_cache_salt(self, model_config: ModelConfig) -> bytes:
        """What a cached page's KV depends on besides its tokens: the weights
        (model, seed, architecture), the compute and KV dtypes, the page size
        and layout and the sharding. Every page key derives from it."""
        parts = (
            self.model,
            str(self.model_seed),
            self.compute_dtype,
            self.kv_dtype,
            str(self.kv_layout),
            str(self.page_size),
            repr(self.parallel),
            repr(model_config),
        )
        return "|".join(parts).encode()

    def shm_path_for(self, rank: int) -> str | None:
        if self.shm_dir is None:
            return None
        return f"{self.shm_dir}/kv-rank{rank}.bin"


def engine_config_from_spec(
    spec: PDClusterSpec, role: RoleSpec, shm_dir: str | None = None, model_dir: str | None = None
) -> EngineConfig:
    """The engine settings of one role of a PDCluster manifest; `model_dir` is the
    folder a `model.source` resolved to on this pod (engine/model_dir.py)."""
    topo = role.topology
    eng = role.engine
    if model_dir is None:
        model_dir = "tiny" if spec.model.name == "tiny" else str(spec.model.path)
    return EngineConfig(
        model=model_dir,
        model_seed=spec.model.seed,
        device=role.device,
        compute_dtype=str(spec.compute_dtype),
        page_size=spec.kv_cache.page_size,
        num_pages=spec.kv_cache.num_pages,  # None: sized by the runner (engine/pool_sizing.py)
        gpu_memory_utilization=spec.kv_cache.gpu_memory_utilization,
        kv_dtype=str(spec.kv_dtype),
        kv_layout=spec.kv_cache.layout,
        max_running_requests=eng.max_running_requests,
        max_batch_tokens=eng.max_batch_tokens,
        chunk_size=eng.chunk_size,
        max_prompt_tokens=eng.max_prompt_tokens,
        max_new_tokens=eng.max_new_tokens,
        max_model_len=None,
        parallel=ParallelConfig(dp=topo.dp, cp=topo.cp, tp=topo.tp, pp=topo.pp),
        shm_dir=shm_dir,
        prefix_cache=eng.prefix_cache,
        cuda_graphs=eng.cuda_graphs,
    )
