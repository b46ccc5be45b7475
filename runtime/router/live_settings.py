"""The router settings a running router takes without a restart.

`spec.router.policy` (the prefill and decode policies, `maxLoadGap`) and
`spec.router.healthCheckIntervalSeconds`, validated by the manifest's own
models (`RouterPolicySpec`, and the interval's bounds in `RouterSpec`).
Why each is safe live:

- a selection policy is asked once per leg plan; swapping it between two
  plans changes where the next request goes, never a leg in flight;
- `maxLoadGap` is read by the cache_aware policy on each choice;
- the health loop reads its interval before each sleep, so the new one is
  in force after the sleep under way ends.

What stays fixed at start: *which roles* are routed by cache_aware. Those
roles' workers are followed (their prefix events, the index), which starts
with the router; a change that would add or drop one is refused
(`LiveSettingsRefused`), and the operator rolls the router for it instead
(`operator/reconcile/revision.py` hashes those roles).

Pure module.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import Field

from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.spec import RouterPolicySpec, RouterSpec, SelectionPolicy
from pdcluster.runtime.spec.base import SpecModel


class LiveSettingsRefused(ValueError):
    """The settings are valid but need a router restart to take effect."""


class RouterLiveSettings(SpecModel):
    """Body of `PUT /admin/settings` and of its answer (camelCase, as in the manifest)."""

    policy: RouterPolicySpec = RouterPolicySpec()
    # The same bounds as `RouterSpec.health_check_interval_seconds` (a test holds them equal).
    health_check_interval_seconds: float = Field(default=2.0, gt=0, le=3600)

    @classmethod
    def from_spec(cls, router: RouterSpec) -> RouterLiveSettings:
        return cls(
            policy=router.policy,
            health_check_interval_seconds=router.health_check_interval_seconds,
        )

    @classmethod
    def from_config(cls, config: RouterConfig) -> RouterLiveSettings:
        """The settings in force in `config` (a colocated router's policy is `decode`)."""
        decode = config.decode_policy if config.is_disaggregated else config.colocated_policy
        return cls(
            policy=RouterPolicySpec(
                prefill=SelectionPolicy(config.prefill_policy),
                decode=SelectionPolicy(decode),
                max_load_gap=config.max_load_gap,
            ),
            health_check_interval_seconds=config.health_check_interval_s,
        )


def apply_live_settings(config: RouterConfig, live: RouterLiveSettings) -> RouterConfig:
    """`config` with `live` in force; raises LiveSettingsRefused if the cache_aware roles change."""
    updated = replace(
        config,
        prefill_policy=live.policy.prefill.value,
        decode_policy=live.policy.decode.value,
        colocated_policy=live.policy.decode.value,
        max_load_gap=live.policy.max_load_gap,
        health_check_interval_s=live.health_check_interval_seconds,
    )
    before, after = config.cache_aware_roles, updated.cache_aware_roles
    if before != after:
        was = ", ".join(r.value for r in before) or "none"
        now = ", ".join(r.value for r in after) or "none"
        raise LiveSettingsRefused(
            f"the roles routed by cache_aware would change ({was} -> {now}): "
            "that needs a router restart"
        )
    return updated
