from __future__ import annotations

from typing import Any

import pytest

from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.router.discovery import KubernetesDiscoverySettings
from pdcluster.runtime.spec import parse_spec

PD = {"prefill_urls": ("http://127.0.0.1:1",), "decode_urls": ("http://127.0.0.1:2",)}


def test_static_lists_decide_the_mode() -> None:
    assert RouterConfig(**PD).is_disaggregated
    assert not RouterConfig(colocated_urls=("http://127.0.0.1:3",)).is_disaggregated


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({}, "no workers"),
        ({**PD, "model_name": ""}, "model_name"),
        ({**PD, "prefill_policy": "fastest"}, "prefill_policy"),
        ({**PD, "api_keys": ("",)}, "empty keys"),
        ({**PD, "max_body_bytes": 10}, "max_body_bytes"),
        ({**PD, "request_timeout_s": 0}, "request_timeout_s"),
        ({**PD, "health_check_interval_s": -1}, "health_check_interval_s"),
        ({**PD, "health_failure_threshold": 0}, "health_failure_threshold"),
        ({**PD, "max_connections": 0}, "max_connections"),
        ({**PD, "failure_policy": "retry"}, "failure_policy"),
        ({**PD, "disaggregated": False}, "contradicts"),
        ({**PD, "kubernetes": KubernetesDiscoverySettings(), "disaggregated": True}, "not both"),
        ({"kubernetes": KubernetesDiscoverySettings()}, "disaggregated"),
    ],
)
def test_bad_settings_are_refused_with_the_field_named(
    kwargs: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        RouterConfig(**kwargs)


def test_kubernetes_discovery_needs_the_mode() -> None:
    config = RouterConfig(kubernetes=KubernetesDiscoverySettings(), disaggregated=False)
    assert not config.is_disaggregated


def test_from_spec_takes_policies_timeouts_and_model_names() -> None:
    spec = parse_spec(
        {
            "model": {"name": "qwen", "path": "/models/qwen"},
            "prefill": {},
            "decode": {},
            "router": {
                "policy": {"prefill": "random", "decode": "least_outstanding"},
                "healthCheckIntervalSeconds": 0.5,
                "requestTimeoutSeconds": 30,
            },
        }
    )
    config = RouterConfig.from_spec(spec, api_keys=["sk-secret-123"], **PD)
    assert config.model_names == ("qwen", "/models/qwen")
    assert (config.prefill_policy, config.decode_policy) == ("random", "least_outstanding")
    assert config.health_check_interval_s == 0.5
    assert config.request_timeout_s == 30
    assert config.api_keys == ("sk-secret-123",)
    assert config.is_disaggregated
    assert "sk-secret-123" not in repr(config)  # keys never reach logs through repr


def test_from_spec_with_kubernetes_takes_the_mode_from_the_spec() -> None:
    spec = parse_spec({"colocated": {}})
    config = RouterConfig.from_spec(spec, kubernetes=KubernetesDiscoverySettings())
    assert config.disaggregated is False


@pytest.mark.parametrize(("policy", "final"), [("fail", True), ("recompute", False)])
def test_from_spec_takes_the_transfer_failure_policy(policy: str, final: bool) -> None:
    spec = parse_spec({"prefill": {}, "decode": {}, "transfer": {"failurePolicy": policy}})
    config = RouterConfig.from_spec(spec, **PD)
    assert config.failure_policy == policy
    assert config.is_prefill_failure_final is final
    assert RouterConfig(**PD).is_prefill_failure_final  # the default is `fail`
