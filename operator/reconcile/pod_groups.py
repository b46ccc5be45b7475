"""Which PodGroups a PDCluster keeps, and which roles wait for the PodGroup API.

With `scheduling.gang: podGroup` each instance generation (role, slot,
template hash) has one scheduler-plugins PodGroup, named like the instance,
that all its pods name in their `scheduling.x-k8s.io/pod-group` label
(builders/scheduling.py). Its lifetime, decided from what was observed:

- created with the instance, before its pods, whenever it is missing when
  the instance's pods are created (rollout.py `_create_members`); a
  PodGroup of that name that the cluster does not own blocks the
  instance's pods, which would otherwise join someone else's gang. The
  executor runs each action on its own: should the PodGroup's create fail,
  the pods of that pass still go out and a coscheduling scheduler keeps
  them pending until the retried pass (`ApplyFailed`) creates it;
- kept while any pod of its generation exists (starting, running or being
  deleted), and, once none is left, while the generation is the current
  one of a slot < replicas of a role that still asks for `podGroup`: a gang
  restart recreates the same pod names, which name the same PodGroup;
- deleted otherwise: a slot scaled away, a rollout to a new template hash
  (once the old generation's pods are gone), `gang` switched off, the role
  removed. Deleting the PDCluster removes them all (owner reference).

The apiserver may not serve PodGroups: no CRD installed (the list answers
404) or no RBAC grant (403). A role that asks for `podGroup` then creates
no pods — a coscheduling scheduler would hold pods whose group is missing,
and the default scheduler would place them without the all-or-nothing rule
the manifest asks for — and the planner says so (`PodGroupUnavailable`
Warning, `Degraded` condition) until the API serves them. Pods that already
exist are left alone; roles with `gang: none` are not affected.

Pure module.
"""

from __future__ import annotations

from collections.abc import Set

from pdcluster.operator import names
from pdcluster.operator.builders.desired import DesiredState
from pdcluster.operator.builders.scheduling import POD_GROUP_GROUP, POD_GROUP_PLURAL
from pdcluster.operator.builders.workers import InstanceKey
from pdcluster.operator.reconcile.observed import Observed, ObservedObject, PodGroupApi
from pdcluster.runtime.spec import Role


def pod_group_generation(obj: ObservedObject) -> InstanceKey | None:
    """The instance generation a PodGroup was made for, from its labels; None when
    they do not parse."""
    labels = obj.labels
    try:
        role = Role(labels.get(names.LABEL_ROLE, ""))
    except ValueError:
        return None
    index = labels.get(names.LABEL_INSTANCE_INDEX, "")
    template = labels.get(names.LABEL_TEMPLATE, "")
    if not index.isdigit() or not template:
        return None
    return InstanceKey(role, int(index), template)


def is_pod_group_kept(
    generation: InstanceKey | None,
    desired: DesiredState,
    generations_with_pods: Set[InstanceKey],
) -> bool:
    """Whether the PodGroup of `generation` stays (the module docstring's rule);
    `generations_with_pods`: the instance generations some observed pod belongs to."""
    if generation is None:
        return False
    if generation in generations_with_pods:
        return True
    role = desired.role(generation.role)
    return (
        role is not None
        and role.uses_pod_groups
        and generation.index < role.replicas
        and generation.template_hash == role.template_hash
    )


def roles_waiting_for_pod_groups(desired: DesiredState, observed: Observed) -> tuple[Role, ...]:
    """Roles that ask for PodGroups the apiserver does not serve: they create no pods."""
    if observed.pod_group_api is PodGroupApi.served:
        return ()
    return tuple(r.role for r in desired.roles if r.uses_pod_groups and r.replicas > 0)


def pod_groups_unavailable_message(api: PodGroupApi, roles: tuple[Role, ...]) -> str:
    """What the Warning and the Degraded condition say; `roles` is never empty."""
    resource = f"{POD_GROUP_PLURAL}.{POD_GROUP_GROUP}"
    if api is PodGroupApi.not_installed:
        why = f"PodGroup CRD {POD_GROUP_GROUP} not installed (the apiserver serves no {resource})"
        fix = "install the scheduler-plugins PodGroup CRD"
    else:
        why = f"the operator may not list {resource} (403)"
        fix = f"grant the operator {resource} (the chart's RBAC does)"
    fields = " and ".join(f"{r.value}.scheduling.gang" for r in roles)
    pods = " and ".join(r.value for r in roles)
    verb = "is" if len(roles) == 1 else "are"
    return (
        f"{why}: no {pods} pods are created while {fields} {verb} podGroup; "
        f"{fix}, or set gang: none"
    )
