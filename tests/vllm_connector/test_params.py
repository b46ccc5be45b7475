"""A request's room as the router hands it to vLLM, and the connector's settings."""

from __future__ import annotations

import pytest

from pdcluster.runtime.spec import Role, TransferBackend
from pdcluster.runtime.spec.base import SpecError
from pdcluster.runtime.vllm_connector.params import RoomParams, RoomParamsError, parse_room_params
from pdcluster.runtime.vllm_connector.rank import EngineFacts
from pdcluster.runtime.vllm_connector.settings import load_settings, role_of

LEG = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 42}


def test_the_routers_fields_make_a_room():
    assert parse_room_params(LEG | {"rid": "req-1", "data_parallel_rank": 0}) == RoomParams(
        42, "10.0.0.7:8998", "req-1", 0
    )
    assert parse_room_params({"bootstrap_room": 7}) == RoomParams(7, None)
    assert parse_room_params(
        {"bootstrap_host": "[FE80::1]", "bootstrap_port": 1, "bootstrap_room": 0}
    ) == RoomParams(0, "[fe80::1]:1")


@pytest.mark.parametrize("params", [None, {}, {"rid": "x"}, {"bootstrap_room": None}])
def test_a_request_without_a_room_is_no_pd_leg(params):
    assert parse_room_params(params) is None


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (LEG | {"bootstrap_room": -1}, "bootstrap_room"),
        (LEG | {"bootstrap_room": 1 << 63}, "bootstrap_room"),
        (LEG | {"bootstrap_room": "42"}, "bootstrap_room"),
        (LEG | {"bootstrap_room": True}, "bootstrap_room"),
        ({"bootstrap_room": 1, "bootstrap_host": "h"}, "bootstrap_port"),
        ({"bootstrap_room": 1, "bootstrap_port": 80}, "bootstrap_host"),
        (LEG | {"bootstrap_port": 0}, "bootstrap_port"),
        (LEG | {"bootstrap_host": "a/b"}, "bootstrap_host"),
        (LEG | {"rid": ""}, "rid"),
        (LEG | {"rid": 5}, "rid"),
        (LEG | {"data_parallel_rank": -1}, "data_parallel_rank"),
        (["bootstrap_room"], "*"),
    ],
)
def test_a_malformed_field_is_named(params, field):
    with pytest.raises(RoomParamsError) as err:
        parse_room_params(params)
    assert err.value.field == field
    assert f"kv_transfer_params.{field}" in str(err.value)


def test_settings_read_the_manifests_transfer_section_in_camel_case():
    settings = load_settings(
        {
            "sidePort": 8998,
            "advertiseHost": "10.0.0.7",
            "transfer": {
                "backend": "nixl",
                "waitingTimeoutSeconds": 5,
                "failurePolicy": "recompute",
            },
            "prefillPeers": ["10.0.0.8:8998"],
        }
    )
    assert settings.side_port == 8998 and settings.transfer.backend is TransferBackend.nixl
    assert settings.transfer.waiting_timeout_seconds == 5
    assert settings.prefill_peers == ["10.0.0.8:8998"]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({}, "sidePort"),
        ({"sidePort": 0}, "sidePort"),
        ({"sidePort": 1, "transfer": {"backend": "carrier-pigeon"}}, "transfer.backend"),
        ({"sidePort": 1, "transfer": {"backend": "shm"}}, "transfer.backend"),
        ({"sidePort": 1, "transfer": {"allocationPolicy": "prefill_complete"}}, "allocationPolicy"),
        ({"sidePort": 1, "sidePorts": 2}, "sidePorts"),
    ],
)
def test_bad_settings_name_the_field(extra, field):
    with pytest.raises(SpecError, match=field):
        load_settings(extra)


def test_the_role_comes_from_vllms_kv_role():
    assert role_of("kv_producer") is Role.prefill and role_of("kv_consumer") is Role.decode
    with pytest.raises(SpecError, match="kv_both"):
        role_of("kv_both")


def facts(**kw):
    base = dict(
        role=Role.decode,
        tp_size=2,
        tp_rank=1,
        num_layers=2,
        num_kv_heads=4,
        head_size=64,
        block_size=32,
        kv_dtype="float32",
        model_fingerprint="weights=a tokenizer=b chat_template=c",
    )
    return EngineFacts(**(base | kw))


def test_a_tp_rank_holds_its_contiguous_share_of_the_kv_heads():
    f = facts()
    f.check()
    assert f.heads == (2, 4)
    assert (f.shape.tp, f.shape.dp, f.coord.tp) == (2, 1, 1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"pp_size": 2}, "pipeline_parallel_size=2"),
        ({"dcp_size": 2}, "decode_context_parallel_size=2"),
        ({"dp_size": 2}, "data_parallel_size=2"),
        ({"tp_size": 8, "tp_rank": 0}, "does not divide the model's 4 KV heads"),
    ],
)
def test_engines_our_protocol_cannot_pair_are_refused_naming_the_setting(kw, match):
    with pytest.raises(SpecError, match=match):
        facts(**kw).check()


@pytest.mark.parametrize(
    ("extra", "env", "advertised"),
    [
        ({"sidePort": 1}, {"POD_IP": "10.1.2.3"}, "10.1.2.3"),
        ({"sidePort": 1}, {}, "127.0.0.1"),
        ({"sidePort": 1, "host": "10.0.0.9"}, {}, "10.0.0.9"),
        ({"sidePort": 1, "advertiseHost": "h"}, {"POD_IP": "10.1.2.3"}, "h"),
    ],
)
def test_the_advertised_host_is_the_pods_ip_unless_set(extra, env, advertised):
    assert load_settings(extra, env).advertise_host == advertised


@pytest.mark.parametrize(
    ("extra", "env", "incarnation"),
    [
        ({"sidePort": 1}, {"PDCLUSTER_INCARNATION": "uid-1"}, "uid-1"),
        ({"sidePort": 1}, {"PDCLUSTER_INCARNATION": ""}, None),
        ({"sidePort": 1}, {}, None),
        ({"sidePort": 1, "incarnation": "given"}, {"PDCLUSTER_INCARNATION": "uid-1"}, "given"),
    ],
)
def test_the_incarnation_is_the_pods_uid_from_the_environment(extra, env, incarnation):
    assert load_settings(extra, env).incarnation == incarnation
