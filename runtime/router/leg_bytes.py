"""The bytes a worker leg is sent: the client's own JSON, the router's fields spliced in.

The router decodes a body to validate it, but it need not encode it again:
when the leg body is the client's body plus router-owned fields (nothing
dropped), the leg bytes are the client's bytes up to its closing brace, then
those fields. A 2,000-token prompt is then never written back out, once per
leg, by the router.

Invariant: ``json.loads(leg_body_bytes(raw, client, leg)) == leg`` whenever
``json.loads(raw) == client``; when splicing cannot promise it (a dropped
field, bytes that are not plain UTF-8 JSON, a NaN or Infinity, which the
leg's encoder refuses), the answer is None and the leg body is encoded as
before.

Pure module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_WHITESPACE = b" \t\r\n"


def leg_body_bytes(raw: bytes, client: Mapping[str, Any], leg: Mapping[str, Any]) -> bytes | None:
    """``raw`` (the client's body, decoding to ``client``) with ``leg``'s new fields, or None."""
    added = {k: v for k, v in leg.items() if k not in client}
    if not added or not client or len(leg) != len(client) + len(added):
        return None  # nothing to add, nothing to add it to, or a client field dropped
    body = raw.strip(_WHITESPACE)
    # UTF-16/32 and a BOM fail these (json.loads accepts them; splicing would not).
    if not body.startswith(b"{") or not body.endswith(b"}") or b"\x00" in body[:4]:
        return None
    if b"NaN" in body or b"Infinity" in body:
        return None
    tail = json.dumps(added, separators=(",", ":"), allow_nan=False).encode()
    return body[:-1].rstrip(_WHITESPACE) + b"," + tail[1:]


def encode_leg_body(leg: Mapping[str, Any]) -> bytes:
    """A leg body written out whole (what an HTTP client's ``json=`` would send)."""
    return json.dumps(leg, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
