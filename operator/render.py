"""Every object the operator would create for a PDCluster manifest, without a
cluster: what `pdcluster render -f FILE` prints for review (like `helm
template`), built by the same pure builders the operator runs.

What differs from a live cluster, on purpose:
- the owner references carry `metadata.uid` of the manifest, or a
  placeholder uid when it has none (a file has not been created yet);
- the token Secret the operator creates is shown without its data: the
  operator fills `token` with a fresh random value when it creates it;
- every instance of every role is shown (the operator creates them one
  rollout step at a time, but ends with exactly these);
- pods k > 0 of a multi-pod instance name their leader `leader-pod-ip`
  (`PLACEHOLDER_LEADER_ADDRESS`): the operator creates them once the leader
  pod has an IP and gives them that IP.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from pdcluster.operator.builders.config import build_token_secret
from pdcluster.operator.builders.desired import build_desired
from pdcluster.operator.builders.meta import Manifest
from pdcluster.operator.reconcile.cluster import Cluster, cluster_from_body
from pdcluster.runtime.spec import SpecError

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
DEFAULT_NAMESPACE = "default"
PLACEHOLDER_LEADER_ADDRESS = "leader-pod-ip"
# build_token_secret refuses an empty token; the data is dropped afterwards.
_UNUSED_TOKEN = "x"


class RenderError(ValueError):
    """The manifest cannot be rendered; the message says why."""


def cluster_for_render(doc: Any, namespace: str | None = None) -> Cluster:
    """The Cluster a manifest document describes; `namespace` wins over its own."""
    if not isinstance(doc, Mapping):
        raise RenderError("the manifest is not a YAML mapping")
    if doc.get("kind") != "PDCluster":
        raise RenderError(f"kind is {doc.get('kind')!r}, expected PDCluster")
    meta = doc.get("metadata")
    if not isinstance(meta, Mapping):
        raise RenderError("the manifest has no metadata")
    body = {
        **doc,
        "metadata": {
            **meta,
            "namespace": namespace or meta.get("namespace") or DEFAULT_NAMESPACE,
            "uid": meta.get("uid") or PLACEHOLDER_UID,
        },
    }
    try:
        return cluster_from_body(body)
    except SpecError as err:
        raise RenderError(str(err)) from None


def render_objects(cluster: Cluster) -> list[Manifest]:
    """Cluster-wide children in apply order, then every instance of every role."""
    desired = build_desired(cluster)
    objects: list[Manifest] = list(desired.objects)
    if desired.owns_token_secret:
        secret = build_token_secret(cluster, _UNUSED_TOKEN)
        del secret["data"]
        objects.insert(len(objects) - 2, secret)  # with the config, before any pod
    for role in desired.roles:
        for index in range(role.replicas):
            instance = desired.instance(role.role, index, PLACEHOLDER_LEADER_ADDRESS)
            if instance.pod_group is not None:
                objects.append(instance.pod_group)
            if instance.bootstrap_service is not None:
                objects.append(instance.bootstrap_service)
            objects.extend(instance.pods)
    return objects


def render_yaml(doc: Any, namespace: str | None = None) -> str:
    """Multi-document YAML of `render_objects`; raises RenderError (or BuildError)."""
    objects = render_objects(cluster_for_render(doc, namespace))
    return "".join(
        "---\n" + yaml.safe_dump(obj, sort_keys=False, default_flow_style=False) for obj in objects
    )
