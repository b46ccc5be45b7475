"""The fields a prefill and a decode instance must agree on before a byte moves.

A mismatch in any of them does not fail loudly in the data plane — it
garbles output (a page size or layout read the wrong way) or leaks pages
(two allocation policies disagreeing on when pages exist). So it is checked
at every handshake point: across the ranks of one prefill instance (bootstrap
registry), by decode after `GET /route`, and by prefill when a decode rank
registers its KV layout. Every error names the field and both values.

Pure module.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

COMPAT_FIELDS: tuple[str, ...] = (
    "page_size",
    "kv_dtype",
    "kv_layout",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "allocation_policy",
    "model_fingerprint",
    "transfer_backend",
    "protocol_version",
)

ShortText = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class CompatInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    page_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    kv_dtype: ShortText
    # The physical order of a pool's axes (`engine/kv_order.py`): NHD, HND, or
    # another engine's (vLLM's CPU pages: LPHKN).
    kv_layout: ShortText
    allocation_policy: ShortText
    model_fingerprint: ShortText
    # tcp | shm | nixl: the prefill writes with the decode's backend, or not at all.
    transfer_backend: ShortText = "tcp"
    # The control protocol's version (`messages.PROTOCOL_VERSION`). Absent in
    # what a version-2 peer publishes, hence the default: a decode meeting
    # such a prefill at GET /route fails the room at once, naming both
    # versions, instead of waiting on frames the peer refuses.
    protocol_version: Annotated[int, msgspec.Meta(ge=1, le=255)] = 2
    # The whole model's KV geometry (every rank's slice is cut from it): the
    # fingerprint covers these too, but a mismatch named here says which.
    # 0: not published (a peer of protocol version 3 or older).
    num_layers: Count = 0
    num_kv_heads: Count = 0
    head_dim: Count = 0


class Mismatch(msgspec.Struct, frozen=True):
    field: str
    ours: object
    theirs: object


class CompatError(ValueError):
    """Two sides disagree on compatibility fields; `.mismatches` lists them."""

    def __init__(self, message: str, mismatches: list[Mismatch]) -> None:
        super().__init__(message)
        self.mismatches = mismatches

    @property
    def field(self) -> str:
        return self.mismatches[0].field


def find_mismatches(ours: CompatInfo, theirs: CompatInfo) -> list[Mismatch]:
    return [
        Mismatch(name, getattr(ours, name), getattr(theirs, name))
        for name in COMPAT_FIELDS
        if getattr(ours, name) != getattr(theirs, name)
    ]


def fingerprint_parts(fingerprint: str) -> dict[str, str]:
    """`weights=a tokenizer=b` → {"weights": "a", "tokenizer": "b"}; {} when not in that form."""
    parts = dict(p.partition("=")[::2] for p in fingerprint.split())
    return parts if all(parts.values()) else {}


def _differing_parts(ours: object, theirs: object) -> list[str]:
    if not isinstance(ours, str) or not isinstance(theirs, str):
        return []
    a, b = fingerprint_parts(ours), fingerprint_parts(theirs)
    if not a or not b:
        return []
    return [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]


def describe(mismatches: list[Mismatch], ours: str, theirs: str) -> str:
    """'page_size mismatch: prefill=16, decode=32; backend_mismatch: prefill shm, decode tcp'.

    A model fingerprint mismatch also says which of its parts differ
    ('(differs in: tokenizer)').
    """
    return "; ".join(_describe_one(m, ours, theirs) for m in mismatches)


def _describe_one(m: Mismatch, ours: str, theirs: str) -> str:
    if m.field == "transfer_backend":
        return f"backend_mismatch: {ours} {m.ours!s}, {theirs} {m.theirs!s}"
    text = f"{m.field} mismatch: {ours}={m.ours!s}, {theirs}={m.theirs!s}"
    parts = _differing_parts(m.ours, m.theirs) if m.field == "model_fingerprint" else []
    if parts:
        text += f" (differs in: {', '.join(parts)})"
    return text


def check_compat(
    ours: CompatInfo, theirs: CompatInfo, *, ours_name: str = "prefill", theirs_name: str = "decode"
) -> None:
    """Raise CompatError naming every mismatched field and both values."""
    mismatches = find_mismatches(ours, theirs)
    if mismatches:
        raise CompatError(describe(mismatches, ours_name, theirs_name), mismatches)
