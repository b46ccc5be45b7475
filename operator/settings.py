"""Operator settings: one dataclass, read from the environment once at start-up.

Every value has its unit in the name and its default here; nothing below
the handlers module reads the environment.

Environment (all optional):
    PDCLUSTER_OPERATOR_METRICS_PORT       Prometheus port, 0 disables (9090)
    PDCLUSTER_OPERATOR_APPLY_CRDS         apply both CRDs at start-up: true/false (true)
    PDCLUSTER_OPERATOR_RESYNC_SECONDS     reconcile every cluster at least this often (60)
    PDCLUSTER_OPERATOR_EVENT_INTERVAL_SECONDS  least time between writes of one Event (30)
    PDCLUSTER_OPERATOR_WORKERS            clusters reconciled at once (4)
    PDCLUSTER_OPERATOR_METRICS_HOST       address the metrics server binds (0.0.0.0)
    PDCLUSTER_OPERATOR_NOT_READY_GRACE_SECONDS  a worker NotReady this long is lost (5)
    PDCLUSTER_OPERATOR_FAILURE_POLL_SECONDS     read the workers' failure counts this often (10)
    PDCLUSTER_OPERATOR_ADMIN_TIMEOUT_SECONDS    timeout of one call to a worker's admin API (2)
    PDCLUSTER_OPERATOR_IMAGE_ALLOWLIST    comma-separated image prefixes PDClusters may
                                          run (see `policy.py`); empty: any image ("")
    PDCLUSTER_OPERATOR_NAMESPACE          the operator's own namespace, which the
                                          clusters' NetworkPolicies admit ("")
    PDCLUSTER_OPERATOR_REGISTRATION_WARN_SECONDS  a prefill unregistered this long: Warning (60)
    PDCLUSTER_OPERATOR_SCRAPE_NAMESPACE_SELECTOR  `k=v,...` labels of the namespaces whose
                                          pods may scrape the workers' metrics port
    PDCLUSTER_OPERATOR_SCRAPE_POD_SELECTOR        `k=v,...` labels of those pods; with
                                          neither set, no scraper is admitted ("")
    KUBECONFIG                            used when not running in a pod
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pdcluster.operator.builders.networkpolicy import ScrapeSource
from pdcluster.runtime.bounds import require_positive
from pdcluster.runtime.spec.observability import check_endpoint

_TRUE = {"1", "true", "yes", "on"}
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def parse_label_selector(var: str, text: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k2=v2` as matchLabels pairs (empty text: match everything);
    ValueError naming `var` and the bad entry."""
    pairs: list[tuple[str, str]] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ValueError(f"{var}: {entry!r} is not a label key=value")
        pairs.append((key, value))
    return tuple(pairs)


