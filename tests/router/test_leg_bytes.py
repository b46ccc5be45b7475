"""Leg bodies are the client's own bytes with the router's fields spliced in."""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.router.bodies import build_leg_body
from pdcluster.runtime.router.leg_bytes import encode_leg_body, leg_body_bytes

from .harness import Cluster, LoopThread, start_cluster

LEG_FIELDS = {"rid": "r-1", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998}


def _leg(client: dict[str, Any]) -> dict[str, Any]:
    return {**client, **LEG_FIELDS}


def test_splice_keeps_the_client_bytes_and_adds_the_router_fields() -> None:
    raw = b' {"input_ids": [1,  2,   3],\n "stream": true } \n'
    client = json.loads(raw)
    out = leg_body_bytes(raw, client, _leg(client))
    assert out is not None
    assert out.startswith(b'{"input_ids": [1,  2,   3],\n "stream": true')
    assert json.loads(out) == _leg(client)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(
    client=st.dictionaries(st.text(), json_values, min_size=1, max_size=6).filter(
        lambda d: not set(d) & set(LEG_FIELDS)
    ),
    indent=st.sampled_from([None, 0, 2]),
    ascii_only=st.booleans(),
)
def test_splice_decodes_to_the_leg_body_whatever_the_client_wrote(
    client: dict[str, Any], indent: int | None, ascii_only: bool
) -> None:
    raw = json.dumps(client, indent=indent, ensure_ascii=ascii_only).encode()
    out = leg_body_bytes(raw, client, _leg(client))
    if out is None:  # only where the text itself spells NaN/Infinity
        assert b"NaN" in raw or b"Infinity" in raw
        return
    assert json.loads(out) == _leg(client)


@pytest.mark.parametrize(
    "raw",
    [
        '{"a": 1}'.encode("utf-16-le"),
        '{"a": 1}'.encode("utf-16"),
        '{"a": 1}'.encode("utf-32-be"),
        codecs.BOM_UTF8 + b'{"a": 1}',
        b'{"a": NaN}',
        b'{"a": -Infinity}',
    ],
)
def test_bytes_splicing_cannot_vouch_for_are_encoded_instead(raw: bytes) -> None:
    client = json.loads(raw)
    assert leg_body_bytes(raw, client, _leg(client)) is None


def test_a_dropped_client_field_means_encoding_the_leg() -> None:
    raw = b'{"text": "hi", "data_parallel_rank": 1}'
    client = json.loads(raw)
    leg = build_leg_body(client, "r-1", None)
    assert "data_parallel_rank" not in leg
    assert leg_body_bytes(raw, client, leg) is None
    assert json.loads(encode_leg_body(leg)) == leg


def test_encoding_refuses_nan_as_the_http_client_did() -> None:
    with pytest.raises(ValueError):
        encode_leg_body({"x": math.nan})


@pytest.fixture
def cluster(loop: LoopThread) -> Iterator[Cluster]:
    with start_cluster(loop) as c:
        yield c


def test_both_legs_carry_the_client_bytes_verbatim(cluster: Cluster) -> None:
    raw = b'{"text":  "one two",   "sampling_params": {"max_new_tokens": 2},  "x": [1,  2]}'
    with cluster.client() as client:
        resp = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    (prefill,) = cluster.prefill[0].received
    (decode,) = cluster.decode[0].received
    assert prefill.raw == decode.raw
    assert prefill.raw.startswith(raw[:-1])
    assert (
        prefill.body
        == decode.body
        == {
            **json.loads(raw),
            **{
                k: prefill.body[k]
                for k in ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room")
            },
        }
    )
