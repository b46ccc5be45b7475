"""Worker pods of one role instance, and the bootstrap Service of a prefill instance.

Layout (`pod_layout`, runtime/pod_layout.py): an instance of R = dp*tp*cp*pp
ranks with `gpusPerPod: G` runs as R / G pods (one pod when `gpusPerPod` is
left out), pod k running ranks [k * G, (k + 1) * G); on `device: cuda` a pod
asks for one GPU per rank it runs. Pod 0 is the leader: bootstrap server,
HTTP API, the store the other pods join; it alone is labelled
`pdcluster.io/leader: "true"`, carries HTTP probes and is what the bootstrap
Service and the router select.

Leader address (no cluster DNS): a pod k > 0 is built only once the leader
pod has an IP, and gets it as `$PDCLUSTER_LEADER_ADDRESS` (and the
`pdcluster.io/leader-address` annotation, which the planner and the fast
path read). A new leader is a new gang anyway (reconcile/instances.py), so
the address never changes under a running pod; a plain variable needs no
downward-API volume, which the e2e node agent does not mount.

Pods k > 0 serve no HTTP, so they carry no probes: they are Ready while
their rank processes run, and exit (the pod turns Failed) when one dies.

With `spec.engine.kind: vllm` the container is `vllm serve` (vllm_pods.py),
labelled `pdcluster.io/engine: vllm`; an instance is one pod, without a
bootstrap Service.

The pods are managed directly (no StatefulSet), with `restartPolicy: Never`,
so a crashed rank turns its pod Failed and the planner restarts the whole
instance instead of the kubelet restarting one rank its peers cannot rejoin.

Pod names carry the role template hash, so during a rollout the new
instance i can run beside the old one (surge) without a name clash.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.builders import meta, podsecurity
from pdcluster.operator.builders.disruption import worker_grace_period_s
from pdcluster.operator.builders.meta import BuildError, Manifest
from pdcluster.operator.builders.model_volume import build_model_mount
from pdcluster.operator.builders.overlay import apply_pod_overlay
from pdcluster.operator.builders.scheduling import build_pod_group, build_pod_scheduling
from pdcluster.operator.builders.vllm_pods import (
    build_vllm_container,
    vllm_annotations,
    vllm_labels,
)
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.operator.reconcile.revision import (
    compute_cluster_revision,
    compute_template_hash,
)
from pdcluster.runtime.dp_ports import derived_dp_ports
from pdcluster.runtime.pd.bootstrap_registry import INCARNATION_ENV
from pdcluster.runtime.pod_layout import LEADER_POD, PodLayout
from pdcluster.runtime.pod_rendezvous import (
    LEADER_ADDRESS_ENV,
    RendezvousError,
    parse_leader_address,
)
from pdcluster.runtime.spec import PDClusterSpec, Role, RoleSpec

GPU_RESOURCE = "nvidia.com/gpu"
WORKER_CONTAINER = "worker"
# A model may take minutes to load (up to PERIOD * FAILURES = 10 min); liveness
# only starts once /health answered. A short period makes a fresh pod Ready soon.
STARTUP_PROBE_PERIOD_S = 2
STARTUP_PROBE_FAILURES = 300
# NotReady after READINESS_PERIOD * READINESS_FAILURES seconds without /health.
READINESS_PERIOD_S = 2
READINESS_FAILURES = 3


def pod_layout(spec: RoleSpec) -> PodLayout:
    """How the ranks of one instance map onto pods (`gpusPerPod`)."""
    layout: PodLayout = spec.pod_layout
    return layout


def placed_spec(spec: PDClusterSpec) -> PDClusterSpec:
    """The spec as the pods read it: defaults the operator decides filled in."""
    update: dict[str, Any] = {}
    if spec.auth.zmq_curve is None:
        # On Kubernetes ranks talk over the pod network: encrypted unless the
        # spec says `zmqCurve: false` (see docs/security.md).
        update["auth"] = spec.auth.model_copy(update={"zmq_curve": True})
    return spec.model_copy(update=update)


@dataclass(frozen=True, order=True)
class InstanceKey:
    """One instance generation: role, index and the template it was built from."""

    role: Role
    index: int
    template_hash: str

    def __str__(self) -> str:
        return f"{self.role.value}-{self.index}@{self.template_hash}"


@dataclass(frozen=True)
class InstanceManifests:
    key: InstanceKey
    # Ordered by pod index: the leader, then (when its address was given) the others.
    pods: tuple[Manifest, ...]
    bootstrap_service: Manifest | None
    num_pods: int = 1  # pods of the whole instance (`pods` may hold only the leader)
    # `scheduling.gang: podGroup`: the PodGroup its pods name; created before them.
    pod_group: Manifest | None = None

    @property
    def pod_names(self) -> tuple[str, ...]:
        return tuple(str(p["metadata"]["name"]) for p in self.pods)


def _role(cluster: Cluster, role: Role) -> RoleSpec:
    spec = cluster.spec.role_spec(role)
    if spec is None:
        raise BuildError(f"cluster {cluster.name} has no {role.value} role")
    return spec


def token_secret_for(cluster: Cluster) -> str:
    """The Secret whose key `token` pods read: the user's, or the one the operator creates."""
    name: str = cluster.spec.auth.token_secret_name or names.token_secret_name(cluster.name)
    return name


