"""CEL rules the apiserver checks before a PDCluster is stored.

They mirror the cross-field validators of `pdcluster.runtime.spec`, so
`kubectl apply` rejects the same manifests `pdcluster up` rejects, with the
same words. Messages are fixed text: the apiserver's cost estimate treats
`string(int)` as unbounded, so a messageExpression that prints numbers is
refused. Each rule is attached to the schema node it reads; the
apiserver evaluates it against the object after defaulting, which is why
rules may read defaulted fields (e.g. `topology.cp`) without `has()`.

Pure module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdcluster.runtime.spec import AUTOSCALING_METRICS, MAX_RANKS_PER_INSTANCE, Role
from pdcluster.runtime.spec.pod_overlay import (
    OWNED_PREFIX,
    REFUSED_CAPABILITIES,
    RESERVED_ENV_NAMES,
    RESERVED_ENV_PREFIX,
    RESERVED_MOUNT_PATHS,
    RESERVED_VOLUME_NAMES,
)
from pdcluster.runtime.spec.serving_engine import OWNED_ENV, OWNED_FLAGS


@dataclass(frozen=True)
class CelRule:
    rule: str
    message: str
    # Evaluated for the message when the rule fails; falls back to `message`.
    message_expression: str | None = None
    reason: str = "FieldValueInvalid"

    def to_schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.message_expression:
            out["messageExpression"] = self.message_expression
        if self.reason != "FieldValueInvalid":
            out["reason"] = self.reason
        return out


def _get(path: str, default: int) -> str:
    """`self.<path>`, or `default` when any part is absent.

    Defaults are normally filled before CEL runs, but not on every path (a
    `kubectl scale` on a cluster without `decode` creates `{replicas: N}`
    bare), and reading a missing key is an error rather than a failed rule.
    """
    parts = path.split(".")
    guards = " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))
    return f"({guards} ? self.{path} : {default})"


def _ranks(role: str) -> str:
    prefix = f"{role}." if role else ""
    return " * ".join(_get(f"{prefix}topology.{axis}", 1) for axis in ("dp", "tp", "cp", "pp"))


def _gpu_floor(role: str) -> str:
    """GPUs `role` holds at least: minReplicas (autoscaled) or replicas, times its ranks."""
    low = (
        f"(has(self.{role}.autoscaling) ? {_get(f'{role}.autoscaling.minReplicas', 1)}"
        f" : {_get(f'{role}.replicas', 1)})"
    )
    return f"{low} * ({_ranks(role)})"


def _budget_rules() -> tuple[CelRule, ...]:
    budget = "self.autoscaling.maxTotalGPUs"
    applies = (
        "!has(self.autoscaling) || !has(self.autoscaling.maxTotalGPUs) || "
        "!has(self.prefill) || !has(self.decode) || "
        "!(has(self.prefill.autoscaling) || has(self.decode.autoscaling))"
    )
    rules = [
        CelRule(
            rule=f"{applies} || {_gpu_floor('prefill')} + {_gpu_floor('decode')} <= {budget}",
            message="autoscaling.maxTotalGPUs is below the GPUs of both roles at their minimum",
        )
    ]
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        top = f"self.{role}.autoscaling.maxReplicas * ({_ranks(role)})"
        rules.append(
            CelRule(
                rule=f"{applies} || !has(self.{role}.autoscaling) || "
                f"{top} + {_gpu_floor(other)} <= {budget}",
                message=f"{role}.autoscaling.maxReplicas with the other role at its minimum "
                "exceeds autoscaling.maxTotalGPUs",
            )
        )
    return tuple(rules)


def _metric_rule(role: Role) -> CelRule:
    accepted = ", ".join(f"'{m.value}'" for m in AUTOSCALING_METRICS[role])
    return CelRule(
        rule=f"!has(self.{role.value}) || !has(self.{role.value}.autoscaling) || "
        f"self.{role.value}.autoscaling.target.metric in [{accepted}]",
        message=f"{role.value}.autoscaling.target.metric does not scale {role.value}",
    )


def _get_str(path: str, default: str) -> str:
    """`self.<path>` of a string field, or `default` when any part is absent."""
    parts = path.split(".")
    guards = " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))
    return f"({guards} ? self.{path} : '{default}')"


# `engine.kind: vllm` (runtime/spec/serving_engine.py, `vllm_refusal`): each rule
# holds for any other engine.
_IS_VLLM = f"{_get_str('engine.kind', 'builtin')} == 'vllm'"
# Our connector inside vLLM (`kvConnector: PDClusterConnector`).
_IS_OURS = f"({_get_str('engine.vllm.kvConnector', 'NixlConnector')} == 'PDClusterConnector')"


def _vllm_rule(rule: str, message: str) -> CelRule:
    return CelRule(rule=f"!({_IS_VLLM}) || ({rule})", message=message)


def _vllm_role_rules(role: str) -> tuple[CelRule, ...]:
    present = f"!has(self.{role})"
    buffer = _get_str("engine.vllm.kvBufferDevice", "")
    metric = f"self.{role}.autoscaling.target.metric"
    return (
        *(
            _vllm_rule(
                f"!{_IS_OURS} || {present} || {_get(f'{role}.topology.{axis}', 1)} == 1",
                f"{role}.topology.{axis}: PDClusterConnector pairs tensor-parallel vLLM "
                "engines; scale with replicas instead",
            )
            for axis in ("dp", "pp")
            if role != "colocated"  # the connector pairs prefill and decode only
        ),
        _vllm_rule(
            f"{present} || {_get(f'{role}.topology.cp', 1)} == 1",
            f"{role}.topology.cp: context parallelism is not mapped onto vLLM; use 1",
        ),
        _vllm_rule(
            f"{present} || !has(self.{role}.gpusPerPod) || "
            f"self.{role}.gpusPerPod == {_ranks(role)}",
            f"{role}.gpusPerPod: a vLLM instance runs in one pod; leave gpusPerPod out "
            "or set it to dp*tp*cp*pp",
        ),
        _vllm_rule(
            f"{present} || {buffer} != 'cuda' || {_get_str(f'{role}.device', 'cpu')} == 'cuda'",
            f"engine.vllm.kvBufferDevice cuda needs {role}.device cuda",
        ),
        _vllm_rule(
            f"{present} || !has(self.{role}.autoscaling) || "
            f"{metric} != 'queuedPrefillTokensPerInstance'",
            f"{role}.autoscaling.target.metric queuedPrefillTokensPerInstance: vLLM "
            "reports no queued prompt tokens; use ttftP90Seconds",
        ),
    )


VLLM_SPEC_RULES = (
    _vllm_rule(
        "has(self.model) && ((has(self.model.path) && size(self.model.path) > 0) || "
        "has(self.model.source))",
        "model.path: engine.kind vllm serves the model at `path` (a directory or a "
        "Hugging Face id) or from `source`; the built-in tiny model runs on the builtin "
        "engine only",
    ),
    _vllm_rule(
        f"{_get_str('model.computeDtype', 'float32')} != 'float64'",
        "model.computeDtype: vLLM computes in float32, float16 or bfloat16, not float64",
    ),
    _vllm_rule(
        "!has(self.kvCache) || !has(self.kvCache.dtype) || (has(self.model) && "
        "has(self.model.computeDtype) && self.kvCache.dtype == self.model.computeDtype)",
        "kvCache.dtype must equal model.computeDtype with engine.kind vllm "
        "(vLLM keeps the KV cache in the model's dtype); leave it out to follow it",
    ),
    _vllm_rule(
        f"{_get_str('kvCache.layout', 'NHD')} == 'NHD'",
        "kvCache.layout: vLLM chooses its own KV layout; leave it NHD",
    ),
    _vllm_rule(
        f"{_IS_OURS} || !has(self.transfer) || !has(self.transfer.checksum) || "
        "!self.transfer.checksum",
        "transfer.checksum: NixlConnector carries no page checksum (PDClusterConnector does)",
    ),
    _vllm_rule(
        f"{_IS_OURS} || has(self.colocated) || {_get_str('transfer.backend', 'tcp')} == 'nixl'",
        "transfer.backend must be nixl with engine.vllm.kvConnector NixlConnector "
        "(vLLM's connector moves the KV over NIXL)",
    ),
    _vllm_rule(
        f"!{_IS_OURS} || {_get_str('transfer.backend', 'tcp')} != 'shm'",
        "transfer.backend: PDClusterConnector moves the KV over tcp or nixl; shm writes "
        "into our engine's shared-memory pool",
    ),
    _vllm_rule(
        f"!{_IS_OURS} || {_get_str('transfer.allocationPolicy', 'early')} == 'early'",
        "transfer.allocationPolicy: PDClusterConnector gets a decode's pages when vLLM "
        "admits the request; only early applies",
    ),
    *(rule for role in Role for rule in _vllm_role_rules(role.value)),
    *(
        _vllm_rule(
            f"!has(self.{role}) || "
            f"{_get_str(f'router.policy.{key}', 'round_robin')} != 'cache_aware' || "
            f"{_get(f'{role}.topology.dp', 1)} == 1",
            f"router.policy.{key}: cache_aware follows one vLLM engine per instance; "
            f"{role}.topology.dp must be 1 (each dp rank publishes its own events)",
        )
        for key, role in (("prefill", "prefill"), ("decode", "decode"), ("decode", "colocated"))
    ),
)

_OWNED_FLAGS = ", ".join(f"'{flag}'" for flag in OWNED_FLAGS)
_OWNED_ENV = ", ".join(f"'{name}'" for name in OWNED_ENV)

# On `spec.engine.vllm` (its field validators in serving_engine.py).
VLLM_RULES = (
    CelRule(
        rule=f"!has(self.extraArgs) || self.extraArgs.all(a, !(a in [{_OWNED_FLAGS}]) && "
        f"![{_OWNED_FLAGS}].exists(f, a.startsWith(f + '=')))",
        message="extraArgs: a flag the manifest sets (e.g. --port, --tensor-parallel-size) "
        "is set from its field; change that field instead",
    ),
    CelRule(
        rule="!has(self.env) || self.env.all(k, k.matches('^[A-Za-z_][A-Za-z0-9_]*$'))",
        message="env: every key must be a variable name",
    ),
    CelRule(
        rule=f"!has(self.env) || self.env.all(k, !(k in [{_OWNED_ENV}]))",
        message="env: VLLM_API_KEY and VLLM_NIXL_SIDE_CHANNEL_* are set by PDCluster on "
        "every vLLM pod",
    ),
)

ROOT_RULES = (
    CelRule(
        rule="size(self.metadata.name) <= 63 && !self.metadata.name.contains('.')",
        message="metadata.name must be a DNS label: at most 63 characters and no dots",
    ),
)


def _rank_net_devices_rule(role: Role) -> CelRule:
    devices = "self.transfer.ucx.rankNetDevices"
    per_pod = (
        f"(has(self.{role.value}.gpusPerPod) ? self.{role.value}.gpusPerPod : {_ranks(role.value)})"
    )
    return CelRule(
        rule=f"!has(self.{role.value}) || !has(self.transfer) || !has(self.transfer.ucx) || "
        f"!has({devices}) || size({devices}) == 0 || {per_pod} <= size({devices})",
        message=f"transfer.ucx.rankNetDevices has fewer entries than a {role.value} pod runs "
        "ranks: one entry per local rank",
    )


def rules_schema(rules: tuple[CelRule, ...]) -> list[dict[str, Any]]:
    return [r.to_schema() for r in rules]


SPEC_RULES = (
    CelRule(
        rule="!(has(self.colocated) && (has(self.prefill) || has(self.decode)))",
        message="use either `colocated` or `prefill`+`decode`, not both",
    ),
    CelRule(
        rule="has(self.colocated) || has(self.prefill) || has(self.decode)",
        message="spec needs `prefill` and `decode` roles (or a `colocated` role)",
    ),
    CelRule(
        rule="has(self.colocated) || !has(self.decode) || has(self.prefill)",
        message="a disaggregated cluster needs a `prefill` role",
    ),
    CelRule(
        rule="has(self.colocated) || !has(self.prefill) || has(self.decode)",
        message="a disaggregated cluster needs a `decode` role",
    ),
    CelRule(
        rule=f"!has(self.decode) || {_get('decode.topology.cp', 1)} == 1",
        message="decode.topology.cp must be 1: cp is prefill-only",
    ),
    CelRule(
        rule=(
            f"!has(self.decode) || !has(self.prefill) || {_get('decode.topology.pp', 1)} == 1"
            f" || {_get('decode.topology.pp', 1)} == {_get('prefill.topology.pp', 1)}"
        ),
        message="decode.topology.pp must be 1 or equal prefill.topology.pp",
    ),
    CelRule(
        rule="!has(self.colocated) || !has(self.colocated.autoscaling)",
        message="colocated.autoscaling is not supported: only prefill and decode scale",
    ),
    _metric_rule(Role.prefill),
    _metric_rule(Role.decode),
    *_budget_rules(),
    *(_rank_net_devices_rule(role) for role in Role),
    *VLLM_SPEC_RULES,
)

ROLE_RULES = (
    CelRule(
        rule=f"{_ranks('')} <= {MAX_RANKS_PER_INSTANCE}",
        message=f"ranks per instance (dp*tp*cp*pp) must be at most {MAX_RANKS_PER_INSTANCE}",
    ),
    # gpusPerPod left out: one pod per instance, nothing to check.
    CelRule(
        rule=f"!has(self.gpusPerPod) || self.gpusPerPod <= {_ranks('')}",
        message="gpusPerPod is larger than the ranks per instance (dp*tp*cp*pp)",
    ),
    CelRule(
        rule=f"!has(self.gpusPerPod) || self.gpusPerPod > {_ranks('')} || "
        f"({_ranks('')}) % self.gpusPerPod == 0",
        message="ranks per instance (dp*tp*cp*pp) must be divisible by gpusPerPod",
    ),
    CelRule(
        rule=f"!has(self.autoscaling) || {_get('autoscaling.minReplicas', 1)} <= "
        "self.autoscaling.maxReplicas",
        message="autoscaling.minReplicas must be at most maxReplicas",
    ),
    CelRule(
        rule="!has(self.autoscaling) || self.autoscaling.target.metric != 'kvPageUsage' || "
        "self.autoscaling.target.value <= 1.0",
        message="a kvPageUsage target is a fraction in (0, 1]",
    ),
)

MODEL_RULES = (
    CelRule(
        rule="(has(self.name) ? self.name : 'tiny') == 'tiny' || "
        "(has(self.path) && size(self.path) > 0) || has(self.source)",
        message="a model other than tiny needs `path` or `source` (only tiny is built in)",
        message_expression="'model ' + self.name + "
        "' needs `path` or `source` (only tiny is built in)'",
    ),
    CelRule(
        rule="!(has(self.path) && size(self.path) > 0 && has(self.source))",
        message="model: set `path` or `source`, not both (the source decides the path)",
    ),
)

MODEL_SOURCE_RULES = (
    CelRule(
        rule="!self.uri.startsWith('hf://') || has(self.cacheClaim)",
        message="model.source: an hf:// source needs cacheClaim (the cache PVC)",
    ),
    CelRule(
        rule="self.uri.startsWith('hf://') || "
        "(!has(self.cacheClaim) && !has(self.tokenSecretName))",
        message="model.source: cacheClaim and tokenSecretName belong to hf:// only",
    ),
    CelRule(
        rule="self.uri.startsWith('oci://') || !has(self.pullPolicy)",
        message="model.source: pullPolicy belongs to oci:// only",
    ),
)


def _cel_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in sorted(values)) + "]"


def _reserved_mount_regex() -> str:
    """A path at, under or above one we mount (runtime/spec/pod_overlay.py), as one
    regular expression: linear in the path's length, which a loop over the
    reserved paths is not in the apiserver's cost estimate."""
    paths = [p.strip("/") for p in RESERVED_MOUNT_PATHS]
    at_or_under = "|".join(re.escape(p) for p in paths).replace("\\", "\\\\")
    parents = sorted(
        {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
    )
    above = "|".join(parents)
    return f"^/+(({at_or_under})(/.*)?|({above})/*|)$"


# The overlay's rules (runtime/spec/pod_overlay.py), on every `pod` node.
POD_RULES = (
    *(
        CelRule(
            rule=f"!has(self.{kind}) || self.{kind}.all(k, !k.startsWith('{OWNED_PREFIX}'))",
            message=f"pod.{kind}: a key under {OWNED_PREFIX}, which the operator owns",
        )
        for kind in ("labels", "annotations")
    ),
    CelRule(
        rule="!has(self.env) || self.env.all(e, !has(e.name) || "
        f"!(string(e.name).startsWith('{RESERVED_ENV_PREFIX}') || "
        f"string(e.name) in {_cel_list(RESERVED_ENV_NAMES)}))",
        message="pod.env: a variable the operator sets cannot be overridden",
    ),
    CelRule(
        rule="!has(self.volumes) || self.volumes.all(v, !has(v.name) || "
        f"!(string(v.name) in {_cel_list(RESERVED_VOLUME_NAMES)}))",
        message="pod.volumes: a volume name the operator mounts",
    ),
    CelRule(
        rule="!has(self.volumeMounts) || "
        "self.volumeMounts.all(m, !has(m.mountPath) || "
        f"!m.mountPath.matches('{_reserved_mount_regex()}'))",
        message="pod.volumeMounts: a mountPath that overlaps a path the operator mounts",
    ),
    CelRule(
        rule="!has(self.capabilities) || self.capabilities.all(c, "
        f"!(c in {_cel_list(REFUSED_CAPABILITIES)}))",
        message="pod.capabilities: ALL and SYS_ADMIN are refused (they lift every guard)",
    ),
)

ROLLOUT_RULES = (
    CelRule(
        rule=f"{_get('maxSurge', 1)} > 0 || {_get('maxUnavailable', 0)} > 0",
        message="rollout: maxSurge and maxUnavailable cannot both be 0",
    ),
)

UCX_RULES = (
    CelRule(
        rule="!has(self.netDevices) || !has(self.rankNetDevices) || size(self.rankNetDevices) == 0",
        message="transfer.ucx: set netDevices or rankNetDevices, not both",
    ),
)
