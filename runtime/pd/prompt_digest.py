"""What both legs of a room must agree on about the prompt, and the one rule comparing it.

Each leg tokenizes its own copy of the request. A decode whose tokenizer
differs from prefill's by one merge would decode from KV computed for another
prompt: silently when the lengths match, and on a one-sided transport even
when they do not. So decode sends its `PromptId` (token count + digest) in
`TransferMeta`, and the prefill rank compares it with its own before a byte
moves (`prompt_problem`).

The digest is blake2b-128 of the token ids as little-endian int64, so it does
not depend on the host's byte order or on how the ids were stored.

Pure module.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import Annotated, Final

import msgspec

DIGEST_BYTES: Final = 16
MAX_PROMPT_TOKENS: Final = 1 << 31


class PromptId(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prompt's identity on one leg: its length and the digest of its token ids."""

    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_PROMPT_TOKENS)]
    digest: Annotated[bytes, msgspec.Meta(min_length=DIGEST_BYTES, max_length=DIGEST_BYTES)]


def prompt_digest(ids: Sequence[int]) -> bytes:
    """blake2b-128 of `ids` as little-endian int64 (raises on an id outside int64)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    step = 1 << 14  # bounded packing buffers for long prompts
    for start in range(0, len(ids), step):
        chunk = ids[start : start + step]
        h.update(struct.pack(f"<{len(chunk)}q", *chunk))
    return h.digest()


def prompt_id(ids: Sequence[int]) -> PromptId:
    """The `PromptId` of a non-empty prompt."""
    if not ids:
        raise ValueError("an empty prompt has no PromptId")
    return PromptId(num_tokens=len(ids), digest=prompt_digest(ids))


def prompt_mismatch(prefill: PromptId, decode: PromptId) -> str | None:
    """Why the two legs hold different prompts, or None; the reason names both lengths."""
    if prefill.num_tokens != decode.num_tokens:
        return (
            f"prompt_mismatch: prefill has {prefill.num_tokens} tokens, decode {decode.num_tokens}"
        )
    if prefill.digest != decode.digest:
        return (
            f"prompt_mismatch: prefill and decode both have {prefill.num_tokens} tokens "
            "but different token ids"
        )
    return None


def prompt_problem(prefill: PromptId | None, decodes: Iterable[PromptId | None]) -> str | None:
    """The first mismatch between prefill's prompt and any decode rank's, once both are known."""
    if prefill is None:
        return None
    for decode in decodes:
        if decode is not None:
            problem = prompt_mismatch(prefill, decode)
            if problem is not None:
                return problem
    return None
