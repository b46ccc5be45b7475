"""The vLLM `/metrics` series PDCluster reads, by what they stand for.

Names as the installed wheel exports them (`vllm/v1/metrics/loggers.py`,
vLLM 0.32); every series carries `engine` (the dp rank) and `model_name`
labels, so readers sum counts and average fractions over the label sets.

What each stands for in the autoscaler's readings (autoscale/samples.py):
- time to first token (histogram): ours `pdcluster_time_to_first_token_seconds`,
  vLLM's `vllm:time_to_first_token_seconds`;
- time per output token, per request: ours `pdcluster_time_per_output_token_seconds`,
  vLLM's `vllm:request_time_per_output_token_seconds`;
- requests in the worker: ours `pdcluster_requests_in_flight`, vLLM's
  `vllm:num_requests_running` + `vllm:num_requests_waiting`;
- KV in use (a fraction): ours 1 - `kv_free_pages` / `kv_total_pages`, vLLM's
  `vllm:kv_cache_usage_perc` (0..1, despite the name);
- queued prompt tokens: ours `pdcluster_queued_prefill_tokens`; vLLM has none
  (the metric is refused at admission for `engine.kind: vllm`).

Pure module.
"""

from __future__ import annotations

PREFIX = "vllm:"
TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
