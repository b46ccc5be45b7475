"""The operator's Kubernetes API calls: a thin async REST client over httpx.

Credentials come from the kubernetes client's loaders (in-cluster service
account, else kubeconfig); requests go out through httpx so the reconcile
loop stays on the event loop without threads. Every write names the field
manager `pdcluster-operator`.

Only the verbs the controller needs exist: get, list by label, server-side
apply, create, delete with a uid precondition, status merge-patch, and
event create/patch. Errors become `ApiError` with the HTTP status, so
callers branch on `status == 404` / `409` instead of parsing messages.
"""

from __future__ import annotations

import builtins
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import quote

import httpx

from pdcluster.operator.api import GROUP, PLURAL, SCALER_PLURAL, VERSION
from pdcluster.operator.builders.scheduling import POD_GROUP_API_VERSION, POD_GROUP_PLURAL

FIELD_MANAGER = "pdcluster-operator"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"
# The kubernetes client's config loaders are untyped.
Loader = Callable[..., Any]


@dataclass(frozen=True)
class Resource:
    prefix: str  # "/api/v1" or "/apis/<group>/<version>"
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return self.prefix.removeprefix("/api/").removeprefix("/apis/")


RESOURCES: dict[str, Resource] = {
    "Pod": Resource("/api/v1", "pods"),
    "Service": Resource("/api/v1", "services"),
    "ConfigMap": Resource("/api/v1", "configmaps"),
    "Secret": Resource("/api/v1", "secrets"),
    "ServiceAccount": Resource("/api/v1", "serviceaccounts"),
    "Event": Resource("/api/v1", "events"),
    "Deployment": Resource("/apis/apps/v1", "deployments"),
    "NetworkPolicy": Resource("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": Resource("/apis/policy/v1", "poddisruptionbudgets"),
    "Role": Resource("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Resource("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "PDCluster": Resource(f"/apis/{GROUP}/{VERSION}", PLURAL),
    "PDClusterRoleScaler": Resource(f"/apis/{GROUP}/{VERSION}", SCALER_PLURAL),
    # scheduler-plugins' CRD: may be absent from a cluster (the list answers 404).
    "PodGroup": Resource(f"/apis/{POD_GROUP_API_VERSION}", POD_GROUP_PLURAL),
    "CustomResourceDefinition": Resource(
        "/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False
    ),
}


class ApiError(Exception):
    """A failed API call; `status` is the HTTP status (0: no response)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def is_not_found(self) -> bool:
        return self.status == 404

    @property
    def is_forbidden(self) -> bool:
        return self.status == 403

    @property
    def is_conflict(self) -> bool:
        return self.status == 409

    @property
    def is_transient(self) -> bool:
        return self.status in (0, 429) or self.status >= 500


class KubeApi(Protocol):
    """What the controller needs from the API; `KubeClient` is the real one."""

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]: ...

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]: ...

    async def delete(
        self, kind: str, namespace: str, name: str, uid: str, grace_period_s: int | None = None
    ) -> bool: ...

    async def patch_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    async def patch(
        self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...


def _path(kind: str, namespace: str | None, name: str | None = None, sub: str = "") -> str:
    try:
        res = RESOURCES[kind]
    except KeyError:
        raise ValueError(f"the operator does not manage kind {kind!r}") from None
    path = res.prefix
    if res.namespaced:
        if not namespace:
            raise ValueError(f"{kind} is namespaced; a namespace is required")
        path += f"/namespaces/{quote(namespace, safe='')}"
    path += f"/{res.plural}"
    if name is not None:
        path += f"/{quote(name, safe='')}"
    if sub:
        path += f"/{sub}"
    return path


@dataclass(frozen=True)
class Credentials:
    host: str
    verify: ssl.SSLContext | bool
    cert: tuple[str, str] | None
    # Returns the Authorization header value, refreshed when the loader can.
    authorization: Callable[[], str | None]


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """In-cluster service account when available, else the kubeconfig."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if kubeconfig:
            raise config.ConfigException("kubeconfig given")
        cast(Loader, config.load_incluster_config)(client_configuration=cfg)
    except config.ConfigException:
        cast(Loader, config.load_kube_config)(config_file=kubeconfig, client_configuration=cfg)

    def authorization() -> str | None:
        hook = getattr(cfg, "refresh_api_key_hook", None)
        if hook is not None:
            hook(cfg)
        value = cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization")
        if value and not value.lower().startswith("bearer "):
            value = f"Bearer {value}"
        return str(value) if value else None

    verify: ssl.SSLContext | bool = bool(cfg.verify_ssl)
    if cfg.verify_ssl and cfg.ssl_ca_cert:
        verify = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
    cert = (cfg.cert_file, cfg.key_file) if cfg.cert_file and cfg.key_file else None
    return Credentials(
        host=str(cfg.host).rstrip("/"), verify=verify, cert=cert, authorization=authorization
    )


class KubeClient:
    """`KubeApi` over HTTP. Create one per process; close it at shutdown."""

    def __init__(self, credentials: Credentials, timeout_s: float = 30.0) -> None:
        self._credentials = credentials
        verify = credentials.verify
        if credentials.cert is not None:
            ctx = verify if isinstance(verify, ssl.SSLContext) else ssl.create_default_context()
            if verify is False:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            ctx.load_cert_chain(*credentials.cert)
            verify = ctx
        self._http = httpx.AsyncClient(base_url=credentials.host, verify=verify, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        json: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        auth = self._credentials.authorization()
        if auth:
            headers["Authorization"] = auth
        if content_type:
            headers["Content-Type"] = content_type
        try:
            resp = await self._http.request(
                method, path, params=dict(params or {}), json=json, headers=headers
            )
        except httpx.HTTPError as err:
            raise ApiError(0, type(err).__name__, str(err)) from err
        if resp.status_code >= 400:
            try:
                body = resp.json()
                reason, message = str(body.get("reason", "")), str(body.get("message", resp.text))
            except ValueError:
                reason, message = resp.reason_phrase, resp.text
            raise ApiError(resp.status_code, reason, message)
        data = resp.json() if resp.content else {}
        return data if isinstance(data, dict) else {}

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj = await self._request("GET", _path(kind, namespace, name))
        except ApiError as err:
            if err.is_not_found:
                return None
            raise
        obj.setdefault("kind", kind)
        return obj

    async def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        data = await self._request(
            "GET", _path(kind, namespace), params={"labelSelector": selector}
        )
        items = data.get("items") or []
        # List items carry no kind; the planner keys objects by kind.
        return [{**item, "kind": kind} for item in items if isinstance(item, dict)]

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        kind, meta = str(manifest["kind"]), manifest["metadata"]
        return await self._request(
            "PATCH",
            _path(kind, meta.get("namespace"), meta["name"]),
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            json=manifest,
            content_type=APPLY_CONTENT_TYPE,
        )

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        kind, meta = str(manifest["kind"]), manifest["metadata"]
        return await self._request(
            "POST",
            _path(kind, meta.get("namespace")),
            params={"fieldManager": FIELD_MANAGER},
            json=manifest,
        )

    async def delete(
        self, kind: str, namespace: str, name: str, uid: str, grace_period_s: int | None = None
    ) -> bool:
        """Delete exactly the object with `uid`; False when it is already gone
        (or the name now belongs to a newer object, which is left alone).
        `grace_period_s` replaces a pod's terminationGracePeriodSeconds for this
        deletion (the drain budget in force now, whatever the pod was built with)."""
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        body["propagationPolicy"] = "Background"
        try:
            await self._request("DELETE", _path(kind, namespace, name), json=body)
        except ApiError as err:
            if err.is_not_found or err.is_conflict:
                return False
            raise
        return True

    async def served_resources(self, prefix: str) -> builtins.list[str]:
        """Plural names the API serves under `prefix` ("/apis/<group>/<version>");
        empty while discovery does not know the group version yet."""
        try:
            data = await self._request("GET", prefix)
        except ApiError as err:
            if err.is_not_found:
                return []
            raise
        found = data.get("resources") or []
        return [str(r.get("name")) for r in found if isinstance(r, dict)]

    async def patch_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], kind: str = "PDCluster"
    ) -> dict[str, Any]:
        return await self._request(
            "PATCH",
            _path(kind, namespace, name, "status"),
            params={"fieldManager": FIELD_MANAGER},
            json=patch,
            content_type=MERGE_CONTENT_TYPE,
        )

    async def patch(
        self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        return await self._request(
            "PATCH",
            _path(kind, namespace, name),
            params={"fieldManager": FIELD_MANAGER},
            json=patch,
            content_type=MERGE_CONTENT_TYPE,
        )