_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class OperatorSettings:
    metrics_port: int = 9090
    metrics_host: str = "0.0.0.0"
    apply_crds: bool = True
    resync_interval_s: float = 60.0
    event_min_interval_s: float = 30.0
    num_workers: int = 4
    # First retry after a failed reconcile; doubles per failure up to the max.
    retry_delay_s: float = 1.0
    max_retry_delay_s: float = 60.0
    # Failover fast path: a worker that was Ready and stays NotReady this long
    # is treated as lost (its peers fail its rooms).
    not_ready_grace_s: float = 5.0
    failure_poll_interval_s: float = 10.0
    admin_timeout_s: float = 2.0
    # Image prefixes a PDCluster's spec.image must match; empty: any image.
    image_allowlist: tuple[str, ...] = ()
    # Namespace the operator's pods run in; their NetworkPolicies admit it.
    operator_namespace: str = ""
    # A prefill worker whose instance is not fully registered with its
    # bootstrap server this long gets a Warning Event (read at each poll).
    registration_warn_s: float = 60.0
    # Who may scrape the workers' metrics port (matchLabels); both None: nobody.
    scrape_namespace_labels: tuple[tuple[str, str], ...] | None = None
    scrape_pod_labels: tuple[tuple[str, str], ...] | None = None
    kubeconfig: str | None = None
    # OTLP/HTTP collector of the PDClusters that turn tracing on and name none
    # (spec.observability.tracing.endpoint); empty: such clusters export to localhost.
    otlp_endpoint: str = ""

    @property
    def scrape_source(self) -> ScrapeSource | None:
        """The scrapers the workers' NetworkPolicy admits (None: none)."""
        if self.scrape_namespace_labels is None and self.scrape_pod_labels is None:
            return None
        return ScrapeSource(
            dict(self.scrape_namespace_labels or ()), dict(self.scrape_pod_labels or ())
        )

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be 0..65535, got {self.metrics_port}")
        if self.not_ready_grace_s < 0:
            raise ValueError(f"not_ready_grace_s must be >= 0, got {self.not_ready_grace_s}")
        require_positive(
            self,
            "resync_interval_s",
            "event_min_interval_s",
            "retry_delay_s",
            "failure_poll_interval_s",
            "admin_timeout_s",
            "registration_warn_s",
        )
        if self.max_retry_delay_s < self.retry_delay_s:
            raise ValueError("max_retry_delay_s must be >= retry_delay_s")
        if not 1 <= self.num_workers <= 64:
            raise ValueError(f"num_workers must be 1..64, got {self.num_workers}")
        if self.otlp_endpoint:
            try:
                check_endpoint(self.otlp_endpoint)
            except ValueError as err:
                raise ValueError(f"PDCLUSTER_OPERATOR_OTLP_ENDPOINT: {err}") from None
        for entry in self.image_allowlist:
            if not entry or entry != entry.strip() or any(c.isspace() for c in entry):
                raise ValueError(f"image allowlist entry {entry!r} is empty or has spaces")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorSettings:
        """Parse the environment; raises ValueError naming the bad variable."""
        kwargs: dict[str, object] = {}
        numbers = (
            ("PDCLUSTER_OPERATOR_METRICS_PORT", "metrics_port", int),
            ("PDCLUSTER_OPERATOR_RESYNC_SECONDS", "resync_interval_s", float),
            ("PDCLUSTER_OPERATOR_EVENT_INTERVAL_SECONDS", "event_min_interval_s", float),
            ("PDCLUSTER_OPERATOR_WORKERS", "num_workers", int),
            ("PDCLUSTER_OPERATOR_NOT_READY_GRACE_SECONDS", "not_ready_grace_s", float),
            ("PDCLUSTER_OPERATOR_FAILURE_POLL_SECONDS", "failure_poll_interval_s", float),
            ("PDCLUSTER_OPERATOR_ADMIN_TIMEOUT_SECONDS", "admin_timeout_s", float),
            ("PDCLUSTER_OPERATOR_REGISTRATION_WARN_SECONDS", "registration_warn_s", float),
        )
        for var, field, kind in numbers:
            if var in env:
                try:
                    number = kind(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r} is not a number") from None
                if not math.isfinite(number):
                    raise ValueError(f"{var}={env[var]!r} is not a finite number")
                kwargs[field] = number
        if "PDCLUSTER_OPERATOR_APPLY_CRDS" in env:
            value = env["PDCLUSTER_OPERATOR_APPLY_CRDS"].strip().lower()
            if value not in _TRUE | _FALSE:
                raise ValueError(f"PDCLUSTER_OPERATOR_APPLY_CRDS={value!r} is not true/false")
            kwargs["apply_crds"] = value in _TRUE
        if env.get("PDCLUSTER_OPERATOR_METRICS_HOST"):
            kwargs["metrics_host"] = env["PDCLUSTER_OPERATOR_METRICS_HOST"]
        if "PDCLUSTER_OPERATOR_IMAGE_ALLOWLIST" in env:
            text = env["PDCLUSTER_OPERATOR_IMAGE_ALLOWLIST"]
            kwargs["image_allowlist"] = tuple(e.strip() for e in text.split(",") if e.strip())
        if env.get("PDCLUSTER_OPERATOR_NAMESPACE"):
            kwargs["operator_namespace"] = env["PDCLUSTER_OPERATOR_NAMESPACE"]
        for var, field in (
            ("PDCLUSTER_OPERATOR_SCRAPE_NAMESPACE_SELECTOR", "scrape_namespace_labels"),
            ("PDCLUSTER_OPERATOR_SCRAPE_POD_SELECTOR", "scrape_pod_labels"),
        ):
            if var in env:
                kwargs[field] = parse_label_selector(var, env[var])
        if env.get("PDCLUSTER_OPERATOR_OTLP_ENDPOINT"):
            kwargs["otlp_endpoint"] = env["PDCLUSTER_OPERATOR_OTLP_ENDPOINT"].strip()
        if env.get("KUBECONFIG"):
            kwargs["kubeconfig"] = env["KUBECONFIG"]
        try:
            return cls(**kwargs)  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"operator settings: {err}") from None
