"""The PDCluster manifest schema: defaults, bounds and cross-field rules."""

from pathlib import Path

import pytest
import yaml

from pdcluster.runtime.spec import (
    PDCluster,
    SpecError,
    load_manifest_text,
    parse_manifest,
    parse_spec,
)

EXAMPLES = sorted(Path(__file__).parent.parent.joinpath("examples").glob("*.yaml"))


def manifest(spec: dict) -> dict:
    return {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": "t"},
        "spec": spec,
    }


PD = {"prefill": {}, "decode": {}}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses(path: Path) -> None:
    cluster = load_manifest_text(path.read_text())
    assert isinstance(cluster, PDCluster)


def test_defaults_are_filled_in() -> None:
    c = parse_manifest(manifest(PD))
    assert c.spec.model.name == "tiny"
    assert c.spec.kv_cache.page_size == 16
    assert c.spec.transfer.heartbeat.interval_seconds == 5.0
    assert c.spec.transfer.heartbeat.failure_threshold == 2
    assert c.spec.prefill is not None and c.spec.prefill.topology.num_ranks == 1
    assert c.spec.is_disaggregated


def test_camel_case_round_trip() -> None:
    c = parse_manifest(manifest({**PD, "kvCache": {"pageSize": 8, "dtype": "bfloat16"}}))
    dumped = c.spec.model_dump(by_alias=True, mode="json")
    assert dumped["kvCache"]["pageSize"] == 8
    assert parse_spec(dumped) == c.spec


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"decode": {}}, "prefill"),
        ({"prefill": {}}, "decode"),
        ({}, "prefill` and `decode"),
        ({**PD, "colocated": {}}, "not both"),
        ({"prefill": {}, "decode": {"topology": {"cp": 2}}}, "decode.topology.cp must be 1"),
        (
            {"prefill": {"topology": {"pp": 2}}, "decode": {"topology": {"pp": 4}}},
            "pp must be 1 or",
        ),
        (
            {"prefill": {"topology": {"tp": 3}, "gpusPerPod": 2}, "decode": {}},
            "divisible by gpusPerPod",
        ),
        ({**PD, "kvCache": {"pageSize": 0}}, "kvCache.pageSize"),
        ({**PD, "kvCache": {"dtype": "int3"}}, "kvCache.dtype"),
        ({**PD, "transfer": {"backend": "rdma"}}, "transfer.backend"),
        ({**PD, "surprise": 1}, "surprise"),
        ({**PD, "model": {"name": "llama"}}, "needs `path`"),
    ],
)
def test_invalid_specs_name_the_problem(spec: dict, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_manifest(manifest(spec))
    assert needle in str(err.value)


def test_decode_pp_may_equal_prefill_pp() -> None:
    c = parse_manifest(
        manifest({"prefill": {"topology": {"pp": 2}}, "decode": {"topology": {"pp": 2}}})
    )
    assert c.spec.decode is not None and c.spec.decode.topology.pp == 2


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a: [", "not valid YAML"),
        ("kind: Deployment\n", "exactly one PDCluster"),
        (yaml.safe_dump(manifest(PD)) + "---\n" + yaml.safe_dump(manifest(PD)), "found 2"),
        (yaml.safe_dump({**manifest(PD), "metadata": {"name": "Bad_Name"}}), "metadata.name"),
    ],
)
def test_manifest_text_errors(text: str, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        load_manifest_text(text)
    assert needle in str(err.value)
