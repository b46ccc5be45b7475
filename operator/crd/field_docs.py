"""Descriptions for spec fields whose model gives none, for `kubectl explain`
and docs/reference.md.

A description written on the model itself (`Field(description=...)`) wins;
these fill the gaps. Keys are dotted paths below `spec`; `<role>` stands for
`prefill`, `decode` and `colocated`.

Pure module.
"""

from __future__ import annotations

from pdcluster.runtime.autoscale.planner import STALE_AFTER_INTERVALS
from pdcluster.runtime.spec import Role

ROLE_PLACEHOLDER = "<role>"
ROLES = tuple(r.value for r in Role)

FIELD_DOCS: dict[str, str] = {
    "model.name": "Model name; `tiny` is the built-in deterministic model (no download).",
    "model.path": "Directory of a Hugging Face-style model inside the image; required unless "
    "`name` is `tiny`.",
    "model.computeDtype": "Dtype the engine computes in; left out: bfloat16 when a role runs "
    "on cuda, float32 otherwise (one dtype for every role).",
    "image": "Container image of every worker and router pod.",
    "kvCache": "Paged KV cache of every rank; prefill and decode must agree on it.",
    "kvCache.dtype": "Element type of the KV cache; left out: the compute dtype.",
    "kvCache.layout": "Page layout: NHD = [pages, page_size, heads, head_dim], HND = [pages, "
    "heads, page_size, head_dim].",
    "transfer": "How KV moves from prefill to decode, and when a transfer counts as failed.",
    "transfer.backend": "tcp (ZMQ over the pod network), shm (same node, one-sided writes) or "
    "nixl (NIXL agents over UCX: one-sided WRITEs over RDMA, NVLink/CUDA IPC, shared memory or "
    "TCP; needs the `nixl` extra in the image).",
    "transfer.ucx": "UCX settings of the nixl backend, set in every worker process's environment.",
    "transfer.ucx.tls": "UCX_TLS: the UCX transports nixl may use, e.g. `rc,cuda_ipc,cuda_copy`; "
    "unset: UCX's own choice.",
    "transfer.ucx.netDevices": "UCX_NET_DEVICES: the network devices nixl may use, e.g. "
    "`mlx5_0:1`; unset: all.",
    "transfer.ucx.requireRdma": "The cluster expects RDMA or GPU-direct: a nixl transfer that "
    "fell back to TCP raises a Warning Event instead of passing silently.",
    "transfer.allocationPolicy": "early: decode reserves pages while prefill computes, and the "
    "KV streams into them chunk by chunk; prefill_complete: prefill computes first, decode "
    "reserves when told the KV is ready.",
    "transfer.bootstrapTimeoutSeconds": "Prefill gives up on a room whose decode metadata has "
    "not arrived within this time.",
    "transfer.waitingTimeoutSeconds": "Decode fails a room whose KV has not fully arrived "
    "within this time.",
    "transfer.prefillWaitTimeoutSeconds": "prefill_complete only: decode fails a room whose "
    "prefill has not reported its KV computed within this time.",
    "transfer.waitingPerTokenMilliseconds": "Added per prompt token to the waiting and prefill "
    "wait timeouts (and to prefill's own transfer deadline), so a long prompt gets the time its "
    "compute and transfer need: deadline = timeout + tokens x this.",
    "transfer.abortReleaseTimeoutSeconds": "After an abort, decode frees the room's pages once "
    "every prefill rank acknowledged or this time passed.",
    "transfer.heartbeat": "Decode's health polling of each prefill instance it talks to.",
    "transfer.heartbeat.intervalSeconds": "Seconds between two polls.",
    "transfer.heartbeat.idleSeconds": "A prefill instance no room has used for this long is "
    "no longer polled and its bootstrap client is dropped; the next room on it brings both back.",
    "transfer.heartbeat.failureThreshold": "Consecutive failed polls that fail every room "
    "tied to that prefill.",
    "transfer.checksum": "Prefill sends a CRC-32 of the KV it read from its pages, decode "
    "checks it over the pages it holds before decoding (tcp and shm; tcp frames also carry one).",
    "transfer.failurePolicy": "On a failed transfer, fail the request with a clear error or "
    "recompute the prompt on decode.",
    "<role>.topology": "Ranks of one instance: dp x tp x cp x pp processes, at most 64.",
    "<role>.topology.dp": "Data-parallel engine groups sharing the instance's bootstrap server.",
    "<role>.topology.tp": "Tensor-parallel ranks; KV heads are split evenly across them.",
    "<role>.topology.cp": "Context-parallel ranks, each owning a token range (prefill only).",
    "<role>.topology.pp": "Pipeline stages, each owning a contiguous layer range.",
    "<role>.gpusPerPod": "Ranks per pod (one GPU each when device is cuda): an instance of "
    "R = dp*tp*cp*pp ranks is R / gpusPerPod pods, pod k holding ranks [k*gpusPerPod, "
    "(k+1)*gpusPerPod). Must divide R and be at most R. Left out: one pod per instance. Pod 0 "
    "is the leader; the pods of an instance are restarted together (docs/kubernetes.md, "
    "Multi-pod instances).",
    "<role>.scheduling": "How the pods of one instance are scheduled.",
    "<role>.scheduling.gang": "none: each pod on its own; podGroup: the operator creates a "
    "scheduler-plugins PodGroup (scheduling.x-k8s.io/v1alpha1) per instance with minMember = "
    "its pods and labels the pods for it, so a scheduler running the coscheduling plugin "
    "places all of them or none (the default scheduler ignores it). Needs the PodGroup CRD: "
    "without it the role's pods are not created and the cluster reports PodGroupUnavailable.",
    "<role>.scheduling.schedulerName": "schedulerName of this role's pods (e.g. the "
    "scheduler-plugins scheduler that honours PodGroups); unset: the cluster's default.",
    "<role>.placement": "Where the pods of one instance land.",
    "<role>.placement.topologyKey": "Node label (e.g. a rack or NVLink-domain label): all pods "
    "of an instance land on nodes with the same value (required pod affinity); decode pods "
    "prefer the domain of prefill pods. Unset: no such rule.",
    "<role>.device": "cuda requests one `nvidia.com/gpu` per rank of the instance's pod; cpu "
    "requests none.",
    "<role>.resources": "Container resources (requests/limits) of each pod of this role. "
    "Requests default to cpu 1 and memory 2Gi; a request or limit given here wins.",
    "<role>.nodeSelector": "Node labels each pod of this role must match.",
    "<role>.tolerations": "Tolerations of each pod of this role.",
    "<role>.affinity": "Affinity of each pod of this role.",
    "<role>.restart": "Gang restarts of a failed instance: exponential back-off and a budget.",
    "<role>.restart.backoffSeconds": "Delay before recreating an instance after its first "
    "failure; doubles with each consecutive failure.",
    "<role>.restart.maxBackoffSeconds": "Upper bound of the back-off delay.",
    "<role>.engine": "Engine limits of each rank.",
    "<role>.engine.maxRunningRequests": "Requests decoded together in one batch.",
    "<role>.engine.maxBatchTokens": "Tokens computed in one engine step.",
    "<role>.engine.maxPromptTokens": "Longest prompt accepted; longer ones get a 400 at once.",
    "<role>.engine.maxNewTokens": "Most tokens one request may generate.",
    "<role>.autoscaling": "The built-in autoscaler of this role (prefill and decode only): "
    "replicas follow the target metric within [minReplicas, maxReplicas].",
    "<role>.autoscaling.minReplicas": "Fewest instances; a manual replicas below it is raised.",
    "<role>.autoscaling.maxReplicas": "Most instances; a manual replicas above it is lowered.",
    "<role>.autoscaling.intervalSeconds": "Seconds between two scrapes and decisions; a "
    f"sample older than {STALE_AFTER_INTERVALS} intervals holds the role.",
    "<role>.autoscaling.target": "The metric held at `value`: prefill ttftP90Seconds or "
    "queuedPrefillTokensPerInstance; decode tpotP90Seconds, runningRequestsPerInstance or "
    "kvPageUsage (a fraction).",
    "<role>.autoscaling.target.metric": "The metric; it must be one of this role's.",
    "<role>.autoscaling.scaleUp": "How long a higher recommendation must last before it is "
    "applied.",
    "<role>.autoscaling.scaleDown": "How long a lower recommendation must last before it is "
    "applied.",
    "autoscaling": "Limits shared by the autoscaled roles.",
    "router": "The OpenAI-compatible router in front of the workers.",
    "router.replicas": "Router pods.",
    "router.policy": "How the router picks a worker of each role.",
    "router.policy.prefill": "Prefill selection policy; cache_aware sends a request to the "
    "prefill holding the longest cached prefix of its prompt (needs engine.prefixCache).",
    "router.policy.decode": "Decode selection policy (also a colocated cluster's); cache_aware "
    "sends a request to the decode holding the longest prefix of its prompt from earlier "
    "transfers, which prefill then does not send (needs engine.prefixCache).",
    "router.policy.maxLoadGap": "cache_aware: legs in flight by which the worker with the "
    "longest cached prefix may exceed the least-loaded candidate; beyond it, "
    "least_outstanding picks.",
    "router.service": "The Service that exposes the router.",
    "router.service.type": "Service type of the router.",
    "router.service.port": "Service port of the router (the pods listen on 8000).",
    "router.healthCheckIntervalSeconds": "Seconds between the router's worker health checks.",
    "router.requestTimeoutSeconds": "Deadline of one request through the router.",
    "router.resources": "Container resources (requests/limits) of each router pod. Requests "
    "default to cpu 250m and memory 256Mi; a request or limit given here wins.",
    "auth": "Cluster token and optional router API keys.",
    "auth.tokenSecretName": "Secret (key `token`) guarding bootstrap, ZMQ registration and "
    "admin endpoints; empty: the operator creates `<cluster>-token` once. A Secret of "
    "your own needs the label pdcluster.io/allow-reference=true.",
    "auth.routerApiKeySecretName": "Secret whose key `keys` lists the API keys the router "
    "requires, comma- or newline-separated (mounted as a file in the router pods, never "
    "passed as an environment variable); it needs the label "
    "pdcluster.io/allow-reference=true; empty: the router API is open.",
    "auth.zmqCurve": (
        "Encrypt ZMQ control and KV traffic with CURVE. Unset: on for pods the"
        " operator builds, off in local mode."
    ),
    "auth.workerApi": (
        "Workers' /generate, /abort_request and /v1/*: `token` needs the cluster token as a "
        "Bearer header (our router sends it; give it to another PD router as its worker API "
        "key); `open` only for a router that cannot send one. Server info stays guarded."
    ),
}


def lookup(path: str) -> str | None:
    """Description of a dotted spec path, e.g. `decode.topology.tp`."""
    if path in FIELD_DOCS:
        return FIELD_DOCS[path]
    head, _, rest = path.partition(".")
    if head in ROLES and rest:
        return FIELD_DOCS.get(f"{ROLE_PLACEHOLDER}.{rest}")
    return None
