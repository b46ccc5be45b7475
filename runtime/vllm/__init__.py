"""Stock vLLM as a PDCluster engine (`spec.engine.kind: vllm`), pure and shared by
the operator, local mode and the router's metric readers:

- `serve_command` — the manifest as `vllm serve` arguments and environment;
- `metric_names`  — the vLLM `/metrics` series PDCluster reads, by what they mean.

The router's side of vLLM's disaggregated flow lives in
`pdcluster.runtime.router` (`vllm_legs`, `vllm_relay`).
"""
