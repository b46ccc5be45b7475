"""One offline vLLM engine with our connector, driven over stdin/stdout (run by vLLM's interpreter).

    python engine_host.py '{"model": ..., "role": "kv_producer", "extra": {...}, "tp": 1}'

Commands, one JSON object per line on stdin:
    {"op": "add", "id": "r1", "prompt": [ids], "max_tokens": 8, "params": {...} | null}
    {"op": "abort", "id": "r1"}            → {"event": "aborted", "id": "r1"}
    {"op": "stats"}
Events on stdout, one JSON object per line after `EVENT_MARK` (vLLM prints
its own lines there too):
    {"event": "ready", "free_blocks": n}
    {"event": "done", "id": "r1", "tokens": [...], "finish_reason": "length", "error": bool}
    {"event": "stats", "free_blocks": n, "requests": n}

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and is
stepped continuously, so the connector's transfers and delayed frees
progress between requests as they do under `vllm serve`.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from typing import Any

EVENT_MARK = "@@pdcluster "


def main() -> None:
    config = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if config.get("tp", 1) > 1:
        # One core per CPU worker: vLLM binds each TP rank to a NUMA node by
        # default, and a test box has one.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(config["tp"]))))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if config.get("role"):
        kv = KVTransferConfig(
            kv_connector="PDClusterConnector",
            kv_connector_module_path="pdcluster.runtime.vllm_connector.connector",
            kv_role=config["role"],
            kv_load_failure_policy=config.get("failure_policy", "fail"),
            kv_connector_extra_config=config.get("extra", {}),
        )
    llm = LLM(
        model=config["model"],
        dtype="float32",
        max_model_len=config.get("max_model_len", 2048),
        enforce_eager=True,
        block_size=config.get("block_size", 32),
        tensor_parallel_size=config.get("tp", 1),
        enable_prefix_caching=config.get("prefix_caching", True),
        kv_transfer_config=kv,
        seed=0,
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool

    out_lock = threading.Lock()

    def emit(event: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(EVENT_MARK + json.dumps(event) + "\n")
            sys.stdout.flush()

    commands: queue.Queue[dict[str, Any]] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                commands.put(json.loads(line))
        commands.put({"op": "exit"})

    threading.Thread(target=read, daemon=True).start()
    emit({"event": "ready", "free_blocks": pool.get_num_free_blocks()})
    while True:
        try:
            while True:
                cmd = commands.get_nowait()
                op = cmd["op"]
                if op == "exit":
                    return
                if op == "add":
                    extra = {"kv_transfer_params": cmd["params"]} if cmd.get("params") else None
                    params = SamplingParams(
                        max_tokens=cmd.get("max_tokens", 8),
                        temperature=0.0,
                        ignore_eos=True,
                        extra_args=extra,
                    )
                    engine.add_request(cmd["id"], {"prompt_token_ids": cmd["prompt"]}, params)
                elif op == "abort":
                    engine.abort_request([cmd["id"]])
                    emit({"event": "aborted", "id": cmd["id"]})
                elif op == "stats":
                    emit(
                        {
                            "event": "stats",
                            "free_blocks": pool.get_num_free_blocks(),
                            "requests": len(scheduler.requests),
                        }
                    )
        except queue.Empty:
            pass
        worked = False
        for output in engine.step():
            worked = True
            if output.finished:
                completion = output.outputs[0] if output.outputs else None
                emit(
                    {
                        "event": "done",
                        "id": output.request_id,
                        "tokens": list(completion.token_ids) if completion else [],
                        "finish_reason": completion.finish_reason if completion else None,
                        "error": completion is None or completion.finish_reason == "error",
                    }
                )
        if not worked:
            time.sleep(0.002)


if __name__ == "__main__":
    main()
