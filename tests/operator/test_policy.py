"""The operator's policy: which images and Secret references a PDCluster may use."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.operator.reconcile.actions import Reason
from pdcluster.operator.reconcile.policy import (
    ALLOW_REFERENCE_LABEL,
    check_cluster,
    image_allowed,
    secret_references,
)

from .helpers import PD, UID, make_cluster


@pytest.mark.parametrize(
    "image,allowed",
    [
        ("registry.example/team", True),
        ("registry.example/team:1.0", True),
        ("registry.example/team@sha256:abc", True),
        ("registry.example/team/llm:1.0", True),
        ("registry.example/teamx:1.0", False),  # a longer name is another repository
        ("registry.example/other:1.0", False),
        ("pdcluster:0.1.0", True),
        ("pdcluster-evil:0.1.0", False),
        ("docker.io/pdcluster:0.1.0", False),
        ("mirror.example/any/thing", True),  # entry ending in "/" is a plain prefix
    ],
)
def test_image_allowlist_matches_whole_path_segments(image: str, allowed: bool) -> None:
    allowlist = ("registry.example/team", "pdcluster", "mirror.example/")
    assert image_allowed(image, allowlist) is allowed


def test_empty_allowlist_allows_every_image() -> None:
    assert image_allowed("anything.example/x:1", ())


def _secret(name: str, labels: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "labels": labels or {}}
    return {"kind": "Secret", "metadata": meta, "type": "Opaque", **extra}


AUTH = {**PD, "auth": {"tokenSecretName": "shared", "routerApiKeySecretName": "keys"}}


def test_a_foreign_secret_is_refused_naming_it_and_its_field() -> None:
    cluster = make_cluster(AUTH)
    refusal = check_cluster(cluster, (), {"shared": _secret("shared"), "keys": None})
    assert refusal is not None and refusal.reason == Reason.SecretNotAllowed
    assert "Secret shared (spec.auth.tokenSecretName)" in refusal.message
    assert ALLOW_REFERENCE_LABEL in refusal.message


def test_the_router_key_secret_is_checked_too() -> None:
    cluster = make_cluster(AUTH)
    ok = _secret("shared", {ALLOW_REFERENCE_LABEL: "true"})
    refusal = check_cluster(cluster, (), {"shared": ok, "keys": _secret("keys")})
    assert refusal is not None and "spec.auth.routerApiKeySecretName" in refusal.message


def test_opted_in_or_owned_secrets_are_accepted_and_missing_ones_left_to_the_planner() -> None:
    cluster = make_cluster(AUTH)
    labelled = _secret("shared", {ALLOW_REFERENCE_LABEL: "true"})
    owned = _secret("keys", ownerReferences=None)
    owned["metadata"]["ownerReferences"] = [{"uid": UID, "controller": True}]
    assert check_cluster(cluster, (), {"shared": labelled, "keys": owned}) is None
    assert check_cluster(cluster, (), {"shared": None, "keys": None}) is None
    wrong_value = _secret("shared", {ALLOW_REFERENCE_LABEL: "yes"})
    assert check_cluster(cluster, (), {"shared": wrong_value, "keys": owned}) is not None


def test_a_service_account_token_is_refused_even_when_labelled() -> None:
    cluster = make_cluster(AUTH)
    token = _secret("shared", {ALLOW_REFERENCE_LABEL: "true"})
    token["type"] = "kubernetes.io/service-account-token"
    refusal = check_cluster(cluster, (), {"shared": token, "keys": None})
    assert refusal is not None and "service-account token" in refusal.message


def test_the_operators_own_token_secret_is_no_reference() -> None:
    assert secret_references(make_cluster(PD)) == ()
    own = make_cluster({**PD, "auth": {"tokenSecretName": "demo-token"}})
    assert secret_references(own) == ()


def test_an_image_outside_the_allowlist_is_refused_with_the_image_named() -> None:
    cluster = make_cluster({**PD, "image": "evil.example/miner:1"})
    refusal = check_cluster(cluster, ("registry.example/",), {})
    assert refusal is not None and refusal.reason == Reason.ImageNotAllowed
    assert "evil.example/miner:1" in refusal.message and "registry.example/" in refusal.message
    assert check_cluster(cluster, ("evil.example/miner",), {}) is None
