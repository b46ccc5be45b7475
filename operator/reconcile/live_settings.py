"""Settings pushed to running pods instead of rolling them.

Live today: the router's `spec.router.policy` (prefill and decode
policies, `maxLoadGap`) and `spec.router.healthCheckIntervalSeconds`
(`runtime/router/live_settings.py` says why each is safe live). They are
left out of the router hash (`revision.py`), except which roles are
routed by cache_aware: the router follows those roles' prefix events from
its start, so a change there still rolls it.

Not live: the workers' `spec.transfer` numbers (heartbeat, timeouts). Each
rank process builds its room tables and peer liveness from them at start,
and a leader pod has no channel to the ranks of its other pods, so they
stay in the cluster revision and a change rolls the workers.

How a change reaches the pods: the ConfigMap every pod mounts holds the
whole manifest, so a router started later reads the new values; each
reconcile puts the desired settings to every Ready router pod that has
not accepted them yet (`router_targets.plan_router_pushes`), so a failed push, a router
restarted by its kubelet, or an operator restart is caught up on the next
pass. vLLM clusters are served by our router too: the same applies.

Pure module.
"""

from __future__ import annotations

from typing import Any

from pdcluster.runtime.router.live_settings import RouterLiveSettings
from pdcluster.runtime.spec import PDClusterSpec, SelectionPolicy

# RouterSpec fields a running router takes (`PUT /admin/settings`).
ROUTER_LIVE_FIELDS = ("policy", "health_check_interval_seconds")


def compute_router_live_settings(spec: PDClusterSpec) -> RouterLiveSettings:
    return RouterLiveSettings.from_spec(spec.router)


def compute_cache_aware_roles(spec: PDClusterSpec) -> list[str]:
    """Roles the router follows by cache_aware: fixed at its start (a change rolls it)."""
    policy = spec.router.policy
    aware = SelectionPolicy.cache_aware
    if not spec.is_disaggregated:
        return ["colocated"] if policy.decode is aware else []
    chosen = (("prefill", policy.prefill), ("decode", policy.decode))
    return [role for role, p in chosen if p is aware]


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_flatten(item, f"{prefix}.{key}"))
    return out


def compute_live_changes(
    old: RouterLiveSettings | None, new: RouterLiveSettings
) -> tuple[str, ...]:
    """`router.<field>: old -> new` for each live field that differs (all of them without `old`).

    Fields are named as in the manifest (camelCase), sorted."""
    after = _flatten(new.model_dump(mode="json", by_alias=True), "router")
    before = {} if old is None else _flatten(old.model_dump(mode="json", by_alias=True), "router")
    return tuple(
        f"{path}: {before[path]} -> {after[path]}" if path in before else f"{path}: {after[path]}"
        for path in sorted(after)
        if before.get(path, object()) != after[path]
    )
