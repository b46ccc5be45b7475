"""What the operator refuses to run, whatever the PDCluster's author asks.

A PDCluster is written by whoever may create one in its namespace; the
operator acts with its own, wider permissions. Two references would let that
author reach further than they should, so both are checked before any
child is created or updated:

- **Secrets** named in `spec.auth` (`tokenSecretName`,
  `routerApiKeySecretName`) are mounted into the cluster's pods. Only a
  Secret this cluster owns (the token Secret the operator created) or one
  carrying the opt-in label `pdcluster.io/allow-reference: "true"` may be
  named; a service-account token Secret is refused even with the label.
  Without this, naming e.g. another workload's service-account token would
  hand it to the cluster's pods.
- **Images**: with an allowlist set (operator setting), `spec.image` must
  match one of its entries. An entry matches an image equal to it, or one
  that continues it after a `/`, `:` or `@` (`registry.example/team` allows
  `registry.example/team/llm:1.0`, not `registry.example/teamx:1`); an entry
  ending in `/`, `:` or `@` matches as a plain prefix. An empty allowlist
  allows every image.

A refusal names what was refused and why; the controller reports it as an
Event and the `Degraded` condition and changes nothing.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.reconcile.actions import Reason
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.operator.reconcile.observed import parse_object
from pdcluster.runtime.spec import PodOverlaySpec, Role

ALLOW_REFERENCE_LABEL = "pdcluster.io/allow-reference"
ALLOW_REFERENCE_VALUE = "true"
SERVICE_ACCOUNT_TOKEN_TYPE = "kubernetes.io/service-account-token"
_SEPARATORS = ("/", ":", "@")


@dataclass(frozen=True)
class Refusal:
    reason: Reason
    message: str


@dataclass(frozen=True)
class SecretReference:
    field: str  # "spec.auth.tokenSecretName"
    name: str


def image_allowed(image: str, allowlist: Sequence[str]) -> bool:
    if not allowlist:
        return True
    for entry in allowlist:
        if image == entry:
            return True
        if entry.endswith(_SEPARATORS) and image.startswith(entry):
            return True
        if image.startswith(entry) and image[len(entry)] in _SEPARATORS:
            return True
    return False


def check_image(cluster: Cluster, allowlist: Sequence[str]) -> Refusal | None:
    image = cluster.spec.image
    if image_allowed(image, allowlist):
        return None
    return Refusal(
        Reason.ImageNotAllowed,
        f"image {image!r} (spec.image) is not in the operator's image allowlist "
        f"({', '.join(allowlist)}); no pods are created or updated",
    )


def secret_references(cluster: Cluster) -> tuple[SecretReference, ...]:
    """The Secrets the spec names for its pods (the operator's own token Secret
    is not a reference: the operator creates it, or refuses a foreign one)."""
    auth = cluster.spec.auth
    refs: list[SecretReference] = []
    own = names.token_secret_name(cluster.name)
    if auth.token_secret_name and auth.token_secret_name != own:
        refs.append(SecretReference("spec.auth.tokenSecretName", auth.token_secret_name))
    if auth.router_api_key_secret_name:
        refs.append(
            SecretReference("spec.auth.routerApiKeySecretName", auth.router_api_key_secret_name)
        )
    source = cluster.spec.model.source
    if source is not None and source.token_secret_name:
        refs.append(SecretReference("spec.model.source.tokenSecretName", source.token_secret_name))
    # A pod overlay reaching a Secret is a reference like any other: without the
    # opt-in label, a PDCluster could read Secrets its author cannot.
    overlays = [(f"spec.{r.value}.pod", cluster.spec.role_spec(r)) for r in Role]
    for where, spec in [*overlays, ("spec.router.pod", cluster.spec.router)]:
        if spec is not None:
            refs += [
                SecretReference(f"{where}.{field}", name)
                for field, name in _overlay_secrets(spec.pod)
            ]
    return tuple(dict.fromkeys(refs))


def _overlay_secrets(pod: PodOverlaySpec) -> list[tuple[str, str]]:
    """(field, Secret name) of every Secret a pod overlay's env, envFrom or volumes name."""
    found: list[tuple[str, str]] = []
    for var in pod.env:
        ref = ((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
        if ref:
            found.append((f"env[{var['name']}]", str(ref)))
    for source in pod.env_from:
        ref = (source.get("secretRef") or {}).get("name")
        if ref:
            found.append(("envFrom", str(ref)))
    for volume in pod.volumes:
        ref = (volume.get("secret") or {}).get("secretName")
        if ref:
            found.append((f"volumes[{volume['name']}]", str(ref)))
        for projected in (volume.get("projected") or {}).get("sources") or []:
            ref = (projected.get("secret") or {}).get("name")
            if ref:
                found.append((f"volumes[{volume['name']}]", str(ref)))
    return found


def secret_refusal(
    ref: SecretReference, raw: Mapping[str, Any] | None, cluster: Cluster
) -> Refusal | None:
    """None when `raw` (the Secret as read; None: missing) may be mounted.

    A missing Secret is not refused here: the pods wait for it (the planner
    reports `TokenSecretMissing`).
    """
    if raw is None:
        return None
    obj = parse_object(raw)
    if obj is None:
        return None
    where = f"Secret {ref.name} ({ref.field})"
    if raw.get("type") == SERVICE_ACCOUNT_TOKEN_TYPE:
        return Refusal(
            Reason.SecretNotAllowed,
            f"{where} is a service-account token and is never mounted; "
            "name a Secret of type Opaque",
        )
    if obj.is_owned_by(cluster.ref.uid):
        return None
    if obj.labels.get(ALLOW_REFERENCE_LABEL) == ALLOW_REFERENCE_VALUE:
        return None
    return Refusal(
        Reason.SecretNotAllowed,
        f'{where} does not carry the label {ALLOW_REFERENCE_LABEL}="{ALLOW_REFERENCE_VALUE}" '
        "and is not owned by this PDCluster; label it to allow its use. Nothing that "
        "would mount it is created",
    )


def check_cluster(
    cluster: Cluster,
    allowlist: Sequence[str],
    secrets: Mapping[str, Mapping[str, Any] | None],
) -> Refusal | None:
    """The first reason to refuse `cluster`; `secrets`: name -> the Secret as read."""
    refusal = check_image(cluster, allowlist)
    if refusal is not None:
        return refusal
    for ref in secret_references(cluster):
        refusal = secret_refusal(ref, secrets.get(ref.name), cluster)
        if refusal is not None:
            return refusal
    return None
