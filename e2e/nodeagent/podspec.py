"""From a pod's API form to what a local process needs: argv, environment, checks.

Pure: Secrets and ConfigMaps a container refers to are fetched by the caller
(see `referenced_objects`) and passed in already decoded. Anything the agent
cannot honour raises ContainerConfigError with a message that names the
field, which the caller reports as the container's waiting reason, the way
the kubelet reports CreateContainerConfigError.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# An object the caller fetched: (kind, name) -> its decoded data, or None if it does not exist.
ObjectKey = tuple[str, str]
Objects = Mapping[ObjectKey, Mapping[str, str] | None]

# What a pod process inherits from the agent's environment; the rest of it stays out,
# as a container would not see its host's environment.
INHERITED_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TZ", "TMPDIR", "VIRTUAL_ENV", "TERM"}
)
INHERITED_PREFIXES = ("LC_", "PYTHON", "OPENBLAS_", "OMP_", "MKL_", "HF_", "TORCH", "CUDA_", "UV_")

# The volumes a pod may carry: the service-account token volume the apiserver adds
# (served through KUBECONFIG instead, see pod.py); emptyDir, which has no
# effect here (the process sees the host's file system at the mount path);
# secret, whose files the agent writes into the pod's folder (mode 0400, the
# Secret read through the API); hostPath, the host folder itself; and
# persistentVolumeClaim, the folder of the hostPath or local PersistentVolume
# the claim is bound to. A mount path of the last three is rewritten to its
# folder wherever the container's arguments or variables name a path under it
# (a process has no mount namespace of its own; `readOnly` is not enforced).
# A Secret or claim that does not exist (or a claim not yet bound) keeps the
# container waiting in ContainerCreating, as a failed mount does.
ALLOWED_VOLUME_KINDS = ("emptyDir", "secret", "hostPath", "persistentVolumeClaim")
HOST_VOLUME_KINDS = ("hostPath", "persistentVolumeClaim")
SERVICE_ACCOUNT_VOLUME_PREFIX = "kube-api-access-"
SECRET_FILE_MODE = 0o400

_LABEL_REF = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ContainerConfigError(ValueError):
    """The container cannot be started as specified; the message says why."""


class VolumeMountError(ContainerConfigError):
    """A volume cannot be set up yet (its Secret is missing): the container waits."""


def build_base_environment(
    host_env: Mapping[str, str], extra_path: Iterable[str]
) -> dict[str, str]:
    """The inherited part of a pod process's environment, extra_path put first on PATH."""
    env = {
        key: value
        for key, value in host_env.items()
        if key in INHERITED_NAMES or key.startswith(INHERITED_PREFIXES)
    }
    path = [p for p in extra_path if p] + [p for p in env.get("PATH", "").split(":") if p]
    env["PATH"] = ":".join(dict.fromkeys(path)) or "/usr/bin:/bin"
    # Logs reach their files as they are written, not when a buffer fills.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def expand_references(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names expand, others stay, `$$` is a `$`."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR_REF.sub(substitute, value)


def referenced_objects(container: Mapping[str, Any]) -> set[ObjectKey]:
    """The Secrets and ConfigMaps the container's env and envFrom read."""
    keys: set[ObjectKey] = set()
    for source in container.get("envFrom") or []:
        if source.get("secretRef"):
            keys.add(("Secret", source["secretRef"]["name"]))
        if source.get("configMapRef"):
            keys.add(("ConfigMap", source["configMapRef"]["name"]))
    for var in container.get("env") or []:
        value_from = var.get("valueFrom") or {}
        if value_from.get("secretKeyRef"):
            keys.add(("Secret", value_from["secretKeyRef"]["name"]))
        if value_from.get("configMapKeyRef"):
            keys.add(("ConfigMap", value_from["configMapKeyRef"]["name"]))
    return keys


