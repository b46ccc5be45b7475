"""The planner's stabilization windows in `status.<role>.autoscaling`, across restarts.

The planner's history (`planner.RoleHistory`) lives in the autoscaling loop's
memory. So that an operator restart does not start every window afresh, the
loop writes it next to each decision and, when it has none for a cluster in
memory (a start, or a new leader), restores it from the stored status:

- `recommendations`: the recommendation step function, as
  `[{time, replicas}]` (RFC 3339 with milliseconds: the windows are seconds
  long, so whole seconds would make a window look full up to 1 s early).
  Consecutive points with the same replicas are one point (the step
  function, and so every window's min and max, is unchanged). More than
  `MAX_RECOMMENDATIONS` points are not written at all (`null`): the windows
  then restart at the next start, which only delays a decision by a window,
  while a cut history could end a window early.
- `last_desired` is the status's `desired` (the planner compares it with the
  replicas to tell a manual change).

Not restored: the scrapes the p90 deltas start from (the first interval after
a start holds with `FirstInterval`) and the decision times (the first pass
after a start decides at once). Times are on the loop's clock (epoch
seconds); a point that does not parse drops the role's whole history (a
fresh start), never the status.

Pure module.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pdcluster.operator.api import MAX_AUTOSCALING_RECOMMENDATIONS, PDClusterStatus
from pdcluster.operator.autoscale.step import AutoscaleHistory, AutoscaleStep
from pdcluster.runtime.autoscale.planner import PlannerHistory, Recommendation, RoleHistory
from pdcluster.runtime.spec import Role

MAX_RECOMMENDATIONS = MAX_AUTOSCALING_RECOMMENDATIONS

_ROLES = (Role.prefill, Role.decode)


def format_point_time(epoch_seconds: float) -> str:
    moment = dt.datetime.fromtimestamp(epoch_seconds, tz=dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def parse_point_time(text: str) -> float:
    """Inverse of `format_point_time` (whole seconds are read too); ValueError otherwise."""
    for layout in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            moment = dt.datetime.strptime(text, layout)
        except ValueError:
            continue
        return moment.replace(tzinfo=dt.UTC).timestamp()
    raise ValueError(f"not an RFC 3339 UTC time: {text!r}")


def compress(recs: tuple[Recommendation, ...]) -> tuple[Recommendation, ...]:
    """The same step function with no point repeating the one before it."""
    out: list[Recommendation] = []
    for rec in recs:
        if not out or out[-1].replicas != rec.replicas:
            out.append(rec)
    return tuple(out)


def build_recommendations(history: RoleHistory | None) -> list[dict[str, Any]] | None:
    """The wire form of one role's windows; None when there is none or it is too long."""
    if history is None or not history.recommendations:
        return None
    points = compress(history.recommendations)
    if len(points) > MAX_RECOMMENDATIONS:
        return None
    return [{"time": format_point_time(p.at), "replicas": p.replicas} for p in points]


def status_patch_with_windows(step: AutoscaleStep) -> dict[str, Any]:
    """`step.status_patch()` with each decided role's windows added (or cleared)."""
    patch = step.status_patch()
    roles: dict[str, Any] = patch["status"]
    for role, status in step.statuses.items():
        wire = roles[role.value]["autoscaling"]
        if status is not None and wire is not None:
            wire["recommendations"] = build_recommendations(step.history.planner.roles.get(role))
    return patch


def _role_history(points: list[Any], desired: int) -> RoleHistory | None:
    recs = []
    for point in points:
        try:
            at = parse_point_time(point.time)
        except ValueError:
            return None
        recs.append(Recommendation(at, point.replicas))
    if not recs or any(b.at < a.at for a, b in zip(recs, recs[1:], strict=False)):
        return None
    return RoleHistory(tuple(recs), last_desired=desired)


def restore_history(status: PDClusterStatus) -> AutoscaleHistory:
    """The planner history a stored status holds (roles without windows start afresh)."""
    roles: dict[Role, RoleHistory] = {}
    for role in _ROLES:
        stored = status.role(role.value)
        auto = stored.autoscaling if stored is not None else None
        if auto is None or not auto.recommendations:
            continue
        restored = _role_history(list(auto.recommendations), auto.desired)
        if restored is not None:
            roles[role] = restored
    return AutoscaleHistory(planner=PlannerHistory(roles))
