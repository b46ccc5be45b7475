"""A small REST client for the node agent: JSON dicts in and out, and watches.

The agent works on objects in their API form (camelCase dicts), patches
status with strategic-merge patches and streams watches; the generated
`kubernetes` client validates every body against typed models, which gets in
the way of all three, so the agent speaks HTTP directly (httpx).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

PATCH_TYPES = {
    "strategic": "application/strategic-merge-patch+json",
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
}


class ApiError(RuntimeError):
    """A non-success answer from the apiserver."""

    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        try:
            message = json.loads(body).get("message", body)
        except ValueError:
            message = body
        super().__init__(f"{method} {path}: {status} {message}")
        self.status = status
        self.message = message


class KubeApi:
    """Token-authenticated client for one apiserver."""

    def __init__(self, server: str, token: str, ca_file: Path, timeout_s: float = 10.0) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.ca_file = ca_file
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self._client = httpx.Client(
            base_url=self.server,
            headers=self._headers,
            verify=ssl.create_default_context(cafile=str(ca_file)),
            timeout=timeout_s,
        )

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeApi:
        """Read the current context of a token kubeconfig such as e2e.pki writes."""
        config = yaml.safe_load(path.read_text())
        context_name = config["current-context"]
        context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        if "token" not in user:
            raise ValueError(f"{path}: the node agent needs a token user")
        return cls(cluster["server"], user["token"], Path(cluster["certificate-authority"]))

    def close(self) -> None:
        self._client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        content = None if body is None else json.dumps(body)
        response = self._client.request(
            method,
            path,
            content=content,
            params=params,
            headers={"Content-Type": content_type} if content is not None else None,
        )
        if response.status_code >= 300:
            raise ApiError(response.status_code, method, path, response.text)
        result: dict[str, Any] = response.json() if response.content else {}
        return result

    def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        try:
            return self.request("GET", path, params=params)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body=body)

    def put(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("PUT", path, body=body)

    def patch(self, path: str, body: Any, patch_type: str = "strategic") -> dict[str, Any]:
        return self.request("PATCH", path, body=body, content_type=PATCH_TYPES[patch_type])

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> bool:
        """True if deleted (or deletion started), False if it was already gone."""
        try:
            self.request("DELETE", path, body=body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def watch(
        self, path: str, resource_version: str, timeout_s: int = 300
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, object) events after resource_version until the server ends the watch.

        A 410 Gone arrives as an ERROR event whose object is a Status; the
        caller relists.
        """
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        timeout = httpx.Timeout(10.0, read=timeout_s + 30.0)
        with self._client.stream("GET", path, params=params, timeout=timeout) as response:
            if response.status_code >= 300:
                raise ApiError(response.status_code, "WATCH", path, response.read().decode())
            for line in response.iter_lines():
                if line:
                    event = json.loads(line)
                    yield event["type"], event["object"]
