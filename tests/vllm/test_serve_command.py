"""The manifest as `vllm serve` flags and environment (runtime/vllm/serve_command.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.spec import PDClusterSpec, Role, SpecError, parse_spec
from pdcluster.runtime.vllm.serve_command import (
    API_SERVER_MODULE,
    DEFAULT_KV_EVENTS_PORTS,
    build_vllm_serve,
    is_interpreter,
    kv_transfer_config,
    side_channel_ports,
    vllm_argv,
)

BASE: dict[str, Any] = {
    "engine": {"kind": "vllm"},
    "model": {"name": "llama", "path": "/models/llama"},
    "transfer": {"backend": "nixl"},
    "prefill": {},
    "decode": {},
}


def spec_of(**patch: Any) -> PDClusterSpec:
    return parse_spec({**BASE, **patch})


def flag(serve_flags: tuple[str, ...], name: str) -> str:
    return serve_flags[serve_flags.index(name) + 1]


def test_the_model_topology_and_settings_become_flags() -> None:
    spec = spec_of(
        model={"name": "llama", "path": "/models/llama", "computeDtype": "bfloat16"},
        kvCache={"dtype": "bfloat16", "pageSize": 32},
        prefill={"topology": {"tp": 2, "pp": 2, "dp": 2}, "engine": {"prefixCache": False}},
    )
    serve = build_vllm_serve(spec, Role.prefill, port=8000)
    assert serve.model == "/models/llama"
    assert serve.serve_args[0] == "/models/llama"
    f = serve.flags
    # The client's name and the path both reach vLLM (the router accepts both).
    assert f[f.index("--served-model-name") + 1 : f.index("--served-model-name") + 3] == (
        "llama",
        "/models/llama",
    )
    assert flag(f, "--port") == "8000"
    assert flag(f, "--host") == "0.0.0.0"
    assert flag(f, "--dtype") == "bfloat16"
    assert flag(f, "--block-size") == "32"
    assert flag(f, "--tensor-parallel-size") == "2"
    assert flag(f, "--pipeline-parallel-size") == "2"
    assert flag(f, "--data-parallel-size") == "2"
    assert "--no-enable-prefix-caching" in f and "--enable-prefix-caching" not in f


def test_a_model_named_by_its_path_is_served_under_one_name() -> None:
    spec = spec_of(model={"name": "/models/llama", "path": "/models/llama"})
    f = build_vllm_serve(spec, Role.decode, port=1).flags
    assert f[f.index("--served-model-name") + 2] == "--host"


@pytest.mark.parametrize(
    ("role", "kv_role"), [(Role.prefill, "kv_producer"), (Role.decode, "kv_consumer")]
)
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_each_role_gets_its_connector_role_and_decode_the_failure_policy(
    role: Role, kv_role: str, policy: str
) -> None:
    spec = spec_of(transfer={"backend": "nixl", "failurePolicy": policy})
    serve = build_vllm_serve(spec, role, port=1, side_channel_port=5700)
    config = json.loads(flag(serve.flags, "--kv-transfer-config"))
    assert config["kv_connector"] == "NixlConnector"
    assert config["kv_role"] == kv_role
    assert config["kv_buffer_device"] == "cpu"
    assert config.get("kv_load_failure_policy") == (policy if role is Role.decode else None)
    assert serve.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    assert serve.side_channel_port == 5700


def test_the_buffer_device_follows_the_role_unless_set() -> None:
    cuda = {"device": "cuda"}
    spec = spec_of(prefill=cuda, decode=cuda)
    assert kv_transfer_config(spec, Role.decode)["kv_buffer_device"] == "cuda"
    spec = spec_of(
        prefill=cuda, decode=cuda, engine={"kind": "vllm", "vllm": {"kvBufferDevice": "cpu"}}
    )
    assert kv_transfer_config(spec, Role.prefill)["kv_buffer_device"] == "cpu"


def test_a_colocated_instance_runs_no_connector() -> None:
    spec = parse_spec(
        {**{k: v for k, v in BASE.items() if k not in ("prefill", "decode")}, "colocated": {}}
    )
    serve = build_vllm_serve(spec, Role.colocated, port=9)
    assert "--kv-transfer-config" not in serve.flags
    assert serve.side_channel_port is None
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in serve.env
    assert side_channel_ports(serve, 4) == ()
    with pytest.raises(SpecError, match="colocated instance has no KV connector"):
        kv_transfer_config(spec, Role.colocated)


def test_ucx_extra_args_and_env_are_passed_through_last() -> None:
    spec = spec_of(
        transfer={"backend": "nixl", "ucx": {"tls": "rc,cuda_copy", "netDevices": "mlx5_0:1"}},
        engine={
            "kind": "vllm",
            "vllm": {"extraArgs": ["--max-model-len", "4096"], "env": {"HF_HOME": "/cache"}},
        },
    )
    serve = build_vllm_serve(spec, Role.decode, port=1)
    assert serve.flags[-2:] == ("--max-model-len", "4096")
    assert serve.env["UCX_TLS"] == "rc,cuda_copy"
    assert serve.env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert serve.env["HF_HOME"] == "/cache"


def test_a_shutdown_timeout_lets_vllm_finish_its_requests() -> None:
    assert "--shutdown-timeout" not in build_vllm_serve(spec_of(), Role.decode, port=1).flags
    flags = build_vllm_serve(spec_of(), Role.decode, port=1, shutdown_timeout_s=300).flags
    assert flag(flags, "--shutdown-timeout") == "300"
    # The drain budget decides it: extraArgs may not.
    with pytest.raises(SpecError, match="drain.timeoutSeconds"):
        spec_of(engine={"kind": "vllm", "vllm": {"extraArgs": ["--shutdown-timeout=7"]}})


def test_a_builtin_cluster_or_a_missing_role_has_no_vllm_command() -> None:
    with pytest.raises(SpecError, match="engine.kind is not vllm"):
        build_vllm_serve(parse_spec({"prefill": {}, "decode": {}}), Role.prefill, port=1)
    with pytest.raises(SpecError, match="no colocated role"):
        build_vllm_serve(spec_of(), Role.colocated, port=1)


@given(dp=st.integers(1, 8), base=st.integers(1024, 60000))
def test_each_dp_group_has_its_own_side_channel_port(dp: int, base: int) -> None:
    serve = build_vllm_serve(spec_of(), Role.prefill, port=1, side_channel_port=base)
    assert side_channel_ports(serve, dp) == tuple(range(base, base + dp))


@pytest.mark.parametrize(
    ("program", "interpreter"),
    [
        ("/opt/venv/bin/python", True),
        ("python3.11", True),
        ("/usr/local/bin/vllm", False),
        ("vllm", False),
    ],
)
def test_the_argv_uses_the_cli_or_the_api_server_module(program: str, interpreter: bool) -> None:
    serve = build_vllm_serve(spec_of(), Role.prefill, port=1)
    argv = vllm_argv(program, serve)
    assert is_interpreter(program) is interpreter
    if interpreter:
        assert argv[:5] == [program, "-m", API_SERVER_MODULE, "--model", "/models/llama"]
    else:
        assert argv[:3] == [program, "serve", "/models/llama"]
    assert argv[-len(serve.flags) :] == list(serve.flags)


@pytest.mark.parametrize(
    ("source", "location", "revision"),
    [
        ({"uri": "pvc://models/llama-8b"}, "/models/llama-8b", None),
        ({"uri": "host:///srv/llama"}, "/models", None),
        ({"uri": "oci://registry.example/llama:1"}, "/models", None),
        (
            {"uri": "hf://meta-llama/Llama-3.1-8B@v2", "cacheClaim": "hf"},
            "meta-llama/Llama-3.1-8B",
            "v2",
        ),
    ],
)
def test_a_model_source_is_served_from_where_the_pod_mounts_it(
    source: dict[str, Any], location: str, revision: str | None
) -> None:
    # The mount itself is the operator's, the same for every engine
    # (operator/builders/model_volume.py); hf:// reads the mounted hub cache offline.
    serve = build_vllm_serve(
        spec_of(model={"name": "llama", "source": source}), Role.decode, port=8000
    )
    assert serve.model == location
    assert ("--revision" in serve.flags) is (revision is not None)
    if revision is not None:
        assert flag(serve.flags, "--revision") == revision


def test_our_connector_is_loaded_from_our_module_with_the_manifests_transfer_section() -> None:
    spec = spec_of(
        engine={"kind": "vllm", "vllm": {"kvConnector": "PDClusterConnector"}},
        transfer={"backend": "tcp", "checksum": True, "failurePolicy": "recompute"},
        auth={"zmqCurve": True},
    )
    serve = build_vllm_serve(spec, Role.decode, port=1, bootstrap_port=9100)
    config = json.loads(flag(serve.flags, "--kv-transfer-config"))
    assert config["kv_connector"] == "PDClusterConnector"
    assert config["kv_connector_module_path"] == "pdcluster.runtime.vllm_connector.connector"
    assert config["kv_role"] == "kv_consumer"
    assert config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]
    assert extra["sidePort"] == 9100 and extra["zmqCurve"] is True
    assert extra["transfer"]["backend"] == "tcp" and extra["transfer"]["checksum"] is True
    # NIXL's side channel is vLLM's connector's, not ours.
    assert serve.side_channel_port is None and "VLLM_NIXL_SIDE_CHANNEL_PORT" not in serve.env


def test_our_connectors_settings_read_back_as_the_connector_reads_them() -> None:
    from pdcluster.runtime.vllm_connector.settings import load_settings

    spec = spec_of(
        engine={"kind": "vllm", "vllm": {"kvConnector": "PDClusterConnector"}},
        transfer={"backend": "nixl", "waitingTimeoutSeconds": 7, "ucx": {"tls": "tcp"}},
    )
    serve = build_vllm_serve(spec, Role.prefill, port=1)
    config = json.loads(flag(serve.flags, "--kv-transfer-config"))
    settings = load_settings(config["kv_connector_extra_config"], {"POD_IP": "10.0.0.3"})
    assert settings.transfer == spec.transfer
    assert settings.side_port == 8998 and settings.advertise_host == "10.0.0.3"
    assert serve.env["UCX_TLS"] == "tcp"  # our nixl backend reads UCX's variables too


def test_with_tracing_vllm_exports_its_own_spans_to_the_cluster_s_collector() -> None:
    traced = spec_of(
        observability={"tracing": {"enabled": True, "endpoint": "http://otel.monitoring:4318"}}
    )
    for role in (Role.prefill, Role.decode):
        serve = build_vllm_serve(traced, role, port=8000)
        assert (
            flag(serve.flags, "--otlp-traces-endpoint") == "http://otel.monitoring:4318/v1/traces"
        )
        assert serve.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    plain = build_vllm_serve(spec_of(), Role.decode, port=8000)
    assert "--otlp-traces-endpoint" not in plain.flags
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in plain.env


@pytest.mark.parametrize(
    ("policy", "publishing"),
    [
        ({}, set()),
        ({"prefill": "cache_aware"}, {Role.prefill}),
        ({"decode": "cache_aware"}, {Role.decode}),
        ({"prefill": "cache_aware", "decode": "cache_aware"}, {Role.prefill, Role.decode}),
    ],
)
def test_a_role_routed_by_cache_aware_publishes_its_cache_events(
    policy: dict[str, str], publishing: set[Role]
) -> None:
    spec = spec_of(router={"policy": policy})
    for role in (Role.prefill, Role.decode):
        serve = build_vllm_serve(spec, role, port=8000, kv_events_ports=(7001, 7002))
        if role not in publishing:
            assert "--kv-events-config" not in serve.flags and serve.kv_events_ports is None
            continue
        assert serve.kv_events_ports == (7001, 7002)
        config = json.loads(flag(serve.flags, "--kv-events-config"))
        # vLLM binds its PUB socket only for a wildcard address.
        assert config["endpoint"] == "tcp://*:7001"
        assert config["replay_endpoint"] == "tcp://*:7002"
        assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
        assert config["topic"] and config["buffer_steps"] > 0


def test_a_colocated_role_follows_the_decode_policy_and_may_keep_replays_local() -> None:
    spec = spec_of(
        prefill=None,
        decode=None,
        transfer={},
        colocated={},
        router={"policy": {"decode": "cache_aware"}},
    )
    serve = build_vllm_serve(spec, Role.colocated, port=8000, kv_replay_host="127.0.0.1")
    assert serve.kv_events_ports == DEFAULT_KV_EVENTS_PORTS
    config = json.loads(flag(serve.flags, "--kv-events-config"))
    assert config["replay_endpoint"] == f"tcp://127.0.0.1:{DEFAULT_KV_EVENTS_PORTS[1]}"


def test_extra_args_may_not_set_the_kv_events_config() -> None:
    engine = {"kind": "vllm", "vllm": {"extraArgs": ["--kv-events-config={}"]}}
    with pytest.raises(SpecError, match="router.policy"):
        spec_of(engine=engine)
