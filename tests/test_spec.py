"""The PDCluster manifest schema: defaults, bounds and cross-field rules."""

import re
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


@pytest.mark.parametrize(
    ("spec", "compute", "kv"),
    [
        (PD, "float32", "float32"),
        ({"prefill": {"device": "cuda"}, "decode": {"device": "cuda"}}, "bfloat16", "bfloat16"),
        # One dtype for the cluster: a CPU decode of a GPU prefill computes alike.
        ({"prefill": {"device": "cuda"}, "decode": {}}, "bfloat16", "bfloat16"),
        ({"colocated": {"device": "cuda"}, "model": {"computeDtype": "float32"}},
         "float32", "float32"),
        ({"colocated": {"device": "cuda"}, "kvCache": {"dtype": "float16"}}, "bfloat16", "float16"),
        ({**PD, "model": {"computeDtype": "float64"}}, "float64", "float64"),
    ],
)  # fmt: skip
def test_dtypes_default_to_bfloat16_on_cuda_unless_the_manifest_says(
    spec: dict, compute: str, kv: str
) -> None:
    from pdcluster.runtime.engine.engine_config import engine_config_from_spec

    c = parse_manifest(manifest(spec)).spec
    assert (c.compute_dtype, c.kv_dtype) == (compute, kv)
    for role in (c.prefill, c.decode, c.colocated):
        if role is not None:
            cfg = engine_config_from_spec(c, role)
            assert (cfg.compute_dtype, cfg.kv_dtype) == (compute, kv)


def test_num_pages_left_out_is_sized_at_start() -> None:
    from pdcluster.runtime.engine.engine_config import engine_config_from_spec

    c = parse_manifest(manifest(PD)).spec
    assert c.kv_cache.num_pages is None and c.kv_cache.gpu_memory_utilization == 0.9
    assert c.decode is not None and engine_config_from_spec(c, c.decode).num_pages is None
    given = parse_manifest(manifest({**PD, "kvCache": {"numPages": 64}})).spec
    assert given.decode is not None and engine_config_from_spec(given, given.decode).num_pages == 64
    for bad in (0, 1.5, -0.1):
        with pytest.raises(SpecError, match="gpuMemoryUtilization"):
            parse_manifest(manifest({**PD, "kvCache": {"gpuMemoryUtilization": bad}}))


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
        ({"prefill": {"drain": {"announceSeconds": -1}}, "decode": {}}, "announceSeconds"),
        ({"prefill": {}, "decode": {"drain": {"announceSeconds": 61}}}, "announceSeconds"),
        # The router is no worker: nothing of it announces a stop.
        ({**PD, "router": {"drain": {"announceSeconds": 1}}}, "announceSeconds"),
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


def _autoscaled(metric: str = "ttftP90Seconds", **fields: object) -> dict:
    return {"maxReplicas": 3, "target": {"metric": metric, "value": 0.5}, **fields}


