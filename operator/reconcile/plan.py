"""plan_reconcile(desired, observed) -> the actions that move one towards the other.

Stateless: everything it needs is in its arguments (the restart ledgers
come from the stored status), so any operator replica, after any crash,
plans the same next step from the same cluster state.

- Cluster-wide children (RBAC, NetworkPolicies, ConfigMap, router) are created when missing
  and applied when the hash of what we would apply differs from the hash
  stamped on the object at the last apply — an unchanged spec plans no
  writes. Only objects we own are ever applied (with force, and with the uid
  we saw as a precondition), so a foreign object is never taken over.
- The token Secret is created once and never rewritten; a Secret the user
  names is only checked for existence (no pods start without it).
- Instances are planned per role (`rollout.plan_role`).
- An object that has one of our names but not our controller reference is
  never touched: it is reported, and a Warning event says so.
- Objects we own that the spec no longer wants are deleted; a PodGroup
  (`gang: podGroup`) once its instance generation is gone (`pod_groups.py`).
- A role asking for PodGroups that the apiserver does not serve (no CRD, no
  RBAC grant) creates nothing; a `PodGroupUnavailable` Warning says why.

Pure module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.builders.desired import DesiredState
from pdcluster.operator.builders.meta import Manifest, ObjectKey, object_key
from pdcluster.operator.builders.scheduling import POD_GROUP_KIND
from pdcluster.operator.builders.workers import InstanceKey
from pdcluster.operator.reconcile.actions import (
    Action,
    Apply,
    Create,
    CreateTokenSecret,
    Delete,
    Emit,
    EventType,
    Reason,
)
from pdcluster.operator.reconcile.instances import ObservedInstance
from pdcluster.operator.reconcile.observed import Observed, ObservedObject
from pdcluster.operator.reconcile.pod_groups import (
    is_pod_group_kept,
    pod_group_generation,
    pod_groups_unavailable_message,
    roles_waiting_for_pod_groups,
)
from pdcluster.operator.reconcile.restarts import RestartLedger
from pdcluster.operator.reconcile.rollout import (
    RolePlan,
    RoleReport,
    plan_absent_role,
    plan_role,
    serves_revision,
)
from pdcluster.runtime.spec import Role

# Kinds the operator creates; only these are ever deleted as stale.
MANAGED_KINDS = (
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "ConfigMap",
    "Secret",
    "Deployment",
    "Service",
    "Pod",
    POD_GROUP_KIND,
)


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    roles: tuple[RoleReport, ...]
    foreign: tuple[ObjectKey, ...]
    token_secret_missing: bool
    router_desired: int
    router_ready: int
    # Earliest time a later pass has work that no watch event will announce
    # (a back-off ending, a budget window closing); None: nothing scheduled.
    wake_at: float | None
    # Why roles asking for PodGroups create no pods (the API does not serve
    # them); None when no role waits for them.
    pod_groups_unavailable: str | None = None

    @property
    def writes(self) -> tuple[Action, ...]:
        """Actions that change cluster objects (events excluded)."""
        return tuple(a for a in self.actions if not isinstance(a, Emit))

    def report(self, role: Role) -> RoleReport | None:
        return next((r for r in self.roles if r.role == role), None)


def manifest_hash(manifest: Manifest) -> str:
    """Hash of a manifest, ignoring the applied-hash annotation itself."""
    meta = dict(manifest.get("metadata", {}))
    annotations = {
        k: v for k, v in meta.get("annotations", {}).items() if k != names.ANNOTATION_APPLIED_HASH
    }
    meta["annotations"] = annotations
    text = json.dumps({**manifest, "metadata": meta}, sort_keys=True, separators=(",", ":"))
    digest: str = names.short_hash(text, 16)
    return digest


def stamp(manifest: Manifest) -> Manifest:
    """A copy of `manifest` carrying its own hash, for the no-change check."""
    meta = dict(manifest["metadata"])
    meta["annotations"] = {
        **meta.get("annotations", {}),
        names.ANNOTATION_APPLIED_HASH: manifest_hash(manifest),
    }
    return {**manifest, "metadata": meta}


def _foreign_event(key: ObjectKey, cluster: str) -> Emit:
    return Emit(
        EventType.Warning,
        Reason.ForeignObject,
        f"{key} already exists and is not owned by PDCluster {cluster}; it is left alone "
        "(delete or rename it to let the operator create its own)",
    )


def _plan_cluster_objects(
    desired: DesiredState, observed: Observed, actions: list[Action], foreign: list[ObjectKey]
) -> None:
    uid = desired.cluster.ref.uid
    for manifest in desired.objects:
        stamped = stamp(manifest)
        found = observed.get(object_key(manifest))
        if found is None:
            # A plain create: should someone else's object appear under this
            # name before it lands, the create fails instead of taking it over.
            actions.append(Create(stamped))
        elif not found.is_owned_by(uid):
            foreign.append(found.key)
        elif found.terminating:
            continue  # re-created once gone
        elif found.annotations.get(names.ANNOTATION_APPLIED_HASH) != manifest_hash(manifest):
            actions.append(Apply(stamped, uid=found.uid))


def _bootstrap_identity(obj: ObservedObject) -> tuple[int, str] | None:
    if obj.labels.get(names.LABEL_COMPONENT) != "bootstrap":
        return None
    index, template = (
        obj.labels.get(names.LABEL_INSTANCE_INDEX, ""),
        obj.labels.get(names.LABEL_TEMPLATE, ""),
    )
    if not index.isdigit() or not template:
        return None
    return int(index), template


def _plan_stale(
    desired: DesiredState,
    observed: Observed,
    prefill_instances: list[ObservedInstance],
    generations_with_pods: set[InstanceKey],
    actions: list[Action],
) -> None:
    """Delete owned objects nothing wants any more."""
    uid = desired.cluster.ref.uid
    wanted = {object_key(m) for m in desired.objects}
    wanted.add(ObjectKey("Secret", desired.token_secret))
    worker_pods = {p.obj.key for p in observed.pods}
    prefill = desired.role(Role.prefill)
    alive = {(i.key.index, i.key.template_hash) for i in prefill_instances if i.is_alive}
    for key, obj in sorted(observed.objects.items()):
        if not obj.is_owned_by(uid) or obj.terminating or key.kind not in MANAGED_KINDS:
            continue
        if key in wanted or key in worker_pods:
            continue
        if key.kind == POD_GROUP_KIND and is_pod_group_kept(
            pod_group_generation(obj), desired, generations_with_pods
        ):
            continue
        slot = _bootstrap_identity(obj) if key.kind == "Service" else None
        if slot is not None and prefill is not None and slot[0] < prefill.replicas:
            if slot[1] == prefill.template_hash or slot in alive:
                continue
        if key.kind == "Secret" and not desired.owns_token_secret:
            # Our old token Secret: keep it until no pod can still be reading it.
            if observed.pods:
                continue
        actions.append(Delete(key, obj.uid))


def _without_creates(actions: list[Action]) -> list[Action]:
    return [
        a
        for a in actions
        if not isinstance(a, Create)
        and not (isinstance(a, Emit) and a.reason == Reason.InstanceCreated)
    ]


def plan_reconcile(
    desired: DesiredState,
    observed: Observed,
    ledgers: Mapping[Role, RestartLedger],
    now: float,
) -> Plan:
    actions: list[Action] = []
    foreign: list[ObjectKey] = []
    _plan_cluster_objects(desired, observed, actions, foreign)

    secret_key = ObjectKey("Secret", desired.token_secret)
    secret = observed.get(secret_key)
    token_missing = False
    if secret is None:
        if desired.owns_token_secret:
            actions.insert(0, CreateTokenSecret(desired.token_secret))
        else:
            token_missing = True
    elif desired.owns_token_secret and not secret.is_owned_by(desired.cluster.ref.uid):
        foreign.append(secret_key)

    reports: list[RoleReport] = []
    wake: list[float] = []
    role_plans: list[RolePlan] = []
    prefill_instances: list[ObservedInstance] = []
    # Retire instances of an older revision only once the current revision has a
    # Ready instance of every role: prefill and decode pair within one revision.
    retire = all(
        serves_revision(
            observed,
            r.role,
            desired.revision,
            now=now,
            not_ready_grace_s=r.restart.not_ready_grace_seconds,
        )
        for r in desired.roles
        if r.replicas
    )
    waiting = roles_waiting_for_pod_groups(desired, observed)
    for role in desired.roles:
        role_plan, report = plan_role(
            desired, role, observed, ledgers.get(role.role, RestartLedger()), now, retire
        )
        # No token: pods would sit in CreateContainerConfigError. No PodGroup API:
        # they would be scheduled without the gang they ask for. Create none.
        if token_missing or role.role in waiting:
            role_plan.actions = _without_creates(role_plan.actions)
        role_plans.append(role_plan)
        reports.append(report)
        wake.extend(role_plan.wake_at)
        if role.role == Role.prefill:
            prefill_instances = role_plan.instances
    present = {r.role for r in desired.roles}
    for absent in (r for r in Role if r not in present):
        role_plans.append(plan_absent_role(absent, observed, now))
    for role_plan in role_plans:
        actions.extend(role_plan.actions)
        foreign.extend(role_plan.foreign)

    generations = {inst.key for rp in role_plans for inst in rp.instances}
    _plan_stale(desired, observed, prefill_instances, generations, actions)
    unique_foreign = tuple(dict.fromkeys(foreign))
    actions.extend(_foreign_event(key, desired.cluster.name) for key in unique_foreign)
    if token_missing:
        actions.append(
            Emit(
                EventType.Warning,
                Reason.TokenSecretMissing,
                f"Secret {desired.token_secret} (spec.auth.tokenSecretName) does not exist; "
                "no pods are created until it does",
            )
        )
    unavailable = None
    if waiting:
        unavailable = pod_groups_unavailable_message(observed.pod_group_api, waiting)
        actions.append(Emit(EventType.Warning, Reason.PodGroupUnavailable, unavailable))
    return Plan(
        actions=tuple(actions),
        roles=tuple(reports),
        foreign=unique_foreign,
        token_secret_missing=token_missing,
        router_desired=desired.cluster.spec.router.replicas,
        router_ready=observed.router_ready_replicas,
        wake_at=min(wake) if wake else None,
        pod_groups_unavailable=unavailable,
    )


def describe(action: Action) -> dict[str, Any]:
    """A loggable summary of an action (no manifests, no secrets)."""
    if isinstance(action, Apply | Create):
        return {"op": type(action).__name__.lower(), "object": str(action.key)}
    if isinstance(action, CreateTokenSecret):
        return {"op": "create-token-secret", "object": f"Secret/{action.name}"}
    if isinstance(action, Delete):
        return {"op": "delete", "object": str(action.key)}
    return {"op": "event", "reason": action.reason.value, "message": action.message}
