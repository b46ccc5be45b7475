"""What a pod worker asks of the apiserver: referenced data, a service-account
token, status writes and the final delete."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from e2e.nodeagent.kubeapi import ApiError, KubeApi
from e2e.pki import render_kubeconfig


def read_object_data(api: KubeApi, namespace: str, kind: str, name: str) -> dict[str, str] | None:
    """A Secret's or ConfigMap's data, decoded; None if it does not exist."""
    plural = "secrets" if kind == "Secret" else "configmaps"
    obj = api.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
    if obj is None:
        return None
    if kind == "Secret":
        return {
            k: base64.b64decode(v).decode(errors="replace")
            for k, v in (obj.get("data") or {}).items()
        }
    data = dict(obj.get("data") or {})
    binary = obj.get("binaryData") or {}
    data.update({k: base64.b64decode(v).decode(errors="replace") for k, v in binary.items()})
    return data


def issue_service_account_env(
    api: KubeApi, pod: Mapping[str, Any], directory: Path, expiration_s: int
) -> dict[str, str]:
    """A per-pod kubeconfig holding a token bound to this pod, in place of the token volume.

    The kubernetes clients fall back from in-cluster config to KUBECONFIG, so
    code that runs in a pod finds the API the same way here.
    """
    metadata, spec = pod["metadata"], pod["spec"]
    account = spec.get("serviceAccountName") or "default"
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "expirationSeconds": expiration_s,
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": metadata["name"],
                "uid": metadata["uid"],
            },
        },
    }
    answer = api.create(
        f"/api/v1/namespaces/{metadata['namespace']}/serviceaccounts/{account}/token", request
    )
    token = answer["status"]["token"]
    account_dir = directory / "serviceaccount"
    account_dir.mkdir(parents=True, exist_ok=True)
    (account_dir / "token").write_text(token)
    (account_dir / "namespace").write_text(metadata["namespace"])
    (account_dir / "ca.crt").write_bytes(api.ca_file.read_bytes())
    kubeconfig = directory / "kubeconfig"
    user = f"system:serviceaccount:{metadata['namespace']}:{account}"
    kubeconfig.write_text(render_kubeconfig(api.server, api.ca_file, user, token))
    return {"KUBECONFIG": str(kubeconfig), **service_host_env(api)}


def service_host_env(api: KubeApi) -> dict[str, str]:
    """Where the API is: the kubelet gives every container these, token or not."""
    host, _, port = api.server.removeprefix("https://").partition(":")
    return {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}


def delete_pod_object(api: KubeApi, namespace: str, name: str, uid: str) -> None:
    """The kubelet's last word on a pod: delete now, but only the pod with this UID."""
    body = {
        "kind": "DeleteOptions",
        "apiVersion": "v1",
        "gracePeriodSeconds": 0,
        "preconditions": {"uid": uid},
    }
    try:
        api.delete(f"/api/v1/namespaces/{namespace}/pods/{name}", body)
    except ApiError as exc:
        # 409: a new pod of the same name already replaced ours; it is not ours to delete.
        if exc.status != 409:
            raise
