"""The fixed set of labels a failure reason is counted under.

A failure reason is free text: a code, often followed by details
(`prompt_mismatch: prefill has 12 tokens, decode 13`), and some reasons
come from a peer (a prefill's Status, a worker's `/admin/failures`). A
metric label or a stats key made from one is therefore one of
`FAILURE_LABELS`, never the peer's text: `reason_label` maps a known code to
itself and anything else to `other`, so label cardinality stays bounded
whatever a peer sends. docs/operations.md ("Failure labels") lists the set;
a test keeps the two equal.

Pure module.
"""

from __future__ import annotations

OTHER = "other"
UNKNOWN = "unknown"  # no reason at all

# Reasons a room, a request or a transfer fails with (runtime and operator).
_FAILURES = frozenset(
    {
        "aborted",
        "aborted_by_decode",
        "allocation_policy_mismatch",
        "backend_mismatch",
        "bad_frame",
        "bad_kv_transfer_params",
        "bad_frame_count",
        "bad_page_count",
        "bad_page_table",
        "bad_pages",
        "bad_sender",
        "bootstrap_error",
        "bootstrap_rejected",
        "bootstrap_timeout",
        "bootstrap_unauthorized",
        "bootstrap_unreachable",
        "checksum_mismatch",
        "checksum_missing",
        "client_disconnect",
        "decode_pod_lost",
        "decode_pod_removed",
        "decode_stalled",
        "dp_rank_conflict",
        "engine_error",
        "engine_stalled",
        "engine_stopped",
        "first_token_mismatch",
        "head_dim_mismatch",
        "incompatible",
        "incomplete_transfer",
        "internal_error",
        "kv_dtype_mismatch",
        "kv_layout_mismatch",
        "kv_transfer_failed",
        "kv_wrong_source",
        "layout_rejected",
        "model_fingerprint_mismatch",
        "not_loopback",
        "notify_failed",
        "num_kv_heads_mismatch",
        "num_layers_mismatch",
        "oversized",
        "page_size_mismatch",
        "peer_lost",
        "peer_reregistered",
        "peer_stalled",
        "preempted",
        "prefill_busy",
        "prefill_failed",
        "prefill_not_ready",
        "prefill_overloaded",
        "prefill_pod_lost",
        "prefill_pod_removed",
        "prefill_restarted",
        "prefill_unreachable",
        "prefill_wait_timeout",
        "prompt_mismatch",
        "protocol_error",
        "protocol_version_mismatch",
        "recomputed",
        "rejected",
        "release_timeout",
        "reuse_mismatch",
        "room_closed",
        "room_conflict",
        "room_failed",
        "send_timeout",
        "sender_closed",
        "staging_timeout",
        "too_many_rooms",
        "transfer_error",
        "transfer_failed",
        "transfer_timeout",
        "unauthorized",
        "unknown_kind",
        "unknown_room",
        "unregistered",
        "unsupported_topology",
        "waiting_timeout",
    }
)

# Finish reasons of a request that ended without failing (requests_total).
_FINISHES = frozenset({"abort", "error", "length", "prefill_done", "shutdown", "stop"})

FAILURE_LABELS: frozenset[str] = _FAILURES | _FINISHES | {OTHER, UNKNOWN}


def reason_label(reason: str | None) -> str:
    """The label of a reason: 'page_size mismatch: prefill=16, decode=32' → 'page_size_mismatch'.

    Always a member of FAILURE_LABELS: `other` for a code not in it,
    `unknown` for no reason.
    """
    if not reason:
        return UNKNOWN
    head = reason.split(":", 1)[0].strip().lower()
    if head.startswith("aborted by decode"):
        return "aborted_by_decode"
    if head.startswith("prefill ") and head.endswith(" failed"):
        return "prefill_failed"
    label = head.replace(" ", "_")
    return label if label in FAILURE_LABELS else OTHER
