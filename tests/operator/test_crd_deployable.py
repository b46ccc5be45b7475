"""The CEL rules of the deployability sections (model source, pod overlay,
rollout, per-rank NICs) refuse exactly what the models refuse."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdcluster.operator.crd import cel_rules
from pdcluster.operator.crd.structural import apply_defaults
from pdcluster.runtime.spec import SpecError, parse_spec

from .test_crd import SPEC_SCHEMA, _eval

ROLES = ("prefill", "decode", "colocated")


def failing(spec: dict[str, Any]) -> list[str]:
    """Messages of every rule that fails, each on the node it is attached to."""
    s = apply_defaults(SPEC_SCHEMA, copy.deepcopy(spec))
    out = [r.message for r in cel_rules.SPEC_RULES if not _eval(r, s)]
    out += [r.message for r in cel_rules.MODEL_RULES if not _eval(r, s["model"])]
    if "source" in s["model"]:
        out += [
            r.message for r in cel_rules.MODEL_SOURCE_RULES if not _eval(r, s["model"]["source"])
        ]
    out += [r.message for r in cel_rules.UCX_RULES if not _eval(r, s["transfer"]["ucx"])]
    pods = [s[role]["pod"] for role in ROLES if role in s] + [s["router"]["pod"]]
    out += [r.message for pod in pods for r in cel_rules.POD_RULES if not _eval(r, pod)]
    for role in (r for r in ROLES if r in s):
        out += [r.message for r in cel_rules.ROLLOUT_RULES if not _eval(r, s[role]["rollout"])]
    return out


def spec_with(**extra: Any) -> dict[str, Any]:
    return {"prefill": {}, "decode": {}, **extra}


def overlay(where: str, pod: dict[str, Any]) -> dict[str, Any]:
    return spec_with(**{where: {"pod": pod}})


MOUNT = {"volumes": [{"name": "v", "emptyDir": {}}]}
CASES = {
    "valid-everything": (
        spec_with(
            model={"name": "llama", "source": {"uri": "pvc://models/llama"}},
            transfer={"ucx": {"rankNetDevices": ["mlx5_0:1", "mlx5_1:1"]}},
            prefill={
                "topology": {"tp": 2},
                "rollout": {"maxSurge": 0, "maxUnavailable": 1},
                "pod": {
                    **MOUNT,
                    "volumeMounts": [{"name": "v", "mountPath": "/scratch"}],
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                    "labels": {"team": "llm"},
                    "capabilities": ["IPC_LOCK"],
                },
            },
        ),
        None,
    ),
    "source-hf-without-cache": (
        spec_with(model={"name": "l", "source": {"uri": "hf://org/name"}}),
        "needs cacheClaim",
    ),
    "source-cache-on-pvc": (
        spec_with(model={"name": "l", "source": {"uri": "pvc://m", "cacheClaim": "c"}}),
        "belong to hf:// only",
    ),
    "source-pull-policy-on-host": (
        spec_with(model={"name": "l", "source": {"uri": "host:///m", "pullPolicy": "Never"}}),
        "belongs to oci:// only",
    ),
    "path-and-source": (
        spec_with(model={"name": "l", "path": "/m", "source": {"uri": "pvc://m"}}),
        "not both",
    ),
    "no-path-no-source": (spec_with(model={"name": "l"}), "needs `path` or `source`"),
    "rollout-zero": (spec_with(decode={"rollout": {"maxSurge": 0}}), "cannot both be 0"),
    "ucx-both": (
        spec_with(transfer={"ucx": {"netDevices": "a", "rankNetDevices": ["a"]}}),
        "not both",
    ),
    "ucx-too-few": (
        spec_with(transfer={"ucx": {"rankNetDevices": ["a"]}}, decode={"topology": {"tp": 2}}),
        "rankNetDevices has",
    ),
    "ucx-per-pod-fits": (
        spec_with(
            transfer={"ucx": {"rankNetDevices": ["a"]}},
            decode={"topology": {"tp": 2}, "gpusPerPod": 1},
        ),
        None,
    ),
}
for where in ("prefill", "router"):
    CASES |= {
        f"{where}-env": (overlay(where, {"env": [{"name": "HOME", "value": "/"}]}), "pod.env"),
        f"{where}-env-prefix": (
            overlay(where, {"env": [{"name": "PDCLUSTER_X", "value": "1"}]}),
            "pod.env",
        ),
        f"{where}-label": (overlay(where, {"labels": {"pdcluster.io/x": "1"}}), "pod.labels"),
        f"{where}-annotation": (
            overlay(where, {"annotations": {"pdcluster.io/x": "1"}}),
            "pod.annotations",
        ),
        f"{where}-volume": (overlay(where, {"volumes": [{"name": "shm"}]}), "pod.volumes"),
        f"{where}-capability": (overlay(where, {"capabilities": ["ALL"]}), "pod.capabilities"),
        **{
            f"{where}-mount-{path}": (
                overlay(where, {**MOUNT, "volumeMounts": [{"name": "v", "mountPath": path}]}),
                "pod.volumeMounts",
            )
            for path in ("/tmp", "/tmp/x", "/models", "/var/run", "/", "/dev", "/dev/shm/a")
        },
        f"{where}-mount-beside": (
            overlay(where, {**MOUNT, "volumeMounts": [{"name": "v", "mountPath": "/tmpfs"}]}),
            None,
        ),
    }


@pytest.mark.parametrize(("spec", "phrase"), list(CASES.values()), ids=list(CASES))
def test_cel_and_the_models_agree(spec: dict[str, Any], phrase: str | None) -> None:
    messages = failing(spec)
    if phrase is None:
        parse_spec(spec)
        assert messages == []
        return
    with pytest.raises(SpecError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        parse_spec(spec)
    assert any(phrase in m for m in messages), messages