def test_autoscaling_defaults() -> None:
    spec = parse_spec({"prefill": {"autoscaling": _autoscaled()}, "decode": {}})
    scaling = spec.prefill.autoscaling
    assert (scaling.min_replicas, scaling.max_replicas, scaling.max_step) == (1, 3, 1)
    assert (scaling.interval_seconds, scaling.tolerance) == (15.0, 0.1)
    assert scaling.scale_up.stabilization_seconds == 30.0
    assert scaling.scale_down.stabilization_seconds == 300.0
    assert spec.decode.autoscaling is None and spec.autoscaling.max_total_gpus is None


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (
            {"prefill": {"autoscaling": _autoscaled(minReplicas=4)}, "decode": {}},
            "autoscaling.minReplicas (4) must be at most maxReplicas (3)",
        ),
        (
            {"prefill": {"autoscaling": _autoscaled("kvPageUsage")}, "decode": {}},
            "prefill.autoscaling.target.metric 'kvPageUsage' does not scale prefill: expected "
            "one of ttftP90Seconds, queuedPrefillTokensPerInstance",
        ),
        (
            {"prefill": {}, "decode": {"autoscaling": _autoscaled("ttftP90Seconds")}},
            "does not scale decode: expected one of tpotP90Seconds, runningRequestsPerInstance",
        ),
        (
            {"prefill": {}, "decode": {"autoscaling": _autoscaled("unknownMetric")}},
            "decode.autoscaling.target.metric: Input should be",
        ),
        (
            {"prefill": {}, "decode": {"autoscaling": _autoscaled("kvPageUsage", target=None)}},
            "decode.autoscaling.target",
        ),
        (
            {
                "prefill": {},
                "decode": {
                    "autoscaling": {
                        "maxReplicas": 2,
                        "target": {"metric": "kvPageUsage", "value": 2},
                    }
                },
            },
            "a kvPageUsage target is a fraction in (0, 1], got 2",
        ),
        (
            {"colocated": {"autoscaling": _autoscaled()}},
            "colocated.autoscaling is not supported",
        ),
        (
            {
                "prefill": {"autoscaling": _autoscaled()},
                "decode": {"replicas": 2, "topology": {"tp": 2}},
                "autoscaling": {"maxTotalGPUs": 4},
            },
            "autoscaling.maxTotalGPUs (4) is below the GPUs of both roles at their minimum (5)",
        ),
        (
            {
                "prefill": {"autoscaling": _autoscaled()},
                "decode": {"autoscaling": _autoscaled("kvPageUsage", minReplicas=2)},
                "autoscaling": {"maxTotalGPUs": 4},
            },
            "prefill.autoscaling.maxReplicas (3) needs 3 GPUs; with the other role at its "
            "minimum (2) that exceeds autoscaling.maxTotalGPUs (4)",
        ),
        (
            {"prefill": {"autoscaling": _autoscaled(tolerance=1)}, "decode": {}},
            "prefill.autoscaling.tolerance",
        ),
    ],
)
def test_invalid_autoscaling_names_the_problem(spec: dict, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert needle in str(err.value)


def test_max_total_gpus_counts_every_rank_and_fits_at_the_edge() -> None:
    spec = {
        "prefill": {"autoscaling": _autoscaled(), "topology": {"tp": 2}},
        "decode": {"replicas": 2},
        "autoscaling": {"maxTotalGPUs": 8},  # prefill 3 x 2 ranks + decode 2 = 8
    }
    assert parse_spec(spec).autoscaling.max_total_gpus == 8
    with pytest.raises(SpecError, match="exceeds autoscaling.maxTotalGPUs"):
        parse_spec({**spec, "autoscaling": {"maxTotalGPUs": 7}})


def test_the_engine_is_builtin_unless_the_manifest_says_vllm() -> None:
    assert parse_spec(PD).engine.kind == "builtin"
    assert not parse_spec(PD).engine.is_vllm
    vllm = parse_spec(
        {
            **PD,
            "engine": {"kind": "vllm"},
            "model": {"name": "m", "path": "/m"},
            "transfer": {"backend": "nixl"},
        }
    )
    assert vllm.engine.is_vllm
    assert vllm.engine.vllm.kv_connector == "NixlConnector"


@pytest.mark.parametrize(
    ("vllm", "message"),
    [
        ({"extraArgs": ["--tensor-parallel-size", "2"]}, "extraArgs[0]: --tensor-parallel-size"),
        ({"extraArgs": ["--x", "--block-size=16"]}, "extraArgs[1]: --block-size is set from"),
        ({"env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "1"}}, "env: VLLM_NIXL_SIDE_CHANNEL_PORT"),
        ({"env": {"A-B": "1"}}, "'A-B' is not a variable name"),
        ({"extraArgs": [""]}, "extraArgs.0"),
    ],
)
def test_vllm_settings_refuse_what_the_manifest_already_decides(vllm: dict, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec({**PD, "engine": {"kind": "builtin", "vllm": vllm}})
