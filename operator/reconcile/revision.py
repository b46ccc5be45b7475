"""Which spec changes restart which pods.

Two hashes, both computed from the typed spec:
- the *cluster revision* covers what prefill and decode must agree on to
  exchange KV (image, model, KV cache, transfer, auth). Pods carry it as a
  label and the router pairs a prefill only with a decode of the same value,
  so during a rollout new prefills never talk to old decodes;
- the *template hash* of a role covers the revision plus that role's pod
  settings (topology, resources, scheduling, engine). A change rolls that
  role's instances; `replicas` and `autoscaling` are excluded, so scaling
  (and how it is decided) never restarts pods.

Values equal to their defaults are left out before hashing, so an operator
upgrade that adds a defaulted field does not restart every pod; so is a
`gpusPerPod` equal to the instance's rank count (one pod, as when left out).

Pure module.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from pdcluster.operator.names import short_hash
from pdcluster.runtime.spec import PDClusterSpec, Role, RoleSpec

HASH_CHARS = 8


def _canonical(model: BaseModel | None, exclude: set[str] | None = None) -> Any:
    if model is None:
        return None
    return model.model_dump(mode="json", by_alias=True, exclude_defaults=True, exclude=exclude)


def _digest(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    digest: str = short_hash(text, HASH_CHARS)
    return digest


def compute_cluster_revision(spec: PDClusterSpec) -> str:
    return _digest(
        {
            "image": spec.image,
            "model": _canonical(spec.model),
            "kvCache": _canonical(spec.kv_cache),
            "transfer": _canonical(spec.transfer),
            "auth": _canonical(spec.auth),
        }
    )


def _one_pod_unset(rs: RoleSpec) -> RoleSpec:
    """`rs` with a `gpusPerPod` that asks for one pod per instance left out, as
    it means the same as leaving it out (runtime/pod_layout.py)."""
    if rs.gpus_per_pod is not None and rs.pod_layout.num_pods == 1:
        return rs.model_copy(update={"gpus_per_pod": None})
    return rs


def compute_template_hash(spec: PDClusterSpec, role: Role) -> str:
    """Hash of everything that shapes the pods of `role`; raises if the role is absent."""
    rs = spec.role_spec(role)
    if rs is None:
        raise ValueError(f"cluster has no {role.value} role")
    return _digest(
        {
            "revision": compute_cluster_revision(spec),
            "role": role.value,
            "spec": _canonical(_one_pod_unset(rs), exclude={"replicas", "autoscaling"}),
        }
    )


def compute_router_hash(spec: PDClusterSpec) -> str:
    """Hash of what the router reads at start; a change rolls the router Deployment."""
    return _digest(
        {
            "revision": compute_cluster_revision(spec),
            "router": _canonical(spec.router, exclude={"replicas"}),
            "disaggregated": spec.is_disaggregated,
        }
    )
