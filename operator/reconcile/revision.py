"""Which spec changes restart which pods.

Two hashes, both computed from the typed spec:
- the *cluster revision* covers what prefill and decode must agree on to
  exchange KV (image, model, KV cache, transfer, auth, the engine). Pods carry it as a
  label and the router pairs a prefill only with a decode of the same value,
  so during a rollout new prefills never talk to old decodes;
- the *template hash* of a role covers the revision plus that role's pod
  settings (topology, resources, scheduling, engine, the pod overlay). A
  change rolls that role's instances. Excluded (`NOT_ROLLED`), so they never
  restart pods: `replicas` and `autoscaling` (scaling, and how it is
  decided), `rollout` and `disruptionBudget` (how instances go away), and
  `drain` (the operator gives each deletion the grace in force then;
  pods started later carry it as their terminationGracePeriodSeconds).

Values equal to their defaults are left out before hashing, so an operator
upgrade that adds a defaulted field does not restart every pod; so is
`gpusPerPod: 1`, its default before it could be left out.

Pure module.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from pdcluster.operator.names import short_hash
from pdcluster.runtime.spec import PDClusterSpec, Role, RoleSpec

HASH_CHARS = 8
# Role fields whose change restarts no pod (the module docstring says why).
NOT_ROLLED = ("replicas", "autoscaling", "rollout", "disruption_budget", "drain")


def _canonical(model: BaseModel | None, exclude: set[str] | None = None) -> Any:
    if model is None:
        return None
    return model.model_dump(mode="json", by_alias=True, exclude_defaults=True, exclude=exclude)


def _digest(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    digest: str = short_hash(text, HASH_CHARS)
    return digest


def compute_cluster_revision(spec: PDClusterSpec) -> str:
    payload = {
        "image": spec.image,
        "model": _canonical(spec.model),
        "kvCache": _canonical(spec.kv_cache),
        "transfer": _canonical(spec.transfer),
        "auth": _canonical(spec.auth),
    }
    # The engine (and vLLM's settings) only when not the default: clusters
    # that never set it keep their revision across the upgrade that added it.
    engine = _canonical(spec.engine)
    if engine:
        payload["engine"] = engine
    return _digest(payload)


def _gpus_per_pod_as_before(rs: RoleSpec) -> RoleSpec:
    """`rs` with `gpusPerPod: 1` hashed as left out.

    `gpusPerPod` defaulted to 1 before it could be left out, so 1 was never
    hashed; hashing 1 and "left out" alike keeps every existing role's hash
    (an operator upgrade restarts no pod). The pods are the same either way
    while every instance runs as one pod (builders/workers.py).
    """
    if rs.gpus_per_pod == 1:
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
            "spec": _canonical(_gpus_per_pod_as_before(rs), exclude=set(NOT_ROLLED)),
        }
    )


def compute_router_hash(spec: PDClusterSpec) -> str:
    """Hash of what the router reads at start; a change rolls the router Deployment."""
    return _digest(
        {
            "revision": compute_cluster_revision(spec),
            "router": _canonical(spec.router, exclude={"replicas", "disruption_budget"}),
            "disaggregated": spec.is_disaggregated,
        }
    )
