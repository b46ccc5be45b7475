"""The leg bodies of vLLM's disaggregated flows.

With our connector inside vLLM (PDClusterConnector) the legs meet as our
workers' do, by a room both name, and go out at once (`build_room_legs`):
the prefill leg computes one token, unstreamed; both carry the room in
`kv_transfer_params` (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`,
`rid`: what `runtime/vllm_connector/params.py` reads).

With a pull connector such as NixlConnector:

vLLM's prefill and decode meet through the `kv_transfer_params` of the
request bodies, not through a room both legs name at once (our workers'
bootstrap fields), so the legs go one after the other:

1. prefill leg: the client's body with `stream: false`, `max_tokens: 1`
   (and `max_completion_tokens: 1` on chat), no `min_tokens` or
   `stream_options`, and `kv_transfer_params` asking for a remote decode
   (`PREFILL_KV_PARAMS`). vLLM computes the prompt, keeps its blocks for the
   decode to read and answers the parameters that name them (its engine id,
   block ids, side-channel host and port);
2. decode leg: the client's body unchanged but for `kv_transfer_params`: the
   prefill's answer, as given. vLLM reads the KV from the prefill and
   generates; its answer is the client's.

Field names are those of the installed wheel
(`vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`:
`get_num_new_matched_tokens`, `request_finished`).

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdcluster.runtime.router.bodies import Bootstrap, Endpoint

# What the prefill leg asks: compute, keep the blocks, answer where they are.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What a prefill's answer must name for a decode to read the blocks.
REQUIRED_ANSWER_FIELDS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
# Request fields a one-token prefill leg must not carry.
_PREFILL_DROPPED = ("stream_options", "min_tokens")


class KVParamsError(ValueError):
    """A prefill answered no usable `kv_transfer_params`; the message says what is wrong."""


def _one_token(body: Mapping[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """The client's body as a prefill leg: one token, not streamed."""
    leg = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if endpoint is Endpoint.chat and "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg


def build_prefill_body(body: Mapping[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, KV kept for a remote decode."""
    leg = _one_token(body, endpoint)
    leg["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return leg


def room_params(bootstrap: Bootstrap, rid: str) -> dict[str, Any]:
    """Our connector's pairing fields, in each leg's `kv_transfer_params`."""
    return {
        "bootstrap_host": bootstrap.host,
        "bootstrap_port": bootstrap.port,
        "bootstrap_room": bootstrap.room,
        "rid": rid,
    }


def build_room_legs(
    body: Mapping[str, Any], endpoint: Endpoint, bootstrap: Bootstrap, rid: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill leg, decode leg) for our connector: the same room on both, sent at once."""
    params = room_params(bootstrap, rid)
    prefill = _one_token(body, endpoint)
    prefill["kv_transfer_params"] = params
    decode = dict(body)
    decode["kv_transfer_params"] = dict(params)
    return prefill, decode


def read_kv_params(payload: Any) -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill's JSON answer, checked."""
    if not isinstance(payload, Mapping):
        raise KVParamsError("the prefill answer is not a JSON object")
    params = payload.get("kv_transfer_params")
    if not isinstance(params, Mapping):
        raise KVParamsError(
            "the prefill answered no kv_transfer_params: is it vLLM with a KV connector "
            "and kv_role kv_producer?"
        )
    if params.get("do_remote_prefill") is not True:
        raise KVParamsError("the prefill's kv_transfer_params do not offer its KV to a decode")
    missing = [name for name in REQUIRED_ANSWER_FIELDS if params.get(name) is None]
    if missing:
        raise KVParamsError(f"the prefill's kv_transfer_params lack {', '.join(missing)}")
    return dict(params)


def build_decode_body(body: Mapping[str, Any], kv_params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the client's, with the prefill's `kv_transfer_params`."""
    leg = dict(body)
    leg["kv_transfer_params"] = dict(kv_params)
    return leg
