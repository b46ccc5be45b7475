"""The token ids cache_aware hashes are those the worker computes: token-id
prompts as sent, text through the model's tokenizer (chat through its
template); anything the router cannot know exactly goes by load (None).
"""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.router.bodies import ClientRequest, Endpoint, check_request
from pdcluster.runtime.router.prefix_index import PromptTokens
from pdcluster.runtime.router.prompt_ids import prompt_tokens

TOK = ByteTokenizer()


def request(endpoint: Endpoint, body: dict[str, Any]) -> ClientRequest:
    return check_request(endpoint, body, disaggregated=False)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.generate, {"input_ids": [5, 6, 7]}),
        (Endpoint.completions, {"model": "tiny", "prompt": [5, 6, 7]}),
    ],
)
def test_token_id_prompts_are_taken_as_sent_with_or_without_a_tokenizer(
    endpoint: Endpoint, body: dict[str, Any]
) -> None:
    for tokenizer in (None, TOK):
        assert prompt_tokens(request(endpoint, body), tokenizer) == PromptTokens((5, 6, 7))


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.generate, {"text": "hello"}),
        (Endpoint.completions, {"model": "tiny", "prompt": "hello"}),
        (Endpoint.completions, {"model": "tiny", "prompt": ["hello"]}),
    ],
)
def test_text_prompts_go_through_the_tokenizer_and_carry_its_fingerprint(
    endpoint: Endpoint, body: dict[str, Any]
) -> None:
    got = prompt_tokens(request(endpoint, body), TOK)
    assert got == PromptTokens(tuple(TOK.encode("hello")), TOK.fingerprint)
    assert prompt_tokens(request(endpoint, body), None) is None


def test_chat_goes_through_the_chat_template_as_the_worker_does() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
    ]
    got = prompt_tokens(request(Endpoint.chat, {"model": "tiny", "messages": messages}), TOK)
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert got == PromptTokens(tuple(TOK.encode_chat(flat)), TOK.fingerprint)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.chat, {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}),
        (Endpoint.chat, {"model": "tiny", "messages": [{"role": "user", "content": ["x"]}]}),
        (Endpoint.completions, {"model": "tiny", "prompt": ["a", "b"]}),
        (Endpoint.completions, {"model": "tiny", "prompt": [[1, 2], [3]]}),
        (Endpoint.generate, {"input_ids": []}),
    ],
)
def test_what_the_router_cannot_know_exactly_goes_by_load(
    endpoint: Endpoint, body: dict[str, Any]
) -> None:
    assert prompt_tokens(request(endpoint, body), TOK) is None
