from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.router.bodies import (
    Bootstrap,
    Endpoint,
    build_leg_body,
    check_request,
    error_message_of,
    parse_json_object,
    payload_error,
)
from pdcluster.runtime.router.errors import RouterError, error_body, error_type_for
from pdcluster.runtime.router.sse import (
    DONE_EVENT,
    Event,
    SSEReader,
    format_event,
    format_json_event,
)

C, CHAT, GEN = Endpoint.completions, Endpoint.chat, Endpoint.generate


@pytest.mark.parametrize(
    ("endpoint", "body", "stream"),
    [
        (C, {"model": "tiny", "prompt": "hi"}, False),
        (C, {"model": "tiny", "prompt": [1, 2, 3], "stream": True, "max_tokens": 0}, True),
        (C, {"model": "tiny", "prompt": "hi", "temperature": 0, "top_p": 1, "seed": 3}, False),
        (C, {"model": "tiny", "prompt": "hi", "stop": ["\n"], "logit_bias": {"1": 2}}, False),
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, False),
        (
            CHAT,
            {"model": "t", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            False,
        ),
        (GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": True}, True),
        (GEN, {"input_ids": [1, 2]}, False),
    ],
)
def test_valid_bodies_pass_with_every_field_kept(
    endpoint: Endpoint, body: dict[str, Any], stream: bool
) -> None:
    req = check_request(endpoint, body, disaggregated=True)
    assert req.stream is stream
    assert req.body == body
    assert req.model == body.get("model")


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "words"),
    [
        (C, {"prompt": "hi"}, "model", "required"),
        (C, {"model": "", "prompt": "hi"}, "model", "at least 1"),
        (C, {"model": "tiny"}, "prompt", "required"),
        (C, {"model": "tiny", "prompt": 5}, "prompt", "must be a string"),
        (C, {"model": "tiny", "prompt": []}, "prompt", "must not be empty"),
        (C, {"model": "tiny", "prompt": "hi", "stream": "yes"}, "stream", "boolean"),
        (C, {"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens", "greater"),
        (C, {"model": "tiny", "prompt": "hi", "temperature": -0.5}, "temperature", ">= 0"),
        (C, {"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
        (C, {"model": "tiny", "prompt": "hi", "stop": 7}, "stop", "list of strings"),
        (C, {"model": "tiny", "prompt": "hi", "n": 0}, "n", "greater"),
        (C, {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": 1}}, None, ""),
        (CHAT, {"model": "tiny", "messages": []}, "messages", "at least 1"),
        (CHAT, {"model": "tiny", "messages": "hi"}, "messages", "list"),
        (CHAT, {"model": "tiny", "messages": [{"content": "hi"}]}, "messages", "role"),
        (GEN, {}, "text", "exactly one"),
        (GEN, {"text": "a", "input_ids": [1]}, "text", "exactly one"),
        (GEN, {"text": "a", "sampling_params": []}, "sampling_params", "dictionary"),
        (C, {"model": "tiny", "prompt": "hi", "rid": "mine"}, "rid", "set by the router"),
        (GEN, {"text": "a", "bootstrap_room": 1}, "bootstrap_room", "set by the router"),
        (GEN, {"text": "a", "bootstrap_host": "x"}, "bootstrap_host", "set by the router"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(
    endpoint: Endpoint, body: dict[str, Any], param: str | None, words: str
) -> None:
    with pytest.raises(RouterError) as err:
        check_request(endpoint, body, disaggregated=False)
    assert err.value.status == 400
    if param is not None:
        assert err.value.param == param
        assert param in err.value.message
    assert words in err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (C, {"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
        (C, {"model": "tiny", "prompt": [[1], [2]]}, "prompt"),
        (C, {"model": "tiny", "prompt": "a", "n": 2}, "n"),
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "n": 3}, "n"),
        (GEN, {"text": ["a", "b"]}, "text"),
        (GEN, {"input_ids": [[1], [2]]}, "text"),
    ],
)
def test_pd_mode_refuses_batches_that_colocated_mode_accepts(
    endpoint: Endpoint, body: dict[str, Any], param: str
) -> None:
    check_request(endpoint, body, disaggregated=False)
    with pytest.raises(RouterError) as err:
        check_request(endpoint, body, disaggregated=True)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize(
    ("raw", "words"),
    [(b"", "empty"), (b"{", "not valid JSON"), (b"[1]", "JSON object"), (b"\xff", "JSON")],
)
def test_body_must_be_a_json_object(raw: bytes, words: str) -> None:
    with pytest.raises(RouterError, match=words) as err:
        parse_json_object(raw)
    assert err.value.status == 400


@given(
    st.dictionaries(st.text(min_size=1, max_size=8), st.integers() | st.text(), max_size=5),
    st.integers(1, (1 << 63) - 1),
)
def test_both_legs_get_the_client_body_plus_router_fields(body: dict[str, Any], room: int) -> None:
    body = {k: v for k, v in body.items() if not k.startswith(("rid", "bootstrap"))}
    leg = build_leg_body(body, "req-x", Bootstrap(host="10.0.0.1", port=8998, room=room))
    assert leg == {
        **body,
        "rid": "req-x",
        "bootstrap_host": "10.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": room,
    }
    assert "rid" not in body  # the client's dict is not modified
    assert build_leg_body(body, "req-x", None) == {**body, "rid": "req-x"}


@pytest.mark.parametrize(
    ("payload", "failure"),
    [
        ({"text": "ok", "meta_info": {"finish_reason": {"type": "length"}}}, None),
        ({"choices": [{"finish_reason": "stop"}]}, None),
        ({"error": {"message": "KV transfer failed"}}, "KV transfer failed"),
        ({"error": "boom"}, "boom"),
        ({"meta_info": {"finish_reason": {"type": "abort", "message": "timeout"}}}, "timeout"),
        ({"meta_info": {"finish_reason": {"type": "abort"}}}, "aborted"),
        ({"choices": [{"finish_reason": "abort"}]}, "aborted"),
        ([1, 2], None),
        (None, None),
    ],
)
def test_payload_error_finds_failures_inside_2xx_answers(payload: Any, failure: str | None) -> None:
    found = payload_error(payload)
    if failure is None:
        assert found is None
    else:
        assert found is not None and failure in found


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"error": {"message": "prompt too long", "code": 400}}', "prompt too long"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b"upstream exploded", "upstream exploded"),
        (b"", "HTTP 502"),
        (b"{}", "HTTP 502"),
    ],
)
def test_worker_error_bodies_reduce_to_a_message(raw: bytes, message: str) -> None:
    assert error_message_of(raw, 502) == message


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "invalid_request_error"),
        (502, "server_error"),
        (503, "server_error"),
    ],
)
def test_error_bodies_have_the_openai_shape(status: int, kind: str) -> None:
    body = error_body("nope", status, param="model")
    assert body == {"error": {"message": "nope", "type": kind, "code": status, "param": "model"}}
    assert error_type_for(status) == kind


