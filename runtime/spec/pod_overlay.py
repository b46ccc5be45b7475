"""What a user adds to the pods we build: `spec.<role>.pod` and `spec.router.pod`.

The overlay is merged onto the built pod last, whatever the engine kind
renders as the worker container (operator/builders/overlay.py): labels and
annotations (e.g. a Multus network), extra env and envFrom, volumes and
their mounts, image pull secrets, a priority or runtime class, the size of
`/dev/shm`, capabilities to add (e.g. `IPC_LOCK` for RDMA), and the host
network or IPC namespace when asked. Node selection, tolerations, affinity
and resources have their own fields on the role (and the router).

Fields we own are never overridden silently; each of these is refused here
(and by the CRD's CEL rules) naming the field:
- env names we set (`RESERVED_ENV_NAMES`, and every `PDCLUSTER_*`);
- volume names and mount paths we use (`RESERVED_VOLUME_NAMES`,
  `RESERVED_MOUNT_PATHS` and what lies under them);
- labels and annotations under our prefix `pdcluster.io/`;
- capabilities no pod should get (`ALL`, `SYS_ADMIN`: use a privileged
  engine image of your own instead).
Command, args, ports, probes, the token mount and the security defaults are
not fields of the overlay at all.

Pure module.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, model_validator

from pdcluster.runtime.spec.base import SpecModel
from pdcluster.runtime.spec.serving_engine import OWNED_ENV as VLLM_OWNED_ENV

OWNED_PREFIX = "pdcluster.io/"
RESERVED_ENV_PREFIX = "PDCLUSTER_"
# Variables the builders set on some container; each carries our meaning.
RESERVED_ENV_NAMES = frozenset(
    {
        "POD_IP",
        "POD_NAME",
        "POD_NAMESPACE",
        "HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "HF_TOKEN",
        "CUDA_VISIBLE_DEVICES",
        *VLLM_OWNED_ENV,
    }
)
RESERVED_VOLUME_NAMES = frozenset(
    {"tmp", "shm", "cluster-token", "router-api-keys", "model", "model-cache"}
)
# Paths we mount; a user mount at one of them or under it would hide ours.
RESERVED_MOUNT_PATHS = ("/tmp", "/dev/shm", "/var/run/secrets/pdcluster.io", "/models")
REFUSED_CAPABILITIES = frozenset({"ALL", "SYS_ADMIN"})
_CAPABILITY = r"^[A-Z][A-Z0-9_]{1,63}$"
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"
_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def is_reserved_env(name: str) -> bool:
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIX)


def is_reserved_mount_path(path: str) -> bool:
    """`path` is one we mount, lies under one, or holds one (and would hide it)."""
    clean = "/" + "/".join(p for p in path.split("/") if p)
    parent = clean.rstrip("/") + "/"
    return any(
        clean == p or clean.startswith(p + "/") or p.startswith(parent)
        for p in RESERVED_MOUNT_PATHS
    )


class PodOverlaySpec(SpecModel):
    """Pod settings merged onto the pods the operator builds (see docs/kubernetes.md)."""

    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    # Kubernetes EnvVar / EnvFromSource objects, appended to the worker container's.
    env: list[dict[str, Any]] = Field(default_factory=list, max_length=256)
    env_from: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    # Kubernetes Volume objects and the worker container's VolumeMounts of them.
    volumes: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    image_pull_secrets: list[str] = Field(default_factory=list, max_length=16)
    priority_class_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=_NAME
    )
    runtime_class_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=_NAME
    )
    # sizeLimit of the /dev/shm emptyDir (NCCL and the shm KV pool use it), e.g. "16Gi".
    shm_size: str | None = Field(default=None, max_length=32, pattern=_QUANTITY)
    # Capabilities added to the worker container (it drops ALL first), e.g. IPC_LOCK.
    capabilities: list[str] = Field(default_factory=list, max_length=16)
    host_network: bool = False
    host_ipc: bool = Field(default=False, alias="hostIPC")

    @model_validator(mode="after")
    def _nothing_we_own(self) -> PodOverlaySpec:
        for kind, keys in (("labels", self.labels), ("annotations", self.annotations)):
            owned = sorted(k for k in keys if k.startswith(OWNED_PREFIX))
            if owned:
                raise ValueError(
                    f"pod.{kind}: {owned[0]!r} is under {OWNED_PREFIX}, which the operator owns"
                )
        for entry in (*self.env, *self.volumes, *self.volume_mounts):
            if not isinstance(entry.get("name"), str) or not entry["name"]:
                raise ValueError("pod.env, pod.volumes and pod.volumeMounts entries need a name")
        for var in self.env:
            if not _ENV_NAME.match(var["name"]):
                raise ValueError(f"pod.env: {var['name']!r} is not a valid variable name")
            if is_reserved_env(var["name"]):
                raise ValueError(
                    f"pod.env: {var['name']!r} is set by the operator and cannot be overridden"
                )
        for source in self.env_from:
            if str(source.get("prefix") or "").startswith(RESERVED_ENV_PREFIX):
                raise ValueError(f"pod.envFrom: prefix {RESERVED_ENV_PREFIX!r} is reserved")
        names = [v["name"] for v in self.volumes]
        if taken := sorted(set(names) & RESERVED_VOLUME_NAMES):
            raise ValueError(f"pod.volumes: {taken[0]!r} is a volume the operator mounts")
        if len(set(names)) != len(names):
            raise ValueError("pod.volumes: two volumes share a name")
        for mount in self.volume_mounts:
            path = mount.get("mountPath")
            if not isinstance(path, str) or not path.startswith("/"):
                raise ValueError(f"pod.volumeMounts: {mount['name']!r} needs an absolute mountPath")
            if is_reserved_mount_path(path):
                raise ValueError(
                    f"pod.volumeMounts: {path!r} overlaps a path the operator mounts "
                    f"({', '.join(RESERVED_MOUNT_PATHS)})"
                )
            if mount["name"] not in names:
                raise ValueError(
                    f"pod.volumeMounts: {mount['name']!r} names no volume of pod.volumes"
                )
        for cap in self.capabilities:
            if not re.match(_CAPABILITY, cap):
                raise ValueError(f"pod.capabilities: {cap!r} is not a capability name")
            if cap in REFUSED_CAPABILITIES:
                raise ValueError(f"pod.capabilities: {cap} is refused (it lifts every guard)")
        for secret in self.image_pull_secrets:
            if not re.match(_NAME, secret):
                raise ValueError(f"pod.imagePullSecrets: {secret!r} is not a Secret name")
        return self