def build_resources(spec: RoleSpec, role: Role) -> dict[str, Any]:
    """The role's resources, plus one `nvidia.com/gpu` per rank of a pod when on cuda."""
    unknown = set(spec.resources) - {"limits", "requests", "claims"}
    if unknown:
        raise BuildError(
            f"{role.value}.resources: unknown keys {sorted(unknown)} "
            "(expected limits, requests, claims)"
        )
    resources: dict[str, Any] = {}
    for key, value in spec.resources.items():
        if key in ("limits", "requests") and not isinstance(value, dict):
            raise BuildError(f"{role.value}.resources.{key} must be a mapping")
        resources[key] = dict(value) if isinstance(value, dict) else value
    if spec.device == "cuda":
        gpus = pod_layout(spec).ranks_per_pod
        for key in ("limits", "requests"):
            given = resources.get(key, {}).get(GPU_RESOURCE)
            if given is not None and str(given) != str(gpus):
                raise BuildError(
                    f"{role.value}.resources.{key}.{GPU_RESOURCE} is {given} but an instance "
                    f"pod runs {gpus} ranks (dp*tp*cp*pp), one GPU each; leave it out, "
                    "the operator sets it"
                )
        limits = resources.setdefault("limits", {})
        limits[GPU_RESOURCE] = gpus
        if GPU_RESOURCE in resources.get("requests", {}):
            resources["requests"][GPU_RESOURCE] = gpus
    else:
        for key in ("limits", "requests"):
            if GPU_RESOURCE in resources.get(key, {}):
                raise BuildError(
                    f"{role.value}.resources.{key} asks for {GPU_RESOURCE} but device is cpu; "
                    "set device: cuda"
                )
    return resources


def _worker_args(role: Role, index: int, pod_index: int) -> list[str]:
    args = [
        "worker",
        "-f",
        meta.MANIFEST_ARG,
        "--role",
        role.value,
        "--instance",
        str(index),
        "--pod-index",
        str(pod_index),
        "--host",
        meta.BIND_HOST,
        "--port",
        str(meta.HTTP_PORT),
        "--dist-port",
        str(meta.DIST_PORT),
    ]
    if role == Role.prefill:
        args += ["--bootstrap-port", str(meta.BOOTSTRAP_PORT)]
    return args


