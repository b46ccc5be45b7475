"""What every worker and router pod is allowed to do: the parts of a pod spec
that make it fit a namespace enforcing Pod Security `restricted`.

- the pod runs as a fixed non-root user and group (`RUNTIME_UID`/`RUNTIME_GID`,
  the `pdcluster` user of the image), with the RuntimeDefault seccomp profile;
- its container cannot gain privileges, holds no capability, and sees a
  read-only root file system: what the runtime writes goes to emptyDir
  volumes (`WRITABLE_VOLUMES`), and HOME points into one so the caches of
  torch and the tokenizer libraries land there too;
- the cluster token (and the router's API keys) arrive as files of a Secret
  volume readable by the pod's group only, never as environment values
  (those show in `kubectl describe`, in /proc/<pid>/environ and in crash dumps);
- CPU and memory requests are set by default (`DEFAULT_REQUESTS`); a role's
  own `resources.requests` wins key by key.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RUNTIME_UID = 10001
RUNTIME_GID = 10001

# name -> (mount path, emptyDir source)
WRITABLE_VOLUMES: dict[str, tuple[str, dict[str, Any]]] = {
    # tempfile's default: the router's copy of the manifest, torch compile caches.
    "tmp": ("/tmp", {}),
    # Decode's shared-memory KV pool (`transfer.backend: shm`) lives under /dev/shm.
    "shm": ("/dev/shm", {"medium": "Memory"}),
}
# HOME of the runtime: ~/.cache (torch hub, tokenizers, triton) on the tmp volume.
HOME_DIR = "/tmp/home"

SECRETS_DIR = "/var/run/secrets/pdcluster.io"
TOKEN_VOLUME = "cluster-token"
TOKEN_DIR = f"{SECRETS_DIR}/token"
# The runtime reads the cluster token from the file this variable names.
TOKEN_FILE_ENV = "PDCLUSTER_TOKEN_FILE"
API_KEYS_VOLUME = "router-api-keys"
API_KEYS_DIR = f"{SECRETS_DIR}/router-api-keys"
# Read by the owner only; with fsGroup set the kubelet makes the files the pod group's.
SECRET_FILE_MODE = 0o400

# Requests of a pod whose role names none: enough for the scheduler to count
# it, far below what a real model needs (set `resources` for those).
DEFAULT_REQUESTS: dict[str, dict[str, str]] = {
    "worker": {"cpu": "1", "memory": "2Gi"},
    "router": {"cpu": "250m", "memory": "256Mi"},
}


def _runtime_user() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_GID}


def _seccomp() -> dict[str, Any]:
    return {"seccompProfile": {"type": "RuntimeDefault"}}


def pod_security_context() -> dict[str, Any]:
    return {**_runtime_user(), "fsGroup": RUNTIME_GID, **_seccomp()}


def container_security_context() -> dict[str, Any]:
    return {
        **_runtime_user(),
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        **_seccomp(),
    }


def secret_volume(name: str, secret: str, key: str) -> dict[str, Any]:
    """A volume holding one key of a Secret as the file `key`."""
    return {
        "name": name,
        "secret": {
            "secretName": secret,
            "items": [{"key": key, "path": key}],
            "defaultMode": SECRET_FILE_MODE,
        },
    }


def token_volume(secret: str, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, volumeMount) of the cluster token file a pod reads at start."""
    volume = secret_volume(TOKEN_VOLUME, secret, key)
    return volume, {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}


def writable_volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) of the emptyDir paths the runtime writes."""
    volumes = [
        {"name": name, "emptyDir": dict(source)} for name, (_, source) in WRITABLE_VOLUMES.items()
    ]
    mounts = [{"name": name, "mountPath": path} for name, (path, _) in WRITABLE_VOLUMES.items()]
    return volumes, mounts


def with_default_requests(resources: Mapping[str, Any], component: str) -> dict[str, Any]:
    """`resources` with the component's default CPU/memory requests where it sets none.

    A limit without a request makes Kubernetes request the limit, so a
    default request is not added for a resource the role limits.
    """
    out = {
        key: dict(value) if isinstance(value, Mapping) else value
        for key, value in resources.items()
    }
    requests = dict(out.get("requests") or {})
    limits = out.get("limits") or {}
    for name, amount in DEFAULT_REQUESTS[component].items():
        if name not in requests and name not in limits:
            requests[name] = amount
    out["requests"] = requests
    return out
