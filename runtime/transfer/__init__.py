"""KV transfer engine: moves KV pages between prefill and decode ranks.

Modules: `frames` (pure: headers, planning, validation), `job` (pure: what
to move), `checksum` (pure), `endpoint` (one ZMQ endpoint per rank) and its sending
half `outbound`,
`staging` (reusable gather buffers), `sender` (`KVSender`, common to every
transport), `tcp` (`TcpTransport`, `KVReceiver`), `shm` (`ShmTransport`),
`nixl` (`NixlTransport`) with the rank's agent `nixl_agent` (`NixlAgent`), the
WRITEs in flight `nixl_writes`, its pure planner `nixl_plan`, its log reader
`ucx_report` (pure) and `nixl_support` (extra check, UCX env).
"""