def test_sse_reader_splits_events_and_spots_done_and_errors() -> None:
    reader = SSEReader()
    lines = [
        ": keep-alive",
        'data: {"text": "a"}',
        "",
        "",
        "data: line one",
        "data: line two",
        "",
        'data: {"error": {"message": "decode died"}}',
        "",
        "data: [DONE]",
        "",
    ]
    events = [e for e in map(reader.feed, lines) if e is not None]
    assert [e.data for e in events] == [
        '{"text": "a"}',
        "line one\nline two",
        '{"error": {"message": "decode died"}}',
        "[DONE]",
    ]
    assert [e.is_done for e in events] == [False, False, False, True]
    assert [e.error() for e in events] == [None, None, "decode died", None]


# Payloads shaped like the workers' events, with failure markers among the
# keys and values often enough to matter.
_words = st.sampled_from(
    ["error", "abort", "text", "meta_info", "finish_reason", "type", "choices"]
)
_scalars = st.none() | st.integers() | st.text(max_size=8) | _words
_payloads = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(_words | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(_payloads, st.booleans())
def test_an_event_reports_what_parsing_its_payload_reports(payload: Any, ascii_only: bool) -> None:
    # Event.error skips the parse for events that cannot hold a failure; the
    # answer must be the one a parse gives, escaped text included.
    data = json.dumps(payload, ensure_ascii=ascii_only)
    assert Event(data).error() == payload_error(payload)


def test_an_escaped_error_key_is_still_an_error() -> None:
    assert Event('{"\\u0065rror": "decode died"}').error() == "decode died"
    assert Event('{"text": "no \\u00e9rror here"}').error() is None


def test_sse_reader_flushes_a_last_event_without_blank_line() -> None:
    reader = SSEReader()
    assert reader.feed("data:[DONE]\r") is None
    event = reader.flush()
    assert event is not None and event.is_done


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=50))
def test_formatted_events_read_back_unchanged(data: str) -> None:
    data = data.replace("\r", "")
    reader = SSEReader()
    raw = format_event(data).decode()
    events = [e for e in map(reader.feed, raw.split("\n")) if e is not None]
    if data == "":
        # An empty data line still makes an event with empty data.
        assert [e.data for e in events] == [""]
    else:
        assert [e.data for e in events] == [data]


def test_json_events_and_done() -> None:
    assert format_json_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert json.loads(format_json_event({"x": "é"})[6:]) == {"x": "é"}
    assert DONE_EVENT == b"data: [DONE]\n\n"


@pytest.mark.parametrize("bootstrap", [Bootstrap(host="10.0.0.1", port=8998, room=7), None])
def test_a_clients_data_parallel_rank_never_reaches_a_worker(bootstrap: Bootstrap | None) -> None:
    body = {"input_ids": [1, 2, 3], "data_parallel_rank": 1}
    check_request(Endpoint.generate, dict(body), disaggregated=True)  # accepted, not refused
    leg = build_leg_body(body, "req-x", bootstrap)
    assert "data_parallel_rank" not in leg
    assert leg["input_ids"] == [1, 2, 3]
    assert body["data_parallel_rank"] == 1  # the client's dict is not modified
