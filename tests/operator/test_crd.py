"""The CRD generated from the models: up to date, structural, and its CEL
rules and defaults agree with the models the local mode uses."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcluster.operator.crd import cel_rules
from pdcluster.operator.crd.crdgen import build_crd, main, render_crd_yaml
from pdcluster.operator.crd.refdoc import render_reference
from pdcluster.operator.crd.structural import apply_defaults, check_structural, to_structural, walk
from pdcluster.runtime.spec import (
    MAX_RANKS_PER_INSTANCE,
    AutoscalingMetric,
    SpecError,
    load_manifest_text,
    parse_spec,
)

from .helpers import need

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = [
    ROOT / "crds" / "pdcluster.io_pdclusters.yaml",
    ROOT / "charts" / "pdcluster-operator" / "crds" / "pdcluster.io_pdclusters.yaml",
]
CRD = build_crd()
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
STATUS_SCHEMA = SCHEMA["properties"]["status"]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_crd_matches_a_fresh_generation(path: Path) -> None:
    assert path.read_text() == render_crd_yaml(), (
        f"{path.relative_to(ROOT)} is stale: run `python -m pdcluster.operator.crd.crdgen "
        "-o crds/pdcluster.io_pdclusters.yaml "
        "-o charts/pdcluster-operator/crds/pdcluster.io_pdclusters.yaml`"
    )


def test_committed_reference_matches_a_fresh_generation() -> None:
    path = ROOT / "docs" / "reference.md"
    assert path.read_text() == render_reference(), "docs/reference.md is stale: run `make crds`"


def test_generator_writes_every_output(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "sub" / "b.yaml"
    assert main(["-o", str(a), "-o", str(b)]) == 0
    assert a.read_text() == b.read_text() == render_crd_yaml()


def test_crd_is_a_valid_apiextensions_object_with_a_structural_schema() -> None:
    need("kubernetes_validate").validate(CRD, "1.37.0", strict=True)
    problems = [p for p in check_structural(SCHEMA) if not p.startswith("<root>.metadata")]
    assert problems == []


def test_identity_subresources_and_columns() -> None:
    spec = CRD["spec"]
    assert spec["group"] == "pdcluster.io" and VERSION["name"] == "v1alpha1"
    assert spec["names"]["shortNames"] == ["pdc"] and spec["scope"] == "Namespaced"
    assert VERSION["subresources"]["status"] == {}
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Prefill", "Decode", "Colocated", "Router", "Age"]
    # Every column and scale path points at a field the schema has.
    scale = VERSION["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.decode.replicas"
    paths = {p for p, _ in walk(SCHEMA, "")}
    for json_path in [*columns.values(), *scale.values()]:
        if json_path != ".metadata.creationTimestamp":
            assert json_path in paths, json_path


def test_conversion_rejects_what_kubernetes_cannot_express() -> None:
    from pdcluster.operator.crd.structural import SchemaConversionError

    with pytest.raises(SchemaConversionError, match="Optional"):
        to_structural({"anyOf": [{"type": "string"}, {"type": "integer"}]})
    with pytest.raises(SchemaConversionError, match="unresolvable"):
        to_structural({"$ref": "#/$defs/Missing"})
    with pytest.raises(SchemaConversionError, match="needs a type"):
        to_structural({"description": "no type"})
    out = to_structural({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 5})
    assert out == {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 5,
        "exclusiveMaximum": True,
    }


def test_structural_check_flags_violations() -> None:
    bad = {
        "type": "object",
        "properties": {"a": {"$ref": "#/x"}, "b": {"type": "array"}, "c": {"type": "object"}},
    }
    problems = check_structural(bad)
    assert any("a: keys not allowed" in p for p in problems)
    assert any("b: array without items" in p for p in problems)
    assert any("c: object with no fields" in p for p in problems)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    if isinstance(value, list) and not value:
        return {}
    return {prefix: value}


AUTOSCALED = {
    "prefill": {
        "autoscaling": {"maxReplicas": 2, "target": {"metric": "ttftP90Seconds", "value": 1}}
    },
    "decode": {
        "autoscaling": {"maxReplicas": 2, "target": {"metric": "kvPageUsage", "value": 0.8}}
    },
}


@pytest.mark.parametrize("spec", [{"prefill": {}, "decode": {}}, {"colocated": {}}, AUTOSCALED])
def test_crd_defaults_equal_the_model_defaults(spec: dict[str, Any]) -> None:
    defaulted = apply_defaults(SPEC_SCHEMA, copy.deepcopy(spec))
    model = parse_spec(spec).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert _flatten(defaulted) == _flatten(model)


def _to_json_schema(schema: Any) -> Any:
    """The structural schema as draft-4 JSON Schema (nullable becomes a type union)."""
    if isinstance(schema, dict):
        out = {
            k: _to_json_schema(v)
            for k, v in schema.items()
            if not k.startswith("x-kubernetes") and k != "nullable"
        }
        if schema.get("nullable"):
            out["type"] = [schema["type"], "null"]
        keeps_unknown = schema.get("x-kubernetes-preserve-unknown-fields")
        if schema.get("type") == "object" and "properties" in schema and not keeps_unknown:
            out["additionalProperties"] = False  # what pruning would silently drop
        return out
    if isinstance(schema, list):
        return [_to_json_schema(v) for v in schema]
    return schema


@functools.cache
def spec_validator() -> Any:
    return need("jsonschema").Draft4Validator(_to_json_schema(SPEC_SCHEMA))


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_pass_the_crd_schema(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    load_manifest_text(path.read_text())
    defaulted = apply_defaults(SPEC_SCHEMA, doc["spec"])
    assert list(spec_validator().iter_errors(defaulted)) == []
    assert _failing_rules(defaulted) == []


@pytest.mark.parametrize(
    "patch",
    [
        {"kvCache": {"pageSize": 0}},
        {"kvCache": {"dtype": "int8"}},
        {"router": {"replicas": 65}},
        {"transfer": {"heartbeat": {"intervalSeconds": 0}}},
        {"prefill": {"bogus": 1}},
    ],
    ids=["page-size-0", "bad-dtype", "router-65", "heartbeat-0", "unknown-field"],
)
def test_schema_rejects_out_of_bounds_values_like_the_models(patch: dict[str, Any]) -> None:
    spec = {"prefill": {}, "decode": {}}
    for key, value in patch.items():
        spec[key] = {**spec.get(key, {}), **value}
    with pytest.raises(SpecError):
        parse_spec(spec)
    assert list(spec_validator().iter_errors(apply_defaults(SPEC_SCHEMA, spec)))


@functools.cache
def _program(text: str) -> Any:
    env = need("celpy").Environment()
    return env.program(env.compile(text))


def _eval(rule: cel_rules.CelRule, self_value: Any) -> bool:
    celpy = need("celpy")
    return bool(_program(rule.rule).evaluate({"self": celpy.json_to_cel(self_value)}))


def _failing_rules(spec: dict[str, Any]) -> list[str]:
    failing = [r.message for r in cel_rules.SPEC_RULES if not _eval(r, spec)]
    for role in ("prefill", "decode", "colocated"):
        if role in spec:
            failing += [r.message for r in cel_rules.ROLE_RULES if not _eval(r, spec[role])]
    failing += [r.message for r in cel_rules.MODEL_RULES if not _eval(r, spec["model"])]
    vllm = spec.get("engine", {}).get("vllm")
    if vllm is not None:
        failing += [r.message for r in cel_rules.VLLM_RULES if not _eval(r, vllm)]
    return failing


# Phrases shared by a model error and the CEL message for the same rule.
PHRASES = (
    "divisible by gpusPerPod",
    "larger than the ranks per instance",
    f"must be at most {MAX_RANKS_PER_INSTANCE}",
    "cp must be 1",
    "pp must be 1 or equal",
    "not both",
    "needs a `prefill` role",
    "needs a `decode` role",
    "needs `path`",
    "needs `prefill` and `decode` roles",
    "must be at most maxReplicas",
    "a fraction in (0, 1]",
    "does not scale prefill",
    "does not scale decode",
    "colocated.autoscaling is not supported",
    "is below the GPUs of both roles at their minimum",
    "exceeds autoscaling.maxTotalGPUs",
    # engine.kind: vllm (runtime/spec/serving_engine.py)
    "model.path: engine.kind vllm",
    "not float64",
    "kvCache.dtype must equal model.computeDtype",
    "kvCache.layout: vLLM",
    "transfer.checksum: NixlConnector",
    "transfer.backend must be nixl",
    "PDClusterConnector moves the KV over tcp or nixl",
    "only early applies",
    "PDClusterConnector pairs tensor-parallel vLLM",
    "context parallelism is not mapped onto vLLM",
    "a vLLM instance runs in one pod",
    "kvBufferDevice cuda needs",
    "vLLM reports no queued prompt tokens",
    "cache_aware follows one vLLM engine per instance",
    "extraArgs",
    "env:",
)

axis = st.integers(min_value=1, max_value=4)
autoscaling = st.fixed_dictionaries(
    {
        "maxReplicas": st.integers(1, 4),
        "target": st.fixed_dictionaries(
            {
                "metric": st.sampled_from([m.value for m in AutoscalingMetric]),
                "value": st.sampled_from([0.5, 2.0]),
            }
        ),
    },
    optional={"minReplicas": st.integers(1, 4)},
)
roles = st.fixed_dictionaries(
    {
        "topology": st.fixed_dictionaries(
            {}, optional={"dp": axis, "tp": axis, "cp": axis, "pp": axis}
        )
    },
    optional={
        "gpusPerPod": st.sampled_from([1, 2, 3, 4, 8]),
        "replicas": st.integers(0, 3),
        "autoscaling": autoscaling,
        "device": st.sampled_from(["cpu", "cuda"]),
    },
)
dtypes = st.sampled_from(["float32", "bfloat16", "float64"])
engines = st.fixed_dictionaries(
    {"kind": st.sampled_from(["builtin", "vllm"])},
    optional={
        "vllm": st.fixed_dictionaries(
            {},
            optional={
                "kvBufferDevice": st.sampled_from(["cpu", "cuda"]),
                "kvConnector": st.sampled_from(["NixlConnector", "PDClusterConnector"]),
                "extraArgs": st.lists(
                    st.sampled_from(["--enforce-eager", "--port=1", "-tp", "--max-model-len"]),
                    max_size=2,
                ),
                "env": st.dictionaries(
                    st.sampled_from(["HF_TOKEN", "VLLM_API_KEY", "1BAD"]), st.just("x"), max_size=2
                ),
            },
        )
    },
)
specs = st.fixed_dictionaries(
    {},
    optional={
        "autoscaling": st.fixed_dictionaries({}, optional={"maxTotalGPUs": st.integers(1, 40)}),
        "prefill": roles,
        "decode": roles,
        "colocated": roles,
        "model": st.fixed_dictionaries(
            {"name": st.sampled_from(["tiny", "llama"])},
            optional={"path": st.sampled_from(["", "/models/llama"]), "computeDtype": dtypes},
        ),
        "engine": engines,
        "kvCache": st.fixed_dictionaries(
            {}, optional={"dtype": dtypes, "layout": st.sampled_from(["NHD", "HND"])}
        ),
        "transfer": st.fixed_dictionaries(
            {},
            optional={
                "backend": st.sampled_from(["tcp", "nixl", "shm"]),
                "checksum": st.booleans(),
                "allocationPolicy": st.sampled_from(["early", "prefill_complete"]),
            },
        ),
        "router": st.fixed_dictionaries(
            {},
            optional={
                "policy": st.fixed_dictionaries(
                    {}, optional={"prefill": st.sampled_from(["round_robin", "cache_aware"])}
                )
            },
        ),
    },
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs)
def test_cel_rules_accept_exactly_what_the_models_accept(spec: dict[str, Any]) -> None:
    defaulted = apply_defaults(SPEC_SCHEMA, copy.deepcopy(spec))
    failing = _failing_rules(defaulted)
    try:
        parse_spec(spec)
    except SpecError as err:
        assert failing, f"models reject but CEL accepts: {err}"
        model_phrases = {p for p in PHRASES if p in str(err)}
        cel_phrases = {p for p in PHRASES if any(p in m for m in failing)}
        assert model_phrases & cel_phrases, (str(err), failing)
    else:
        assert failing == []


OURS: dict[str, Any] = {"kind": "vllm", "vllm": {"kvConnector": "PDClusterConnector"}}
VLLM_OK: dict[str, Any] = {
    "engine": {"kind": "vllm", "vllm": {"extraArgs": ["--enforce-eager"], "env": {"A": "1"}}},
    "model": {"name": "m", "path": "/models/m"},
    "transfer": {"backend": "nixl"},
    "prefill": {"topology": {"tp": 2}, "gpusPerPod": 2},
    "decode": {},
}


@pytest.mark.parametrize(
    ("patch", "phrase"),
    [
        ({}, None),
        ({"model": {"name": "tiny"}}, "model.path: engine.kind vllm"),
        ({"model": {"name": "m", "path": "/m", "computeDtype": "float64"}}, "not float64"),
        ({"kvCache": {"dtype": "bfloat16"}}, "kvCache.dtype must equal model.computeDtype"),
        ({"kvCache": {"layout": "HND"}}, "kvCache.layout: vLLM"),
        ({"transfer": {"backend": "nixl", "checksum": True}}, "transfer.checksum: NixlConnector"),
        ({"transfer": {"backend": "tcp"}}, "transfer.backend must be nixl"),
        ({"engine": OURS, "transfer": {"backend": "tcp", "checksum": True}}, None),
        ({"engine": OURS, "transfer": {"backend": "nixl"}}, None),
        (
            {"engine": OURS, "transfer": {"backend": "shm"}},
            "PDClusterConnector moves the KV over tcp or nixl",
        ),
        (
            {
                "engine": OURS,
                "transfer": {"backend": "tcp", "allocationPolicy": "prefill_complete"},
            },
            "only early applies",
        ),
        ({"prefill": {"topology": {"cp": 2}}}, "context parallelism is not mapped onto vLLM"),
        ({"decode": {"topology": {"tp": 2}, "gpusPerPod": 1}}, "a vLLM instance runs in one pod"),
        (
            {"engine": {"kind": "vllm", "vllm": {"kvBufferDevice": "cuda"}}},
            "kvBufferDevice cuda needs",
        ),
        (
            {
                "prefill": {
                    "autoscaling": {
                        "maxReplicas": 2,
                        "target": {"metric": "queuedPrefillTokensPerInstance", "value": 100},
                    }
                }
            },
            "vLLM reports no queued prompt tokens",
        ),
        ({"router": {"policy": {"decode": "cache_aware", "prefill": "cache_aware"}}}, None),
        (
            {
                "router": {"policy": {"decode": "cache_aware"}},
                "decode": {"topology": {"dp": 2}},
            },
            "cache_aware follows one vLLM engine per instance; decode.topology.dp",
        ),
        (
            {
                "router": {"policy": {"prefill": "cache_aware"}},
                "prefill": {"topology": {"tp": 2, "dp": 2}, "gpusPerPod": 4},
            },
            "cache_aware follows one vLLM engine per instance; prefill.topology.dp",
        ),
        (
            {
                "prefill": None,
                "decode": None,
                "transfer": {},
                "colocated": {"topology": {"dp": 2}},
                "router": {"policy": {"decode": "cache_aware"}},
            },
            "colocated.topology.dp must be 1",
        ),
        (
            {"router": {"policy": {"prefill": "cache_aware"}}, "decode": {"topology": {"dp": 2}}},
            None,
        ),
        ({"engine": {"kind": "vllm", "vllm": {"extraArgs": ["--port=9"]}}}, "extraArgs"),
        ({"engine": {"kind": "vllm", "vllm": {"env": {"VLLM_API_KEY": "x"}}}}, "env:"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_vllm_rules_refuse_in_both_places_with_the_same_words(
    patch: dict[str, Any], phrase: str | None
) -> None:
    # A None in the patch drops the field (a colocated cluster drops prefill and decode).
    spec = {k: v for k, v in {**copy.deepcopy(VLLM_OK), **patch}.items() if v is not None}
    failing = _failing_rules(apply_defaults(SPEC_SCHEMA, copy.deepcopy(spec)))
    if phrase is None:
        parse_spec(spec)
        assert failing == []
        return
    with pytest.raises(SpecError, match=re.escape(phrase)):
        parse_spec(spec)
    assert [m for m in failing if phrase in m], failing


def test_cel_rules_hold_on_objects_the_apiserver_did_not_default() -> None:
    # `kubectl scale` on a colocated cluster writes a bare `decode: {replicas: N}`.
    bare = {"colocated": {"replicas": 1}, "decode": {"replicas": 2}, "model": {}}
    assert _failing_rules(bare) == ["use either `colocated` or `prefill`+`decode`, not both"]


def test_name_rule_rejects_names_child_objects_cannot_carry() -> None:
    (rule,) = cel_rules.ROOT_RULES
    assert _eval(rule, {"metadata": {"name": "a" * 63}})
    assert not _eval(rule, {"metadata": {"name": "a" * 64}})
    assert not _eval(rule, {"metadata": {"name": "my.cluster"}})


def test_rank_cap_refuses_a_huge_instance_in_both_places() -> None:
    # Each axis alone is bounded (<= 64); their product was not: 64**4 ranks in
    # one instance passed the CRD and the models.
    huge = {"topology": {"dp": 64, "tp": 64, "cp": 64, "pp": 64}}
    at_cap = {"topology": {"dp": 4, "tp": 4, "pp": 4}}
    message = f"ranks per instance (dp*tp*cp*pp) must be at most {MAX_RANKS_PER_INSTANCE}"
    assert [r.message for r in cel_rules.ROLE_RULES if not _eval(r, huge)] == [message]
    assert all(_eval(r, at_cap) for r in cel_rules.ROLE_RULES)
    with pytest.raises(SpecError, match=f"must be at most {MAX_RANKS_PER_INSTANCE}"):
        parse_spec({"colocated": huge})
    parse_spec({"colocated": at_cap})


def test_model_message_names_the_model() -> None:
    rule = cel_rules.MODEL_RULES[0]
    assert rule.message_expression is not None
    program = _program(rule.message_expression)
    text = program.evaluate({"self": need("celpy").json_to_cel({"name": "llama"})})
    assert str(text) == "model llama needs `path` or `source` (only tiny is built in)"