def _worker_env(
    cluster: Cluster,
    layout: PodLayout,
    spec: RoleSpec,
    key: InstanceKey,
    pod_index: int,
    leader: str,
    revision: str,
) -> list[dict[str, Any]]:
    return [
        *meta.manifest_env(names.config_map_name(cluster.name)),
        meta.env_value(podsecurity.TOKEN_FILE_ENV, f"{podsecurity.TOKEN_DIR}/{meta.TOKEN_KEY}"),
        meta.env_value("HOME", podsecurity.HOME_DIR),
        meta.env_field("POD_NAME", "metadata.name"),
        meta.env_field("POD_NAMESPACE", "metadata.namespace"),
        # Which start of this pod: its ranks register it, and the operator's
        # loss reports name it (a report about a predecessor at the same IP
        # fails nothing of this pod's).
        meta.env_field(INCARNATION_ENV, "metadata.uid"),
        meta.env_value("PDCLUSTER_CLUSTER", cluster.name),
        meta.env_value("PDCLUSTER_LEADER_POD", leader),
        meta.env_value("PDCLUSTER_ROLE", key.role.value),
        meta.env_value("PDCLUSTER_INSTANCE", str(key.index)),
        meta.env_value("PDCLUSTER_POD_INDEX", str(pod_index)),
        meta.env_value("PDCLUSTER_PODS_PER_INSTANCE", str(layout.num_pods)),
        meta.env_value(names.ENV_RANKS_PER_POD, str(layout.ranks_per_pod)),
        meta.env_value(names.ENV_FIRST_RANK, str(layout.rank_range(pod_index).start)),
        meta.env_value("PDCLUSTER_NUM_RANKS", str(spec.topology.num_ranks)),
        meta.env_value("PDCLUSTER_REVISION", revision),
        meta.log_format_env(cluster.spec),
    ]


def _dp_container_ports(spec: RoleSpec, layout: PodLayout, pod_index: int) -> list[dict[str, Any]]:
    """The store and internal HTTP ports of the dp groups > 0 whose rank 0 this pod
    hosts (fixed, runtime/dp_ports.py); the NetworkPolicy lets the instance's pods in.
    Pod 0 declares none: its dp leaders serve on loopback, next to the front."""
    dp = spec.topology.dp
    if dp == 1 or pod_index == LEADER_POD:
        return []
    ports = derived_dp_ports(dp, meta.DIST_PORT)
    group = layout.num_ranks // dp
    out = []
    for d in range(1, dp):
        if layout.pod_of_rank(d * group) != pod_index:
            continue
        out.append({"name": f"dist-dp{d}", "containerPort": ports.dist_port(d), "protocol": "TCP"})
        out.append({"name": f"http-dp{d}", "containerPort": ports.http_port(d), "protocol": "TCP"})
    return out


def _instance_key(cluster: Cluster, role: Role, index: int) -> InstanceKey:
    if index < 0:
        raise BuildError(f"instance index must be >= 0, got {index}")
    return InstanceKey(role, index, compute_template_hash(cluster.spec, role))


def worker_labels(key: InstanceKey, pod_index: int, revision: str) -> dict[str, str]:
    identity = names.PodIdentity(key.role, key.index, key.template_hash, pod_index)
    return {
        **names.pod_identity_labels(identity),
        names.LABEL_LEADER: str(pod_index == LEADER_POD).lower(),
        names.LABEL_REVISION: revision,
    }


def _leader_address(role: Role, pod_index: int, leader_address: str | None) -> str | None:
    """The leader's address a pod k > 0 gets, checked; None for the leader itself."""
    if pod_index == LEADER_POD:
        return None
    if leader_address is None:
        raise BuildError(
            f"{role.value} pod index {pod_index} needs its leader pod's address "
            "(pods k > 0 are built once the leader pod has an IP)"
        )
    try:
        return parse_leader_address(leader_address)
    except RendezvousError as err:
        raise BuildError(f"{role.value} pod index {pod_index}: {err}") from None


