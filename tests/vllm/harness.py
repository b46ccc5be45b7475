"""Real vLLM processes for tests: a tiny model, manifests, and reading vLLM's metrics.

A module starts its vLLM cluster once (`pdcluster up` with `--vllm` naming
the cached vLLM environment, e2e/vllmenv) and shares it: a vLLM process
takes a minute or two to start on a busy 2-core box.

- `write_vllm_model(dir)`: a random-weight Llama (tests/engine/testing.py) with
  a chat template, so both OpenAI endpoints serve it;
- `vllm_spec(model_dir, ...)`: a `kind: vllm` spec sized for CPU (vLLM's CPU
  attention wants KV blocks of a multiple of 32; 1 GiB of KV; eager mode;
  the engine in the API server's process tree without a third process);
- `WorkerMetrics`: one vLLM worker's /metrics, read for what tests assert.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.testing import write_random_hf_dir

MODEL_NAME = "tiny-llama"
# Jinja the chat endpoint renders (the random tokenizer ships none).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# What every vLLM process of the tests gets (engine.vllm.env).
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # The engine core runs the model itself (no third worker process).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM's CPU build pins each rank's OpenMP threads to cores of its own
    # ("auto"), one NUMA node per local rank: on a one-node box a TP2 engine
    # refuses to start ("Not enough allowed NUMA nodes"), and every TP1 engine
    # is pinned to core 0. The tests' processes share the box's cores instead.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def write_vllm_model(directory: Path) -> Path:
    root = write_random_hf_dir(
        directory, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512
    )
    config = root / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    config.write_text(json.dumps(data, indent=2))
    return root


def vllm_spec(model_dir: Path, *, prefills: int = 1, decodes: int = 1) -> dict[str, Any]:
    """A disaggregated `kind: vllm` spec over NixlConnector, sized for CPU tests."""
    return {
        "engine": {
            "kind": "vllm",
            "vllm": {
                "extraArgs": ["--max-model-len", "1024", "--enforce-eager"],
                "env": dict(CPU_ENV),
            },
        },
        "model": {"name": MODEL_NAME, "path": str(model_dir)},
        "kvCache": {"pageSize": 128},
        "transfer": {"backend": "nixl", "failurePolicy": "fail"},
        "prefill": {"replicas": prefills, "restart": {"backoffSeconds": 0}},
        "decode": {"replicas": decodes},
        "router": {"policy": {"prefill": "round_robin", "decode": "round_robin"}},
    }


@dataclass(frozen=True)
class WorkerMetrics:
    """The series of one vLLM worker's /metrics the tests read, summed over dp ranks."""

    values: dict[str, float]

    def get(self, name: str, **labels: str) -> float:
        key = name + json.dumps(labels, sort_keys=True) if labels else name
        return self.values.get(key, 0.0)

    @property
    def running(self) -> float:
        return self.get("vllm:num_requests_running")

    @property
    def waiting(self) -> float:
        return self.get("vllm:num_requests_waiting")

    @property
    def kv_usage(self) -> float:
        return self.get("vllm:kv_cache_usage_perc")

    @property
    def kv_reads(self) -> float:
        """KV transfers this worker completed as the reader (a decode)."""
        return self.get("vllm:nixl_xfer_time_seconds_count")

    @property
    def prompt_tokens(self) -> float:
        return self.get("vllm:prompt_tokens_total")


def read_metrics(url: str) -> WorkerMetrics:
    text = httpx.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("engine", "model_name")}
            for key in {sample.name, sample.name + json.dumps(labels, sort_keys=True)}:
                values[key] = values.get(key, 0.0) + sample.value
    return WorkerMetrics(values)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until `check()`; the seconds it took. AssertionError naming `what` after `timeout`."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.2)
    return time.monotonic() - started


def is_idle(url: str) -> bool:
    """No request running or waiting and no KV block held (a prefix-cached block is free)."""
    m = read_metrics(url)
    return m.running == 0 and m.waiting == 0 and m.kv_usage == 0
