"""Client of the node agent's control endpoint: the fault hooks tests call.

agent = NodeAgentClient("http://127.0.0.1:PORT")
agent.kill_pod("ns", "web-0")               # SIGKILL: exit 137, restarted per restartPolicy
agent.freeze_pod("ns", "web-0")             # SIGSTOP: the process hangs, probes fail
agent.thaw_pod("ns", "web-0")               # SIGCONT
agent.pod_log("ns", "web-0", previous=True) # the log of the run before the current one
"""

from __future__ import annotations

from typing import Any

import httpx


class NodeAgentError(LookupError):
    """The agent refused: unknown pod or container, or a bad signal name."""


class NodeAgentClient:
    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, params: dict[str, str]) -> httpx.Response:
        response = httpx.request(method, self.url + path, params=params, timeout=self.timeout_s)
        if response.status_code >= 400:
            try:
                message = response.json()["error"]
            except (ValueError, KeyError):
                message = response.text
            raise NodeAgentError(message)
        return response

    def is_ready(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def pods(self) -> list[dict[str, Any]]:
        """Pods running on the agent's nodes, with their addresses and container pids."""
        result: list[dict[str, Any]] = self._call("GET", "/pods", {}).json()
        return result

    def signal_pod(
        self, namespace: str, name: str, signal: str, container: str | None = None
    ) -> list[str]:
        """Send KILL, TERM, STOP or CONT to the pod's containers; returns those signalled."""
        params = {"signal": signal}
        if container is not None:
            params["container"] = container
        signalled: list[str] = self._call(
            "POST", f"/pods/{namespace}/{name}/signal", params
        ).json()["signalled"]
        return signalled

    def kill_pod(self, namespace: str, name: str, container: str | None = None) -> list[str]:
        return self.signal_pod(namespace, name, "KILL", container)

    def freeze_pod(self, namespace: str, name: str, container: str | None = None) -> list[str]:
        return self.signal_pod(namespace, name, "STOP", container)

    def thaw_pod(self, namespace: str, name: str, container: str | None = None) -> list[str]:
        return self.signal_pod(namespace, name, "CONT", container)

    def pod_log(
        self, namespace: str, name: str, container: str | None = None, previous: bool = False
    ) -> str:
        params = {"previous": "1"} if previous else {}
        if container is not None:
            params["container"] = container
        return self._call("GET", f"/pods/{namespace}/{name}/logs", params).text