def build_worker_pod(
    cluster: Cluster,
    role: Role,
    index: int,
    pod_index: int,
    leader_address: str | None = None,
) -> Manifest:
    """Pod `pod_index` of instance `index` of `role`; a pod k > 0 needs `leader_address`,
    the leader pod's IP."""
    spec = _role(cluster, role)
    layout = pod_layout(spec)
    num_pods = layout.num_pods
    if not 0 <= pod_index < num_pods:
        raise BuildError(
            f"{role.value} has {num_pods} pods per instance; pod index {pod_index} is out of range"
        )
    leader_host = _leader_address(role, pod_index, leader_address)
    key = _instance_key(cluster, role, index)
    revision = compute_cluster_revision(cluster.spec)
    name = names.pod_name(cluster.name, role, index, key.template_hash, pod_index)
    leader = names.pod_name(cluster.name, role, index, key.template_hash, LEADER_POD)
    annotations = {
        names.ANNOTATION_HTTP_PORT: str(meta.HTTP_PORT),
        names.ANNOTATION_DIST_PORT: str(meta.DIST_PORT),
        names.ANNOTATION_INSTANCE_SIZE: str(num_pods),
    }
    ports = [
        {"name": "http", "containerPort": meta.HTTP_PORT, "protocol": "TCP"},
        {"name": "dist", "containerPort": meta.DIST_PORT, "protocol": "TCP"},
    ]
    ports += _dp_container_ports(spec, layout, pod_index)
    if role == Role.prefill and leader_host is None:
        annotations[names.ANNOTATION_BOOTSTRAP_PORT] = str(meta.BOOTSTRAP_PORT)
        ports.append({"name": "bootstrap", "containerPort": meta.BOOTSTRAP_PORT, "protocol": "TCP"})
    env = _worker_env(cluster, layout, spec, key, pod_index, leader, revision)
    if leader_host is not None:
        annotations[names.ANNOTATION_LEADER_ADDRESS] = leader_host
        env.append(meta.env_value(LEADER_ADDRESS_ENV, leader_host))
    resources = podsecurity.with_default_requests(build_resources(spec, role), "worker")
    labels = worker_labels(key, pod_index, revision)
    if cluster.spec.engine.is_vllm:
        identity = [
            meta.env_field("POD_NAME", "metadata.name"),
            meta.env_field("POD_NAMESPACE", "metadata.namespace"),
            # Our connector registers it, as our ranks do (see _worker_env).
            meta.env_field(INCARNATION_ENV, "metadata.uid"),
            meta.env_value("PDCLUSTER_CLUSTER", cluster.name),
            meta.env_value("PDCLUSTER_ROLE", key.role.value),
            meta.env_value("PDCLUSTER_INSTANCE", str(key.index)),
            meta.env_value("PDCLUSTER_REVISION", revision),
        ]
        vllm = build_vllm_container(cluster, role, spec, identity_env=identity)
        vllm["resources"] = resources
        vllm["securityContext"] = podsecurity.container_security_context()
        annotations = vllm_annotations(cluster, role, num_pods)
        labels.update(vllm_labels())
        return _pod(cluster, spec, (role, index, pod_index), name, labels, annotations, vllm)
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": cluster.spec.image,
        "command": ["pdcluster"],
        "args": _worker_args(role, index, pod_index),
        "env": env,
        "ports": ports,
        "resources": resources,
        "securityContext": podsecurity.container_security_context(),
    }
    if leader_host is None:
        # Only the leader serves HTTP; it answers 503 until every rank of every
        # pod joined, so its readiness is the instance's. A pod k > 0 has no
        # probes: it ends (Failed) when one of its ranks dies.
        container["startupProbe"] = meta.http_probe(STARTUP_PROBE_PERIOD_S, STARTUP_PROBE_FAILURES)
        container["readinessProbe"] = meta.http_probe(READINESS_PERIOD_S, READINESS_FAILURES)
        # /health/live fails only for an engine that is gone or hung
        # (engine_stalled): the kubelet restarts it; a worker still waiting
        # for its peers stays alive (readiness keeps it out of the pool).
        container["livenessProbe"] = meta.http_probe(10, 3, timeout_s=5, path="/health/live")
    return _pod(cluster, spec, (role, index, pod_index), name, labels, annotations, container)