def _field_ref(pod: Mapping[str, Any], path: str, pod_ip: str, host_ip: str) -> str:
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    simple = {
        "metadata.name": metadata.get("name", ""),
        "metadata.namespace": metadata.get("namespace", ""),
        "metadata.uid": metadata.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return str(simple[path])
    match = _LABEL_REF.match(path)
    if match:
        return str((metadata.get(match.group(1)) or {}).get(match.group(2), ""))
    raise ContainerConfigError(f"fieldRef {path!r} is not supported by the node agent")


def _object_value(
    objects: Objects, kind: str, ref: Mapping[str, Any], namespace: str
) -> str | None:
    name, key, optional = ref["name"], ref["key"], bool(ref.get("optional"))
    data = objects.get((kind, name))
    if data is None:
        if optional:
            return None
        raise ContainerConfigError(f'{kind.lower()} "{name}" not found in namespace {namespace}')
    if key not in data:
        if optional:
            return None
        raise ContainerConfigError(f"couldn't find key {key} in {kind} {namespace}/{name}")
    return data[key]


def resolve_environment(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    pod_ip: str,
    host_ip: str,
    objects: Objects,
) -> dict[str, str]:
    """The container's own variables (envFrom, then env), references expanded in order."""
    namespace = (pod.get("metadata") or {}).get("namespace", "")
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = str(source.get("prefix") or "")
        for kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
            ref = source.get(field)
            if not ref:
                continue
            data = objects.get((kind, ref["name"]))
            if data is None:
                if ref.get("optional"):
                    continue
                raise ContainerConfigError(
                    f'{kind.lower()} "{ref["name"]}" not found in namespace {namespace}'
                )
            env.update({prefix + key: value for key, value in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        value_from = var.get("valueFrom")
        if not value_from:
            env[name] = expand_references(str(var.get("value") or ""), env)
            continue
        if value_from.get("fieldRef"):
            env[name] = _field_ref(pod, value_from["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif value_from.get("secretKeyRef"):
            value = _object_value(objects, "Secret", value_from["secretKeyRef"], namespace)
            if value is not None:
                env[name] = value
        elif value_from.get("configMapKeyRef"):
            value = _object_value(objects, "ConfigMap", value_from["configMapKeyRef"], namespace)
            if value is not None:
                env[name] = value
        else:
            kinds = ", ".join(sorted(value_from))
            raise ContainerConfigError(
                f"env {name}: valueFrom {kinds} is not supported by the node agent"
            )
    return env


def resolve_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded; images are ignored, so a command is required."""
    command = [str(c) for c in container.get("command") or []]
    if not command:
        raise ContainerConfigError(
            f"container {container.get('name')!r} has no command: the node agent runs commands "
            "from the project's environment and ignores images, so set `command`"
        )
    args = [str(a) for a in container.get("args") or []]
    return [expand_references(part, env) for part in command + args]


def check_volumes(pod: Mapping[str, Any], container: Mapping[str, Any]) -> None:
    """Refuse mounts the agent cannot give a local process."""
    volumes = {v["name"]: v for v in (pod.get("spec") or {}).get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        name = mount["name"]
        volume = volumes.get(name, {})
        if name.startswith(SERVICE_ACCOUNT_VOLUME_PREFIX):
            continue
        if any(kind in volume for kind in ALLOWED_VOLUME_KINDS):
            continue
        kinds = sorted(k for k in volume if k != "name") or ["unknown"]
        raise ContainerConfigError(
            f"volume {name!r} ({', '.join(kinds)}) mounted at {mount.get('mountPath')!r}: the "
            "node agent runs pods as local processes and supports only "
            f"{', '.join(ALLOWED_VOLUME_KINDS)} volumes"
        )


def _mounted_volumes(
    pod: Mapping[str, Any], container: Mapping[str, Any], kind: str
) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(volume, mount) of every mount of the container whose volume is of `kind`."""
    volumes = {v["name"]: v for v in (pod.get("spec") or {}).get("volumes") or []}
    found = []
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"], {})
        if kind in volume:
            found.append((volume, mount))
    return found


def secret_volume_secrets(pod: Mapping[str, Any], container: Mapping[str, Any]) -> set[ObjectKey]:
    """The Secrets behind the container's secret volumes."""
    return {
        ("Secret", str(volume["secret"]["secretName"]))
        for volume, _ in _mounted_volumes(pod, container, "secret")
    }


def secret_volume_files(
    pod: Mapping[str, Any], container: Mapping[str, Any], objects: Objects
) -> dict[str, dict[str, str]]:
    """Volume name -> {relative file path: content} for the container's secret volumes.

    `items` picks and renames keys, as the kubelet does; without it every key
    is a file. A missing Secret (or key) raises VolumeMountError unless the
    volume (or item) is optional.
    """
    namespace = (pod.get("metadata") or {}).get("namespace", "")
    files: dict[str, dict[str, str]] = {}
    for volume, _ in _mounted_volumes(pod, container, "secret"):
        source = volume["secret"]
        name, optional = str(source["secretName"]), bool(source.get("optional"))
        data = objects.get(("Secret", name))
        if data is None:
            if optional:
                files[volume["name"]] = {}
                continue
            raise VolumeMountError(
                f'MountVolume.SetUp failed for volume "{volume["name"]}": '
                f'secret "{name}" not found in namespace {namespace}'
            )
        items = source.get("items")
        chosen: dict[str, str] = {}
        for item in items if items is not None else [{"key": k, "path": k} for k in data]:
            path = str(item["path"])
            if path.startswith("/") or ".." in path.split("/"):
                raise ContainerConfigError(f"volume {volume['name']!r}: item path {path!r}")
            if item["key"] not in data:
                if optional:
                    continue
                raise VolumeMountError(
                    f'MountVolume.SetUp failed for volume "{volume["name"]}": '
                    f"couldn't find key {item['key']} in Secret {namespace}/{name}"
                )
            chosen[path] = data[item["key"]]
        files[volume["name"]] = chosen
    return files


def secret_mount_paths(
    pod: Mapping[str, Any], container: Mapping[str, Any], volume_dirs: Mapping[str, str]
) -> dict[str, str]:
    """mountPath -> local folder of each secret volume the container mounts."""
    return {
        str(mount["mountPath"]).rstrip("/"): volume_dirs[volume["name"]]
        for volume, mount in _mounted_volumes(pod, container, "secret")
    }


def claimed_volumes(pod: Mapping[str, Any], container: Mapping[str, Any]) -> set[str]:
    """The PersistentVolumeClaims behind the container's mounts."""
    return {
        str(volume["persistentVolumeClaim"]["claimName"])
        for volume, _ in _mounted_volumes(pod, container, "persistentVolumeClaim")
    }


def _volume_folder(
    volume: Mapping[str, Any], claims: Mapping[str, Mapping[str, Any] | None], namespace: str
) -> str:
    """The host folder of a hostPath volume, or of the PersistentVolume a claim is bound to
    (`claims`: claim name -> its bound PersistentVolume, None when unbound or missing)."""
    if "hostPath" in volume:
        source = volume["hostPath"]
        path = str(source["path"])
        kind = source.get("type") or ""
        if kind == "Directory" and not Path(path).is_dir():
            raise VolumeMountError(
                f'MountVolume.SetUp failed for volume "{volume["name"]}": hostPath type check '
                f"failed: {path} is not a directory"
            )
        return path
    claim = str(volume["persistentVolumeClaim"]["claimName"])
    bound = claims.get(claim)
    if bound is None:
        raise VolumeMountError(
            f'MountVolume.SetUp failed for volume "{volume["name"]}": '
            f'persistentvolumeclaim "{claim}" in namespace {namespace} is missing or not bound'
        )
    spec = bound.get("spec") or {}
    for kind in ("hostPath", "local"):
        if spec.get(kind):
            return str(spec[kind]["path"])
    raise ContainerConfigError(
        f"volume {volume['name']!r}: PersistentVolume {bound['metadata']['name']} is neither "
        "hostPath nor local, which is all the node agent can mount"
    )


def host_mount_paths(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    claims: Mapping[str, Mapping[str, Any] | None],
) -> dict[str, str]:
    """mountPath -> host folder (with the mount's subPath) of each hostPath and
    persistentVolumeClaim volume the container mounts."""
    namespace = (pod.get("metadata") or {}).get("namespace", "")
    out: dict[str, str] = {}
    for kind in HOST_VOLUME_KINDS:
        for volume, mount in _mounted_volumes(pod, container, kind):
            folder = _volume_folder(volume, claims, namespace)
            sub = str(mount.get("subPath") or "").strip("/")
            if sub.startswith("..") or "/../" in f"/{sub}/":
                raise ContainerConfigError(f"volumeMount {mount['name']!r}: subPath {sub!r}")
            out[str(mount["mountPath"]).rstrip("/")] = f"{folder}/{sub}" if sub else folder
    return out


def translate_mount_paths(value: str, mounts: Mapping[str, str]) -> str:
    """`value` with a leading mount path (the whole value, or a path under it) rewritten."""
    for mount_path, local in mounts.items():
        if value == mount_path or value.startswith(mount_path + "/"):
            return local + value[len(mount_path) :]
    return value


def wants_service_account_token(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    if spec.get("automountServiceAccountToken") is False:
        return False
    return any(
        v.get("name", "").startswith(SERVICE_ACCOUNT_VOLUME_PREFIX)
        for v in spec.get("volumes") or []
    )


def prestop_sleep_s(container: Mapping[str, Any]) -> float:
    """Seconds of the container's `lifecycle.preStop.sleep` (0: none). An `exec` or
    `httpGet` preStop hook is refused: the agent runs only Kubernetes' sleep action."""
    hook = (container.get("lifecycle") or {}).get("preStop")
    if not hook:
        return 0.0
    if set(hook) != {"sleep"}:
        raise ContainerConfigError(
            f"lifecycle.preStop: {sorted(hook)}: the node agent runs only the sleep action"
        )
    return float(hook["sleep"]["seconds"])
