"""Merge a user's pod overlay (`spec.<role>.pod`, `spec.router.pod`) onto a built pod.

Applied last, after the engine's builder rendered its container, so it
holds for whatever engine runs there. The overlay's own rules (no field we
own, runtime/spec/pod_overlay.py) were checked at admission; here it only
adds:
- metadata: labels and annotations (ours win on a clash, which admission
  already refuses);
- pod: imagePullSecrets, priorityClassName, runtimeClassName, hostNetwork
  (with the DNS policy a host-network pod needs to resolve cluster names),
  hostIPC, volumes, and the `/dev/shm` emptyDir's sizeLimit;
- the named container: env, envFrom and volumeMounts appended after ours,
  and capabilities added (it still drops ALL first).

`pod_security_level` says which Pod Security level the result needs
(`restricted` unless the overlay or the model source asks for more), so a
refusal by the namespace's admission can be explained with the label that
would admit it.

Pure module.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from pdcluster.runtime.spec import PodOverlaySpec

# Capabilities each Pod Security level lets a container add (Kubernetes' Pod
# Security Standards): restricted only NET_BIND_SERVICE, baseline the default set.
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# Volume kinds the restricted level admits (image volumes too, as the v1.37
# admission plugin does: e2e/test_deployable.py asks it); baseline admits every
# kind but hostPath.
RESTRICTED_VOLUME_KINDS = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "image",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
LEVELS = ("restricted", "baseline", "privileged")
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"


def apply_pod_overlay(
    metadata: dict[str, Any], pod_spec: dict[str, Any], overlay: PodOverlaySpec, container: str
) -> None:
    """Merge `overlay` into a pod's (or a pod template's) `metadata` and `pod_spec`,
    in place; `container` names the container the env, mounts and capabilities join."""
    if overlay == PodOverlaySpec():
        return
    metadata["labels"] = {**overlay.labels, **metadata.get("labels", {})}
    annotations = {**overlay.annotations, **metadata.get("annotations", {})}
    if annotations:
        metadata["annotations"] = annotations
    if overlay.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in overlay.image_pull_secrets]
    if overlay.priority_class_name is not None:
        pod_spec["priorityClassName"] = overlay.priority_class_name
    if overlay.runtime_class_name is not None:
        pod_spec["runtimeClassName"] = overlay.runtime_class_name
    if overlay.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if overlay.host_ipc:
        pod_spec["hostIPC"] = True
    volumes = pod_spec.setdefault("volumes", [])
    if overlay.shm_size is not None:
        for volume in volumes:
            if volume["name"] == "shm" and "emptyDir" in volume:
                volume["emptyDir"]["sizeLimit"] = overlay.shm_size
    volumes.extend(copy.deepcopy(overlay.volumes))
    target = next(c for c in pod_spec["containers"] if c["name"] == container)
    if overlay.env:
        target["env"] = [*target.get("env", []), *copy.deepcopy(overlay.env)]
    if overlay.env_from:
        target["envFrom"] = [*target.get("envFrom", []), *copy.deepcopy(overlay.env_from)]
    if overlay.volume_mounts:
        target["volumeMounts"] = [
            *target.get("volumeMounts", []),
            *copy.deepcopy(overlay.volume_mounts),
        ]
    if overlay.capabilities:
        capabilities = target.setdefault("securityContext", {}).setdefault("capabilities", {})
        capabilities["add"] = sorted(set(capabilities.get("add", [])) | set(overlay.capabilities))


def _volume_kinds(volumes: Iterable[dict[str, Any]]) -> set[str]:
    return {k for v in volumes for k in v if k != "name"}


def pod_security_level(pod_spec: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The least Pod Security level that admits `pod_spec`, and why it is above restricted."""
    why_baseline: list[str] = []
    why_privileged: list[str] = []
    for name in ("hostNetwork", "hostIPC", "hostPID"):
        if pod_spec.get(name):
            why_privileged.append(f"{name}: true")
    kinds = _volume_kinds(pod_spec.get("volumes", []))
    if "hostPath" in kinds:
        why_privileged.append("a hostPath volume")
    if other := sorted(kinds - RESTRICTED_VOLUME_KINDS - {"hostPath"}):
        why_baseline.append(f"volume kinds {', '.join(other)}")
    containers = [*pod_spec.get("initContainers", []), *pod_spec.get("containers", [])]
    for container in containers:
        added = set((container.get("securityContext") or {}).get("capabilities", {}).get("add", []))
        if beyond := sorted(added - BASELINE_CAPABILITIES):
            why_privileged.append(f"container {container['name']} adds {', '.join(beyond)}")
        elif beyond := sorted(added - RESTRICTED_CAPABILITIES):
            why_baseline.append(f"container {container['name']} adds {', '.join(beyond)}")
    if why_privileged:
        return "privileged", tuple(why_privileged + why_baseline)
    if why_baseline:
        return "baseline", tuple(why_baseline)
    return "restricted", ()


def explain_pod_security_refusal(role: str, pod_spec: dict[str, Any], namespace: str) -> str:
    """What to do when the namespace's Pod Security admission refused `role`'s pods."""
    level, why = pod_security_level(pod_spec)
    if level == "restricted":
        return (
            f"{role} pods fit Pod Security restricted, yet the namespace refused them; "
            "see the apiserver's message in the ApplyFailed Event"
        )
    return (
        f"{role} pods need Pod Security level {level} ({'; '.join(why)}), which the "
        f"namespace {namespace} does not admit: label it {ENFORCE_LABEL}={level} "
        "(kubectl label namespace ... --overwrite), or remove those settings"
    )