def _pod(
    cluster: Cluster,
    spec: RoleSpec,
    where: tuple[Role, int, int],
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str],
    container: dict[str, Any],
) -> Manifest:
    """The pod every worker container runs in (`where`: role, instance, pod index): the
    cluster token file and the model mounted, the drain's grace, the user's overlay."""
    role, index, pod_index = where
    volumes, mounts = podsecurity.writable_volumes()
    token_volume, token_mount = podsecurity.token_volume(token_secret_for(cluster), meta.TOKEN_KEY)
    volumes.append(token_volume)
    mounts.append(token_mount)
    model = build_model_mount(cluster.spec)
    volumes.extend(model.volumes)
    mounts.extend(model.mounts)
    container["env"].extend(model.env)
    container["volumeMounts"] = mounts
    # A worker that cannot start (no model at its source) says why in the pod's status.
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    pod_spec: dict[str, Any] = {
        # A rank that dies must fail the pod so the whole gang restarts.
        "restartPolicy": "Never",
        # The drain (builders/disruption.py): never cut at Kubernetes' 30 s.
        "terminationGracePeriodSeconds": worker_grace_period_s(cluster, spec, pod_index),
        "serviceAccountName": names.runtime_account_name(cluster.name),
        # Workers never call the API (leaders are found through the bootstrap
        # Service), so they carry no service-account token.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": podsecurity.pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    if model.init_containers:
        pod_spec["initContainers"] = list(model.init_containers)
    pod_meta = meta.object_meta(
        cluster.ref,
        name,
        component="worker",
        labels=labels,
        annotations=annotations,
    )
    # Last: the user's overlay joins whatever the engine's container is.
    apply_pod_overlay(pod_meta, pod_spec, spec.pod, WORKER_CONTAINER)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": pod_meta,
        "spec": pod_spec,
    }
    return build_pod_scheduling(cluster, role, index).apply_to(pod)


def build_bootstrap_service(cluster: Cluster, index: int) -> Manifest:
    """Headless Service naming the bootstrap server (pod 0) of prefill instance `index`."""
    _role(cluster, Role.prefill)
    key = _instance_key(cluster, Role.prefill, index)
    selector = {
        names.LABEL_CLUSTER: cluster.name,
        names.LABEL_ROLE: Role.prefill.value,
        names.LABEL_INSTANCE_INDEX: str(index),
        names.LABEL_TEMPLATE: key.template_hash,
        names.LABEL_POD_INDEX: "0",
    }
    labels = {
        names.LABEL_ROLE: Role.prefill.value,
        names.LABEL_INSTANCE_INDEX: str(index),
        names.LABEL_TEMPLATE: key.template_hash,
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta.object_meta(
            cluster.ref,
            names.bootstrap_service_name(cluster.name, index, key.template_hash),
            component="bootstrap",
            labels=labels,
        ),
        "spec": {
            "clusterIP": "None",
            # Ranks register with the bootstrap server before the leader is Ready.
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [
                {
                    "name": "bootstrap",
                    "port": meta.BOOTSTRAP_PORT,
                    "targetPort": "bootstrap",
                    "protocol": "TCP",
                },
                {"name": "http", "port": meta.HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def build_instance(
    cluster: Cluster, role: Role, index: int, leader_address: str | None = None
) -> InstanceManifests:
    """The objects of one instance: its leader pod, its other pods when the leader's
    address is known (`leader_address`), for prefill its bootstrap Service, and with
    `scheduling.gang: podGroup` its PodGroup."""
    spec = _role(cluster, role)
    key = _instance_key(cluster, role, index)
    num_pods = pod_layout(spec).num_pods
    built = range(num_pods) if leader_address is not None else range(LEADER_POD + 1)
    pods = tuple(build_worker_pod(cluster, role, index, k, leader_address) for k in built)
    # vLLM has no bootstrap server: its decode learns the prefill from each request.
    has_bootstrap = role == Role.prefill and not cluster.spec.engine.is_vllm
    service = build_bootstrap_service(cluster, index) if has_bootstrap else None
    return InstanceManifests(
        key=key,
        pods=pods,
        bootstrap_service=service,
        num_pods=num_pods,
        pod_group=build_pod_group(cluster, role, index),
    )
