"""What a set of NetworkPolicies admits, by the rules of networking.k8s.io/v1.

The local control plane stores NetworkPolicies but runs no network plugin to
enforce them, so the e2e tests read the objects back from the apiserver (as
stored and defaulted) and ask this module who they let in:

- a pod selected by no policy with `Ingress` in its policyTypes admits all;
- otherwise a connection is admitted when some rule of some selecting policy
  admits it: one of its `from` peers matches (a peer with both selectors
  needs both; a podSelector alone means the policy's own namespace; no
  `from` means every source) and one of its `ports` matches (none: every
  port; a named port is the target container's port of that name).
Only matchLabels selectors and TCP are modelled (what our policies use);
anything else raises, so a test never trusts a rule it cannot read.

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    """A pod as NetworkPolicies see it: its namespace's labels and its own."""

    namespace: str
    namespace_labels: Mapping[str, str]
    labels: Mapping[str, str]
    # Container port name -> number (the target's, for named ports).
    ports: Mapping[str, int] = field(default_factory=dict)


def _matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return True
    unknown = set(selector) - {"matchLabels"}
    if unknown:
        raise ValueError(f"selector fields {sorted(unknown)} are not modelled")
    wanted = selector.get("matchLabels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def _peer_admits(peer: Mapping[str, Any], source: Endpoint, policy_ns: str) -> bool:
    unknown = set(peer) - {"podSelector", "namespaceSelector"}
    if unknown:
        raise ValueError(f"peer fields {sorted(unknown)} are not modelled")
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], source.namespace_labels):
            return False
    elif source.namespace != policy_ns:
        return False
    return _matches(peer.get("podSelector"), source.labels)


def _port_admits(rule_port: Mapping[str, Any], target: Endpoint, port: int) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP" or "endPort" in rule_port:
        raise ValueError(f"port {dict(rule_port)} is not modelled")
    wanted = rule_port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str):
        return target.ports.get(wanted) == port
    return int(wanted) == port


def admits(
    policies: Iterable[Mapping[str, Any]], source: Endpoint, target: Endpoint, port: int
) -> bool:
    """Whether `policies` let `source` open a TCP connection to `target` on `port`."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
        and _matches(p["spec"].get("podSelector") or {}, target.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers and not any(
                _peer_admits(peer, source, policy["metadata"]["namespace"]) for peer in peers
            ):
                continue
            ports = rule.get("ports")
            if not ports or any(_port_admits(p, target, port) for p in ports):
                return True
    return False
